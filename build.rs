//! Links pg_dedup.so with link/first-call.ld, which puts the code a connection's first call runs side by side: a new
//! backend maps a library's code page by page as it first runs it, so scattered code is page faults on every new
//! connection (scripts/first-call-layout.sh says how the script is made, bench/results/profiles/issue-22.md what it
//! saves).
fn main() {
    let script = std::path::Path::new(&std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("link/first-call.ld");
    println!("cargo:rerun-if-changed=link/first-call.ld");
    // An ELF linker script (lld, the default linker of Rust on x86-64 Linux, and GNU ld both take INSERT).
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-T,{}", script.display());
    }
}
