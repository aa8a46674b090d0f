//! Hostile-guest tests: every malformed chain whose status byte can be located gets IOERR
//! there (never a silent completion: Linux reads its own status byte, not `used.len`); a chain
//! that cannot be enumerated, or whose status byte cannot be found or written, stops the device
//! (DEVICE_NEEDS_RESET, as QEMU's `virtio_error`) with nothing completed; never a panic, never
//! an access outside guest memory, and a good request works afterwards (after a reset, for a
//! stopped device).

mod common;

use std::sync::Arc;

use bounce::{Direction, Dma, Policy, PoolConfig};
use common::*;
use devices::block::io::OnFull;
use devices::block::request::RequestHeader;
use devices::block::{BlockConfig, MemDisk, STATUS_UNSET};
use devices::testing::{first_fit_pool, DiskHook, DiskOp, HookedDisk};
use devices::virtio::driver::{write_table_desc, Desc, Used};
use devices::virtio::spec::{
    feature, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    VIRTIO_RING_F_INDIRECT_DESC, VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
};

const DISK: u64 = 1 << 20;
const N: u16 = VRING_DESC_F_NEXT;
const W: u16 = VRING_DESC_F_WRITE;
const I: u16 = VRING_DESC_F_INDIRECT;

fn dev(dma: Dma, drop: u64) -> Blk<MemDisk> {
    let b = Blk::new(
        MemDisk::new(DISK).unwrap(),
        BlockConfig::default(),
        dma,
        drop,
    );
    b.drv
        .device
        .disk()
        .write_bytes(0, &pattern(3, 8192))
        .unwrap();
    b
}

fn dmas() -> Vec<(String, Dma)> {
    devices::testing::dma_matrix(1024)
        .into_iter()
        .take(3)
        .collect()
}

/// Writes `descs` at table indexes `base..`, links each to the next when it has NEXT and
/// `next` is 0, and publishes `base`.
fn publish(blk: &mut Blk<MemDisk>, base: u16, descs: &[Desc]) {
    for (i, d) in descs.iter().enumerate() {
        let mut d = *d;
        if d.flags & N != 0 && d.next == 0 {
            d.next = base + i as u16 + 1;
        }
        blk.drv.vqs[0]
            .write_desc(blk.drv.ram.mem(), base + i as u16, d)
            .unwrap();
    }
    blk.drv.publish_raw(0, base);
}

/// [`publish`], then kicks. Returns the used entries.
fn raw(blk: &mut Blk<MemDisk>, base: u16, descs: &[Desc]) -> Vec<Used> {
    publish(blk, base, descs);
    blk.drv.kick(0).expect("the device must keep serving");
    blk.drv.reap(0)
}

/// Writes `descs` as [`raw`] does, for a chain the device cannot serve: the kick must stop the
/// device (DEVICE_NEEDS_RESET) with no used entry; the driver then resets and re-activates it.
fn unusable(blk: &mut Blk<MemDisk>, base: u16, descs: &[Desc]) {
    publish(blk, base, descs);
    let e = blk.drv.kick(0).expect_err("the device must stop");
    assert!(
        matches!(e, devices::virtio::WorkerError::Broken(_)),
        "{e:?}"
    );
    assert!(blk.drv.broken(0).is_some());
    assert!(blk.drv.reap(0).is_empty(), "nothing completes silently");
    blk.drv.reset();
    blk.drv.activate(64).expect("re-activate after a reset");
}

fn d(addr: u64, len: u32, flags: u16) -> Desc {
    Desc {
        addr,
        len,
        flags,
        next: 0,
    }
}

/// A good read still works and returns the disk's bytes.
fn still_works(blk: &mut Blk<MemDisk>) {
    let r = blk.read(0, 4096, Layout::Split(2));
    ok(&r);
    assert_eq!(r.data, pattern(3, 4096));
    let w = blk.write(4, &pattern(8, 1024), Layout::Simple);
    ok(&w);
    assert_eq!(blk.read(4, 1024, Layout::Simple).data, pattern(8, 1024));
    blk.drv
        .device
        .disk()
        .write_bytes(0, &pattern(3, 8192))
        .unwrap();
}

