//! Unit tests of the net device core: TX, RX (with and without MRG_RXBUF), the control queue,
//! the configuration space, feature negotiation, the shaper in the data path, and hostile
//! guests. Each data test runs with the bounce module off, forced swiotlb and forced iova.

#![allow(clippy::undocumented_unsafe_blocks)]

use std::sync::atomic::AtomicU16;
use std::sync::{Arc, Mutex};

use bounce::Dma;
use vm_memory::GuestMemoryMmap;

use super::backend::{MemBackend, NetBackend};
use super::ctrl::CtrlWorker;
use super::header::VnetHeader;
use super::metrics::NetMetrics;
use super::rate_limiter::RateLimiter;
use super::test_utils::*;
use super::worker::{PairWorker, SharedBackend, TOKEN_BACKEND, TOKEN_SHAPER};
use super::*;
use crate::testing::tso4_header;
use crate::virtio::spec::{
    feature, VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_VERSION_1, VIRTIO_NET_CTRL_MAC,
    VIRTIO_NET_CTRL_MAC_TABLE_SET, VIRTIO_NET_CTRL_MQ, VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET,
    VIRTIO_NET_CTRL_RX, VIRTIO_NET_ERR, VIRTIO_NET_F_CSUM, VIRTIO_NET_F_CTRL_VQ,
    VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_TSO6,
    VIRTIO_NET_F_GUEST_UFO, VIRTIO_NET_F_HOST_ECN, VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6,
    VIRTIO_NET_F_HOST_UFO, VIRTIO_NET_F_MAC, VIRTIO_NET_F_MQ, VIRTIO_NET_F_MRG_RXBUF,
    VIRTIO_NET_F_MTU, VIRTIO_NET_F_SPEED_DUPLEX, VIRTIO_NET_F_STATUS, VIRTIO_NET_HDR_F_DATA_VALID,
    VIRTIO_NET_HDR_F_NEEDS_CSUM, VIRTIO_NET_HDR_GSO_TCPV4, VIRTIO_NET_OK, VIRTIO_NET_S_LINK_UP,
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};
use crate::virtio::{QueueWorker, VirtioDevice, WorkerEvent};

const BASE: u64 =
    feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_NET_F_CSUM) | feature(VIRTIO_NET_F_GUEST_CSUM);
const RXQ: usize = 0;
const TXQ: usize = 1;

struct Pair {
    g: Guest,
    be: MemBackend,
    w: PairWorker<GuestMemoryMmap>,
    m: Arc<NetMetrics>,
}

impl Pair {
    fn new(acked: u64, dma: Dma) -> Self {
        Self::with_shaper(acked, dma, None)
    }

    fn with_shaper(acked: u64, dma: Dma, shaper: Option<RateLimiter>) -> Self {
        let be = MemBackend::new().unwrap();
        let shared: SharedBackend = Arc::new(Mutex::new(Box::new(be.clone())));
        let m = Arc::new(NetMetrics::default());
        let w = PairWorker::new(0, acked, shared, dma, m.clone(), shaper);
        Self {
            g: Guest::new(2),
            be,
            w,
            m,
        }
    }

    fn ev(&mut self, e: WorkerEvent) -> crate::virtio::Signal {
        let (mem, mut qs) = self.g.split(&[0, 1]);
        self.w.handle(e, mem, &mut qs).unwrap()
    }

    fn kick_tx(&mut self) -> crate::virtio::Signal {
        self.ev(WorkerEvent::Kick(1))
    }

    fn kick_rx(&mut self) -> crate::virtio::Signal {
        self.ev(WorkerEvent::Kick(0))
    }

    fn tap_readable(&mut self) -> crate::virtio::Signal {
        self.ev(WorkerEvent::Fd(TOKEN_BACKEND))
    }
}

fn plain() -> VnetHeader {
    VnetHeader::default()
}

/// After traffic, a bounced run holds no slot (`used == 0`), and the pool copied at least the
/// bytes that moved: `to_dev` guest -> device (TX), `from_dev` device -> guest (RX). The
/// payload itself is compared byte for byte by each test. Nothing to check with bounce off.
fn assert_pool_covers(name: &str, dma: &Dma, to_dev: usize, from_dev: usize) {
    let Some(s) = dma.stats() else {
        assert!(dma.pool().is_none(), "{name}: a pool without stats");
        return;
    };
    assert_eq!(
        s.used, 0,
        "{name}: bounce slots held after the traffic: {s:?}"
    );
    assert!(
        s.maps > 0 && s.maps == s.unmaps,
        "{name}: maps/unmaps: {s:?}"
    );
    assert!(
        s.bytes_to_device >= to_dev as u64,
        "{name}: {to_dev} bytes went to the device, the pool copied {}",
        s.bytes_to_device
    );
    assert!(
        s.bytes_from_device >= from_dev as u64,
        "{name}: {from_dev} bytes came from the device, the pool copied {}",
        s.bytes_from_device
    );
}

// ---------------------------------------------------------------- TX

