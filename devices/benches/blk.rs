//! virtio-blk requests per second through the device core, with a memory disk, for 4 KiB
//! reads and writes: bounce off (the device's own cost: chain walk, parsing, DMA handle,
//! used ring) against bounce forced (plus the map/copy/unmap of the header, data and status).
//!
//! `cargo bench -p devices --bench blk -- --warm-up-time 1 --measurement-time 3`
//!
//! Each iteration posts a batch of 32 requests (header, one 4 KiB data buffer, status), kicks
//! once and reaps the 32 completions, as a guest with a queue depth of 32 would. Every row
//! runs the same requests through the same device and driver; only the DMA handle differs.

use std::hint::black_box;
use std::sync::Arc;

use bounce::{AllocatorKind, BouncePool, Dma, Policy, PoolConfig};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use devices::block::request::RequestHeader;
use devices::block::{Block, BlockConfig, MemDisk};
use devices::testing::{first_fit_pool, TestDriver};
use devices::virtio::driver::Buf;
use devices::virtio::spec::{VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};

const BATCH: usize = 32;
const DISK: u64 = 64 << 20;

struct Rig {
    drv: TestDriver<Block<MemDisk>>,
    reqs: Vec<[Buf; 3]>,
}

fn rig(dma: Dma, t: u32) -> Rig {
    let dev = Block::new(MemDisk::new(DISK).unwrap(), BlockConfig::default(), dma).unwrap();
    let mut drv = TestDriver::new(dev, 64 << 20);
    drv.negotiate(u64::MAX);
    drv.activate(256).unwrap();
    let reqs = (0..BATCH)
        .map(|i| {
            let hdr = drv.ram.alloc_bytes(&RequestHeader::encode(t, 8 * i as u64));
            let data = drv.ram.alloc(4096, 4096);
            let st = drv.ram.alloc(1, 1);
            let w = t == VIRTIO_BLK_T_IN;
            [
                Buf::ro(hdr, 16),
                Buf {
                    addr: data,
                    len: 4096,
                    writable: w,
                },
                Buf::wo(st, 1),
            ]
        })
        .collect();
    Rig { drv, reqs }
}

impl Rig {
    fn batch(&mut self) {
        for r in &self.reqs {
            self.drv.post(0, r).unwrap();
        }
        self.drv.kick(0).unwrap();
        let used = self.drv.reap(0);
        assert_eq!(used.len(), BATCH);
        black_box(used);
    }
}

/// Bounce off, and forced bouncing through each pool: Linux's `areas`, the reusing allocators
/// (`areas-lifo`, `magazine`) and `iova-rcache`, each with the pool's time accounting on (the
/// default, as `bouncevm-vhost`) and off (`timing=off`), so the rows separate what the
/// accounting costs from what the bounce itself costs.
fn dmas() -> Vec<(String, Dma)> {
    let mut v = vec![("off".to_string(), Dma::direct())];
    v.push((
        "force/swiotlb/first-fit".into(),
        Dma::bounced(Policy::Force, first_fit_pool(&PoolConfig::swiotlb(32768))),
    ));
    let pools = [
        ("swiotlb", AllocatorKind::Areas),
        ("swiotlb", AllocatorKind::AreasLifo),
        ("swiotlb", AllocatorKind::Magazine),
        ("iova", AllocatorKind::IovaRcache),
    ];
    for (mode, kind) in pools {
        for timing in [true, false] {
            let mut cfg = if mode == "iova" {
                PoolConfig::iova(16384)
            } else {
                PoolConfig::swiotlb(32768)
            };
            cfg.allocator = kind;
            let name = format!(
                "force/{mode}/{kind}{}",
                if timing { "" } else { "/untimed" }
            );
            match BouncePool::new(&cfg) {
                Ok(p) => {
                    p.set_timing(timing);
                    v.push((name, Dma::bounced(Policy::Force, Arc::new(p))));
                }
                Err(e) => eprintln!("skipping {name}: {e}"),
            }
        }
    }
    v
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("blk-4k");
    g.throughput(Throughput::Elements(BATCH as u64));
    for (name, dma) in dmas() {
        for (op, t) in [("read", VIRTIO_BLK_T_IN), ("write", VIRTIO_BLK_T_OUT)] {
            let mut r = rig(dma.clone(), t);
            g.bench_with_input(BenchmarkId::new(op, &name), &(), |b, _| {
                b.iter(|| r.batch())
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