/// Buffers for a hand-made request: a header, a data buffer and a status byte.
struct Bufs {
    hdr: u64,
    data: u64,
    st: u64,
}

fn bufs(blk: &mut Blk<MemDisk>, t: u32, sector: u64) -> Bufs {
    let ram = &mut blk.drv.ram;
    let hdr = ram.alloc_bytes(&RequestHeader::encode(t, sector));
    let data = ram.alloc(8192, 4096);
    ram.write(data, &[0xaa; 8192]);
    let st = ram.alloc(1, 1);
    ram.write(st, &[STATUS_UNSET]);
    Bufs { hdr, data, st }
}

fn status_of(blk: &Blk<MemDisk>, b: &Bufs) -> u8 {
    blk.drv.ram.read(b.st, 1)[0]
}

/// Posts `descs` as one chain (head 40) and checks that it completes with IOERR and a used
/// length of 1 (the status byte only); `what` names the case in a failure.
fn expect_ioerr(blk: &mut Blk<MemDisk>, b: &Bufs, descs: &[Desc], what: &str) {
    let used = raw(blk, 40, descs);
    assert_eq!(
        (used[0].len, status_of(blk, b)),
        (1, VIRTIO_BLK_S_IOERR),
        "{what}"
    );
}

#[test]
fn descriptor_loop() {
    for (name, dma) in dmas() {
        let mut blk = dev(dma, 0);
        let b = bufs(&mut blk, VIRTIO_BLK_T_IN, 0);
        // header -> data -> back to header, forever.
        unusable(
            &mut blk,
            40,
            &[
                d(b.hdr, 16, N),
                Desc {
                    addr: b.data,
                    len: 512,
                    flags: N | W,
                    next: 40,
                },
            ],
        );
        assert_eq!(blk.metric("err_bad_chain"), 1, "{name}");
        // A self-loop in an indirect table.
        let t = blk.drv.ram.alloc(16, 16);
        blk.drv.ram.write(t, &[0u8; 16]);
        let ld = Desc {
            addr: b.hdr,
            len: 16,
            flags: N,
            next: 0,
        };
        write_table_desc(blk.drv.ram.mem(), t, 0, ld).unwrap();
        unusable(&mut blk, 40, &[d(t, 16, I)]);
        assert_eq!(blk.metric("err_bad_chain"), 2);
        still_works(&mut blk);
    }
}

/// Writes an indirect table of `entries` (addr, len, flags) and returns its address.
fn table(blk: &mut Blk<MemDisk>, entries: &[(u64, u32, u16)]) -> u64 {
    let t = blk.drv.ram.alloc(16 * entries.len() as u64, 16);
    for (i, &(addr, len, flags)) in entries.iter().enumerate() {
        let next = if flags & N != 0 { i as u16 + 1 } else { 0 };
        let e = Desc {
            addr,
            len,
            flags,
            next,
        };
        write_table_desc(blk.drv.ram.mem(), t, i as u16, e).unwrap();
    }
    t
}

#[test]
fn chain_longer_than_the_device_maximum() {
    let mut blk = dev(Dma::direct(), 0);
    let b = bufs(&mut blk, VIRTIO_BLK_T_IN, 0);
    // An indirect table of 257 entries: more than the device's maximum queue size (256),
    // which bounds indirect tables.
    let mut e = vec![(b.hdr, 16, N)];
    e.extend((1..256u64).map(|i| (b.data + i, 1, N | W)));
    e.push((b.st, 1, W));
    let t = table(&mut blk, &e);
    unusable(&mut blk, 0, &[d(t, 16 * 257, I)]);
    assert_eq!(blk.metric("err_bad_chain"), 1);
    still_works(&mut blk);

    // Exactly the queue size in direct descriptors is fine: header + 62 data descriptors +
    // status = 64.
    let mut descs = vec![d(b.hdr, 16, N)];
    for i in 0..62u64 {
        descs.push(d(b.data + 512 * (i % 16), 512, N | W));
    }
    descs.push(d(b.st, 1, W));
    let used = raw(&mut blk, 0, &descs);
    assert_eq!(used[0].len, 62 * 512 + 1);
    assert_eq!(status_of(&blk, &b), VIRTIO_BLK_S_OK);
}