#[test]
fn tx_frame_split_over_descriptors_reaches_backend_byte_for_byte() {
    for (name, dma) in dmas() {
        let mut p = Pair::new(BASE, dma.clone());
        let f = frame(&plain(), 1500, 7);
        let head = p.g.post_readable(TXQ, &[&f[..12], &f[12..100], &f[100..]]);
        let sig = p.kick_tx();
        assert!(sig.has(1), "{name}");
        assert_eq!(p.be.take_sent(), vec![f.clone()], "{name}");
        assert_eq!(p.g.used(TXQ), vec![(u32::from(head), 0)], "{name}");
        assert_eq!(p.m.tx_frames.get(), 1);
        assert_eq!(p.m.tx_bytes.get(), 1500);
        assert_pool_covers(name, &dma, f.len(), 0);
    }
}

#[test]
fn tx_header_split_mid_field_is_checked_and_num_buffers_cleared() {
    for (name, dma) in dmas() {
        let mut p = Pair::new(BASE, dma.clone());
        let mut f = frame(&plain(), 200, 3);
        // num_buffers means nothing on transmit: the device clears it on the way out.
        f[10..12].copy_from_slice(&7u16.to_le_bytes());
        let head =
            p.g.post_readable(TXQ, &[&f[..3], &f[3..11], &f[11..14], &f[14..]]);
        p.kick_tx();
        let mut want = f.clone();
        want[10..12].fill(0);
        assert_eq!(p.be.take_sent(), vec![want], "{name}");
        assert_eq!(p.g.used(TXQ), vec![(u32::from(head), 0)], "{name}");
        assert_pool_covers(name, &dma, f.len(), 0);
    }
}

#[test]
fn tx_64k_tso_and_csum_partial_frames_pass_with_features_acked() {
    let acked = BASE | feature(VIRTIO_NET_F_HOST_TSO4) | feature(VIRTIO_NET_F_HOST_TSO6);
    for (name, dma) in dmas() {
        let mut p = Pair::new(acked, dma.clone());
        let tso = tso4_header();
        let big = frame(&tso, MAX_FRAME_LEN, 1);
        p.g.post_readable(TXQ, &[&big]);
        let partial = VnetHeader {
            flags: VIRTIO_NET_HDR_F_NEEDS_CSUM,
            csum_start: 34,
            csum_offset: 6,
            ..Default::default()
        };
        let small = frame(&partial, 60, 2);
        p.g.post_readable(TXQ, &[&small[..12], &small[12..]]);
        p.kick_tx();
        let moved = big.len() + small.len();
        assert_eq!(p.be.take_sent(), vec![big, small], "{name}");
        assert_eq!(p.g.used(TXQ).len(), 2);
        assert_pool_covers(name, &dma, moved, 0);
    }
}

#[test]
fn tx_oversized_frame_dropped_and_counted() {
    let mut p = Pair::new(BASE, Dma::direct());
    let f = frame(&plain(), MAX_FRAME_LEN + 1, 0);
    let head = p.g.post_readable(TXQ, &[&f[..40_000], &f[40_000..]]);
    p.kick_tx();
    assert!(p.be.take_sent().is_empty());
    assert_eq!(p.g.used(TXQ), vec![(u32::from(head), 0)]);
    assert_eq!(p.m.tx_dropped_oversized.get(), 1);
}

#[test]
fn tx_offloads_not_acked_are_dropped() {
    let mut p = Pair::new(feature(VIRTIO_F_VERSION_1), Dma::direct());
    let tso = VnetHeader {
        gso_type: VIRTIO_NET_HDR_GSO_TCPV4,
        gso_size: 1448,
        ..Default::default()
    };
    let csum = VnetHeader {
        flags: VIRTIO_NET_HDR_F_NEEDS_CSUM,
        csum_start: 14,
        csum_offset: 2,
        ..Default::default()
    };
    p.g.post_readable(TXQ, &[&frame(&tso, 3000, 0)]);
    p.g.post_readable(TXQ, &[&frame(&csum, 100, 0)]);
    p.kick_tx();
    assert!(p.be.take_sent().is_empty());
    assert_eq!(p.m.tx_dropped_bad_header.get(), 2);
    assert_eq!(p.g.used(TXQ).len(), 2);
}

#[test]
fn tx_bounce_failure_drops_frame_counts_and_keeps_serving() {
    let mut p = Pair::new(BASE, failing_dma());
    let head = p.g.post_readable(TXQ, &[&frame(&plain(), 100, 0)]);
    p.kick_tx();
    assert_eq!(p.g.used(TXQ), vec![(u32::from(head), 0)]);
    assert_eq!(p.m.tx_bounce_failures.get(), 1);
    assert!(p.be.take_sent().is_empty());
}

// ---------------------------------------------------------------- hostile TX

