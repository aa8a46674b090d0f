//! Semantics tests: every row of the copy-rule table and every placement rule of
//! DESIGN.md ("The bounce module"), for every allocator that can serve the pool.
//!
//! Each test is written so that a plausible bug fails it: a map that skips the copy for
//! from-device buffers, an unmap that copies back for to-device, a sync that copies the wrong
//! way or from the wrong slot, a placement that ignores a mask or crosses a segment.

use bounce::{
    AllocatorKind, BouncePool, CopyOnMap, Direction, DmaAttrs, Error, HostMemory, MapRequest,
    Mapping, OrigMemory, PoolConfig, PoolMode, SizeLimit, SyncFor,
};
use vm_memory::VolatileSlice;

const ORIG_BASE: u64 = 0x1000_0000;
const ORIG_LEN: usize = 1 << 20;

fn pool(kind: AllocatorKind, mode: PoolMode, slots: usize) -> BouncePool {
    let mut cfg = match mode {
        PoolMode::Swiotlb => PoolConfig::swiotlb(slots),
        PoolMode::Iova => PoolConfig::iova(slots),
    };
    cfg.allocator = kind;
    cfg.areas = Some(1);
    BouncePool::new(&cfg).unwrap_or_else(|e| panic!("{kind}: {e}"))
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i * 7 % 251) as u8))
        .collect()
}

/// Original memory: a host buffer whose bytes start as `pattern(1, ..)`.
struct Orig {
    buf: Vec<u8>,
}

impl Orig {
    fn new() -> Self {
        Self {
            buf: pattern(1, ORIG_LEN),
        }
    }
    fn mem(&mut self) -> HostMemory<'_> {
        HostMemory::new(ORIG_BASE, &mut self.buf)
    }
    fn at(&self, addr: u64, len: usize) -> &[u8] {
        let off = (addr - ORIG_BASE) as usize;
        &self.buf[off..off + len]
    }
}

fn dev_read(p: &BouncePool, addr: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    p.device_slice(addr, len).unwrap().copy_to(&mut v[..]);
    v
}

fn dev_write(p: &BouncePool, addr: u64, data: &[u8]) {
    p.device_slice(addr, data.len()).unwrap().copy_from(data);
}

const SWIOTLB_KINDS: [AllocatorKind; AllocatorKind::ALL.len()] = AllocatorKind::ALL;

/// Every direction, in the order the tests derive addresses and patterns from.
const DIRECTIONS: [Direction; 3] = [
    Direction::ToDevice,
    Direction::FromDevice,
    Direction::Bidirectional,
];

/// `DMA_ATTR_SKIP_CPU_SYNC`: map without copying in, unmap without copying back.
const SKIP_CPU_SYNC: DmaAttrs = DmaAttrs {
    skip_cpu_sync: true,
    no_warn: false,
};

/// Maps `len` bytes of the original at `addr` for `dir`, without masks.
fn map(p: &BouncePool, o: &mut Orig, addr: u64, len: usize, dir: Direction) -> Mapping {
    p.map(&o.mem(), &MapRequest::new(addr, len, dir)).unwrap()
}

/// Unmaps every mapping of `live`.
fn unmap_all(p: &BouncePool, o: &mut Orig, live: &[Mapping]) {
    for m in live {
        p.unmap(&o.mem(), m, 0).unwrap();
    }
}

/// Unmaps `m` whole without copying back.
fn unmap_skipping_sync(p: &BouncePool, o: &mut Orig, m: &Mapping) {
    p.unmap_single(&o.mem(), m.dev_addr, m.size, m.dir, SKIP_CPU_SYNC, 0)
        .unwrap();
}

/// Runs `test` once per allocator on a fresh one-area swiotlb-mode pool of `slots` slots, with
/// fresh original memory.
fn each_swiotlb_pool(slots: usize, mut test: impl FnMut(AllocatorKind, &BouncePool, &mut Orig)) {
    for kind in SWIOTLB_KINDS {
        test(
            kind,
            &pool(kind, PoolMode::Swiotlb, slots),
            &mut Orig::new(),
        );
    }
}

// ---------------------------------------------------------------- copy rules: map