/// The device advertises `seg_max` = 254 (its maximum queue size less 2)
/// whatever ring size the driver picks; QEMU's vhost-user-blk-pci uses 128-entry rings, and
/// Linux bounds segments by `seg_max`. A 254-segment read through one indirect table on a
/// 128-entry ring must be served (it was refused with "indirect table longer than the queue").
#[test]
fn seg_max_segments_on_a_ring_smaller_than_seg_max() {
    for (name, dma) in dmas() {
        let mut blk = Blk::with_ring(
            MemDisk::new(DISK).unwrap(),
            BlockConfig::default(),
            dma.clone(),
            0,
            128,
        );
        let seg_max = u32::from_le_bytes(blk.drv.read_config(12, 4).try_into().unwrap());
        assert_eq!(seg_max, 254);
        let disk = pattern(11, 254 * 512);
        blk.drv.device.disk().write_bytes(0, &disk).unwrap();
        let b = bufs(&mut blk, VIRTIO_BLK_T_IN, 0);
        let data = blk.drv.ram.alloc(254 * 512, 4096);
        let mut e = vec![(b.hdr, 16, N)];
        e.extend((0..254u64).map(|i| (data + 512 * i, 512, N | W)));
        e.push((b.st, 1, W));
        let t = table(&mut blk, &e);
        let used = raw(&mut blk, 0, &[d(t, 16 * 256, I)]);
        assert_eq!(
            (used[0].len, status_of(&blk, &b)),
            (254 * 512 + 1, VIRTIO_BLK_S_OK),
            "{name}"
        );
        assert!(blk.drv.ram.read(data, 254 * 512) == disk, "{name}: data");
        if let Some(s) = dma.stats() {
            assert_eq!(s.used, 0, "{name}: slots leaked");
        }
    }
}

#[test]
fn addresses_outside_guest_memory() {
    for (name, dma) in dmas() {
        let mut blk = dev(dma.clone(), 0);
        let end = blk.drv.ram.size();
        let b = bufs(&mut blk, VIRTIO_BLK_T_IN, 0);
        // Data entirely outside.
        expect_ioerr(
            &mut blk,
            &b,
            &[d(b.hdr, 16, N), d(end, 512, N | W), d(b.st, 1, W)],
            &name,
        );
        // Data straddling the end of RAM: nothing is written, not even the part inside.
        let near = end - 512;
        blk.drv.ram.write(near, &[0x55; 512]);
        expect_ioerr(
            &mut blk,
            &b,
            &[d(b.hdr, 16, N), d(near, 1024, N | W), d(b.st, 1, W)],
            &name,
        );
        assert_eq!(
            blk.drv.ram.read(near, 512),
            vec![0x55; 512],
            "{name}: partial write before the check"
        );
        // Header outside.
        let used = raw(
            &mut blk,
            40,
            &[d(end + 4096, 16, N), d(b.data, 512, N | W), d(b.st, 1, W)],
        );
        assert_eq!((used[0].len, status_of(&blk, &b)), (1, VIRTIO_BLK_S_IOERR));
        // Status outside: no status can be written, the device stops.
        unusable(
            &mut blk,
            40,
            &[d(b.hdr, 16, N), d(b.data, 512, N | W), d(end, 1, W)],
        );
        // An indirect table outside.
        unusable(&mut blk, 40, &[d(end - 16, 64, I)]);
        // A write whose data is outside: the disk is untouched.
        let wb = bufs(&mut blk, VIRTIO_BLK_T_OUT, 0);
        let used = raw(
            &mut blk,
            40,
            &[d(wb.hdr, 16, N), d(end - 256, 512, N), d(wb.st, 1, W)],
        );
        assert_eq!((used[0].len, status_of(&blk, &wb)), (1, VIRTIO_BLK_S_IOERR));
        assert!(blk.metric("err_guest_access") >= 4);
        still_works(&mut blk);
        if let Some(s) = dma.stats() {
            assert_eq!(s.used, 0, "{name}: slots leaked");
        }
    }
}

