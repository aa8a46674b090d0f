//! map+unmap pairs per second for each allocator at 1, 2, 4 and 8 threads, for 4 KiB and
//! 64 KiB, with and without the copies, and a plain memcpy of the same sizes in the same run as
//! the physical reference.
//!
//! `cargo bench -p bounce --bench alloc` (add `-- --quick` or a filter such as `areas/` to
//! shorten). Each thread maps and unmaps bidirectional buffers (one copy in, one copy back)
//! with its own worker id; the pool is Linux's default 64 MiB with one area per thread.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use bounce::{
    AllocatorKind, BouncePool, Direction, HostMemory, MapRequest, NoCopyMemory, OrigMemory,
    PoolConfig,
};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

fn pairs<M: OrigMemory>(pool: &BouncePool, mem: &M, orig: u64, size: usize, worker: usize, n: u64) {
    let req = MapRequest::new(orig, size, Direction::Bidirectional).worker(worker);
    for _ in 0..n {
        let m = pool.map(mem, &req).expect("map");
        pool.unmap(mem, &m, worker).expect("unmap");
    }
}

fn run(pool: &Arc<BouncePool>, threads: usize, size: usize, copy: bool, iters: u64) -> Duration {
    let barrier = Arc::new(Barrier::new(threads + 1));
    let per_thread = iters.div_ceil(threads as u64);
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let pool = Arc::clone(pool);
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                let mut buf = vec![0x5au8; size];
                let orig = 0x1000_0000u64 * (t as u64 + 1);
                barrier.wait();
                if copy {
                    let mem = HostMemory::new(orig, &mut buf);
                    pairs(&pool, &mem, orig, size, t, per_thread);
                } else {
                    pairs(&pool, &NoCopyMemory, orig, size, t, per_thread);
                }
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for h in handles {
        h.join().expect("bench thread");
    }
    start.elapsed()
}

fn allocators(c: &mut Criterion) {
    for size in [4096usize, 65536] {
        let mut g = c.benchmark_group(format!("memcpy/{}k", size / 1024));
        g.throughput(Throughput::Elements(1));
        let src = vec![1u8; size];
        let mut dst = vec![0u8; size];
        g.bench_function("copy", |b| {
            b.iter(|| {
                dst.copy_from_slice(std::hint::black_box(&src));
                std::hint::black_box(&dst);
            })
        });
        g.finish();
    }
    for kind in AllocatorKind::ALL {
        for size in [4096usize, 65536] {
            for copy in [true, false] {
                let name = format!(
                    "{kind}/{}k/{}",
                    size / 1024,
                    if copy { "copy" } else { "nocopy" }
                );
                let mut g = c.benchmark_group(name);
                g.throughput(Throughput::Elements(1));
                for threads in [1usize, 2, 4, 8] {
                    let mut cfg = PoolConfig::swiotlb(PoolConfig::DEFAULT_SLOTS);
                    cfg.allocator = kind;
                    cfg.workers = threads;
                    let pool = Arc::new(BouncePool::new(&cfg).expect("pool"));
                    g.bench_with_input(BenchmarkId::from_parameter(threads), &threads, |b, &t| {
                        b.iter_custom(|iters| run(&pool, t, size, copy, iters))
                    });
                }
                g.finish();
            }
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20);
    targets = allocators
}
criterion_main!(benches);