#[test]
fn map_copies_in_for_every_direction_in_swiotlb_mode() {
    each_swiotlb_pool(1024, |kind, p, o| {
        for dir in DIRECTIONS {
            let addr = ORIG_BASE + 0x3000;
            // Dirty the pool so a missing copy-in would show stale bytes.
            let probe = map(p, o, addr, 8192, Direction::ToDevice);
            dev_write(p, probe.dev_addr, &[0xee; 8192]);
            p.unmap(&o.mem(), &probe, 0).unwrap();

            let m = map(p, o, addr, 8192, dir);
            assert_eq!(
                dev_read(p, m.dev_addr, 8192),
                o.at(addr, 8192),
                "{kind} {dir:?}: map must copy the original in"
            );
            p.unmap(&o.mem(), &m, 0).unwrap();
        }
    });
}

#[test]
fn partial_device_write_keeps_unwritten_original_bytes() {
    // The 2022 info-leak fix: from-device, device writes only the first half.
    each_swiotlb_pool(1024, |kind, p, o| {
        let addr = ORIG_BASE + 0x10000;
        let before = o.at(addr, 4096).to_vec();
        let m = map(p, o, addr, 4096, Direction::FromDevice);
        dev_write(p, m.dev_addr, &[0xab; 2048]);
        p.unmap(&o.mem(), &m, 0).unwrap();
        assert_eq!(o.at(addr, 2048), &[0xab; 2048][..], "{kind}");
        assert_eq!(o.at(addr + 2048, 2048), &before[2048..], "{kind}");
    });
}

#[test]
fn iova_mode_copies_in_only_when_the_device_reads() {
    for kind in [
        AllocatorKind::IovaRbtree,
        AllocatorKind::IovaRcache,
        AllocatorKind::Genpool,
        AllocatorKind::IovaBitmap,
        AllocatorKind::Areas,
        AllocatorKind::AreasLifo,
        AllocatorKind::Magazine,
    ] {
        let p = &pool(kind, PoolMode::Iova, 256);
        assert_eq!(p.copy_on_map(), CopyOnMap::WhenDeviceReads);
        let o = &mut Orig::new();
        let addr = ORIG_BASE + 0x2000;
        // to-device and bidirectional copy in
        for dir in [Direction::ToDevice, Direction::Bidirectional] {
            let m = map(p, o, addr, 4096, dir);
            assert_eq!(
                dev_read(p, m.dev_addr, 4096),
                o.at(addr, 4096),
                "{kind} {dir:?}"
            );
            dev_write(p, m.dev_addr, &[0x5a; 4096]);
            p.unmap(&o.mem(), &m, 0).unwrap();
        }
        // from-device does not: the device sees whatever the pool held
        let m = map(p, o, addr + 0x1000, 4096, Direction::FromDevice);
        assert_ne!(
            dev_read(p, m.dev_addr, 4096),
            o.at(addr + 0x1000, 4096),
            "{kind}: iova mode must not copy a from-device buffer in"
        );
        p.unmap(&o.mem(), &m, 0).unwrap();
        // skip-cpu-sync suppresses the copy-in of a to-device buffer too (VDUSE)
        let req = MapRequest::new(addr + 0x8000, 4096, Direction::ToDevice).attrs(SKIP_CPU_SYNC);
        let m = p.map(&o.mem(), &req).unwrap();
        assert_ne!(
            dev_read(p, m.dev_addr, 4096),
            o.at(addr + 0x8000, 4096),
            "{kind}"
        );
        p.unmap(&o.mem(), &m, 0).unwrap();
    }
}

#[test]
fn copy_rules_parse_by_the_names_the_statistics_show() {
    for rule in [CopyOnMap::Always, CopyOnMap::WhenDeviceReads] {
        assert_eq!(rule.name().parse::<CopyOnMap>().unwrap(), rule);
        assert_eq!(rule.to_string(), rule.name());
        assert_eq!(
            serde_json::to_string(&rule).unwrap(),
            format!("\"{}\"", rule.name())
        );
    }
    let e = "sometimes".parse::<CopyOnMap>().unwrap_err();
    assert!(e.to_string().contains("always or when-device-reads"), "{e}");
    let mut cfg = PoolConfig::iova(64);
    assert_eq!(
        BouncePool::new(&cfg).unwrap().stats().copy_on_map,
        CopyOnMap::WhenDeviceReads
    );
    cfg.copy_on_map = Some(CopyOnMap::Always);
    assert_eq!(
        BouncePool::new(&cfg).unwrap().stats().copy_on_map,
        CopyOnMap::Always
    );
}