#[test]
fn lengths_that_overflow() {
    for (name, dma) in dmas() {
        let mut blk = dev(dma, 0);
        let b = bufs(&mut blk, VIRTIO_BLK_T_IN, 0);
        for (addr, len) in [
            (u64::MAX - 100, 4096u32),
            (u64::MAX - 511, 512),
            (b.data, 0xffff_fe00),
            (u64::MAX, u32::MAX),
        ] {
            expect_ioerr(
                &mut blk,
                &b,
                &[d(b.hdr, 16, N), d(addr, len, N | W), d(b.st, 1, W)],
                &format!("{name} {addr:#x}+{len:#x}"),
            );
        }
        // Descriptors whose lengths sum past 4 GiB.
        let used = raw(
            &mut blk,
            40,
            &[
                d(b.hdr, 16, N),
                d(b.data, u32::MAX, N | W),
                d(b.data, u32::MAX, N | W),
                d(b.st, 1, W),
            ],
        );
        assert!(used[0].len <= 1, "{name}");
        // A header claiming a huge sector.
        let hb = bufs(&mut blk, VIRTIO_BLK_T_IN, u64::MAX - 1);
        let used = raw(
            &mut blk,
            40,
            &[d(hb.hdr, 16, N), d(hb.data, 1024, N | W), d(hb.st, 1, W)],
        );
        assert_eq!((used[0].len, status_of(&blk, &hb)), (1, VIRTIO_BLK_S_IOERR));
        // An indirect table length that is not a whole number of descriptors, or huge.
        unusable(&mut blk, 40, &[d(b.data, 17, I)]);
        unusable(&mut blk, 40, &[d(b.data, 0xffff_fff0, I)]);
        still_works(&mut blk);
    }
}

/// A chain with a zero-length descriptor was completed with `used.len` 0
/// and the status byte left as it was (a stale 0 reads as OK to Linux). Now IOERR is written
/// wherever the status byte can be located, and the device stops where it cannot.
#[test]
fn zero_length_buffers() {
    let mut blk = dev(Dma::direct(), 0);
    let b = bufs(&mut blk, VIRTIO_BLK_T_IN, 0);
    for descs in [
        vec![d(b.hdr, 16, N), d(b.data, 0, N | W), d(b.st, 1, W)],
        vec![d(b.hdr, 0, N), d(b.data, 512, N | W), d(b.st, 1, W)],
    ] {
        blk.drv.ram.write(b.st, &[0]);
        expect_ioerr(&mut blk, &b, &descs, &format!("{descs:?}"));
    }
    // A zero-length status descriptor, or a zero-length indirect table: where the status
    // goes is unknown.
    unusable(
        &mut blk,
        40,
        &[d(b.hdr, 16, N), d(b.data, 512, N | W), d(b.st, 0, W)],
    );
    unusable(&mut blk, 40, &[d(b.data, 0, I)]);
    assert_eq!(blk.metric("err_bad_chain"), 4);
    still_works(&mut blk);
}

#[test]
fn wrong_directions() {
    let mut blk = dev(Dma::direct(), 0);
    let r = bufs(&mut blk, VIRTIO_BLK_T_IN, 0);
    let w = bufs(&mut blk, VIRTIO_BLK_T_OUT, 0);
    // A read whose data is device-readable: IOERR.
    let used = raw(
        &mut blk,
        40,
        &[d(r.hdr, 16, N), d(r.data, 512, N), d(r.st, 1, W)],
    );
    assert_eq!((used[0].len, status_of(&blk, &r)), (1, VIRTIO_BLK_S_IOERR));
    assert_eq!(
        blk.drv.ram.read(r.data, 512),
        vec![0xaa; 512],
        "read into a readable buffer"
    );
    // A write whose data is device-writable: IOERR, the disk untouched.
    let used = raw(
        &mut blk,
        40,
        &[d(w.hdr, 16, N), d(w.data, 512, N | W), d(w.st, 1, W)],
    );
    assert_eq!((used[0].len, status_of(&blk, &w)), (1, VIRTIO_BLK_S_IOERR));
    // A readable status byte: nothing is writable, no status: the device stops.
    unusable(
        &mut blk,
        40,
        &[d(w.hdr, 16, N), d(w.data, 512, N), d(w.st, 1, 0)],
    );
    assert_eq!(
        status_of(&blk, &w),
        VIRTIO_BLK_S_IOERR,
        "untouched since the last request"
    );
    // A writable header: the request has no header, IOERR in the last writable byte.
    blk.drv.ram.write(r.st, &[STATUS_UNSET]);
    let used = raw(
        &mut blk,
        40,
        &[d(r.hdr, 16, N | W), d(r.data, 512, N | W), d(r.st, 1, W)],
    );
    assert_eq!((used[0].len, status_of(&blk, &r)), (1, VIRTIO_BLK_S_IOERR));
    // Readable after writable: the last descriptor, a status byte the device may not write,
    // is refused, so the status cannot be located.
    unusable(
        &mut blk,
        40,
        &[d(r.hdr, 16, N), d(r.data, 512, N | W), d(r.st, 1, 0)],
    );
    assert_eq!(
        blk.read(0, 512, Layout::Simple).data,
        pattern(3, 512),
        "disk untouched"
    );
    still_works(&mut blk);
}