#[test]
fn hostile_tx_chains_each_get_one_used_entry_and_good_frames_still_pass() {
    for (name, dma) in dmas() {
        let mut p = Pair::new(BASE, dma.clone());
        let good = p.g.alloc(200, &frame(&plain(), 188, 3));
        let out = (MEM_SIZE as u64) - 16;
        let heads = p.g.post_raw(
            TXQ,
            &[
                // 0-1: a loop (1 -> 0).
                (good, 100, F_NEXT, 1),
                (good, 100, F_NEXT | LAST, 0),
                // 2-3: crosses the end of guest memory.
                (good, 100, F_NEXT, 3),
                (out, 64, 0, 0),
                // 4: an address far outside.
                (u64::MAX - 8, 64, 0, 0),
                // 5: device-writable in a TX chain.
                (good, 200, F_WRITE, 0),
                // 6-7: zero-length only.
                (good, 0, F_NEXT, 7),
                (good, 0, 0, 0),
                // 8-9: too short for header + Ethernet header.
                (good, 12, F_NEXT, 9),
                (good, 4, 0, 0),
                // 10-12: zero-length descriptors around a good frame: refused too (the one
                // walker's rule for every device: no zero-length descriptors).
                (good, 0, F_NEXT, 11),
                (good, 200, F_NEXT, 12),
                (good, 0, 0, 0),
            ],
        );
        assert_eq!(heads.len(), 7);
        p.kick_tx();
        let used = p.g.used(TXQ);
        let ids: Vec<u32> = used.iter().map(|u| u.0).collect();
        assert_eq!(
            ids,
            heads.iter().map(|&h| u32::from(h)).collect::<Vec<_>>(),
            "{name}"
        );
        assert!(used.iter().all(|u| u.1 == 0));
        assert_eq!(p.m.tx_dropped_malformed.get(), 7, "{name}");
        assert!(p.be.take_sent().is_empty(), "{name}");
        // Later good requests work.
        let f = frame(&plain(), 60, 1);
        p.g.post_readable(TXQ, &[&f]);
        p.kick_tx();
        assert_eq!(p.be.take_sent(), vec![f.clone()], "{name}");
        // Hostile chains released whatever they had mapped; only the good frame went to the
        // device (the frame between zero-length descriptors is refused by the walker's rule).
        assert_pool_covers(name, &dma, f.len(), 0);
    }
}

#[test]
fn hostile_avail_index_far_ahead_breaks_the_device_without_panic() {
    let mut p = Pair::new(BASE, Dma::direct());
    p.g.set_avail_idx(TXQ, QSIZE + 5);
    let (mem, mut qs) = p.g.split(&[0, 1]);
    let r = p.w.handle(WorkerEvent::Kick(1), mem, &mut qs);
    assert!(
        matches!(r, Err(crate::virtio::WorkerError::Broken(_))),
        "{r:?}"
    );
}

// ---------------------------------------------------------------- RX

#[test]
fn rx_frame_into_one_buffer_with_num_buffers_1() {
    for (name, dma) in dmas() {
        let mut p = Pair::new(BASE, dma.clone());
        let (head, addrs) = p.g.post_writable(RXQ, &[2048]);
        let f = frame(&plain(), 1000, 9);
        p.be.inject(f.clone());
        let sig = p.tap_readable();
        assert!(sig.has(0));
        assert_eq!(p.g.used(RXQ), vec![(u32::from(head), 1012)], "{name}");
        let got = p.g.read(addrs[0], 1012);
        let hdr = VnetHeader::from_bytes(got[..12].try_into().unwrap());
        assert_eq!(hdr.num_buffers, 1);
        assert_eq!(got[12..], f[12..], "{name}");
        assert_pool_covers(name, &dma, 0, 1012);
    }
}

#[test]
fn rx_mrg_rxbuf_scatters_over_chains_and_counts_buffers() {
    let acked = BASE | feature(VIRTIO_NET_F_MRG_RXBUF);
    for (name, dma) in dmas() {
        let mut p = Pair::new(acked, dma.clone());
        let mut bufs = Vec::new();
        for _ in 0..4 {
            bufs.push(p.g.post_writable(RXQ, &[600, 400]));
        }
        let f = frame(&plain(), 3000, 5);
        p.be.inject(f.clone());
        p.tap_readable();
        let used = p.g.used(RXQ);
        let lens: Vec<u32> = used.iter().map(|u| u.1).collect();
        assert_eq!(lens, vec![1000, 1000, 1000, 12], "{name}");
        let mut got = Vec::new();
        for (i, (head, addrs)) in bufs.iter().enumerate() {
            assert_eq!(used[i].0, u32::from(*head));
            let mut left = lens[i] as usize;
            for (a, sz) in addrs.iter().zip([600usize, 400]) {
                let n = left.min(sz);
                got.extend(p.g.read(*a, n));
                left -= n;
            }
        }
        let hdr = VnetHeader::from_bytes(got[..12].try_into().unwrap());
        assert_eq!(hdr.num_buffers, 4, "{name}");
        assert_eq!(got[12..], f[12..], "{name}");
        assert_eq!(p.m.rx_buffers_used.get(), 4);
        assert_pool_covers(name, &dma, 0, f.len());
    }
}

#[test]
fn rx_64k_tso_frame_with_mrg_rxbuf() {
    let acked = BASE | feature(VIRTIO_NET_F_MRG_RXBUF) | feature(VIRTIO_NET_F_GUEST_TSO4);
    let mut p = Pair::new(acked, dmas().remove(1).1);
    for _ in 0..20 {
        p.g.post_writable(RXQ, &[4096]);
    }
    let tso = VnetHeader {
        flags: VIRTIO_NET_HDR_F_NEEDS_CSUM,
        gso_type: VIRTIO_NET_HDR_GSO_TCPV4,
        gso_size: 1448,
        csum_start: 34,
        csum_offset: 16,
        hdr_len: 66,
        num_buffers: 0,
    };
    p.be.inject(frame(&tso, MAX_FRAME_LEN, 0));
    p.tap_readable();
    assert_eq!(p.m.rx_frames.get(), 1);
    // 65562 bytes in 4096-byte buffers.
    assert_eq!(p.g.used(RXQ).len(), MAX_BUFFER_LEN.div_ceil(4096));
}

