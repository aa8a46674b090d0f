//! Dynamic pools (`bounce::dynamic`) against the static pool, and as devices use them.
//!
//! - `agrees_with_the_static_pool_map_for_map` (property): a dynamic pool whose growth is
//!   never served (no transient pool given, no pool added) decides every map exactly as the
//!   static pool of the same geometry: the same address or failure, the same area state and
//!   counters; it asks for growth exactly where the static pool is full (and never without
//!   `can_grow`).
//! - `grows_into_its_own_memory`: a pool with memory of its own serves a map the default pool
//!   cannot from a transient pool, its worker thread adds a pool that later maps land in, data
//!   survives the round trip through both, and every slot comes back.
//! - `a_full_window_fails_maps_and_the_worker`: when the window has no room, a map no pool
//!   serves fails as "pool full" and the worker counts its failure; nothing panics.

use std::time::{Duration, Instant};

use bounce::{
    BouncePool, Direction, DynamicConfig, Error, HostMemory, MapRequest, PoolConfig, PoolKind,
    PoolPages, SizeLimit, SyncFor,
};
use proptest::prelude::*;

const BASE: u64 = 0x4000_0000;

/// One step of a workload.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// Map `size` bytes of `orig` for `worker`, with the masks picked by index.
    Map {
        orig: u64,
        size: usize,
        worker: usize,
        min_align: usize,
        alloc_align: usize,
    },
    /// Unmap the live mapping picked by index (modulo the live count).
    Unmap(usize),
}

const MIN_ALIGN: [u64; 4] = [0, 0, 0xfff, 0x3ff];
const ALLOC_ALIGN: [u64; 4] = [0, 0, 0, 0x3fff];

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0u64..1 << 30, prop_oneof![1usize..2048, 1usize..16384, 1usize..=262_144], 0usize..8, 0usize..4, 0usize..4)
            .prop_map(|(orig, size, worker, min_align, alloc_align)| Step::Map {
                orig,
                size,
                worker,
                min_align,
                alloc_align,
            }),
        2 => any::<usize>().prop_map(Step::Unmap),
    ]
}

fn config(slots: usize, areas: usize, workers: usize) -> PoolConfig {
    let mut c = PoolConfig::swiotlb(slots);
    c.areas = Some(areas);
    c.workers = workers;
    c.base = BASE;
    c.size_limit = SizeLimit::Kernel;
    c
}

/// The same pool, dynamic, with its page allocator's answers given by the test (none are).
fn dynamic(c: &PoolConfig, can_grow: bool) -> PoolConfig {
    let mut d = c.clone();
    d.dynamic = Some(DynamicConfig {
        pages: PoolPages::Given {
            window_base: BASE,
            window_bytes: 4 * (c.geometry().unwrap().bytes() as u64),
        },
        can_grow,
    });
    d
}

fn request(s: &Step) -> Option<MapRequest> {
    let Step::Map {
        orig,
        size,
        worker,
        min_align,
        alloc_align,
    } = *s
    else {
        return None;
    };
    Some(
        MapRequest::new(orig, size, Direction::Bidirectional)
            .worker(worker)
            .min_align_mask(MIN_ALIGN[min_align])
            .alloc_align_mask(ALLOC_ALIGN[alloc_align]),
    )
}

