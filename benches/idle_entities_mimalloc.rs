//! `idle_entities` under mimalloc, a size-class allocator: the same measure, to tell what
//! ddshard keeps per idle entity from what glibc's malloc keeps of freed memory.
//!
//! `cargo bench --bench idle_entities_mimalloc` (`DDSHARD_BENCH_QUICK=1`: 10,000 entities).

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "idle_entities.rs"]
mod idle;

fn main() {
    idle::run("mimalloc");
}