#[test]
fn rx_waits_for_buffers_then_resumes_on_kick() {
    for (name, dma) in dmas() {
        let mut p = Pair::new(BASE | feature(VIRTIO_NET_F_MRG_RXBUF), dma.clone());
        p.be.inject(frame(&plain(), 500, 1));
        p.be.inject(frame(&plain(), 500, 2));
        p.tap_readable();
        assert_eq!(p.m.rx_no_buffers.get(), 1, "{name}");
        // One frame is pending; the second is still in the backend (not read).
        assert_eq!(p.w.rx_state(), (true, 0));
        assert_eq!(p.be.state().rx.len(), 1);
        p.g.post_writable(RXQ, &[1024]);
        p.g.post_writable(RXQ, &[1024]);
        let sig = p.kick_rx();
        assert!(sig.has(0));
        assert_eq!(p.g.used(RXQ).len(), 2, "{name}");
        assert_eq!(p.m.rx_frames.get(), 2);
        assert_eq!(p.w.rx_state(), (false, 0));
        // the frame that waited for buffers holds no slot once delivered
        assert_pool_covers(name, &dma, 0, 2 * 512);
    }
}

#[test]
fn rx_frame_too_big_without_mrg_is_dropped_and_the_buffer_kept() {
    let mut p = Pair::new(BASE, Dma::direct());
    let (head, _) = p.g.post_writable(RXQ, &[200]);
    p.be.inject(frame(&plain(), 1000, 0));
    p.be.inject(frame(&plain(), 100, 0));
    p.tap_readable();
    assert_eq!(p.m.rx_dropped_too_small.get(), 1);
    assert_eq!(p.g.used(RXQ), vec![(u32::from(head), 112)]);
}

#[test]
fn rx_header_cleared_without_guest_csum() {
    let mut p = Pair::new(feature(VIRTIO_F_VERSION_1), Dma::direct());
    let (_, addrs) = p.g.post_writable(RXQ, &[256]);
    let valid = VnetHeader {
        flags: VIRTIO_NET_HDR_F_DATA_VALID,
        ..Default::default()
    };
    p.be.inject(frame(&valid, 60, 0));
    p.tap_readable();
    assert_eq!(p.g.read(addrs[0], 1), vec![0]);
}

#[test]
fn rx_bounce_failure_drops_frame_and_keeps_buffers() {
    let mut p = Pair::new(BASE, failing_dma());
    p.g.post_writable(RXQ, &[2048]);
    p.be.inject(frame(&plain(), 100, 0));
    p.tap_readable();
    assert_eq!(p.m.rx_bounce_failures.get(), 1);
    assert!(p.g.used(RXQ).is_empty());
    // The buffer went back on the ring, unused.
    assert_eq!(p.w.rx_state(), (false, 0));
    assert_eq!(p.g.next_avail(RXQ), 0);
}

#[test]
fn rx_chains_held_for_a_waiting_frame_go_back_on_the_ring_between_passes() {
    // Regression: chains held for a frame that waits for more buffers were
    // counted in `next_avail`, which is what a vhost-user stop (GET_VRING_BASE) reports: the
    // frontend resumed after them and the guest lost those buffers.
    for (name, dma) in dmas() {
        let mut p = Pair::new(BASE | feature(VIRTIO_NET_F_MRG_RXBUF), dma.clone());
        let (h0, a0) = p.g.post_writable(RXQ, &[600]);
        let (h1, a1) = p.g.post_writable(RXQ, &[600]);
        let f = frame(&plain(), 3000, 9);
        p.be.inject(f.clone());
        p.tap_readable();
        assert_eq!(p.m.rx_no_buffers.get(), 1, "{name}");
        assert_eq!(
            p.w.rx_state(),
            (true, 0),
            "{name}: nothing held between events"
        );
        assert_eq!(
            p.g.next_avail(RXQ),
            0,
            "{name}: both chains back on the ring"
        );
        assert!(p.g.used(RXQ).is_empty(), "{name}");
        assert_eq!(p.m.rx_chains_returned.get(), 2, "{name}");
        // Another event with no new buffer: popped and put back again, still no used entry.
        p.tap_readable();
        assert_eq!(p.g.next_avail(RXQ), 0, "{name}");
        // Enough buffers now: the frame fills the two first chains, in ring order.
        let (h2, a2) = p.g.post_writable(RXQ, &[2048]);
        let (_, _) = p.g.post_writable(RXQ, &[2048]);
        let sig = p.kick_rx();
        assert!(sig.has(0), "{name}");
        assert_eq!(
            p.g.used(RXQ),
            vec![
                (u32::from(h0), 600),
                (u32::from(h1), 600),
                (u32::from(h2), (f.len() - 1200) as u32)
            ],
            "{name}"
        );
        assert_eq!(
            p.g.next_avail(RXQ),
            3,
            "{name}: the fourth chain stays on the ring"
        );
        let mut got = p.g.read(a0[0], 600);
        got.extend(p.g.read(a1[0], 600));
        got.extend(p.g.read(a2[0], f.len() - 1200));
        // num_buffers = 3 in the delivered header.
        assert_eq!(u16::from_le_bytes([got[10], got[11]]), 3, "{name}");
        assert_eq!(got[12..], f[12..], "{name}");
        assert_eq!(p.m.rx_chains_returned_empty.get(), 0, "{name}");
        assert_pool_covers(name, &dma, 0, f.len());
    }
}

