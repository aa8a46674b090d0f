//! Randomized model test: long sequences of map / device write / CPU write / sync / unmap with
//! random sizes, masks, directions and workers, checked against a simple reference model.
//!
//! The model keeps the expected bytes of the original memory and of every live mapping's device
//! buffer, and applies the copy rules of DESIGN.md itself. After every step the test checks: no
//! two live mappings share a slot; the pool's used count equals the model's; device buffers and
//! the original memory hold exactly what the model says. At the end everything is unmapped and
//! the whole pool must be usable again.
//!
//! The pool is an oracle's subject, not its source: [`expect`] derives, from Linux's rules and
//! not from the crate, each map's in-slot offset, padding slots, allocation size, minimal slot
//! count and whether it is too large. A successful map must return exactly that slot count, a
//! device address `base + (slot + pad) * slot_size + offset`, and a run that satisfies every
//! placement rule (checked by [`placement_ok`], written independently of `SlotRequest::fits`).
//! A "pool full" is checked against an independent first-fit search over the model's free
//! slots: the allocators whose search is complete must find a run whenever one exists, and
//! `genpool` (first fit) must return exactly the first one.
//!
//! Inputs cover `min_align_mask` up to 64 KiB, `alloc_align_mask` (padding slots), segment
//! boundary masks down to 32 KiB, sizes at the maximum mapping size and one slot/byte either
//! side, 1 to 8 areas, a pool base half a page in, the kernel size limit (the band above the
//! maximum mapping size that Linux still places), and the production geometry (64 MiB, one
//! area per worker).

use bounce::{
    AllocatorKind, BouncePool, Direction, DmaAttrs, Error, Geometry, HostMemory, MapRequest,
    Mapping, OrigMemory, PoolConfig, PoolMode, SizeLimit, SyncFor,
};
use proptest::prelude::*;
use vm_memory::VolatileSlice;

const ORIG_BASE: u64 = 0x20_0000;
const ORIG_LEN: usize = 512 * 1024;

/// Device `min_align_mask`s (NVMe's 4 KiB, and larger ones that need padding slots when
/// `alloc_align_mask` lets the offset exceed a slot).
const MIN_ALIGN: [u64; 6] = [0, 0x7ff, 0xfff, 0x3ff, 0x3fff, 0xffff];
/// `alloc_align_mask`s (mostly none, as for streaming maps).
const ALLOC_ALIGN: [u64; 6] = [0, 0, 0, 0x7ff, 0xfff, 0x3fff];
/// Device segment boundary masks, down to 32 KiB (16 slots).
const BOUNDARY: [u64; 6] = [u64::MAX, u64::MAX, 0xffff_ffff, 0x3_ffff, 0xffff, 0x7fff];
/// Offsets from the maximum mapping size: one slot and one byte either side.
const NEAR_MAX: [i64; 5] = [-2048, -1, 0, 1, 2048];

/// A pool shape for one case.
#[derive(Clone, Copy, Debug)]
struct Shape {
    slots: usize,
    areas: Option<usize>,
    base: Option<u64>,
    kernel_limit: bool,
}

fn shape(mode: PoolMode) -> impl Strategy<Value = Shape> {
    let s = |slots, areas, base, kernel_limit| Shape {
        slots,
        areas,
        base,
        kernel_limit,
    };
    match mode {
        PoolMode::Swiotlb => prop_oneof![
            3 => Just(s(1024, Some(2), None, false)),
            2 => Just(s(1024, Some(4), Some(0x4000_0800), false)),
            2 => Just(s(2048, Some(8), Some(0x7ffe_0000), false)),
            2 => Just(s(1024, Some(2), None, true)),
            1 => Just(s(PoolConfig::DEFAULT_SLOTS, None, None, false)),
        ]
        .boxed(),
        PoolMode::Iova => prop_oneof![
            Just(s(512, None, None, false)),
            Just(s(300, None, Some(0x10_0000), false)),
        ]
        .boxed(),
    }
}

/// A map as generated: an original offset and size, and indexes into the mask tables.
#[derive(Clone, Copy, Debug)]
struct MapOp {
    off: usize,
    size: usize,
    /// Some(k): the size is the maximum mapping size for the masks plus `NEAR_MAX[k]`.
    near_max: Option<usize>,
    dir: u8,
    mask: u8,
    align: u8,
    boundary: u8,
    worker: usize,
}

