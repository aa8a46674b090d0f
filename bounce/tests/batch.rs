//! Batched maps and unmaps ([`bounce::PoolBatch`], [`bounce::DmaBatch`]) against the same
//! calls one by one on a twin pool: over random workloads, every allocator (static pools) and
//! a dynamic pool, the same device addresses and slots, the same failures at the same
//! request, the same bytes copied back, the same occupancy and statistics.

use bounce::{
    AllocatorKind, BouncePool, Direction, DmaAttrs, DynamicConfig, HostMemory, MapRequest, Mapping,
    PoolConfig, RangeCheck,
};
use proptest::prelude::*;
use vm_memory::Bytes;

/// Bytes of the original buffer.
const ORIG: usize = 1 << 20;
/// Its address.
const BASE: u64 = 0x1_0000_0000;

/// One map: offset into the original, size (0 and oversize included, to fail checks),
/// direction, `min_align_mask`.
type Map = (u64, usize, bool, bool);

/// One step: which live mappings to unmap (positions, taken in order), then maps, by `worker`.
type Step = (Vec<usize>, Vec<Map>, usize);

fn map() -> impl Strategy<Value = Map> {
    (
        0u64..(ORIG as u64 / 2),
        prop_oneof![
            4 => 1usize..2048,
            4 => Just(4096usize),
            3 => 4096usize..70_000,
            1 => 200_000usize..300_000,
            1 => Just(0usize),
        ],
        any::<bool>(),
        any::<bool>(),
    )
}

fn step() -> impl Strategy<Value = Step> {
    (
        proptest::collection::vec(0usize..32, 0..5),
        proptest::collection::vec(map(), 0..12),
        0usize..4,
    )
}

fn request(&(off, size, from_device, align): &Map, worker: usize) -> MapRequest {
    let dir = if from_device {
        Direction::FromDevice
    } else {
        Direction::ToDevice
    };
    let mut r = MapRequest::new(BASE + off, size, dir).worker(worker);
    if align {
        r.min_align_mask = 0xfff;
    }
    r
}

/// The pool of `kind` (or a dynamic one), small enough to fill.
fn pool(kind: Option<AllocatorKind>) -> BouncePool {
    let mut c = PoolConfig::swiotlb(1024);
    c.areas = Some(2);
    c.workers = 4;
    match kind {
        Some(k) => c.allocator = k,
        // A dynamic pool that does not grow: growth runs on a worker thread of its own, so
        // two pools would not grow at the same moments.
        None => {
            c.dynamic = Some(DynamicConfig {
                can_grow: false,
                ..DynamicConfig::host(8192)
            })
        }
    }
    BouncePool::new(&c).unwrap()
}

/// What a step did: each unmap's result, each map's mapping or error (as text), the
/// occupancy, and what the device wrote as the originals now hold it.
#[derive(Debug, PartialEq)]
struct Outcome {
    unmaps: Vec<Result<(), String>>,
    maps: Vec<Result<Mapping, String>>,
    used: usize,
    area_used: Vec<usize>,
    area_index: Vec<usize>,
}

/// Runs `step` on `pool` one call at a time (`batched` false) or through one batch.
fn run(
    pool: &BouncePool,
    orig: &mut [u8],
    live: &mut Vec<Mapping>,
    (unmaps, maps, worker): &Step,
    batched: bool,
) -> Outcome {
    let mem = HostMemory::new(BASE, orig);
    let mut gone = Vec::new();
    for &k in unmaps {
        if !live.is_empty() {
            gone.push(live.swap_remove(k % live.len()));
        }
    }
    let reqs: Vec<MapRequest> = maps.iter().map(|m| request(m, *worker)).collect();
    let mut out = Outcome {
        unmaps: Vec::new(),
        maps: Vec::new(),
        used: 0,
        area_used: Vec::new(),
        area_index: Vec::new(),
    };
    if batched {
        let mut b = pool.batch(*worker);
        for m in &gone {
            out.unmaps.push(b.unmap(&mem, m).map_err(|e| e.to_string()));
        }
        let mut mapped = Vec::new();
        let r = b.map(&mem, &reqs, RangeCheck::Here, |m| mapped.push(m));
        out.maps.extend(mapped.into_iter().map(Ok));
        if let Err(e) = r {
            out.maps.push(Err(e.to_string()));
        }
    } else {
        for m in &gone {
            out.unmaps
                .push(pool.unmap(&mem, m, *worker).map_err(|e| e.to_string()));
        }
        for r in &reqs {
            match pool.map(&mem, r) {
                Ok(m) => out.maps.push(Ok(m)),
                Err(e) => {
                    out.maps.push(Err(e.to_string()));
                    break;
                }
            }
        }
    }
    for m in out.maps.iter().flatten() {
        // The device writes something of its own into every buffer.
        let tag = (m.dev_addr >> 11) as u8;
        pool.device_slice(m.dev_addr, m.size)
            .unwrap()
            .write_slice(&vec![tag; m.size], 0)
            .unwrap();
        live.push(*m);
    }
    out.used = pool.used();
    let a = pool.allocator();
    a.flush_caches();
    out.area_used = a.area_used();
    out.area_index = a.area_index();
    out
}