#[test]
fn rx_held_chains_before_a_refused_one_are_completed_empty() {
    // A chain held before a refused one cannot go back on the ring (the refused one is on the
    // used ring already): it is completed with length 0; the one after it goes back.
    let mut p = Pair::new(BASE | feature(VIRTIO_NET_F_MRG_RXBUF), Dma::direct());
    let b = p.g.alloc(4096, &[]);
    let heads = p.g.post_raw(
        RXQ,
        &[
            (b, 100, F_WRITE, 0),
            (b, 100, 0, 0), // device-readable: refused
            (b, 100, F_WRITE, 0),
        ],
    );
    p.be.inject(frame(&plain(), 1000, 0));
    p.tap_readable();
    assert_eq!(p.m.rx_bad_chains.get(), 1);
    assert_eq!(
        p.g.used(RXQ),
        vec![(u32::from(heads[1]), 0), (u32::from(heads[0]), 0)]
    );
    assert_eq!(p.m.rx_chains_returned_empty.get(), 1);
    assert_eq!(p.m.rx_chains_returned.get(), 1);
    assert_eq!(p.g.next_avail(RXQ), 2, "the last chain is back on the ring");
    assert_eq!(p.w.rx_state(), (true, 0));
}

#[test]
fn hostile_rx_chains_completed_with_zero_and_good_buffers_used() {
    for (name, dma) in dmas() {
        let mut p = Pair::new(BASE | feature(VIRTIO_NET_F_MRG_RXBUF), dma.clone());
        let b = p.g.alloc(4096, &[]);
        let heads = p.g.post_raw(
            RXQ,
            &[
                // 0: device-readable in an RX chain.
                (b, 1024, 0, 0),
                // 1: outside guest memory.
                (MEM_SIZE as u64, 1024, F_WRITE, 0),
                // 2: smaller than a vnet header.
                (b, 8, F_WRITE, 0),
                // 3-4: loop.
                (b, 100, F_WRITE | F_NEXT, 4),
                (b, 100, F_WRITE | F_NEXT | LAST, 3),
                // 5-6: writable then readable.
                (b, 100, F_WRITE | F_NEXT, 6),
                (b, 100, 0, 0),
                // 7: zero length.
                (b, 0, F_WRITE, 0),
                // 8: good.
                (b, 4096, F_WRITE, 0),
            ],
        );
        p.be.inject(frame(&plain(), 300, 0));
        p.tap_readable();
        let used = p.g.used(RXQ);
        assert_eq!(used.len(), 7, "{name}");
        assert!(used[..6].iter().all(|u| u.1 == 0));
        assert_eq!(used[6], (u32::from(heads[6]), 312));
        assert_eq!(p.m.rx_bad_chains.get(), 6);
        assert_pool_covers(name, &dma, 0, 312);
    }
}

// ---------------------------------------------------------------- shaper

#[test]
fn shaper_holds_tx_in_the_ring_until_the_timer() {
    let (shaper, clock) = RateLimiter::on_manual_clock(3000);
    let mut p = Pair::with_shaper(BASE, Dma::direct(), Some(shaper));
    assert_eq!(p.w.extra_fds().len(), 2);
    for i in 0..3 {
        p.g.post_readable(TXQ, &[&frame(&plain(), 1500, i)]);
    }
    p.kick_tx();
    assert_eq!(p.be.take_sent().len(), 2);
    assert_eq!(p.g.used(TXQ).len(), 2);
    assert_eq!(
        p.g.next_avail(TXQ),
        2,
        "the throttled chain stays in the ring"
    );
    assert_eq!(p.m.tx_throttled.get(), 1);
    // A kick while throttled does nothing.
    p.kick_tx();
    assert!(p.be.take_sent().is_empty());
    clock.advance(1500 * 1000);
    p.ev(WorkerEvent::Fd(TOKEN_SHAPER));
    assert_eq!(p.be.take_sent().len(), 1);
    assert_eq!(p.g.used(TXQ).len(), 3);
}

#[test]
fn shaper_holds_rx_frame_pending() {
    let (shaper, clock) = RateLimiter::on_manual_clock(1000);
    let mut p = Pair::with_shaper(BASE, Dma::direct(), Some(shaper));
    p.g.post_writable(RXQ, &[2048]);
    p.g.post_writable(RXQ, &[2048]);
    p.be.inject(frame(&plain(), 800, 0));
    p.be.inject(frame(&plain(), 800, 0));
    p.tap_readable();
    assert_eq!(p.g.used(RXQ).len(), 1);
    assert_eq!(p.m.rx_throttled.get(), 1);
    // The frame waits in the worker; the second buffer is not even popped yet.
    assert_eq!(p.w.rx_state(), (true, 0));
    clock.advance(1_000_000);
    p.ev(WorkerEvent::Fd(TOKEN_SHAPER));
    assert_eq!(p.g.used(RXQ).len(), 2);
}