fn agree(slots: usize, areas: usize, workers: usize, can_grow: bool, steps: &[Step]) {
    let c = config(slots, areas, workers);
    let fixed = BouncePool::new(&c).unwrap();
    let dynamic = BouncePool::new(&dynamic(&c, can_grow)).unwrap();
    let d = dynamic.dynamic().expect("a dynamic pool");
    let mem = bounce::trace::NullMemory;
    let mut live = Vec::new();
    let mut full = 0u64;
    for (i, s) in steps.iter().enumerate() {
        match request(s) {
            Some(req) => {
                let a = fixed.map(&mem, &req);
                let b = dynamic.map(&mem, &req);
                match (&a, &b) {
                    (Ok(x), Ok(y)) => {
                        assert_eq!(x.dev_addr, y.dev_addr, "step {i}: {req:?}");
                        assert_eq!(dynamic.pool_of(y.dev_addr).unwrap().kind, PoolKind::Default);
                        live.push((*x, *y));
                    }
                    (Err(Error::PoolFull { .. }), Err(Error::PoolFull { .. })) => full += 1,
                    (Err(x), Err(y)) => assert_eq!(x.to_string(), y.to_string(), "step {i}"),
                    _ => panic!("step {i}: {req:?}: static {a:?}, dynamic {b:?}"),
                }
            }
            None => {
                let Step::Unmap(k) = *s else { unreachable!() };
                if live.is_empty() {
                    continue;
                }
                let (x, y) = live.swap_remove(k % live.len());
                fixed.unmap(&mem, &x, 0).unwrap();
                dynamic.unmap(&mem, &y, 0).unwrap();
            }
        }
        let (fa, da) = (fixed.allocator(), dynamic.allocator());
        assert_eq!(fa.area_used(), da.area_used(), "step {i}");
        assert_eq!(fa.area_index(), da.area_index(), "step {i}");
        assert_eq!(fixed.used(), dynamic.used(), "step {i}");
        assert_eq!(fixed.hiwater(), dynamic.hiwater(), "step {i}");
        assert_eq!(
            d.grow_requests(),
            if can_grow { full } else { 0 },
            "step {i}"
        );
        assert_eq!((d.nslabs(), d.transient_nslabs()), (slots as u64, 0));
    }
}

proptest! {
    #![proptest_config(bounce::testing::fuzz_config(64))]

    #[test]
    fn agrees_with_the_static_pool_map_for_map(
        (slots, areas) in prop_oneof![Just((128, 1)), Just((512, 4)), Just((1024, 2)), Just((2048, 8))],
        workers in 1usize..4,
        can_grow in any::<bool>(),
        steps in proptest::collection::vec(step(), 1..400),
    ) {
        agree(slots, areas, workers, can_grow, &steps);
    }
}