#[test]
fn copy_on_map_is_selectable() {
    let mut cfg = PoolConfig::swiotlb(256);
    cfg.copy_on_map = Some(CopyOnMap::WhenDeviceReads);
    let p = &BouncePool::new(&cfg).unwrap();
    let o = &mut Orig::new();
    let m = map(p, o, ORIG_BASE, 2048, Direction::FromDevice);
    assert_eq!(
        dev_read(p, m.dev_addr, 2048),
        vec![0; 2048],
        "fresh pool is zeroed"
    );
    p.unmap(&o.mem(), &m, 0).unwrap();

    let mut cfg = PoolConfig::iova(64);
    cfg.copy_on_map = Some(CopyOnMap::Always);
    let p = &BouncePool::new(&cfg).unwrap();
    let m = map(p, o, ORIG_BASE, 2048, Direction::FromDevice);
    assert_eq!(dev_read(p, m.dev_addr, 2048), o.at(ORIG_BASE, 2048));
    p.unmap(&o.mem(), &m, 0).unwrap();
}

// ---------------------------------------------------------------- copy rules: unmap

#[test]
fn unmap_copies_back_exactly_for_from_device_and_bidirectional() {
    for kind in SWIOTLB_KINDS {
        for mode in [PoolMode::Swiotlb, PoolMode::Iova] {
            let p = &pool(kind, mode, 512);
            let o = &mut Orig::new();
            for (i, dir) in DIRECTIONS.into_iter().enumerate() {
                let addr = ORIG_BASE + 0x4000 * (i as u64 + 1);
                let before = o.at(addr, 6000).to_vec();
                let m = map(p, o, addr, 6000, dir);
                let new = pattern(0x90 + i as u8, 6000);
                dev_write(p, m.dev_addr, &new);
                p.unmap(&o.mem(), &m, 0).unwrap();
                let want = if dir.device_writes() { &new } else { &before };
                assert_eq!(o.at(addr, 6000), &want[..], "{kind} {mode:?} {dir:?}");
            }
        }
    }
}

#[test]
fn unmap_with_skip_cpu_sync_does_not_copy_back() {
    each_swiotlb_pool(256, |kind, p, o| {
        let addr = ORIG_BASE + 0x8000;
        let before = o.at(addr, 3000).to_vec();
        for dir in [Direction::FromDevice, Direction::Bidirectional] {
            let m = map(p, o, addr, 3000, dir);
            dev_write(p, m.dev_addr, &[0x11; 3000]);
            unmap_skipping_sync(p, o, &m);
            assert_eq!(o.at(addr, 3000), &before[..], "{kind} {dir:?}");
        }
        assert_eq!(p.used(), 0);
    });
}

// ---------------------------------------------------------------- copy rules: sync

#[test]
fn sync_for_device_copies_in_for_to_device_and_bidirectional_only() {
    each_swiotlb_pool(256, |kind, p, o| {
        for dir in DIRECTIONS {
            let addr = ORIG_BASE + 0x20000;
            let m = map(p, o, addr, 8192, dir);
            // The CPU changes the original after map.
            let fresh = pattern(0x33, 8192);
            o.mem()
                .write_orig(addr, &VolatileSlice::from(&mut fresh.clone()[..]))
                .unwrap();
            let stale = dev_read(p, m.dev_addr, 8192);
            p.sync(&o.mem(), m.dev_addr, 8192, dir, SyncFor::Device)
                .unwrap();
            let now = dev_read(p, m.dev_addr, 8192);
            if dir.device_reads() {
                assert_eq!(now, fresh, "{kind} {dir:?}");
            } else {
                assert_eq!(
                    now, stale,
                    "{kind} {dir:?}: from-device sync_for_device copies nothing"
                );
            }
            unmap_skipping_sync(p, o, &m);
            *o = Orig::new();
        }
    });
}