#[test]
fn shaper_rx_flood_does_not_throttle_tx() {
    // Regression: one `armed` flag for both directions, so a throttled RX
    // frame made the TX path stop too, until RX's refill.
    let (shaper, _) = RateLimiter::on_manual_clock(2000);
    let mut p = Pair::with_shaper(BASE, Dma::direct(), Some(shaper));
    for _ in 0..3 {
        p.g.post_writable(RXQ, &[2048]);
    }
    for _ in 0..3 {
        p.be.inject(frame(&plain(), 1500, 0));
    }
    p.tap_readable();
    assert_eq!(p.g.used(RXQ).len(), 1);
    assert_eq!(p.m.rx_throttled.get(), 1, "RX must be throttled");
    p.g.post_readable(TXQ, &[&frame(&plain(), 1000, 1)]);
    p.kick_tx();
    assert_eq!(p.be.take_sent().len(), 1, "TX waited for RX's budget");
    assert_eq!(p.m.tx_throttled.get(), 0);
}

// ---------------------------------------------------------------- control queue

fn ctrl_worker(
    acked: u64,
    pairs: usize,
) -> (
    CtrlWorker<GuestMemoryMmap>,
    Vec<MemBackend>,
    Arc<NetMetrics>,
) {
    let bes: Vec<MemBackend> = (0..pairs).map(|_| MemBackend::new().unwrap()).collect();
    let shared: Vec<SharedBackend> = bes
        .iter()
        .map(|b| Arc::new(Mutex::new(Box::new(b.clone()) as Box<dyn NetBackend>)))
        .collect();
    let m = Arc::new(NetMetrics::default());
    let w = CtrlWorker::new(
        2 * pairs as u16,
        acked,
        shared,
        Arc::new(AtomicU16::new(1)),
        Dma::direct(),
        m.clone(),
    );
    (w, bes, m)
}

fn ctrl_cmd(g: &mut Guest, class: u8, cmd: u8, data: &[u8]) -> u64 {
    let mut c = vec![class, cmd];
    c.extend_from_slice(data);
    let a = g.alloc(c.len(), &c);
    let ack = g.alloc(1, &[0xff]);
    g.post_raw(0, &[(a, c.len() as u32, F_NEXT, 1), (ack, 1, F_WRITE, 0)]);
    ack
}

#[test]
fn ctrl_queue_mq_pairs_set_rx_mode_and_naks() {
    let acked = BASE | feature(VIRTIO_NET_F_CTRL_VQ) | feature(VIRTIO_NET_F_MQ);
    let (mut w, bes, m) = ctrl_worker(acked, 4);
    let mut g = Guest::new(1);
    let cases: Vec<(u64, u8)> = vec![
        (
            ctrl_cmd(
                &mut g,
                VIRTIO_NET_CTRL_MQ,
                VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET,
                &3u16.to_le_bytes(),
            ),
            VIRTIO_NET_OK,
        ),
        (
            ctrl_cmd(
                &mut g,
                VIRTIO_NET_CTRL_MQ,
                VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET,
                &0u16.to_le_bytes(),
            ),
            VIRTIO_NET_ERR,
        ),
        (
            ctrl_cmd(
                &mut g,
                VIRTIO_NET_CTRL_MQ,
                VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET,
                &5u16.to_le_bytes(),
            ),
            VIRTIO_NET_ERR,
        ),
        (
            ctrl_cmd(
                &mut g,
                VIRTIO_NET_CTRL_MQ,
                VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET,
                &[1],
            ),
            VIRTIO_NET_ERR,
        ),
        (ctrl_cmd(&mut g, VIRTIO_NET_CTRL_RX, 0, &[1]), VIRTIO_NET_OK),
        (ctrl_cmd(&mut g, VIRTIO_NET_CTRL_RX, 1, &[0]), VIRTIO_NET_OK),
        (
            ctrl_cmd(
                &mut g,
                VIRTIO_NET_CTRL_MAC,
                VIRTIO_NET_CTRL_MAC_TABLE_SET,
                &[0; 8],
            ),
            VIRTIO_NET_OK,
        ),
        (
            ctrl_cmd(&mut g, VIRTIO_NET_CTRL_MAC, 1, &[0; 6]),
            VIRTIO_NET_ERR,
        ),
        (ctrl_cmd(&mut g, 2, 0, &[0; 2]), VIRTIO_NET_ERR),
        (ctrl_cmd(&mut g, 0x7f, 9, &[]), VIRTIO_NET_ERR),
    ];
    let (mem, mut qs) = g.split(&[0]);
    let sig = w.handle(WorkerEvent::Kick(0), mem, &mut qs).unwrap();
    assert!(sig.has(0));
    for (i, (ack, want)) in cases.iter().enumerate() {
        assert_eq!(g.read(*ack, 1), vec![*want], "command {i}");
    }
    assert!(g.used(0).iter().all(|u| u.1 == 1));
    let enabled: Vec<bool> = bes.iter().map(|b| b.state().enabled).collect();
    assert_eq!(enabled, vec![true, true, true, false]);
    assert_eq!(m.ctrl_ok.get(), 4);
    assert_eq!(m.ctrl_err.get(), 6);
}