impl MapOp {
    /// The request this op makes of a pool of `geom`, with the original's offset in the
    /// model's buffer (the size fitted to the buffer, or to the maximum mapping size).
    fn request(self, geom: &Geometry) -> (MapRequest, usize) {
        let min_align_mask = MIN_ALIGN[self.mask as usize];
        let (size, off) = match self.near_max {
            Some(k) => {
                let max = linux_max_mapping_size(geom, min_align_mask) as i64;
                let size = (max + NEAR_MAX[k]).clamp(1, ORIG_LEN as i64) as usize;
                (size, self.off % (ORIG_LEN - size + 1))
            }
            None => (self.size.min(ORIG_LEN - self.off).max(1), self.off),
        };
        let dir = Direction::from_linux(self.dir.into()).unwrap();
        let req = MapRequest::new(ORIG_BASE + off as u64, size, dir)
            .min_align_mask(min_align_mask)
            .alloc_align_mask(ALLOC_ALIGN[self.align as usize])
            .seg_boundary_mask(BOUNDARY[self.boundary as usize])
            .worker(self.worker);
        (req, off)
    }
}

#[derive(Clone, Debug)]
enum Op {
    Map(MapOp),
    DeviceWrite {
        pick: usize,
        at: usize,
        len: usize,
        seed: u8,
    },
    CpuWrite {
        off: usize,
        len: usize,
        seed: u8,
    },
    SyncForDevice {
        pick: usize,
        at: usize,
        len: usize,
    },
    SyncForCpu {
        pick: usize,
        at: usize,
        len: usize,
    },
    Unmap {
        pick: usize,
        skip: bool,
        worker: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (
            0..ORIG_LEN,
            prop_oneof![1usize..64, 64usize..5000, 5000usize..70_000, 70_000usize..262_144],
            prop_oneof![3 => Just(None), 1 => (0..NEAR_MAX.len()).prop_map(Some)],
            0u8..3,
            (0..MIN_ALIGN.len() as u8, 0..ALLOC_ALIGN.len() as u8, 0..BOUNDARY.len() as u8),
            0usize..8,
        )
            .prop_map(|(off, size, near_max, dir, (mask, align, boundary), worker)| Op::Map(MapOp {
                off,
                size,
                near_max,
                dir,
                mask,
                align,
                boundary,
                worker,
            })),
        2 => (any::<usize>(), any::<usize>(), 1usize..9000, any::<u8>())
            .prop_map(|(pick, at, len, seed)| Op::DeviceWrite { pick, at, len, seed }),
        1 => (0..ORIG_LEN, 1usize..9000, any::<u8>()).prop_map(|(off, len, seed)| Op::CpuWrite { off, len, seed }),
        1 => (any::<usize>(), any::<usize>(), 1usize..9000).prop_map(|(pick, at, len)| Op::SyncForDevice { pick, at, len }),
        1 => (any::<usize>(), any::<usize>(), 1usize..9000).prop_map(|(pick, at, len)| Op::SyncForCpu { pick, at, len }),
        3 => (any::<usize>(), any::<bool>(), 0usize..4).prop_map(|(pick, skip, worker)| Op::Unmap { pick, skip, worker }),
    ]
}

struct Live {
    m: Mapping,
    /// Expected device-visible bytes.
    dev: Vec<u8>,
    /// Bytes the device may legitimately hold that the model does not know (iova mode,
    /// from-device buffers are not copied in): positions not yet written are "unknown".
    known: Vec<bool>,
    min_align_mask: u64,
}

/// The live mapping `pick` names and the sub-range (`at`, `len`) of it, both fitted to its
/// size; `None` when nothing is live.
fn pick_range(
    live: &mut [Live],
    pick: usize,
    at: usize,
    len: usize,
) -> Option<(&mut Live, usize, usize)> {
    if live.is_empty() {
        return None;
    }
    let n = live.len();
    let l = &mut live[pick % n];
    let at = at % l.m.size;
    let len = len.min(l.m.size - at);
    Some((l, at, len))
}

fn bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed ^ (i as u8).wrapping_mul(31))
        .collect()
}