#[test]
fn sync_for_cpu_copies_back_for_from_device_and_bidirectional_only() {
    each_swiotlb_pool(256, |kind, p, o| {
        for dir in DIRECTIONS {
            *o = Orig::new();
            let addr = ORIG_BASE + 0x30000;
            let before = o.at(addr, 8192).to_vec();
            let m = map(p, o, addr, 8192, dir);
            let new = pattern(0x77, 8192);
            dev_write(p, m.dev_addr, &new);
            p.sync(&o.mem(), m.dev_addr, 8192, dir, SyncFor::Cpu)
                .unwrap();
            let want = if dir.device_writes() { &new } else { &before };
            assert_eq!(o.at(addr, 8192), &want[..], "{kind} {dir:?}");
            p.unmap(&o.mem(), &m, 0).unwrap();
        }
    });
}

#[test]
fn partial_sync_from_the_middle_finds_its_source() {
    // Slot i of a mapping records orig + i * 2 KiB: a sync of a sub-range that starts in a
    // later slot (and at an odd offset) must copy exactly that sub-range.
    each_swiotlb_pool(256, |kind, p, o| {
        let addr = ORIG_BASE + 0x40000 + 100; // not slot aligned
        let m = map(p, o, addr, 20000, Direction::Bidirectional);
        let new = pattern(0xc4, 20000);
        dev_write(p, m.dev_addr, &new);
        let (off, len) = (5000usize, 3333usize);
        let before = o.at(addr, 20000).to_vec();
        p.sync(
            &o.mem(),
            m.dev_addr + off as u64,
            len,
            Direction::Bidirectional,
            SyncFor::Cpu,
        )
        .unwrap();
        let mut want = before.clone();
        want[off..off + len].copy_from_slice(&new[off..off + len]);
        assert_eq!(o.at(addr, 20000), &want[..], "{kind}");
        // and the other way
        let cpu = pattern(0x21, len);
        o.mem()
            .write_orig(
                addr + off as u64 + 7,
                &VolatileSlice::from(&mut cpu.clone()[..]),
            )
            .unwrap();
        p.sync(
            &o.mem(),
            m.dev_addr + off as u64 + 7,
            len,
            Direction::Bidirectional,
            SyncFor::Device,
        )
        .unwrap();
        assert_eq!(dev_read(p, m.dev_addr + off as u64 + 7, len), cpu, "{kind}");
        unmap_skipping_sync(p, o, &m);
    });
}

#[test]
fn sync_past_the_end_of_a_mapping_is_clamped() {
    let p = &pool(AllocatorKind::Areas, PoolMode::Swiotlb, 256);
    let o = &mut Orig::new();
    let addr = ORIG_BASE + 0x1000;
    // Two mappings back to back: the first is 2 KiB, a sync of 4 KiB from it must not spill
    // into the second mapping's original.
    let a = map(p, o, addr, 2048, Direction::FromDevice);
    let b = map(p, o, addr + 0x10000, 2048, Direction::FromDevice);
    assert_eq!(
        b.dev_addr,
        a.dev_addr + 2048,
        "areas places them back to back"
    );
    dev_write(p, a.dev_addr, &[1; 2048]);
    dev_write(p, b.dev_addr, &[2; 2048]);
    let before_b = o.at(addr + 0x10000, 2048).to_vec();
    let after_a = o.at(addr + 2048, 2048).to_vec();
    p.sync(
        &o.mem(),
        a.dev_addr,
        4096,
        Direction::FromDevice,
        SyncFor::Cpu,
    )
    .unwrap();
    assert_eq!(o.at(addr, 2048), &[1; 2048][..]);
    assert_eq!(
        o.at(addr + 2048, 2048),
        &after_a[..],
        "clamped at the allocation end"
    );
    assert_eq!(o.at(addr + 0x10000, 2048), &before_b[..]);
    assert_eq!(p.stats().clamped, 1);
}

// ---------------------------------------------------------------- placement rules