#[test]
fn ctrl_mq_refused_when_mq_not_acked_and_bad_chains_zero() {
    let (mut w, _bes, m) = ctrl_worker(BASE | feature(VIRTIO_NET_F_CTRL_VQ), 2);
    let mut g = Guest::new(1);
    let ack = ctrl_cmd(
        &mut g,
        VIRTIO_NET_CTRL_MQ,
        VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET,
        &2u16.to_le_bytes(),
    );
    let c = g.alloc(4, &[0, 0, 1, 0]);
    // No writable descriptor.
    g.post_raw(0, &[(c, 3, 0, 0)]);
    // Writable before readable.
    g.post_raw(0, &[(c, 1, F_WRITE | F_NEXT, 1), (c, 3, 0, 0)]);
    // Only 1 command byte.
    g.post_raw(0, &[(c, 1, F_NEXT, 1), (c, 1, F_WRITE, 0)]);
    let (mem, mut qs) = g.split(&[0]);
    w.handle(WorkerEvent::Kick(0), mem, &mut qs).unwrap();
    assert_eq!(g.read(ack, 1), vec![VIRTIO_NET_ERR]);
    let lens: Vec<u32> = g.used(0).iter().map(|u| u.1).collect();
    assert_eq!(lens, vec![1, 0, 0, 0]);
    assert_eq!(m.ctrl_bad_chains.get(), 3);
}

// ---------------------------------------------------------------- device

fn device(pairs: u16) -> (Net, Vec<MemBackend>) {
    let bes: Vec<MemBackend> = (0..pairs).map(|_| MemBackend::new().unwrap()).collect();
    let cfg = NetConfig {
        queue_pairs: pairs,
        ..Default::default()
    };
    let boxed = bes
        .iter()
        .map(|b| Box::new(b.clone()) as Box<dyn NetBackend>)
        .collect();
    (Net::new(cfg, boxed, Dma::direct()).unwrap(), bes)
}

#[test]
fn config_space_layout() {
    let (mut d, _) = device(4);
    let dev: &mut dyn VirtioDevice<GuestMemoryMmap> = &mut d;
    let mut cs = [0xaau8; 32];
    dev.read_config(0, &mut cs);
    assert_eq!(cs[0..6], [0x52, 0x54, 0x00, 0x12, 0x34, 0x56]);
    assert_eq!(u16::from_le_bytes([cs[6], cs[7]]), VIRTIO_NET_S_LINK_UP);
    assert_eq!(u16::from_le_bytes([cs[8], cs[9]]), 4);
    assert_eq!(u16::from_le_bytes([cs[10], cs[11]]), 0, "mtu not offered");
    assert_eq!(u32::from_le_bytes(cs[12..16].try_into().unwrap()), 10_000);
    assert_eq!(cs[16], 1, "full duplex");
    assert!(cs[17..].iter().all(|b| *b == 0));
    let mut b = [0xaau8; 4];
    dev.read_config(14, &mut b);
    assert_eq!(b, [0, 0, 1, 0]);
    dev.read_config(u64::MAX, &mut b);
    assert_eq!(b, [0; 4]);
    dev.write_config(0, &[1, 2, 3]);
    let mut mac = [0u8; 6];
    dev.read_config(0, &mut mac);
    assert_eq!(mac[0], 0x52);
    assert_eq!(d.metrics().config_writes_ignored.get(), 1);
}

#[test]
fn features_offered_and_negotiation() {
    let (mut d, bes) = device(2);
    let f = <Net as VirtioDevice<GuestMemoryMmap>>::avail_features(&d);
    for bit in [
        VIRTIO_F_VERSION_1,
        VIRTIO_F_ACCESS_PLATFORM,
        VIRTIO_RING_F_EVENT_IDX,
        VIRTIO_RING_F_INDIRECT_DESC,
        VIRTIO_NET_F_MAC,
        VIRTIO_NET_F_STATUS,
        VIRTIO_NET_F_SPEED_DUPLEX,
        VIRTIO_NET_F_MQ,
        VIRTIO_NET_F_CTRL_VQ,
        VIRTIO_NET_F_MRG_RXBUF,
        VIRTIO_NET_F_CSUM,
        VIRTIO_NET_F_GUEST_CSUM,
        VIRTIO_NET_F_HOST_TSO4,
        VIRTIO_NET_F_HOST_TSO6,
        VIRTIO_NET_F_GUEST_TSO4,
        VIRTIO_NET_F_GUEST_TSO6,
    ]
    .map(feature)
    {
        assert_ne!(f & bit, 0, "{bit:#x}");
    }
    for bit in [
        VIRTIO_NET_F_GUEST_UFO,
        VIRTIO_NET_F_HOST_UFO,
        VIRTIO_NET_F_MTU,
        VIRTIO_NET_F_HOST_ECN,
    ]
    .map(feature)
    {
        assert_eq!(f & bit, 0);
    }
    assert_eq!(<Net as VirtioDevice<GuestMemoryMmap>>::num_queues(&d), 5);
    let act = |d: &mut Net, a: u64| {
        <Net as VirtioDevice<GuestMemoryMmap>>::activate(d, a)
            .map(|w| w.iter().map(|w| w.queue_indexes()).collect::<Vec<_>>())
    };
    assert!(
        act(&mut d, feature(VIRTIO_NET_F_MRG_RXBUF)).is_err(),
        "VERSION_1 required"
    );
    assert!(act(
        &mut d,
        feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_NET_F_GUEST_TSO4)
    )
    .is_err());
    assert!(act(
        &mut d,
        feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_NET_F_MQ)
    )
    .is_err());
    // Everything offered, plus a bit never offered (dropped).
    let q = act(&mut d, f | feature(VIRTIO_NET_F_GUEST_UFO)).unwrap();
    assert_eq!(q, vec![vec![0, 1], vec![2, 3], vec![4]]);
    assert_eq!(d.acked_features(), f);
    // Offloads applied from acked guest features only; only pair 0 receives at first.
    assert_eq!(bes[0].state().acked, Some(f));
    assert!(bes[0].state().enabled && !bes[1].state().enabled);
    assert!(act(&mut d, f).is_err(), "already active");
    <Net as VirtioDevice<GuestMemoryMmap>>::reset(&mut d);
    assert_eq!(bes[0].state().acked, Some(0));
    // Without MQ: one pair, control queue at 2.
    let q = act(
        &mut d,
        feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_NET_F_CTRL_VQ),
    )
    .unwrap();
    assert_eq!(q, vec![vec![0, 1], vec![2]]);
    let s = <Net as VirtioDevice<GuestMemoryMmap>>::stats(&d);
    assert_eq!(s["net"]["tx_frames"], 0);
    assert_eq!(s["policy"], "off");
}