/// Waits until `f` holds (the worker thread runs on its own time), at most 10 s.
fn eventually(what: &str, f: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{what}: not within 10 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A dynamic pool of 128 slots in one area growing into a window of `window` slots.
fn host_pool(window: usize) -> BouncePool {
    let mut c = config(128, 1, 1);
    c.dynamic = Some(DynamicConfig::host(window));
    BouncePool::new(&c).unwrap()
}

#[test]
fn grows_into_its_own_memory() {
    let pool = host_pool(1024);
    let d = pool.dynamic().unwrap();
    let mut orig = vec![0u8; 1 << 20];
    for (i, b) in orig.iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    let mem = HostMemory::new(0, &mut orig);
    // Fill the default pool: 128 one-slot maps.
    let one = |o: u64| MapRequest::new(o, 2048, Direction::Bidirectional);
    let mut maps: Vec<_> = (0..128)
        .map(|i| pool.map(&mem, &one(i * 2048)).unwrap())
        .collect();
    assert!(maps
        .iter()
        .all(|m| pool.pool_of(m.dev_addr).unwrap().kind == PoolKind::Default));
    // The next map asks for growth and lands in a transient pool of its own 3 slots.
    let t = pool
        .map(
            &mem,
            &MapRequest::new(0x4_0000, 5000, Direction::Bidirectional),
        )
        .unwrap();
    let tp = pool.pool_of(t.dev_addr).unwrap();
    assert_eq!((tp.kind, tp.nslabs, tp.nareas), (PoolKind::Transient, 3, 1));
    assert_eq!(t.dev_addr, tp.start);
    assert_eq!(d.transient_nslabs(), 3);
    assert_eq!(pool.used(), 131);
    // The data went in; a device write comes back at unmap.
    let mut seen = vec![0u8; 5000];
    pool.device_slice(t.dev_addr, 5000)
        .unwrap()
        .copy_to(&mut seen[..]);
    assert_eq!(&seen[..], &orig[0x4_0000..0x4_0000 + 5000]);
    let mem = HostMemory::new(0, &mut orig);
    pool.device_slice(t.dev_addr, 4)
        .unwrap()
        .copy_from(&[9u8, 8, 7, 6][..]);
    pool.unmap(&mem, &t, 0).unwrap();
    assert_eq!(&orig[0x4_0000..0x4_0004], &[9, 8, 7, 6]);
    let mem = HostMemory::new(0, &mut orig);
    assert_eq!((d.transient_nslabs(), pool.used()), (0, 128));
    // The worker adds a pool of default_nslabs in limit_nareas(1, 128) areas.
    eventually("the worker's pool", || d.nslabs() == 256);
    let s = pool.stats();
    let ds = s.dynamic.as_ref().unwrap();
    assert_eq!(
        (ds.pools_added, ds.grow_requests, ds.transient_pools),
        (1, 1, 1)
    );
    assert_eq!(s.nslabs, 256);
    assert_eq!(ds.pools[1].kind, PoolKind::Default);
    let added = ds.pools[0];
    assert_eq!(
        (added.kind, added.nslabs, added.nareas),
        (PoolKind::Added, 128, 1)
    );
    assert_eq!(
        added.start % (256 << 10),
        0,
        "a 256 KiB block on its own alignment"
    );
    // Later maps land there, at its first slot.
    let m = pool.map(&mem, &one(0x8_0000)).unwrap();
    assert_eq!(m.dev_addr, added.start);
    assert_eq!(pool.pool_of(m.dev_addr).unwrap().kind, PoolKind::Added);
    pool.sync(&mem, m.dev_addr, 16, m.dir, SyncFor::Cpu)
        .unwrap();
    maps.push(m);
    for m in maps.drain(..) {
        pool.unmap(&mem, &m, 0).unwrap();
    }
    assert_eq!(pool.used(), 0);
    assert!(
        pool.unmap(&mem, &t, 0).is_err(),
        "a transient pool's mapping unmaps once"
    );
    let s = pool.stats();
    assert_eq!((s.maps, s.unmaps, s.bad_unmaps), (130, 130, 1));
}

#[test]
fn a_full_window_fails_maps_and_the_worker() {
    // Room for the default pool and nothing else.
    let pool = host_pool(128);
    let d = pool.dynamic().unwrap();
    let mem = bounce::trace::NullMemory;
    let seg = MapRequest::new(0, 128 * 2048, Direction::ToDevice);
    let m = pool.map(&mem, &seg).unwrap();
    let err = pool.map(&mem, &seg).unwrap_err();
    assert!(matches!(err, Error::PoolFull { total: 128, .. }), "{err}");
    eventually("the worker's run", || {
        pool.stats().dynamic.unwrap().worker_alloc_failed == 1
    });
    let s = pool.stats().dynamic.unwrap();
    assert_eq!(
        (s.grow_requests, s.transient_alloc_failed, s.pools_added),
        (1, 1, 0)
    );
    assert_eq!(d.nslabs(), 128);
    pool.unmap(&mem, &m, 0).unwrap();
    assert_eq!(pool.map(&mem, &seg).unwrap().dev_addr, BASE);
}

#[test]
fn dynamic_pools_need_the_areas_allocator_and_swiotlb_mode() {
    let mut c = config(128, 1, 1);
    c.dynamic = Some(DynamicConfig::host(1024));
    c.allocator = bounce::AllocatorKind::Magazine;
    assert!(BouncePool::new(&c).is_err());
    let mut c = PoolConfig::iova(256);
    c.dynamic = Some(DynamicConfig::host(1024));
    assert!(BouncePool::new(&c).is_err());
    let mut c = config(128, 1, 1);
    c.dynamic = Some(DynamicConfig::host(64));
    assert!(
        BouncePool::new(&c).is_err(),
        "a window smaller than the default pool"
    );
}