#[test]
fn min_align_mask_preserves_the_offset_bits() {
    each_swiotlb_pool(1024, |kind, p, o| {
        let mut live = Vec::new();
        for (i, mask) in [0xfffu64, 0x7ff, 0x3fff, 0x1ff].into_iter().enumerate() {
            for off in [0u64, 1, 0x200, 0x7ff, 0x800, 0x801, 0xabc, 0x1fff, 0x2f00] {
                let addr = ORIG_BASE + 0x10000 * (i as u64 + 1) + off;
                let req = MapRequest::new(addr, 5000, Direction::ToDevice).min_align_mask(mask);
                let m = p.map(&o.mem(), &req).unwrap();
                assert_eq!(
                    m.dev_addr & mask,
                    addr & mask,
                    "{kind} mask {mask:#x} off {off:#x}"
                );
                assert_eq!(dev_read(p, m.dev_addr, 5000), o.at(addr, 5000), "{kind}");
                live.push(m);
            }
        }
        unmap_all(p, o, &live);
        assert_eq!(p.used(), 0, "{kind}: padding slots are released too");
    });
}

#[test]
fn page_alignment_only_for_page_sized_mappings_without_masks() {
    // Linux's search: after a one-slot mapping at slot 0 the rolling index is 1, so the next
    // request is placed at slot 1 unless it must be page aligned.
    let after_one_slot = |kind: AllocatorKind, req: MapRequest| -> usize {
        let p = &pool(kind, PoolMode::Swiotlb, 1024);
        let o = &mut Orig::new();
        let one = map(p, o, ORIG_BASE, 100, Direction::ToDevice);
        assert_eq!(one.slot, 0, "{kind}");
        let m = p.map(&o.mem(), &req).unwrap();
        m.slot
    };
    for kind in [
        AllocatorKind::Areas,
        AllocatorKind::Legacy,
        AllocatorKind::Bitmap,
        AllocatorKind::AreasBitmap,
    ] {
        let at = ORIG_BASE + 0x800;
        assert_eq!(
            after_one_slot(kind, MapRequest::new(at, 4096, Direction::ToDevice)),
            2,
            "{kind}: a 4 KiB mapping without masks is page aligned"
        );
        assert_eq!(
            after_one_slot(kind, MapRequest::new(at, 4095, Direction::ToDevice)),
            1,
            "{kind}: a sub-page mapping is not page aligned"
        );
        assert_eq!(
            after_one_slot(
                kind,
                MapRequest::new(at, 4096, Direction::ToDevice).min_align_mask(0x7ff)
            ),
            1,
            "{kind}: the page rule applies only when both masks are zero"
        );
    }
    // Whatever the allocator, page-sized mappings without masks come out page aligned.
    each_swiotlb_pool(1024, |kind, p, o| {
        let mut live = Vec::new();
        for (i, size) in [100usize, 4096, 2048, 10_000, 4097, 3000, 65536]
            .into_iter()
            .enumerate()
        {
            let m = map(
                p,
                o,
                ORIG_BASE + 0x800 * i as u64,
                size,
                Direction::ToDevice,
            );
            if size >= 4096 {
                assert_eq!(m.dev_addr % 4096, 0, "{kind} size {size}");
            }
            live.push(m);
        }
        unmap_all(p, o, &live);
    });
}

#[test]
fn padding_slots_keep_offsets_above_the_slot_size() {
    // min_align_mask and alloc_align_mask together: an original at page offset 0x900 needs one
    // padding slot so that the device address keeps the 0x900 offset inside an aligned page.
    each_swiotlb_pool(1024, |kind, p, o| {
        let addr = ORIG_BASE + 0x5900;
        let req = MapRequest::new(addr, 6000, Direction::Bidirectional)
            .min_align_mask(0xfff)
            .alloc_align_mask(0xfff);
        let m = p.map(&o.mem(), &req).unwrap();
        assert_eq!(m.dev_addr & 0xfff, 0x900, "{kind}");
        assert_eq!(
            (m.dev_addr - 0x900) % 4096,
            0,
            "{kind}: allocation starts page aligned"
        );
        assert_eq!(
            m.nslots, 6,
            "{kind}: 0x900 + 6000 bytes round up to three pages"
        );
        assert_eq!(dev_read(p, m.dev_addr, 6000), o.at(addr, 6000), "{kind}");
        let new = pattern(0x4b, 6000);
        dev_write(p, m.dev_addr, &new);
        p.unmap(&o.mem(), &m, 0).unwrap();
        assert_eq!(o.at(addr, 6000), &new[..], "{kind}");
        assert_eq!(p.used(), 0, "{kind}: the padding slot was released");
    });
}

