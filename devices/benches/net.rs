//! Frames per second through the virtio-net TX path with a null backend: the device's own
//! cost (chain walk, DMA gather into the worker's buffer, header checks, used ring) and the
//! bounce cost on top (policy off vs forced swiotlb vs forced iova), for 1500-byte and 64 KiB
//! frames. Each iteration posts a batch of 64 two-descriptor chains (header, frame), kicks the
//! TX queue and reaps the used entries.

use std::sync::Arc;
use std::time::Duration;

use bounce::{BouncePool, Dma, Policy, PoolConfig};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use devices::net::{Net, NetBackend, NetConfig, NullBackend, VnetHeader};
use devices::testing::{Buf, TestDriver};
use devices::virtio::features as vf;

const BATCH: usize = 64;
const TXQ: u16 = 1;

fn dmas() -> Vec<(&'static str, Dma)> {
    let sw = PoolConfig::swiotlb(32768);
    let iova = PoolConfig::iova(16384);
    vec![
        ("off", Dma::direct()),
        (
            "force-swiotlb",
            Dma::bounced(Policy::Force, Arc::new(BouncePool::new(&sw).expect("pool"))),
        ),
        (
            "force-iova",
            Dma::bounced(
                Policy::Force,
                Arc::new(BouncePool::new(&iova).expect("pool")),
            ),
        ),
    ]
}

fn bench_tx(c: &mut Criterion) {
    let mut g = c.benchmark_group("net_tx");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for frame_len in [1500usize, 65536] {
        for (name, dma) in dmas() {
            let backends: Vec<Box<dyn NetBackend>> = vec![Box::new(NullBackend::default())];
            let dev = Net::new(NetConfig::default(), backends, dma).expect("device");
            let mut drv = TestDriver::new(dev, 64 << 20);
            drv.negotiate(vf::VERSION_1 | vf::ACCESS_PLATFORM);
            drv.activate(256).expect("activate");
            let hdr = drv.ram.alloc_bytes(&VnetHeader::default().to_bytes());
            let frames: Vec<u64> = (0..BATCH)
                .map(|i| drv.ram.alloc_bytes(&vec![i as u8; frame_len]))
                .collect();
            g.throughput(Throughput::Elements(BATCH as u64));
            g.bench_function(format!("{frame_len}B/{name}"), |b| {
                b.iter(|| {
                    for &f in &frames {
                        drv.post(TXQ, &[Buf::ro(hdr, 12), Buf::ro(f, frame_len as u32)])
                            .expect("ring space");
                    }
                    drv.kick(TXQ).expect("tx");
                    let used = drv.reap(TXQ);
                    assert_eq!(used.len(), BATCH);
                });
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench_tx);
criterion_main!(benches);