#[test]
fn indirect_tables_nested_unnegotiated_or_with_next() {
    let mut blk = dev(Dma::direct(), 0);
    let b = bufs(&mut blk, VIRTIO_BLK_T_IN, 0);
    // Nested: an indirect table whose entry is itself indirect.
    let inner = blk.drv.ram.alloc(48, 16);
    let outer = blk.drv.ram.alloc(16, 16);
    let ent = |a: u64, l: u32, f: u16, n: u16| {
        let mut e = [0u8; 16];
        e[0..8].copy_from_slice(&a.to_le_bytes());
        e[8..12].copy_from_slice(&l.to_le_bytes());
        e[12..14].copy_from_slice(&f.to_le_bytes());
        e[14..16].copy_from_slice(&n.to_le_bytes());
        e
    };
    blk.drv.ram.write(inner, &ent(b.hdr, 16, N, 1));
    blk.drv.ram.write(inner + 16, &ent(b.data, 512, N | W, 2));
    blk.drv.ram.write(inner + 32, &ent(b.st, 1, W, 0));
    blk.drv.ram.write(outer, &ent(inner, 48, I, 0));
    unusable(&mut blk, 40, &[d(outer, 16, I)]);
    // The inner table directly is a good request.
    let used = raw(&mut blk, 40, &[d(inner, 48, I)]);
    assert_eq!((used[0].len, status_of(&blk, &b)), (513, VIRTIO_BLK_S_OK));
    // INDIRECT together with NEXT.
    unusable(&mut blk, 40, &[d(inner, 48, I | N), d(b.st, 1, W)]);
    // Not negotiated.
    let mut blk2 = dev(Dma::direct(), feature(VIRTIO_RING_F_INDIRECT_DESC));
    blk2.drv.ram.write(inner, &ent(b.hdr, 16, N, 1));
    unusable(&mut blk2, 40, &[d(inner, 48, I)]);
    assert_eq!(blk.metric("err_bad_chain"), 2);
    still_works(&mut blk);
    still_works(&mut blk2);
}

#[test]
fn descriptor_index_out_of_range() {
    let mut blk = dev(Dma::direct(), 0);
    let b = bufs(&mut blk, VIRTIO_BLK_T_IN, 0);
    unusable(
        &mut blk,
        40,
        &[Desc {
            addr: b.hdr,
            len: 16,
            flags: N,
            next: 64,
        }],
    );
    still_works(&mut blk);
}

#[test]
fn sectors_past_the_end() {
    let mut blk = dev(Dma::direct(), 0);
    let cap = DISK / 512;
    for s in [cap, cap + 1, u64::MAX, u64::MAX >> 9] {
        assert_eq!(blk.read(s, 512, Layout::Simple).status, VIRTIO_BLK_S_IOERR);
    }
    assert_eq!(
        blk.read(cap - 1, 1024, Layout::Indirect).status,
        VIRTIO_BLK_S_IOERR
    );
    still_works(&mut blk);
}