fn same_as_one_by_one(kind: Option<AllocatorKind>, steps: &[Step]) -> Result<(), TestCaseError> {
    let (one, batch) = (pool(kind), pool(kind));
    let (mut orig_one, mut orig_batch) = (vec![0x5au8; ORIG], vec![0x5au8; ORIG]);
    let (mut live_one, mut live_batch) = (Vec::new(), Vec::new());
    for (n, s) in steps.iter().enumerate() {
        let a = run(&one, &mut orig_one, &mut live_one, s, false);
        let b = run(&batch, &mut orig_batch, &mut live_batch, s, true);
        prop_assert_eq!(&a, &b, "{:?} step {}", kind, n);
        prop_assert!(orig_one == orig_batch, "{:?} step {}: copied back", kind, n);
    }
    let (sa, sb) = (one.stats(), batch.stats());
    prop_assert_eq!(
        (sa.maps, sa.unmaps, sa.map_failures, sa.bytes_to_device),
        (sb.maps, sb.unmaps, sb.map_failures, sb.bytes_to_device),
        "{:?}",
        kind
    );
    prop_assert_eq!(sa.bytes_from_device, sb.bytes_from_device);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Every allocator whose decisions do not depend on the clock (`iova-rcache` trims its
    /// depot by time, so two pools of it may differ one by one already).
    #[test]
    fn a_pool_batch_maps_and_unmaps_as_the_calls_one_by_one(
        steps in proptest::collection::vec(step(), 1..40)
    ) {
        for kind in AllocatorKind::ALL {
            if kind != AllocatorKind::IovaRcache {
                same_as_one_by_one(Some(kind), &steps)?;
            }
        }
    }

    #[test]
    fn a_dynamic_pool_batch_maps_and_unmaps_as_the_calls_one_by_one(
        steps in proptest::collection::vec(step(), 1..40)
    ) {
        same_as_one_by_one(None, &steps)?;
    }
}

#[test]
fn a_batch_of_three_maps_and_three_unmaps_takes_two_area_locks() {
    let p = pool(Some(AllocatorKind::Areas));
    let mut orig = vec![0u8; ORIG];
    let mem = HostMemory::new(BASE, &mut orig);
    let locks = || -> u64 {
        p.allocator()
            .lock_stats()
            .iter()
            .map(|l| l.acquisitions)
            .sum()
    };
    let reqs = [
        MapRequest::new(BASE, 1, Direction::FromDevice),
        MapRequest::new(BASE + 0x1000, 16, Direction::ToDevice),
        MapRequest::new(BASE + 0x2000, 4096, Direction::FromDevice),
    ];
    let mut maps = Vec::new();
    let mut b = p.batch(0);
    b.map(&mem, &reqs, RangeCheck::Here, |m| maps.push(m))
        .unwrap();
    assert_eq!(locks(), 1);
    for m in &maps {
        b.unmap(&mem, m).unwrap();
    }
    assert_eq!(
        (locks(), p.used()),
        (1, 4),
        "releases wait for the batch's next call"
    );
    drop(b);
    assert_eq!((locks(), p.used()), (2, 0));
    // An unmap of something not mapped is refused at once, as one by one.
    let mut b = p.batch(0);
    let e = b
        .unmap_single(
            &mem,
            maps[0].dev_addr,
            1,
            Direction::FromDevice,
            DmaAttrs::default(),
        )
        .unwrap_err();
    assert!(matches!(e, bounce::Error::NotMapped { .. }), "{e}");
}

#[test]
fn a_dma_batch_keeps_direct_and_bounced_buffers_in_order_and_stops_at_a_failure() {
    use bounce::{Dma, Policy};
    use vm_memory::{GuestAddress, GuestMemoryMmap};
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x20_0000)]).unwrap();
    let one = std::sync::Arc::new(pool(Some(AllocatorKind::Areas)));
    let batched = std::sync::Arc::new(pool(Some(AllocatorKind::Areas)));
    // Buffers ending above 1 MiB are bounced, the others are not.
    let (d1, d2) = (
        Dma::bounced(Policy::Mask(20), one.clone()),
        Dma::bounced(Policy::Mask(20), batched.clone()),
    );
    let bufs = [
        (0x1000, 512, Direction::ToDevice),
        (0x10_0000, 4096, Direction::FromDevice),
        (0x8000, 16, Direction::ToDevice),
        (0x18_0000, 1, Direction::FromDevice),
        (0x19_0000, 0, Direction::FromDevice),
        (0x1a_0000, 4096, Direction::FromDevice),
    ];
    let mut seq = Vec::new();
    let mut seq_err = None;
    for &(gpa, len, dir) in &bufs {
        match d1.map(&mem, gpa, len, dir, 1, RangeCheck::Here) {
            Ok(b) => seq.push(b),
            Err(e) => {
                seq_err = Some(e.to_string());
                break;
            }
        }
    }
    let mut got = Vec::new();
    let mut b = d2.batch(1);
    let err = b
        .map(&mem, &bufs, RangeCheck::Here, |buf| got.push(buf))
        .unwrap_err();
    assert_eq!(Some(err.to_string()), seq_err);
    assert_eq!(got, seq);
    assert_eq!(got.len(), 4);
    assert_eq!(got.iter().filter(|b| b.is_bounced()).count(), 2);
    for buf in got {
        b.unmap(&mem, buf).unwrap();
    }
    drop(b);
    for buf in seq {
        d1.unmap(&mem, buf, 1).unwrap();
    }
    assert_eq!((one.used(), batched.used()), (0, 0));
    let locks = |p: &BouncePool| -> u64 {
        p.allocator()
            .lock_stats()
            .iter()
            .map(|l| l.acquisitions)
            .sum()
    };
    // Two maps and two unmaps: four locks one by one; batched, two map calls (the direct
    // buffer between them keeps the order) and one release.
    assert_eq!((locks(&one), locks(&batched)), (4, 3));
}
