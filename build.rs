//! Links pg_dedup.so with link/first-call.ld, which puts the code a connection's first call runs side by side: a new
//! backend maps a library's code page by page as it first runs it, so scattered code is page faults on every new
//! connection (scripts/first-call-layout.sh says how the script is made, bench/results/profiles/issue-22.md what it
//! saves).
fn main() {
    println!("cargo:rerun-if-changed=link/first-call.ld");
    println!("cargo:rerun-if-env-changed=PG_DEDUP_FIRST_CALL_LAYOUT");
    let env = |name: &str| std::env::var(name).unwrap_or_default();
    // Release builds only (a debug build's code is laid out for debugging anyway), and only where the linker is known
    // to keep one .text with the script's functions at its start: Rust's own lld, its default linker for
    // x86_64-unknown-linux-gnu since Rust 1.90. Another linker (GNU ld would make a second .text, mold takes no
    // SECTIONS) is PG_DEDUP_FIRST_CALL_LAYOUT=off.
    if env("PROFILE") != "release"
        || env("CARGO_CFG_TARGET_ARCH") != "x86_64"
        || env("CARGO_CFG_TARGET_OS") != "linux"
        || env("CARGO_CFG_TARGET_ENV") != "gnu"
        || env("PG_DEDUP_FIRST_CALL_LAYOUT") == "off"
    {
        return;
    }
    let script = std::path::Path::new(&env("CARGO_MANIFEST_DIR")).join("link/first-call.ld");
    // -Xlinker, not -Wl,: a comma in the path would split it.
    for arg in ["-Xlinker", "-T", "-Xlinker", &script.display().to_string()] {
        println!("cargo:rustc-cdylib-link-arg={arg}");
    }
}