#[test]
fn alloc_align_mask_aligns_the_allocation() {
    each_swiotlb_pool(1024, |kind, p, o| {
        let one = map(p, o, ORIG_BASE, 100, Direction::ToDevice);
        for mask in [0xfffu64, 0x3fff, 0xffff] {
            let m = p
                .map(
                    &o.mem(),
                    &MapRequest::new(ORIG_BASE + 0x100, 3000, Direction::ToDevice)
                        .alloc_align_mask(mask),
                )
                .unwrap();
            assert_eq!(m.dev_addr & mask, 0, "{kind} mask {mask:#x}");
            p.unmap(&o.mem(), &m, 0).unwrap();
        }
        p.unmap(&o.mem(), &one, 0).unwrap();
    });
}

#[test]
fn no_mapping_crosses_a_segment() {
    // 423 slots in a 2048-slot pool (iova-bitmap serves large maps from half of it): every map
    // must succeed. In address order the first three
    // leave 41 slots of segment 0, so the 128-slot mapping that follows must skip to a later
    // segment: an allocator that ignores segments crosses one here.
    let sizes = [
        5000usize, 100_000, 70_000, 262_144, 2048, 150_000, 9_000, 262_144,
    ];
    each_swiotlb_pool(2048, |kind, p, o| {
        let base = p.geometry().base;
        let mut live = Vec::new();
        let mut addr = ORIG_BASE;
        for size in sizes {
            let m = p
                .map(&o.mem(), &MapRequest::new(addr, size, Direction::ToDevice))
                .unwrap_or_else(|e| panic!("{kind}: {size} bytes: {e}"));
            // Slots from the device address, not from what the pool reports.
            let first = ((m.dev_addr - base) >> 11) as usize;
            let last = ((m.dev_addr + size as u64 - 1 - base) >> 11) as usize;
            assert_eq!(first, m.slot, "{kind}: {size} bytes");
            assert_eq!(
                first / 128,
                last / 128,
                "{kind}: {size} bytes crossed a segment at slot {first}"
            );
            live.push(m);
            addr += 0x1000;
        }
        unmap_all(p, o, &live);
        assert_eq!(p.used(), 0, "{kind}");
    });
}

#[test]
fn maximum_mapping_size_follows_linux() {
    let p = &pool(AllocatorKind::Areas, PoolMode::Swiotlb, 1024);
    assert_eq!(p.max_mapping_size(0), 262_144);
    assert_eq!(p.max_mapping_size(0xfff), 262_144 - 4096);
    assert_eq!(p.max_mapping_size(0x7ff), 262_144 - 2048);
    assert_eq!(p.max_mapping_size(0x1), 262_144 - 2048);
    let o = &mut Orig::new();
    let m = map(p, o, ORIG_BASE, 262_144, Direction::ToDevice);
    p.unmap(&o.mem(), &m, 0).unwrap();
    assert!(matches!(
        p.map(
            &o.mem(),
            &MapRequest::new(ORIG_BASE, 262_145, Direction::ToDevice)
        ),
        Err(Error::TooLarge {
            size: 262_145,
            max: 262_144
        })
    ));
    let req = MapRequest::new(ORIG_BASE + 0xfff, 262_144 - 4096, Direction::ToDevice)
        .min_align_mask(0xfff);
    let m = p.map(&o.mem(), &req).unwrap();
    assert_eq!(m.dev_addr & 0xfff, 0xfff);
    p.unmap(&o.mem(), &m, 0).unwrap();
    let req = MapRequest::new(ORIG_BASE, 262_144 - 4095, Direction::ToDevice).min_align_mask(0xfff);
    assert!(matches!(p.map(&o.mem(), &req), Err(Error::TooLarge { .. })));
}