fn run(kind: AllocatorKind, mode: PoolMode, shape: Shape, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut cfg = match mode {
        PoolMode::Swiotlb => PoolConfig::swiotlb(shape.slots),
        PoolMode::Iova => PoolConfig::iova(shape.slots),
    };
    cfg.allocator = kind;
    cfg.workers = 4;
    if shape.areas.is_some() {
        cfg.areas = shape.areas;
    }
    if let Some(base) = shape.base {
        cfg.base = base;
    }
    if shape.kernel_limit {
        cfg.size_limit = SizeLimit::Kernel;
    }
    let pool = BouncePool::new(&cfg).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let geom = *pool.geometry();
    let mut orig = bytes(3, ORIG_LEN);
    let mut model = orig.clone();
    let mut live: Vec<Live> = Vec::new();
    let mut occupied = vec![false; geom.nslabs];

    for op in ops {
        let mem = HostMemory::new(ORIG_BASE, &mut orig);
        match *op {
            Op::Map(map) => {
                let (req, off) = map.request(&geom);
                let (addr, size, dir, min_align_mask) =
                    (req.orig, req.size, req.dir, req.min_align_mask);
                let want = expect(&geom, shape.kernel_limit, &req);
                match pool.map(&mem, &req) {
                    Ok(m) => {
                        prop_assert!(!want.too_large, "{kind}: {req:?} should be too large");
                        prop_assert_eq!(m.nslots, want.nslots, "{}: slots of {:?}", kind, req);
                        prop_assert_eq!(
                            m.dev_addr,
                            geom.base
                                + ((m.slot + want.pad) as u64) * geom.slot_size()
                                + want.in_slot,
                            "{}: device address of {:?} at slot {}",
                            kind,
                            req,
                            m.slot
                        );
                        prop_assert_eq!(m.dev_addr & min_align_mask, addr & min_align_mask);
                        prop_assert!(
                            placement_ok(&geom, &req, &want, m.slot),
                            "{kind}: {req:?} misplaced at slot {}",
                            m.slot
                        );
                        if kind == AllocatorKind::Genpool {
                            let first = first_fit(&geom, &req, &want, &occupied);
                            prop_assert_eq!(Some(m.slot), first, "genpool is first fit");
                        }
                        for (s, occ) in occupied.iter_mut().enumerate().skip(m.slot).take(m.nslots)
                        {
                            prop_assert!(!*occ, "{kind}: slot {} handed out twice", s);
                            *occ = true;
                        }
                        let copied = mode == PoolMode::Swiotlb || dir.device_reads();
                        let dev = model[off..off + size].to_vec();
                        let known = vec![copied; size];
                        check_dev(&pool, &m, &dev, &known)?;
                        live.push(Live {
                            m,
                            dev,
                            known,
                            min_align_mask,
                        });
                    }
                    Err(Error::PoolFull {
                        used,
                        total,
                        size: bytes,
                    }) => {
                        prop_assert!(!want.too_large, "{kind}: {req:?} should be too large");
                        prop_assert_eq!(total, geom.nslabs);
                        prop_assert!(used <= total);
                        prop_assert_eq!(bytes as u64, want.alloc_size);
                        let fit = first_fit(&geom, &req, &want, &occupied);
                        if let Some(slot) = fit {
                            prop_assert!(
                                !complete_search(kind, &geom, &want),
                                "{kind}: {req:?} refused as pool full, but slot {slot} fits"
                            );
                        }
                    }
                    Err(Error::TooLarge { size: s, max }) => {
                        prop_assert!(want.too_large, "{kind}: {req:?} refused as too large");
                        prop_assert_eq!(s, size);
                        prop_assert_eq!(max, linux_max_mapping_size(&geom, min_align_mask));
                    }
                    Err(e) => return Err(TestCaseError::fail(format!("{kind}: {e}"))),
                }
            }
            Op::DeviceWrite {
                pick,
                at,
                len,
                seed,
            } => {
                let Some((l, at, len)) = pick_range(&mut live, pick, at, len) else {
                    continue;
                };
                let data = bytes(seed, len);
                pool.device_slice(l.m.dev_addr + at as u64, len)
                    .unwrap()
                    .copy_from(&data[..]);
                l.dev[at..at + len].copy_from_slice(&data);
                l.known[at..at + len].iter_mut().for_each(|k| *k = true);
            }
            Op::CpuWrite { off, len, seed } => {
                let len = len.min(ORIG_LEN - off);
                let data = bytes(seed, len);
                mem.write_orig(
                    ORIG_BASE + off as u64,
                    &VolatileSlice::from(&mut data.clone()[..]),
                )
                .unwrap();
                model[off..off + len].copy_from_slice(&data);
            }
            Op::SyncForDevice { pick, at, len } => {
                let Some((l, at, len)) = pick_range(&mut live, pick, at, len) else {
                    continue;
                };
                pool.sync(
                    &mem,
                    l.m.dev_addr + at as u64,
                    len,
                    l.m.dir,
                    SyncFor::Device,
                )
                .unwrap();
                if l.m.dir.device_reads() {
                    let o = (l.m.orig - ORIG_BASE) as usize + at;
                    l.dev[at..at + len].copy_from_slice(&model[o..o + len]);
                    l.known[at..at + len].iter_mut().for_each(|k| *k = true);
                }
                check_dev(&pool, &l.m, &l.dev, &l.known)?;
            }
            Op::SyncForCpu { pick, at, len } => {
                let Some((l, at, len)) = pick_range(&mut live, pick, at, len) else {
                    continue;
                };
                if l.m.dir.device_writes() && !l.known[at..at + len].iter().all(|k| *k) {
                    continue; // the model cannot predict unknown bytes
                }
                pool.sync(&mem, l.m.dev_addr + at as u64, len, l.m.dir, SyncFor::Cpu)
                    .unwrap();
                if l.m.dir.device_writes() {
                    let o = (l.m.orig - ORIG_BASE) as usize + at;
                    model[o..o + len].copy_from_slice(&l.dev[at..at + len]);
                }
            }
            Op::Unmap { pick, skip, worker } => {
                if live.is_empty() {
                    continue;
                }
                let i = pick % live.len();
                if live[i].m.dir.device_writes() && !skip && !live[i].known.iter().all(|k| *k) {
                    // Write the unknown bytes so the copy back is predictable.
                    let l = &mut live[i];
                    for (j, k) in l.known.iter_mut().enumerate() {
                        if !*k {
                            l.dev[j] = 0x5e;
                            *k = true;
                        }
                    }
                    pool.device_slice(l.m.dev_addr, l.m.size)
                        .unwrap()
                        .copy_from(&l.dev[..]);
                }
                let l = live.swap_remove(i);
                let attrs = DmaAttrs {
                    skip_cpu_sync: skip,
                    no_warn: true,
                };
                pool.unmap_single(&mem, l.m.dev_addr, l.m.size, l.m.dir, attrs, worker)
                    .unwrap();
                occupied[l.m.slot..l.m.slot + l.m.nslots].fill(false);
                if l.m.dir.device_writes() && !skip {
                    let o = (l.m.orig - ORIG_BASE) as usize;
                    model[o..o + l.m.size].copy_from_slice(&l.dev);
                }
                let _ = l.min_align_mask;
            }
        }
        prop_assert_eq!(
            pool.used(),
            occupied.iter().filter(|o| **o).count(),
            "{}: used count",
            kind
        );
        prop_assert!(
            orig == model,
            "{kind}: original memory differs from the model after {op:?}"
        );
    }

    let mem = HostMemory::new(ORIG_BASE, &mut orig);
    for l in live.drain(..) {
        pool.unmap_single(
            &mem,
            l.m.dev_addr,
            l.m.size,
            l.m.dir,
            DmaAttrs {
                skip_cpu_sync: true,
                no_warn: true,
            },
            0,
        )
        .unwrap();
    }
    prop_assert_eq!(pool.used(), 0);
    // Cached runs count as used until flushed; then nothing is.
    pool.allocator().flush_caches();
    prop_assert_eq!(
        pool.allocator().area_used().iter().sum::<usize>(),
        0,
        "{}: slots still in use after every unmap",
        kind
    );
    // Nothing leaked: every slot can be mapped again, one slot per mapping.
    let slot = geom.slot_size() as usize;
    let mut again = Vec::new();
    for i in 0..geom.nslabs {
        let m = pool
            .map(
                &mem,
                &MapRequest::new(ORIG_BASE, slot, Direction::ToDevice).worker(i % 4),
            )
            .map_err(|e| TestCaseError::fail(format!("{kind}: refill {i}/{}: {e}", geom.nslabs)))?;
        again.push(m);
    }
    for m in again.drain(..) {
        pool.unmap(&mem, &m, 0).unwrap();
    }
    // In swiotlb mode segments are aligned, so maximal mappings tile the pool exactly (the
    // iova-bitmap allocator serves large requests from half of the pool only). The IOVA
    // allocators align a run to its size in device-slot numbers, which a base that is not a
    // multiple of a segment puts across every segment: no whole segment is placeable there.
    let size_aligned = matches!(
        kind,
        AllocatorKind::IovaRbtree | AllocatorKind::IovaRcache | AllocatorKind::IovaBitmap
    );
    let seg_bytes = geom.segsize as u64 * geom.slot_size();
    if mode == PoolMode::Swiotlb && (!size_aligned || geom.base % seg_bytes == 0) {
        let max = pool.max_mapping_size(0);
        let mut want = geom.bytes() / max;
        if kind == AllocatorKind::IovaBitmap {
            want /= 2;
        }
        for i in 0..want {
            let m = pool
                .map(
                    &mem,
                    // Slot alignment only: with a base half a page in no segment starts on
                    // a page.
                    &MapRequest::new(ORIG_BASE, max, Direction::ToDevice)
                        .alloc_align_mask(0x7ff)
                        .worker(i % 4),
                )
                .map_err(|e| TestCaseError::fail(format!("{kind}: refill {i}/{want}: {e}")))?;
            again.push(m);
        }
        for m in &again {
            pool.unmap(&mem, m, 0).unwrap();
        }
    }
    Ok(())
}

