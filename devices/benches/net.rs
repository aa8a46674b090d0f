//! Frames per second through the virtio-net TX path with a null backend (which, like a tap's
//! `writev`, takes the mapped pieces without copying them): the device's own cost (chain
//! walk, mapping, header checks, used ring) and the bounce cost on top (policy off vs forced
//! swiotlb, with and without the pool's time accounting, vs forced iova). 64-byte frames come
//! in one descriptor with their vnet header in front (as DPDK's virtio_user posts them),
//! 1500-byte and 64 KiB frames as two-descriptor chains (header, frame). Each iteration posts
//! a batch of 64 chains, kicks the TX queue and reaps the used entries.

use std::sync::Arc;
use std::time::Duration;

use bounce::{BouncePool, Dma, Policy, PoolConfig};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use devices::net::{Net, NetBackend, NetConfig, NullBackend, VnetHeader};
use devices::testing::TestDriver;
use devices::virtio::driver::Buf;
use devices::virtio::spec::{feature, VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_VERSION_1};

const BATCH: usize = 64;
const TXQ: u16 = 1;

fn dmas() -> Vec<(&'static str, Dma)> {
    let sw = PoolConfig::swiotlb(32768);
    let iova = PoolConfig::iova(16384);
    let untimed = Arc::new(BouncePool::new(&sw).expect("pool"));
    untimed.set_timing(false);
    vec![
        ("off", Dma::direct()),
        (
            "force-swiotlb",
            Dma::bounced(Policy::Force, Arc::new(BouncePool::new(&sw).expect("pool"))),
        ),
        (
            "force-swiotlb-untimed",
            Dma::bounced(Policy::Force, untimed),
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
    for frame_len in [64usize, 1500, 65536] {
        // One descriptor (header + frame) for small frames, two for the others.
        let one_desc = frame_len == 64;
        for (name, dma) in dmas() {
            let backends: Vec<Box<dyn NetBackend>> = vec![Box::new(NullBackend::default())];
            let dev = Net::new(NetConfig::default(), backends, dma).expect("device");
            let mut drv = TestDriver::new(dev, 64 << 20);
            drv.negotiate(feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_F_ACCESS_PLATFORM));
            drv.activate(256).expect("activate");
            let hdr_bytes = VnetHeader::default().to_bytes();
            let hdr = drv.ram.alloc_bytes(&hdr_bytes);
            let frames: Vec<u64> = (0..BATCH)
                .map(|i| {
                    let mut f = if one_desc {
                        hdr_bytes.to_vec()
                    } else {
                        Vec::new()
                    };
                    f.resize(f.len() + frame_len, i as u8);
                    drv.ram.alloc_bytes(&f)
                })
                .collect();
            let hdr_len = hdr_bytes.len() as u32;
            g.throughput(Throughput::Elements(BATCH as u64));
            g.bench_function(format!("{frame_len}B/{name}"), |b| {
                b.iter(|| {
                    for &f in &frames {
                        let len = frame_len as u32;
                        let posted = if one_desc {
                            drv.post(TXQ, &[Buf::ro(f, hdr_len + len)])
                        } else {
                            drv.post(TXQ, &[Buf::ro(hdr, hdr_len), Buf::ro(f, len)])
                        };
                        posted.expect("ring space");
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
