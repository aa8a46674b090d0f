//! Multi-threaded stress: 8 threads on 2 cores hammer one pool per allocator with random maps,
//! device writes and unmaps. An external occupancy array catches any slot handed out twice
//! (each mapping claims its slots with a swap that must find them free); every mapping's
//! device buffer must keep exactly what its thread wrote; every from-device unmap must deliver
//! exactly those bytes to the thread's own original buffer; at the end nothing is in use.

#[macro_use]
mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bounce::{
    AllocatorKind, BouncePool, Direction, Error, HostMemory, MapRequest, PoolConfig, PoolMode,
};
use rand::{Rng, SeedableRng};

const THREADS: usize = 8;

fn iterations() -> usize {
    std::env::var("BOUNCE_STRESS_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4000)
}

/// One stress thread `t`: random maps (claiming their slots in `occupied` and filling their
/// device buffers), checked unmaps (the device buffer kept, the copy back delivered) and, at the
/// end, unmaps of what is still live. Returns how many maps found the pool full.
fn hammer(
    kind: AllocatorKind,
    pool: &BouncePool,
    occupied: &Arc<Vec<AtomicBool>>,
    t: usize,
) -> usize {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed + t as u64);
    // Each thread owns a private original buffer.
    let base = 0x1_0000_0000u64 * (t as u64 + 1);
    let mut orig = vec![0u8; 1 << 20];
    let mut live = Vec::new();
    let mut full = 0usize;
    for i in 0..iterations() {
        let mem = HostMemory::new(base, &mut orig);
        if live.len() < 6 && rng.gen_bool(0.6) {
            let size = match rng.gen_range(0..4) {
                0 => rng.gen_range(1..2048),
                1 => 4096,
                2 => rng.gen_range(4096..40_000),
                _ => rng.gen_range(40_000..200_000),
            };
            let off = rng.gen_range(0..(1 << 20) - size) as u64;
            let req = MapRequest::new(base + off, size, Direction::FromDevice).worker(t);
            match pool.map(&mem, &req) {
                Ok(m) => {
                    for s in m.slot..m.slot + m.nslots {
                        assert!(
                            !occupied[s].swap(true, Ordering::AcqRel),
                            "{kind}: slot {s} handed out twice"
                        );
                    }
                    let fill = (t * 31 + i) as u8;
                    pool.device_slice(m.dev_addr, size)
                        .unwrap()
                        .copy_from(&vec![fill; size][..]);
                    live.push((m, fill));
                }
                Err(Error::PoolFull { .. }) => full += 1,
                Err(e) => panic!("{kind}: {e}"),
            }
        } else if !live.is_empty() {
            let (m, fill) = live.swap_remove(rng.gen_range(0..live.len()));
            let mut got = vec![0u8; m.size];
            pool.device_slice(m.dev_addr, m.size)
                .unwrap()
                .copy_to(&mut got[..]);
            assert!(
                got.iter().all(|b| *b == fill),
                "{kind}: device buffer was overwritten"
            );
            for s in m.slot..m.slot + m.nslots {
                occupied[s].store(false, Ordering::Release);
            }
            pool.unmap(&mem, &m, t).unwrap();
            let off = (m.orig - base) as usize;
            assert!(
                orig[off..off + m.size].iter().all(|b| *b == fill),
                "{kind}: copy back"
            );
        }
    }
    let mem = HostMemory::new(base, &mut orig);
    for (m, _) in live {
        for s in m.slot..m.slot + m.nslots {
            occupied[s].store(false, Ordering::Release);
        }
        pool.unmap(&mem, &m, t).unwrap();
    }
    full
}

fn stress(kind: AllocatorKind, mode: PoolMode) {
    let mut cfg = match mode {
        PoolMode::Swiotlb => PoolConfig::swiotlb(2048),
        PoolMode::Iova => PoolConfig::iova(1024),
    };
    cfg.allocator = kind;
    cfg.workers = THREADS;
    cfg.areas = Some(4);
    let pool = Arc::new(BouncePool::new(&cfg).unwrap());
    let nslabs = pool.geometry().nslabs;
    let occupied: Arc<Vec<AtomicBool>> =
        Arc::new((0..nslabs).map(|_| AtomicBool::new(false)).collect());

    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let pool = Arc::clone(&pool);
            let occupied = Arc::clone(&occupied);
            std::thread::spawn(move || hammer(kind, &pool, &occupied, t))
        })
        .collect();
    let mut fulls = 0;
    for h in handles {
        fulls += h.join().unwrap();
    }
    let s = pool.stats();
    assert_eq!(s.used, 0, "{kind}: slots leaked");
    assert!(occupied.iter().all(|o| !o.load(Ordering::Acquire)));
    // The allocator agrees once its per-worker caches are flushed.
    pool.allocator().flush_caches();
    assert_eq!(
        pool.allocator().area_used().iter().sum::<usize>(),
        0,
        "{kind}: the allocator still counts slots in use"
    );
    assert_eq!(s.maps, s.unmaps);
    assert_eq!(s.map_failures as usize, fulls);
    eprintln!(
        "{kind} {mode:?}: {} maps, {} full, lock waits {} ns over {} contended acquisitions",
        s.maps,
        fulls,
        s.lock_wait_ns,
        s.locks.iter().map(|l| l.contended).sum::<u64>()
    );
}

tests_of!(stress {
    stress_legacy: AllocatorKind::Legacy, PoolMode::Swiotlb;
    stress_bitmap: AllocatorKind::Bitmap, PoolMode::Swiotlb;
    stress_areas: AllocatorKind::Areas, PoolMode::Swiotlb;
    stress_areas_bitmap: AllocatorKind::AreasBitmap, PoolMode::Swiotlb;
    stress_iova_rbtree: AllocatorKind::IovaRbtree, PoolMode::Swiotlb;
    stress_iova_rcache: AllocatorKind::IovaRcache, PoolMode::Swiotlb;
    stress_genpool: AllocatorKind::Genpool, PoolMode::Swiotlb;
    stress_iova_bitmap: AllocatorKind::IovaBitmap, PoolMode::Swiotlb;
    stress_iova_mode_rbtree: AllocatorKind::IovaRbtree, PoolMode::Iova;
    stress_iova_mode_rcache: AllocatorKind::IovaRcache, PoolMode::Iova;
    stress_iova_mode_genpool: AllocatorKind::Genpool, PoolMode::Iova;
    stress_iova_mode_bitmap: AllocatorKind::IovaBitmap, PoolMode::Iova;
    stress_areas_lifo: AllocatorKind::AreasLifo, PoolMode::Swiotlb;
    stress_magazine: AllocatorKind::Magazine, PoolMode::Swiotlb;
    stress_iova_mode_magazine: AllocatorKind::Magazine, PoolMode::Iova;
});
