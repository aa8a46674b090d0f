//! Hostile-guest tests: every malformed chain gets an error status, or a used entry of length
//! 0 when no status byte can be found or written, or (for a ring the device cannot serve at
//! all) a broken-device state; never a panic, never an access outside guest memory, and a good
//! request afterwards works.

mod common;

use std::sync::Arc;

use bounce::{Direction, Dma, Policy, PoolConfig};
use common::*;
use devices::block::{req_type, status, BlockConfig, MemDisk};
use devices::testing::{
    first_fit_pool, RawDesc, VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
};
use devices::virtio::features as vf;

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
/// `next` is 0, publishes `base` and kicks. Returns the used entries.
fn raw(blk: &mut Blk<MemDisk>, base: u16, descs: &[RawDesc]) -> Vec<devices::testing::Used> {
    for (i, d) in descs.iter().enumerate() {
        let mut d = *d;
        if d.flags & N != 0 && d.next == 0 {
            d.next = base + i as u16 + 1;
        }
        blk.drv.vqs[0].write_desc(&blk.drv.ram, base + i as u16, d);
    }
    blk.drv.publish_raw(0, base);
    blk.drv.kick(0).expect("the device must keep serving");
    blk.drv.reap(0)
}

fn d(addr: u64, len: u32, flags: u16) -> RawDesc {
    RawDesc {
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
    let hdr = ram.alloc_bytes(&header(t, sector));
    let data = ram.alloc(8192, 4096);
    ram.write(data, &[0xaa; 8192]);
    let st = ram.alloc(1, 1);
    ram.write(st, &[0xee]);
    Bufs { hdr, data, st }
}

fn status_of(blk: &Blk<MemDisk>, b: &Bufs) -> u8 {
    blk.drv.ram.read(b.st, 1)[0]
}

#[test]
fn descriptor_loop() {
    for (name, dma) in dmas() {
        let mut blk = dev(dma, 0);
        let b = bufs(&mut blk, req_type::IN, 0);
        // header -> data -> back to header, forever.
        let used = raw(
            &mut blk,
            40,
            &[
                d(b.hdr, 16, N),
                RawDesc {
                    addr: b.data,
                    len: 512,
                    flags: N | W,
                    next: 40,
                },
            ],
        );
        assert_eq!(used.len(), 1, "{name}");
        assert_eq!(used[0].len, 0);
        assert_eq!(blk.metric("err_bad_chain"), 1);
        // A self-loop in an indirect table.
        let t = blk.drv.ram.alloc(16, 16);
        blk.drv.ram.write(t, &[0u8; 16]);
        let ld = RawDesc {
            addr: b.hdr,
            len: 16,
            flags: N,
            next: 0,
        };
        let mut bytes = [0u8; 16];
        bytes[0..8].copy_from_slice(&ld.addr.to_le_bytes());
        bytes[8..12].copy_from_slice(&16u32.to_le_bytes());
        bytes[12..14].copy_from_slice(&N.to_le_bytes());
        blk.drv.ram.write(t, &bytes);
        let used = raw(&mut blk, 40, &[d(t, 16, I)]);
        assert_eq!(used[0].len, 0);
        assert_eq!(blk.metric("err_bad_chain"), 2);
        still_works(&mut blk);
    }
}

#[test]
fn chain_longer_than_the_queue() {
    let mut blk = dev(Dma::direct(), 0);
    let b = bufs(&mut blk, req_type::IN, 0);
    // An indirect table of 65 entries in a 64-entry queue.
    let t = blk.drv.ram.alloc(16 * 65, 16);
    for i in 0..65u64 {
        let (flags, len) = if i == 0 { (N, 16) } else { (N | W, 1) };
        let mut e = [0u8; 16];
        e[0..8].copy_from_slice(&(if i == 0 { b.hdr } else { b.data + i }).to_le_bytes());
        e[8..12].copy_from_slice(&(len as u32).to_le_bytes());
        e[12..14].copy_from_slice(&(if i == 64 { W } else { flags }).to_le_bytes());
        e[14..16].copy_from_slice(&((i + 1) as u16).to_le_bytes());
        blk.drv.ram.write(t + 16 * i, &e);
    }
    let used = raw(&mut blk, 0, &[d(t, 16 * 65, I)]);
    assert_eq!(used[0].len, 0);
    assert_eq!(blk.metric("err_bad_chain"), 1);
    still_works(&mut blk);

    // Exactly the queue size is fine: header + 62 data descriptors + status = 64 (seg_max).
    let mut descs = vec![d(b.hdr, 16, N)];
    for i in 0..62u64 {
        descs.push(d(b.data + 512 * (i % 16), 512, N | W));
    }
    descs.push(d(b.st, 1, W));
    let used = raw(&mut blk, 0, &descs);
    assert_eq!(used[0].len, 62 * 512 + 1);
    assert_eq!(status_of(&blk, &b), status::OK);
}

#[test]
fn addresses_outside_guest_memory() {
    for (name, dma) in dmas() {
        let mut blk = dev(dma.clone(), 0);
        let end = blk.drv.ram.size();
        let b = bufs(&mut blk, req_type::IN, 0);
        // Data entirely outside.
        let used = raw(
            &mut blk,
            40,
            &[d(b.hdr, 16, N), d(end, 512, N | W), d(b.st, 1, W)],
        );
        assert_eq!(
            (used[0].len, status_of(&blk, &b)),
            (1, status::IOERR),
            "{name}"
        );
        // Data straddling the end of RAM: nothing is written, not even the part inside.
        let near = end - 512;
        blk.drv.ram.write(near, &[0x55; 512]);
        let used = raw(
            &mut blk,
            40,
            &[d(b.hdr, 16, N), d(near, 1024, N | W), d(b.st, 1, W)],
        );
        assert_eq!(
            (used[0].len, status_of(&blk, &b)),
            (1, status::IOERR),
            "{name}"
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
        assert_eq!((used[0].len, status_of(&blk, &b)), (1, status::IOERR));
        // Status outside: no status can be written.
        let used = raw(
            &mut blk,
            40,
            &[d(b.hdr, 16, N), d(b.data, 512, N | W), d(end, 1, W)],
        );
        assert_eq!(used[0].len, 0);
        // An indirect table outside.
        let used = raw(&mut blk, 40, &[d(end - 16, 64, I)]);
        assert_eq!(used[0].len, 0);
        // A write whose data is outside: the disk is untouched.
        let wb = bufs(&mut blk, req_type::OUT, 0);
        let used = raw(
            &mut blk,
            40,
            &[d(wb.hdr, 16, N), d(end - 256, 512, N), d(wb.st, 1, W)],
        );
        assert_eq!((used[0].len, status_of(&blk, &wb)), (1, status::IOERR));
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
        let b = bufs(&mut blk, req_type::IN, 0);
        for (addr, len) in [
            (u64::MAX - 100, 4096u32),
            (u64::MAX - 511, 512),
            (b.data, 0xffff_fe00),
            (u64::MAX, u32::MAX),
        ] {
            let used = raw(
                &mut blk,
                40,
                &[d(b.hdr, 16, N), d(addr, len, N | W), d(b.st, 1, W)],
            );
            assert_eq!(
                (used[0].len, status_of(&blk, &b)),
                (1, status::IOERR),
                "{name} {addr:#x}+{len:#x}"
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
        let hb = bufs(&mut blk, req_type::IN, u64::MAX - 1);
        let used = raw(
            &mut blk,
            40,
            &[d(hb.hdr, 16, N), d(hb.data, 1024, N | W), d(hb.st, 1, W)],
        );
        assert_eq!((used[0].len, status_of(&blk, &hb)), (1, status::IOERR));
        // An indirect table length that is not a whole number of descriptors, or huge.
        let used = raw(&mut blk, 40, &[d(b.data, 17, I)]);
        assert_eq!(used[0].len, 0);
        let used = raw(&mut blk, 40, &[d(b.data, 0xffff_fff0, I)]);
        assert_eq!(used[0].len, 0);
        still_works(&mut blk);
    }
}

#[test]
fn zero_length_buffers() {
    let mut blk = dev(Dma::direct(), 0);
    let b = bufs(&mut blk, req_type::IN, 0);
    for descs in [
        vec![d(b.hdr, 16, N), d(b.data, 0, N | W), d(b.st, 1, W)],
        vec![d(b.hdr, 0, N), d(b.data, 512, N | W), d(b.st, 1, W)],
        vec![d(b.hdr, 16, N), d(b.data, 512, N | W), d(b.st, 0, W)],
        vec![d(b.data, 0, I)],
    ] {
        let used = raw(&mut blk, 40, &descs);
        assert_eq!(used[0].len, 0, "{descs:?}");
    }
    assert_eq!(blk.metric("err_bad_chain"), 4);
    still_works(&mut blk);
}

#[test]
fn wrong_directions() {
    let mut blk = dev(Dma::direct(), 0);
    let r = bufs(&mut blk, req_type::IN, 0);
    let w = bufs(&mut blk, req_type::OUT, 0);
    // A read whose data is device-readable: IOERR.
    let used = raw(
        &mut blk,
        40,
        &[d(r.hdr, 16, N), d(r.data, 512, N), d(r.st, 1, W)],
    );
    assert_eq!((used[0].len, status_of(&blk, &r)), (1, status::IOERR));
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
    assert_eq!((used[0].len, status_of(&blk, &w)), (1, status::IOERR));
    // A readable status byte: nothing is writable, no status.
    let used = raw(
        &mut blk,
        40,
        &[d(w.hdr, 16, N), d(w.data, 512, N), d(w.st, 1, 0)],
    );
    assert_eq!(used[0].len, 0);
    assert_eq!(
        status_of(&blk, &w),
        status::IOERR,
        "untouched since the last request"
    );
    // A writable header: the request has no header, IOERR in the last writable byte.
    blk.drv.ram.write(r.st, &[0xee]);
    let used = raw(
        &mut blk,
        40,
        &[d(r.hdr, 16, N | W), d(r.data, 512, N | W), d(r.st, 1, W)],
    );
    assert_eq!((used[0].len, status_of(&blk, &r)), (1, status::IOERR));
    // Readable after writable.
    let used = raw(
        &mut blk,
        40,
        &[d(r.hdr, 16, N), d(r.data, 512, N | W), d(r.st, 1, 0)],
    );
    assert_eq!(used[0].len, 0);
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
    let b = bufs(&mut blk, req_type::IN, 0);
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
    let used = raw(&mut blk, 40, &[d(outer, 16, I)]);
    assert_eq!(used[0].len, 0);
    // The inner table directly is a good request.
    let used = raw(&mut blk, 40, &[d(inner, 48, I)]);
    assert_eq!((used[0].len, status_of(&blk, &b)), (513, status::OK));
    // INDIRECT together with NEXT.
    let used = raw(&mut blk, 40, &[d(inner, 48, I | N), d(b.st, 1, W)]);
    assert_eq!(used[0].len, 0);
    // Not negotiated.
    let mut blk2 = dev(Dma::direct(), vf::RING_INDIRECT_DESC);
    blk2.drv.ram.write(inner, &ent(b.hdr, 16, N, 1));
    let used = raw(&mut blk2, 40, &[d(inner, 48, I)]);
    assert_eq!(used[0].len, 0);
    assert_eq!(blk.metric("err_bad_chain"), 2);
    still_works(&mut blk);
    still_works(&mut blk2);
}

#[test]
fn descriptor_index_out_of_range() {
    let mut blk = dev(Dma::direct(), 0);
    let b = bufs(&mut blk, req_type::IN, 0);
    let used = raw(
        &mut blk,
        40,
        &[RawDesc {
            addr: b.hdr,
            len: 16,
            flags: N,
            next: 64,
        }],
    );
    assert_eq!(used[0].len, 0);
    still_works(&mut blk);
}

#[test]
fn sectors_past_the_end() {
    let mut blk = dev(Dma::direct(), 0);
    let cap = DISK / 512;
    for s in [cap, cap + 1, u64::MAX, u64::MAX >> 9] {
        assert_eq!(blk.read(s, 512, Layout::Simple).status, status::IOERR);
    }
    assert_eq!(
        blk.read(cap - 1, 1024, Layout::Indirect).status,
        status::IOERR
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
        let r = blk.request(0, req_type::IN, 0, &[], big, Layout::Split(4));
        assert_eq!((r.status, r.len), (status::IOERR, 1), "{mode}");
        let w = blk.request(
            0,
            req_type::OUT,
            0,
            &vec![1u8; big as usize],
            0,
            Layout::Split(8),
        );
        assert_eq!(w.status, status::IOERR, "{mode}");
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

        // A pool that is completely full: not even the status byte can be mapped.
        let mut backing = vec![0u8; 1 << 20];
        let host = bounce::HostMemory::new(0, &mut backing);
        let mut held = Vec::new();
        while let Ok(m) = pool.map(
            &host,
            &bounce::MapRequest::new(0x1000 + 4096 * held.len() as u64, 2048, Direction::ToDevice),
        ) {
            held.push(m);
        }
        let r = blk.read(0, 512, Layout::Simple);
        assert_eq!(r.len, 0, "{mode}: no status can be written");
        assert!(blk.metric("no_status") >= 1);
        for m in held {
            pool.unmap(&host, &m, 0).unwrap();
        }
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
    blk.drv.vqs[0].set_avail_idx(&blk.drv.ram, 1000);
    let e = blk.drv.kick(0).unwrap_err();
    assert!(
        matches!(e, devices::virtio::WorkerError::Broken(_)),
        "{e:?}"
    );
}

#[test]
fn kick_before_the_queue_is_ready() {
    let mut blk = dev(Dma::direct(), 0);
    blk.post(0, req_type::IN, 0, &[], 512, Layout::Simple);
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
    let b = bufs(&mut blk, req_type::IN, 1);
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
    assert_eq!((used[0].len, status_of(&blk, &b)), (513, status::OK));
    assert_eq!(blk.drv.ram.read(b.data, 512), pattern(3, 1024)[512..]);
}