/// What Linux's rules say about one map, derived without the crate.
#[derive(Debug)]
struct Expect {
    /// The map must fail with TooLarge.
    too_large: bool,
    /// Bytes from the allocation's start to the data's slot, in slots (padding).
    pad: usize,
    /// Offset of the data in its first slot.
    in_slot: u64,
    /// Allocation size in bytes, padding and alignment included.
    alloc_size: u64,
    /// Minimal slots for the allocation.
    nslots: usize,
    /// Effective alignment mask of the allocation's first slot (page rule and slot floor).
    align_mask: u64,
    /// Bits of the first slot's address that must equal the original's.
    iotlb_mask: u64,
}

/// Linux `swiotlb_max_mapping_size`: a segment less `min_align_mask` rounded up to a slot.
fn linux_max_mapping_size(geom: &Geometry, min_align_mask: u64) -> usize {
    let slot = geom.slot_size();
    let seg = geom.segsize as u64 * slot;
    let pad = if min_align_mask == 0 {
        0
    } else {
        min_align_mask.div_ceil(slot) * slot
    };
    (seg - pad.min(seg)) as usize
}

/// `swiotlb_tbl_map_single` and `swiotlb_search_pool_area`, from the kernel's text.
fn expect(geom: &Geometry, kernel_limit: bool, req: &MapRequest) -> Expect {
    let slot = geom.slot_size();
    let offset = req.orig & req.min_align_mask & (req.alloc_align_mask | (slot - 1));
    let align = req.alloc_align_mask + 1;
    let alloc_size = (req.size as u64 + offset).div_ceil(align) * align;
    let seg_bytes = geom.segsize as u64 * slot;
    let over_max = !kernel_limit && req.size > linux_max_mapping_size(geom, req.min_align_mask);
    let mut align_mask = req.alloc_align_mask;
    if geom.mode == PoolMode::Swiotlb
        && req.alloc_align_mask == 0
        && req.min_align_mask == 0
        && alloc_size >= 4096
    {
        align_mask = 4095;
    }
    align_mask |= slot - 1;
    Expect {
        too_large: over_max || alloc_size > seg_bytes,
        pad: (offset / slot) as usize,
        in_slot: offset % slot,
        alloc_size,
        nslots: alloc_size.div_ceil(slot) as usize,
        align_mask,
        iotlb_mask: req.min_align_mask & !align_mask,
    }
}