#[test]
fn kernel_size_limit_places_the_band_above_max_mapping_size() {
    // Linux's map refuses only an allocation over a segment: with a 4 KiB min_align_mask and a
    // page-aligned original, 258_049..=262_144 bytes still fit in 128 slots although the
    // advertised maximum is 258_048.
    let mut cfg = PoolConfig::swiotlb(1024);
    cfg.areas = Some(1);
    cfg.size_limit = SizeLimit::Kernel;
    let p = BouncePool::new(&cfg).unwrap();
    let strict = pool(AllocatorKind::Areas, PoolMode::Swiotlb, 1024);
    assert_eq!(p.max_mapping_size(0xfff), 262_144 - 4096);
    let mut o = Orig::new();
    for size in [262_144 - 4095, 262_144 - 1, 262_144] {
        let req = MapRequest::new(ORIG_BASE, size, Direction::ToDevice).min_align_mask(0xfff);
        assert!(matches!(
            strict.map(&o.mem(), &req),
            Err(Error::TooLarge { .. })
        ));
        let m = p.map(&o.mem(), &req).unwrap();
        assert_eq!(
            (m.nslots, m.dev_addr & 0xfff),
            (size.div_ceil(2048), 0),
            "{size}"
        );
        assert_eq!(m.slot / 128, (m.slot + m.nslots - 1) / 128);
        assert_eq!(dev_read(&p, m.dev_addr, size), o.at(ORIG_BASE, size));
        p.unmap(&o.mem(), &m, 0).unwrap();
    }
    // An original 2 KiB into a page must start on an odd slot: 127 slots fit (slots 1..128 of
    // a segment), 128 fit nowhere, which Linux reports as "buffer full", not as too large.
    let at = ORIG_BASE + 0x800;
    let req = |size| MapRequest::new(at, size, Direction::ToDevice).min_align_mask(0xfff);
    let m = p.map(&o.mem(), &req(262_144 - 2048)).unwrap();
    assert_eq!(
        (m.nslots, m.slot % 128, m.dev_addr & 0xfff),
        (127, 1, 0x800)
    );
    p.unmap(&o.mem(), &m, 0).unwrap();
    assert!(matches!(
        p.map(&o.mem(), &req(262_144 - 2047)),
        Err(Error::PoolFull { .. })
    ));
    assert!(matches!(
        strict.map(&o.mem(), &req(262_144 - 2047)),
        Err(Error::TooLarge { .. })
    ));
    assert_eq!(p.used(), 0);
}

#[test]
fn segment_boundary_mask_is_honoured() {
    each_swiotlb_pool(1024, |kind, p, o| {
        let mut live = Vec::new();
        for i in 0..12u64 {
            let req = MapRequest::new(ORIG_BASE + i * 0x1000, 24_000, Direction::ToDevice)
                .seg_boundary_mask(0xffff);
            let m = p.map(&o.mem(), &req).unwrap();
            let end = m.dev_addr + 24_000 - 1;
            assert_eq!(
                m.dev_addr >> 16,
                end >> 16,
                "{kind}: crossed a 64 KiB boundary"
            );
            live.push(m);
        }
        unmap_all(p, o, &live);
    });
}

// ---------------------------------------------------------------- failure and bad input

#[test]
fn a_full_pool_fails_with_numbers_and_recovers() {
    each_swiotlb_pool(256, |kind, p, o| {
        let mut live = Vec::new();
        let mut addr = ORIG_BASE;
        let err = loop {
            match p.map(&o.mem(), &MapRequest::new(addr, 65536, Direction::ToDevice)) {
                Ok(m) => live.push(m),
                Err(e) => break e,
            }
            addr += 0x10000;
            assert!(live.len() <= 8, "{kind}: more than the pool holds");
        };
        if kind == AllocatorKind::IovaBitmap {
            // Half the domain is kept for the per-worker small-request bitmaps.
            assert_eq!(
                live.len(),
                4,
                "{kind}: the tree half holds four 64 KiB mappings"
            );
        } else {
            assert_eq!(
                live.len(),
                8,
                "{kind}: 256 slots hold eight 64 KiB mappings"
            );
        }
        match err {
            Error::PoolFull { size, total, used } => {
                assert_eq!((size, total), (65536, 256), "{kind}");
                assert_eq!(used, live.len() * 32, "{kind}");
            }
            e => panic!("{kind}: {e}"),
        }
        assert_eq!(p.stats().map_failures, 1, "{kind}");
        p.unmap(&o.mem(), &live.pop().unwrap(), 0).unwrap();
        live.push(map(p, o, addr, 65536, Direction::ToDevice));
        unmap_all(p, o, &live);
        assert_eq!(p.used(), 0, "{kind}");
    });
}

