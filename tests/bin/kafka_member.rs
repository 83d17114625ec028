//! A Kafka group member process for tests/kafka.rs: `kafka_member BOOTSTRAP POSTGRES ROAD BATCH CRASH_RATE SEED`
//! (see `replay::kafka::member_main`; the demo runs the same code as `demo --kafka-member`).

fn main() {
    pg_dedup_harness::replay::kafka::member_main(std::env::args().skip(1));
}