#[test]
fn bounce_pool_full() {
    let mut pools = Vec::new();
    for mode in ["swiotlb", "iova"] {
        // 128 slots: 256 KiB (swiotlb) or 512 KiB (iova).
        let cfg = if mode == "swiotlb" {
            PoolConfig::swiotlb(128)
        } else {
            PoolConfig::iova(128)
        };
        pools.push((format!("{mode}/first-fit"), first_fit_pool(&cfg)));
        for kind in bounce::AllocatorKind::ALL {
            let mut c = cfg.clone();
            c.allocator = kind;
            let p = bounce::BouncePool::new(&c)
                .unwrap_or_else(|e| panic!("bounce configuration {mode}/{kind}: {e}"));
            pools.push((format!("{mode}/{kind}"), Arc::new(p)));
        }
    }
    for (mode, pool) in pools {
        let dma = Dma::bounced(Policy::Force, Arc::clone(&pool));
        let mut blk = dev(dma, 0);
        // One request needing more than the whole pool at once.
        let big = 1024 << 10;
        let r = blk.request(0, VIRTIO_BLK_T_IN, 0, &[], big, Layout::Split(4));
        assert_eq!((r.status, r.len), (VIRTIO_BLK_S_IOERR, 1), "{mode}");
        let w = blk.request(
            0,
            VIRTIO_BLK_T_OUT,
            0,
            &vec![1u8; big as usize],
            0,
            Layout::Split(8),
        );
        assert_eq!(w.status, VIRTIO_BLK_S_IOERR, "{mode}");
        assert_eq!(blk.metric("err_bounce"), 2);
        assert_eq!(
            pool.used(),
            0,
            "{mode}: slots leaked after a failed request"
        );
        assert_eq!(
            blk.read(0, 4096, Layout::Simple).data,
            pattern(3, 4096),
            "{mode}: disk untouched"
        );
        still_works(&mut blk);

        // A pool held whole by something other than this device's requests: not even the
        // status byte can be mapped. With on-full=wait the read waits for as long as the
        // slots are held (nothing fails it on a clock), then completes.
        let mut backing = vec![0u8; 1 << 20];
        let host = bounce::HostMemory::new(0, &mut backing);
        let hold = || {
            let mut held = Vec::new();
            while let Ok(m) = pool.map(
                &host,
                &bounce::MapRequest::new(
                    0x1000 + 4096 * held.len() as u64,
                    2048,
                    Direction::ToDevice,
                ),
            ) {
                held.push(m);
            }
            held
        };
        let failed = blk.metric("pool_full_failed");
        let held = hold();
        let p = blk.post(0, VIRTIO_BLK_T_IN, 0, &[], 512, Layout::Simple);
        blk.drv.kick(0).unwrap();
        let until = std::time::Instant::now() + std::time::Duration::from_millis(300);
        while std::time::Instant::now() < until {
            blk.drv.poll_worker(0, 50).unwrap();
        }
        assert!(
            blk.drv.reap(0).is_empty(),
            "{mode}: completed while the pool was held"
        );
        assert!(blk.metric("pool_full_waits") >= 1, "{mode}");
        for m in held {
            pool.unmap(&host, &m, 0).unwrap();
        }
        let used = blk.drv.wait_used(0, 1, std::time::Duration::from_secs(20));
        assert_eq!(used.len(), 1, "{mode}");
        let r = blk.done(p, used[0].len, 512);
        assert_eq!(r.status, 0, "{mode}: the waiting read");
        assert_eq!(r.data, pattern(3, 512), "{mode}: the waiting read");
        assert_eq!(blk.metric("pool_full_failed"), failed, "{mode}");
        // With on-full=fail the status byte is written directly (never a completion with
        // used.len 0 and a stale status) and the driver sees IOERR.
        let config = BlockConfig {
            on_full: OnFull::Fail,
            ..BlockConfig::default()
        };
        let disk = MemDisk::new(DISK).unwrap();
        disk.write_bytes(0, &pattern(3, 8192)).unwrap();
        let dma = Dma::bounced(Policy::Force, Arc::clone(&pool));
        let mut failing = Blk::new(disk, config, dma, 0);
        let held = hold();
        let r = failing.read(0, 512, Layout::Simple);
        assert_eq!(
            (r.len, r.status),
            (1, VIRTIO_BLK_S_IOERR),
            "{mode}: the status still reaches the driver"
        );
        assert!(failing.metric("status_direct") >= 1);
        assert_eq!(failing.metric("no_status"), 0);
        for m in held {
            pool.unmap(&host, &m, 0).unwrap();
        }
        still_works(&mut failing);
        still_works(&mut blk);
        assert_eq!(pool.used(), 0);
    }
}