#[test]
fn bad_input_gets_typed_errors_and_leaves_the_pool_intact() {
    each_swiotlb_pool(256, |kind, p, o| {
        let mem = o.mem();
        let live = p
            .map(
                &mem,
                &MapRequest::new(ORIG_BASE, 5000, Direction::Bidirectional),
            )
            .unwrap();
        let used = p.used();
        assert_eq!(
            p.map(&mem, &MapRequest::new(ORIG_BASE, 0, Direction::ToDevice)),
            Err(Error::ZeroLength)
        );
        assert!(matches!(
            p.map(
                &mem,
                &MapRequest::new(ORIG_BASE, 1 << 20, Direction::ToDevice)
            ),
            Err(Error::TooLarge { .. })
        ));
        assert!(matches!(
            p.map(
                &mem,
                &MapRequest::new(u64::MAX - 10, 100, Direction::ToDevice)
            ),
            Err(Error::Overflow { .. })
        ));
        assert!(matches!(
            p.map(
                &mem,
                &MapRequest::new(ORIG_BASE, 100, Direction::ToDevice).min_align_mask(0x1001)
            ),
            Err(Error::BadAlignment { .. })
        ));
        assert!(matches!(
            p.map(
                &mem,
                &MapRequest::new(ORIG_BASE, 100, Direction::ToDevice).seg_boundary_mask(0xff)
            ),
            Err(Error::BadAlignment { .. })
        ));
        // an original outside memory is refused before anything is allocated
        assert!(matches!(
            p.map(
                &mem,
                &MapRequest::new(ORIG_BASE + ORIG_LEN as u64 - 10, 100, Direction::ToDevice)
            ),
            Err(Error::OrigAccess { .. })
        ));
        let none = DmaAttrs::default();
        // never mapped, middle of a mapping, outside the pool
        for addr in [live.dev_addr + 8192, live.dev_addr + 1, 0, u64::MAX] {
            assert!(
                matches!(
                    p.unmap_single(&mem, addr, 10, Direction::FromDevice, none, 0),
                    Err(Error::NotMapped { .. })
                ),
                "{kind}: unmap of {addr:#x}"
            );
        }
        assert_eq!(p.used(), used, "{kind}: refused calls changed nothing");
        p.unmap(&mem, &live, 0).unwrap();
        // double unmap
        assert!(
            matches!(p.unmap(&mem, &live, 0), Err(Error::NotMapped { .. })),
            "{kind}"
        );
        assert_eq!(p.used(), 0);
        assert_eq!(p.stats().bad_unmaps, 5, "{kind}");
        // sync of an unmapped address
        assert!(p
            .sync(&mem, live.dev_addr, 10, Direction::FromDevice, SyncFor::Cpu)
            .is_err());
        // the pool still works in full
        let all = p
            .map(
                &mem,
                &MapRequest::new(ORIG_BASE, 262_144, Direction::ToDevice),
            )
            .unwrap();
        p.unmap(&mem, &all, 0).unwrap();
    });
}

#[test]
fn statistics_count_maps_bytes_and_hiwater() {
    let p = &pool(AllocatorKind::Areas, PoolMode::Swiotlb, 256);
    let o = &mut Orig::new();
    let a = map(p, o, ORIG_BASE, 4096, Direction::ToDevice);
    let b = map(p, o, ORIG_BASE, 3000, Direction::FromDevice);
    unmap_all(p, o, &[a, b]);
    let s = p.stats();
    assert_eq!((s.maps, s.unmaps, s.used, s.used_hiwater), (2, 2, 0, 4));
    assert_eq!(s.bytes_to_device, 4096 + 3000);
    assert_eq!(s.bytes_from_device, 3000);
    assert_eq!(s.nslabs, 256);
    let json: serde_json::Value = serde_json::from_str(&s.to_json()).unwrap();
    assert_eq!(json["used_hiwater"], 4);
    assert_eq!(json["allocator"], "areas");
    p.reset_hiwater();
    assert_eq!(p.stats().used_hiwater, 0);
}