#[test]
fn mq_without_ctrl_vq_is_served_when_the_frontend_steers() {
    // Regression: QEMU acks MQ but not CTRL_VQ to a vhost-user-net
    // backend (it keeps the control queue), and the device refused to activate.
    let bes: Vec<MemBackend> = (0..2).map(|_| MemBackend::new().unwrap()).collect();
    let boxed = || {
        bes.iter()
            .map(|b| Box::new(b.clone()) as Box<dyn NetBackend>)
            .collect::<Vec<_>>()
    };
    let cfg = NetConfig {
        queue_pairs: 2,
        frontend_steering: true,
        ..Default::default()
    };
    let mut d = Net::new(cfg, boxed(), Dma::direct()).unwrap();
    let acked = BASE | feature(VIRTIO_NET_F_MQ) | feature(VIRTIO_NET_F_MRG_RXBUF);
    // Still refused whatever the steering: no VERSION_1, TSO without CSUM.
    for bad in [
        feature(VIRTIO_NET_F_MQ),
        feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_NET_F_MQ) | feature(VIRTIO_NET_F_HOST_TSO4),
    ] {
        assert!(<Net as VirtioDevice<GuestMemoryMmap>>::activate(&mut d, bad).is_err());
    }
    let mut workers = <Net as VirtioDevice<GuestMemoryMmap>>::activate(&mut d, acked).unwrap();
    let queues: Vec<_> = workers.iter().map(|w| w.queue_indexes()).collect();
    assert_eq!(
        queues,
        vec![vec![0, 1], vec![2, 3]],
        "both pairs, no control worker"
    );
    assert_eq!(d.acked_features(), acked);
    let enabled = || bes.iter().map(|b| b.state().enabled).collect::<Vec<_>>();
    assert_eq!(enabled(), vec![true, false], "pair 0 receives first");
    // Pair 1's rings enabled: its first event attaches its backend queue, and it serves.
    let mut g = Guest::new(2);
    let (h, _) = g.post_writable(0, &[2048]);
    bes[1].inject(frame(&plain(), 100, 3));
    let (mem, mut qs) = g.split(&[0, 1]);
    let sig = workers[1]
        .handle(WorkerEvent::Kick(0), mem, &mut qs)
        .unwrap();
    assert!(sig.has(0));
    assert_eq!(g.used(0), vec![(u32::from(h), 112)]);
    assert_eq!(enabled(), vec![true, true]);
    assert_eq!(workers[1].stats()["rx_frames"], 1);
    assert_eq!(workers[0].stats()["rx_frames"], 0);
    // Its rings disabled (the guest went back to one pair): detached, pair 0 untouched.
    workers[1].queues_disabled();
    assert_eq!(enabled(), vec![true, false]);
    assert_eq!(d.metrics().steering_changes.get(), 2);
    // A transport without a steering frontend (virtio-pci): the driver must ack CTRL_VQ.
    drop(workers);
    let mut pci = Net::new(
        NetConfig {
            queue_pairs: 2,
            ..Default::default()
        },
        boxed(),
        Dma::direct(),
    )
    .unwrap();
    assert!(<Net as VirtioDevice<GuestMemoryMmap>>::activate(&mut pci, acked).is_err());
}

#[test]
fn device_rejects_bad_configs() {
    let be = || vec![Box::new(NullBackend::default()) as Box<dyn NetBackend>];
    let mut c = NetConfig {
        queue_pairs: 2,
        ..Default::default()
    };
    assert!(Net::new(c.clone(), be(), Dma::direct()).is_err());
    c.queue_pairs = 0;
    assert!(Net::new(c.clone(), Vec::new(), Dma::direct()).is_err());
    c.queue_pairs = 1;
    c.queue_size = 100;
    assert!(Net::new(c, be(), Dma::direct()).is_err());
}

#[test]
fn queue_groups_are_pairs_and_the_control_queue_before_activation() {
    let (dev, _) = device(3);
    let groups = VirtioDevice::<GuestMemoryMmap>::queue_groups(&dev);
    assert_eq!(
        groups,
        vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6]],
        "declared before any feature is negotiated"
    );
}