/// Every placement rule, for an allocation of `want.nslots` slots starting at `slot`: inside
/// the pool and one segment; the first slot's address (from the pool base masked by the
/// boundary mask, as Linux's `tbl_dma_addr`) aligned and in phase with the original; the whole
/// allocation inside one segment-boundary window.
fn placement_ok(geom: &Geometry, req: &MapRequest, want: &Expect, slot: usize) -> bool {
    let n = want.nslots;
    if slot + n > geom.nslabs || slot / geom.segsize != (slot + n - 1) / geom.segsize {
        return false;
    }
    let tlb = (geom.base & req.seg_boundary_mask) + slot as u64 * geom.slot_size();
    let last = tlb + n as u64 * geom.slot_size() - 1;
    tlb & want.align_mask == 0
        && tlb & want.iotlb_mask == req.orig & want.iotlb_mask
        && tlb & !req.seg_boundary_mask == last & !req.seg_boundary_mask
}

/// The lowest slot where the allocation fits on the model's free slots.
fn first_fit(geom: &Geometry, req: &MapRequest, want: &Expect, occupied: &[bool]) -> Option<usize> {
    let n = want.nslots;
    (0..=geom.nslabs.saturating_sub(n))
        .find(|&s| placement_ok(geom, req, want, s) && occupied[s..s + n].iter().all(|o| !*o))
}