#[test]
fn head_out_of_range_breaks_the_device() {
    let mut blk = dev(Dma::direct(), 0);
    blk.drv.publish_raw(0, 200);
    let e = blk.drv.kick(0).unwrap_err();
    assert!(
        matches!(e, devices::virtio::WorkerError::Broken(_)),
        "{e:?}"
    );
    assert!(blk.drv.broken(0).is_some());
}

#[test]
fn avail_index_too_far_ahead_breaks_the_device() {
    let mut blk = dev(Dma::direct(), 0);
    blk.drv.vqs[0]
        .set_avail_idx(blk.drv.ram.mem(), 1000)
        .unwrap();
    let e = blk.drv.kick(0).unwrap_err();
    assert!(
        matches!(e, devices::virtio::WorkerError::Broken(_)),
        "{e:?}"
    );
}

#[test]
fn kick_before_the_queue_is_ready() {
    let mut blk = dev(Dma::direct(), 0);
    blk.post(0, VIRTIO_BLK_T_IN, 0, &[], 512, Layout::Simple);
    virtio_queue::QueueT::set_ready(&mut blk.drv.queues[0], false);
    assert!(blk.drv.kick(0).unwrap().is_empty());
    assert!(blk.drv.reap(0).is_empty());
    virtio_queue::QueueT::set_ready(&mut blk.drv.queues[0], true);
    blk.drv.kick(0).unwrap();
    assert_eq!(blk.drv.reap(0).len(), 1);
}

#[test]
fn header_split_across_descriptors_is_fine() {
    let mut blk = dev(Dma::direct(), 0);
    let b = bufs(&mut blk, VIRTIO_BLK_T_IN, 1);
    let used = raw(
        &mut blk,
        40,
        &[
            d(b.hdr, 8, N),
            d(b.hdr + 8, 8, N),
            d(b.data, 512, N | W),
            d(b.st, 1, W),
        ],
    );
    assert_eq!((used[0].len, status_of(&blk, &b)), (513, VIRTIO_BLK_S_OK));
    assert_eq!(blk.drv.ram.read(b.data, 512), pattern(3, 1024)[512..]);
}

/// Makes a memory disk's reads fail (EIO) past the first 512 bytes of a request while
/// set: the device has then written 512 bytes of an 8 KiB read.
#[derive(Debug, Default)]
struct FailPastFirstSector(std::sync::atomic::AtomicBool);

impl DiskHook<MemDisk> for FailPastFirstSector {
    fn before(&self, op: DiskOp, offset: u64, len: u64) -> std::io::Result<u64> {
        if op != DiskOp::Read || !self.0.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(len);
        }
        if offset >= 512 {
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(512 - offset)
    }
    fn kind(&self, _: &MemDisk) -> &'static str {
        "failing"
    }
}

/// In IOVA mode a device-write mapping is not filled from the guest, so the
/// pool buffer holds whatever an earlier mapping left there. A read that fails part-way used
/// to copy the whole pool buffer back: another request's (in bouncevm-vhost, another
/// client's) bytes reached the guest. Now a failed read copies nothing back.
#[test]
fn failed_read_leaks_no_stale_pool_bytes() {
    for (name, cfg) in [
        ("iova", PoolConfig::iova(64)),
        ("swiotlb", PoolConfig::swiotlb(64)),
    ] {
        let disk = HookedDisk::new(MemDisk::new(DISK).unwrap(), FailPastFirstSector::default());
        let dma = Dma::bounced(Policy::Force, first_fit_pool(&cfg));
        let mut blk = Blk::new(disk, BlockConfig::default(), dma.clone(), 0);
        // A write of "secret" bytes leaves them in the pool slots the read will reuse.
        let secret = vec![0x5e; 8192];
        ok(&blk.write(8, &secret, Layout::Simple));
        blk.drv
            .device
            .disk()
            .hook
            .0
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let r = blk.read(0, 8192, Layout::Simple);
        assert_eq!((r.status, r.len), (VIRTIO_BLK_S_IOERR, 1), "{name}");
        assert!(
            !r.data.contains(&0x5e),
            "{name}: stale pool bytes reached the guest"
        );
        assert_eq!(dma.stats().unwrap().used, 0, "{name}: slots leaked");
    }
}