/// True when `kind`'s search finds a run whenever one exists: the bitmap searches, first fit
/// and the magazine (after its flush) always; the rolling-index searches of Linux only when no
/// alignment makes them stride over candidates. The IOVA allocators impose their own size
/// alignment and are not complete.
fn complete_search(kind: AllocatorKind, geom: &Geometry, want: &Expect) -> bool {
    match kind {
        AllocatorKind::Bitmap
        | AllocatorKind::AreasBitmap
        | AllocatorKind::Genpool
        | AllocatorKind::Magazine => true,
        AllocatorKind::Areas | AllocatorKind::AreasLifo | AllocatorKind::Legacy => {
            (want.align_mask | want.iotlb_mask) < geom.slot_size()
        }
        _ => false,
    }
}

fn check_dev(
    pool: &BouncePool,
    m: &Mapping,
    dev: &[u8],
    known: &[bool],
) -> Result<(), TestCaseError> {
    let mut got = vec![0u8; m.size];
    pool.device_slice(m.dev_addr, m.size)
        .unwrap()
        .copy_to(&mut got[..]);
    for i in 0..m.size {
        if known[i] && got[i] != dev[i] {
            return Err(TestCaseError::fail(format!(
                "device byte {i} of {m:?}: {} != {}",
                got[i], dev[i]
            )));
        }
    }
    Ok(())
}

/// Cases per test unless `BOUNCE_MODEL_CASES` says otherwise.
const DEFAULT_CASES: u32 = 64;

fn cases() -> u32 {
    std::env::var("BOUNCE_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

macro_rules! model_tests {
    ($($name:ident: $kind:expr, $mode:expr;)*) => {$(
        proptest! {
            #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]
            #[test]
            fn $name(shape in shape($mode), ops in proptest::collection::vec(op(), 1..400)) {
                run($kind, $mode, shape, &ops)?;
            }
        }
    )*};
}

model_tests! {
    model_legacy: AllocatorKind::Legacy, PoolMode::Swiotlb;
    model_bitmap: AllocatorKind::Bitmap, PoolMode::Swiotlb;
    model_areas: AllocatorKind::Areas, PoolMode::Swiotlb;
    model_areas_bitmap: AllocatorKind::AreasBitmap, PoolMode::Swiotlb;
    model_iova_rbtree: AllocatorKind::IovaRbtree, PoolMode::Swiotlb;
    model_iova_rcache: AllocatorKind::IovaRcache, PoolMode::Swiotlb;
    model_genpool: AllocatorKind::Genpool, PoolMode::Swiotlb;
    model_iova_bitmap: AllocatorKind::IovaBitmap, PoolMode::Swiotlb;
    model_iova_mode_rbtree: AllocatorKind::IovaRbtree, PoolMode::Iova;
    model_iova_mode_rcache: AllocatorKind::IovaRcache, PoolMode::Iova;
    model_iova_mode_genpool: AllocatorKind::Genpool, PoolMode::Iova;
    model_iova_mode_bitmap: AllocatorKind::IovaBitmap, PoolMode::Iova;
    model_iova_mode_areas: AllocatorKind::Areas, PoolMode::Iova;
    model_areas_lifo: AllocatorKind::AreasLifo, PoolMode::Swiotlb;
    model_magazine: AllocatorKind::Magazine, PoolMode::Swiotlb;
    model_iova_mode_areas_lifo: AllocatorKind::AreasLifo, PoolMode::Iova;
    model_iova_mode_magazine: AllocatorKind::Magazine, PoolMode::Iova;
}
