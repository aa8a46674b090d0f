//! Property tests of the net device core with hostile descriptor chains, vnet headers and
//! control commands, through the test driver and an in-memory backend.
//!
//! `hostile_tx_rx_and_control_chains`: per case, one device (1 or 2 queue pairs, queue sizes
//! 2..16, a random subset of INDIRECT, EVENT_IDX, MRG_RXBUF, the offloads, CTRL_VQ and MQ;
//! bounce off or forced swiotlb/iova) gets
//! - on TX: a random descriptor table, or well-formed chains (vnet header with odd
//!   gso/csum fields, frame in pieces) with random mutations; heads over 1-3 kicks;
//! - on RX: the same for device-writable chains, and frames of every awkward length with odd
//!   headers injected into the backend (read on its fd event and on RX kicks);
//! - on the control queue: every class/command with short, long and odd payloads, in random
//!   or well-formed chains.
//!
//! Oracle: no panic, no broken worker; every published TX and control head completes exactly
//! once and RX heads at most once; guest RAM is canary-filled and no byte outside a
//! device-writable descriptor or the used ring changes (TX writes nothing at all); every
//! completion is counted (TX: frames sent + every drop counter; RX: bad chains + buffers
//! used; control: OK + ERR + bad chains), every injected frame is delivered, dropped and
//! counted, or still waiting; frames reaching the backend carry a header `check_tx` accepts;
//! a well-formed control command gets the ack the device documents; bounce slots all come
//! back; after a reset the device sends and receives a good frame.
//!
//! `BVM_FUZZ_CASES` (default 512) and `BVM_FUZZ_SEED` as for `blk_fuzz`
//! ([`bounce::testing::fuzz_config`]); a longer run:
//! `BVM_FUZZ_CASES=20000 BVM_FUZZ_SEED=random cargo test --release -p devices --test net_fuzz`.

mod common;

use bounce::BouncePool;
use common::fuzz::{
    assert_only_writable_changed, canary, dma_for, fuzz_desc, snapshot, FuzzDesc, Targets, Writable,
};
use devices::net::worker::TOKEN_BACKEND;
use devices::net::{MemBackend, Net, NetBackend, NetConfig, VnetHeader};
use devices::net::{MAX_BUFFER_LEN, MIN_FRAME_LEN, VNET_HDR_LEN};
use devices::testing::TestDriver;
use devices::virtio::driver::{Buf, Desc, Layout, Used};
use devices::virtio::spec::{
    feature, VIRTIO_F_ACCESS_PLATFORM, VIRTIO_NET_CTRL_MAC, VIRTIO_NET_CTRL_MQ, VIRTIO_NET_CTRL_RX,
    VIRTIO_NET_ERR, VIRTIO_NET_F_CSUM, VIRTIO_NET_F_CTRL_VQ, VIRTIO_NET_F_GUEST_CSUM,
    VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_TSO6, VIRTIO_NET_F_HOST_TSO4,
    VIRTIO_NET_F_HOST_TSO6, VIRTIO_NET_F_MQ, VIRTIO_NET_F_MRG_RXBUF, VIRTIO_NET_OK,
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC, VRING_DESC_F_WRITE,
};
use proptest::prelude::*;

/// Entries of the random descriptor tables (the queue size is 2..=16).
const TABLE: usize = 16;
const RAM: u64 = 32 << 20;

prop_compose! {
    /// A vnet header with any field values (odd gso types, ECN, csum outside the frame, ...).
    fn hdr()(
        flags in prop_oneof![Just(0u8), Just(1), Just(2), Just(3), any::<u8>()],
        gso_type in prop_oneof![
            Just(0u8),
            Just(1),
            Just(3),
            Just(4),
            Just(5),
            Just(0x81),
            any::<u8>()
        ],
        hdr_len in prop_oneof![Just(0u16), Just(54), any::<u16>()],
        gso_size in prop_oneof![Just(0u16), Just(1448), any::<u16>()],
        csum_start in prop_oneof![Just(0u16), Just(34), Just(1500), any::<u16>()],
        csum_offset in prop_oneof![Just(6u16), Just(16), any::<u16>()],
        num_buffers in any::<u16>(),
    ) -> VnetHeader {
        VnetHeader {
            flags,
            gso_type,
            hdr_len,
            gso_size,
            csum_start,
            csum_offset,
            num_buffers,
        }
    }
}

/// A control command: class, command, payload.
#[derive(Clone, Debug)]
struct Cmd {
    class: u8,
    cmd: u8,
    data: Vec<u8>,
}

fn cmd() -> impl Strategy<Value = Cmd> {
    (
        prop_oneof![
            Just(VIRTIO_NET_CTRL_RX),
            Just(VIRTIO_NET_CTRL_MAC),
            Just(2u8),
            Just(3),
            Just(VIRTIO_NET_CTRL_MQ),
            Just(5),
            any::<u8>()
        ],
        prop_oneof![0u8..8, any::<u8>()],
        prop_oneof![
            prop::collection::vec(any::<u8>(), 0..4),
            prop::collection::vec(0u8..3, 2..=2),
            prop::collection::vec(any::<u8>(), 0..64),
            // A MAC table: entries (le32) then MACs, possibly lying about the count.
            (
                0u32..8,
                any::<u32>(),
                prop::collection::vec(any::<u8>(), 0..64)
            )
                .prop_map(|(n, m, rest)| {
                    let mut v = n.to_le_bytes().to_vec();
                    v.extend_from_slice(&rest[..(6 * n as usize).min(rest.len())]);
                    v.extend_from_slice(&m.to_le_bytes());
                    v
                }),
            // Over the 48 KiB command limit.
            Just(vec![0u8; 50 << 10]),
        ],
    )
        .prop_map(|(class, cmd, data)| Cmd { class, cmd, data })
}

/// Well-formed chains, then mutations (descriptor index, field, value) as in `blk_fuzz`.
#[derive(Clone, Debug)]
struct Structured {
    /// Per chain: how many pieces, and a size selector for each.
    chains: Vec<(u8, u16)>,
    mutations: Vec<(u8, u8, FuzzDesc)>,
}

fn structured() -> impl Strategy<Value = Option<Structured>> {
    prop::option::of(
        (
            prop::collection::vec((1u8..5, any::<u16>()), 1..8),
            prop::collection::vec((any::<u8>(), 0u8..5, fuzz_desc()), 0..3),
        )
            .prop_map(|(chains, mutations)| Structured { chains, mutations }),
    )
}

/// One queue's hostile input: a random table (or structured chains) and the heads published.
#[derive(Clone, Debug)]
struct QueueInput {
    table: Vec<FuzzDesc>,
    heads: Vec<u16>,
    structured: Option<Structured>,
}

fn queue_input() -> impl Strategy<Value = QueueInput> {
    (
        prop::collection::vec(fuzz_desc(), TABLE),
        prop::collection::vec(0u16..TABLE as u16, 1..=TABLE),
        structured(),
    )
        .prop_map(|(table, heads, structured)| QueueInput {
            table,
            heads,
            structured,
        })
}

#[derive(Clone, Debug)]
struct NetCase {
    tx: QueueInput,
    rx: QueueInput,
    ctrl: QueueInput,
    indirect: Vec<FuzzDesc>,
    /// Vnet headers written (with a frame behind each) for TX descriptors to point at.
    tx_hdrs: Vec<(VnetHeader, u16)>,
    cmds: Vec<Cmd>,
    /// Frames injected into the backend: header and a length selector.
    rx_frames: Vec<(VnetHeader, u8, u32)>,
    /// Features dropped from the offer (bit i drops DROPPABLE[i]).
    drop: u16,
    bounce: u8,
    qsize_log2: u8,
    pairs: u8,
    kicks: u8,
}

/// Features a case may drop.
const DROPPABLE: [u64; 12] = [
    feature(VIRTIO_RING_F_INDIRECT_DESC),
    feature(VIRTIO_RING_F_EVENT_IDX),
    feature(VIRTIO_NET_F_MRG_RXBUF),
    feature(VIRTIO_NET_F_CSUM),
    feature(VIRTIO_NET_F_GUEST_CSUM),
    feature(VIRTIO_NET_F_HOST_TSO4),
    feature(VIRTIO_NET_F_HOST_TSO6),
    feature(VIRTIO_NET_F_GUEST_TSO4),
    feature(VIRTIO_NET_F_GUEST_TSO6),
    feature(VIRTIO_NET_F_CTRL_VQ),
    feature(VIRTIO_NET_F_MQ),
    feature(VIRTIO_F_ACCESS_PLATFORM),
];

prop_compose! {
    fn net_case()(
        tx in queue_input(),
        rx in queue_input(),
        ctrl in queue_input(),
        indirect in prop::collection::vec(fuzz_desc(), 1..24),
        tx_hdrs in prop::collection::vec((hdr(), any::<u16>()), 2),
        cmds in prop::collection::vec(cmd(), 2),
        rx_frames in prop::collection::vec((hdr(), any::<u8>(), any::<u32>()), 0..12),
        drop in any::<u16>(),
        bounce in 0u8..4,
        qsize_log2 in any::<u8>(),
        pairs in 1u8..=2,
        kicks in any::<u8>(),
    ) -> NetCase {
        NetCase {
            tx,
            rx,
            ctrl,
            indirect,
            tx_hdrs,
            cmds,
            rx_frames,
            drop,
            bounce,
            qsize_log2,
            pairs,
            kicks,
        }
    }
}

/// Deterministic frame bytes.
fn payload(seed: u16, len: usize) -> Vec<u8> {
    common::pattern(u64::from(seed) + 1, len)
}

/// The length of an injected frame (header included) for selector `sel`.
fn rx_len(sel: u8, raw: u32) -> usize {
    match sel % 12 {
        0 => 0,
        1 => 5,
        2 => VNET_HDR_LEN,
        3 => VNET_HDR_LEN + MIN_FRAME_LEN - 1,
        4 => VNET_HDR_LEN + MIN_FRAME_LEN,
        5 => 60,
        6 => 1526,
        7 => 4096 + 7,
        8 => 9000,
        9 => MAX_BUFFER_LEN,
        10 => MAX_BUFFER_LEN + 100,
        _ => (raw as usize) % (MAX_BUFFER_LEN + 1),
    }
}

/// Lays `chains` (each a list of descriptors without NEXT/next) out in table order from
/// index 0, chaining them; returns the descriptors and heads (chains that do not fit the
/// queue are left out).
fn lay_out(qsize: u16, chains: &[Vec<Desc>]) -> (Vec<Desc>, Vec<u16>, Vec<usize>) {
    let mut descs: Vec<Desc> = Vec::new();
    let mut heads = Vec::new();
    let mut owner = Vec::new();
    for (k, chain) in chains.iter().enumerate() {
        if descs.len() + chain.len() > usize::from(qsize) {
            break;
        }
        heads.push(descs.len() as u16);
        for (j, d) in chain.iter().enumerate() {
            let last = j + 1 == chain.len();
            let next = descs.len() as u16 + 1;
            descs.push(Desc {
                flags: d.flags | if last { 0 } else { 1 },
                next: if last { 0 } else { next },
                ..*d
            });
            owner.push(k);
        }
    }
    (descs, heads, owner)
}

/// What a queue's table offers the device: writable ranges and bytes, and the heads.
struct Laid {
    heads: Vec<u16>,
    allowed: Vec<(u64, u64)>,
    writable_bytes: u64,
    /// The structured chains, when no mutation touched the table: (head, chain index).
    intact: Vec<(u16, usize)>,
}

/// Writes queue `q`'s table: `input.table` resolved against `tg`, or `chains` laid out and
/// mutated. Adds the writable descriptors of the table and of the indirect table.
fn write_queue(
    drv: &TestDriver<Net>,
    q: u16,
    qsize: u16,
    input: &QueueInput,
    chains: &[Vec<Desc>],
    tg: &Targets,
    indirect: &[FuzzDesc],
) -> Laid {
    let mut descs = Vec::new();
    let mut heads: Vec<u16> = input.heads.iter().map(|h| h % qsize).collect();
    let mut intact = Vec::new();
    if let Some(s) = &input.structured {
        let (d, h, owner) = lay_out(qsize, chains);
        descs = d;
        let mut touched = vec![false; chains.len()];
        for (idx, field, f) in &s.mutations {
            let i = usize::from(*idx) % usize::from(qsize);
            let Some(d) = descs.get_mut(i) else {
                continue;
            };
            touched[owner[i]] = true;
            let (addr, len) = tg.resolve(f);
            match field {
                0 => d.addr = addr,
                1 => d.len = len,
                2 => d.flags = f.flags,
                3 => d.next = f.next,
                _ => *d = tg.raw(f),
            }
        }
        // A mutated chain may link into another one's descriptors: only a table no mutation
        // touched is checked against the model.
        if !touched.contains(&true) {
            intact = h.iter().enumerate().map(|(k, &head)| (head, k)).collect();
        }
        heads = h;
        if heads.is_empty() {
            heads.push(0);
        }
    }
    let mut w = Writable::default();
    for (i, f) in input.table.iter().take(usize::from(qsize)).enumerate() {
        let d = descs.get(i).copied().unwrap_or_else(|| tg.raw(f));
        w.note(&d);
        drv.vqs[usize::from(q)]
            .write_desc(drv.ram.mem(), i as u16, d)
            .unwrap();
    }
    for f in indirect {
        w.note(&tg.raw(f));
    }
    let Writable {
        mut allowed,
        bytes: writable_bytes,
    } = w;
    allowed.extend(rings(drv, q));
    heads.truncate(usize::from(qsize));
    Laid {
        heads,
        allowed,
        writable_bytes,
        intact,
    }
}

/// Queue `q`'s used ring (the device writes it) and avail ring (the test, as the driver,
/// publishes into it during a case).
fn rings(drv: &TestDriver<Net>, q: u16) -> [(u64, u64); 2] {
    let l = drv.vqs[usize::from(q)].layout();
    [
        (l.used, l.used + Layout::used_ring_bytes(l.size)),
        (l.avail, l.avail + Layout::avail_ring_bytes(l.size)),
    ]
}

/// Publishes `heads` on queue `q` over `kicks` kicks, calling `run` after each publication;
/// returns the used entries.
fn publish_and_run(
    drv: &mut TestDriver<Net>,
    q: u16,
    heads: &[u16],
    kicks: usize,
    what: &str,
    mut run: impl FnMut(&mut TestDriver<Net>),
) -> Vec<Used> {
    let per = heads.len().div_ceil(kicks).max(1);
    let mut used = Vec::new();
    for part in heads.chunks(per) {
        for &h in part {
            drv.publish_raw(q, h);
        }
        drv.kick(q)
            .unwrap_or_else(|e| panic!("{what}: queue {q} broke the worker: {e}"));
        run(drv);
        used.extend(drv.reap(q));
    }
    used
}

/// Asserts each used head was published and completes at most once per publication
/// (exactly once when `all`).
fn check_heads(used: &[Used], heads: &[u16], all: bool, what: &str) {
    let mut want: Vec<u32> = heads.iter().map(|&h| u32::from(h)).collect();
    for u in used {
        let i = want.iter().position(|&w| w == u.id).unwrap_or_else(|| {
            panic!(
                "{what}: head {} completed but never published, or twice",
                u.id
            )
        });
        want.remove(i);
    }
    assert!(
        !all || want.is_empty(),
        "{what}: published heads {want:?} never completed"
    );
}

fn counters(dev: &Net) -> serde_json::Value {
    dev.metrics().to_json()
}

/// Guest RAM (below the high-water mark `hw` and the top 64 KiB) and the device's counters
/// as a stage found them, to check its run against.
struct Before {
    hw: u64,
    ram: (Vec<u8>, Vec<u8>),
    counters: serde_json::Value,
}

impl Before {
    fn take(drv: &mut TestDriver<Net>) -> Self {
        let hw = drv.ram.alloc(1, 1);
        Self {
            hw,
            ram: snapshot(&drv.ram, hw),
            counters: counters(&drv.device),
        }
    }

    /// What every stage holds to: the used heads are published ones, each completed at most
    /// once (exactly once when `all`), and no byte outside `allowed` changed. Returns the
    /// counters after the run.
    fn check(
        &self,
        drv: &TestDriver<Net>,
        used: &[Used],
        heads: &[u16],
        all: bool,
        allowed: &[(u64, u64)],
        tag: &str,
    ) -> serde_json::Value {
        check_heads(used, heads, all, tag);
        assert_only_writable_changed(&drv.ram, self.hw, &self.ram, allowed, tag);
        counters(&drv.device)
    }
}

fn delta(before: &serde_json::Value, after: &serde_json::Value, names: &[&str]) -> u64 {
    names
        .iter()
        .map(|n| after[n].as_u64().unwrap() - before[n].as_u64().unwrap())
        .sum()
}

/// After a reset (and the same features again), a good frame goes out and one comes in on the
/// first pair; no bounce slot is held beyond the `used_before` the case started with.
fn check_after_reset(
    drv: &mut TestDriver<Net>,
    backends: &[MemBackend],
    pool: Option<&BouncePool>,
    acked: u64,
    qsize: u16,
    used_before: usize,
    what: &str,
) {
    let (rxq, txq) = (0u16, 1u16);
    drv.reset();
    drv.negotiate(acked);
    drv.activate(qsize).expect("reactivate");
    if let Some(p) = pool {
        assert_eq!(p.used(), used_before, "{what}: bounce slots leaked");
    }
    backends[0].state().rx.clear();
    let _ = backends[0].take_sent();
    let good = {
        let mut v = VnetHeader::default().to_bytes().to_vec();
        v.extend(payload(7, 100));
        v
    };
    let a = drv.ram.alloc_bytes(&good);
    drv.post(txq, &[Buf::ro(a, good.len() as u32)]).unwrap();
    drv.kick(txq).unwrap();
    assert_eq!(drv.reap(txq).len(), 1, "{what}: good TX");
    assert_eq!(backends[0].take_sent(), vec![good.clone()], "{what}");
    let b = drv.ram.alloc(4096, 64);
    let head = drv.post(rxq, &[Buf::wo(b, 4096)]).unwrap();
    drv.kick(rxq).unwrap();
    backends[0].inject(good.clone());
    let w = drv.owner(rxq).unwrap();
    drv.fd_event(w, TOKEN_BACKEND).unwrap();
    let used = drv.reap(rxq);
    assert_eq!(
        used,
        vec![Used {
            id: u32::from(head),
            len: good.len() as u32
        }],
        "{what}: good RX"
    );
    assert_eq!(
        drv.ram.read(b + VNET_HDR_LEN as u64, 100),
        good[VNET_HDR_LEN..],
        "{what}"
    );
    drv.reset();
    if let Some(p) = pool {
        assert_eq!(p.used(), used_before, "{what}: bounce slots leaked");
    }
}

/// Where the control stage's commands are: `cmd_bytes[i]` at `tg.hdrs[first + i]`, and a
/// 64-byte ack area at `acks`.
struct CtrlTargets<'a> {
    tg: &'a Targets,
    first: usize,
    cmd_bytes: &'a [Vec<u8>],
    acks: u64,
}

/// `len` bytes at `addr` as `n` readable descriptors of nearly equal lengths.
fn readable_pieces(addr: u64, len: u32, n: u32) -> Vec<Desc> {
    (0..n)
        .map(|j| {
            let (s, e) = (len * j / n, len * (j + 1) / n);
            Desc {
                addr: addr + u64::from(s),
                len: e - s,
                flags: 0,
                next: 0,
            }
        })
        .collect()
}

/// The control stage's chains: each a command cut in `pieces` readable descriptors followed
/// by its one-byte writable ack.
fn ctrl_chains(c: &NetCase, t: &CtrlTargets) -> Vec<Vec<Desc>> {
    c.ctrl
        .structured
        .iter()
        .flat_map(|s| s.chains.iter())
        .enumerate()
        .map(|(k, &(pieces, _))| {
            let i = k % t.cmd_bytes.len();
            let (a, len) = (t.tg.hdrs[t.first + i], t.cmd_bytes[i].len() as u32);
            let mut v = readable_pieces(a, len, u32::from(pieces).min(len).max(1));
            v.push(Desc {
                addr: t.acks + (k as u64 % 64),
                len: 1,
                flags: VRING_DESC_F_WRITE,
                next: 0,
            });
            v
        })
        .collect()
}

/// Control queue: hostile chains of commands (in pieces, each with a one-byte ack); every
/// completion is counted, the pairs in use stay in range, and untouched well-formed commands
/// get the documented ack.
fn check_ctrl(
    drv: &mut TestDriver<Net>,
    c: &NetCase,
    t: &CtrlTargets,
    ctrlq: u16,
    qsize: u16,
    kicks: usize,
    what: &str,
) {
    let pairs = u16::from(c.pairs);
    let acked = drv.acked();
    let ctrl_chains = ctrl_chains(c, t);
    let laid = write_queue(drv, ctrlq, qsize, &c.ctrl, &ctrl_chains, t.tg, &c.indirect);
    let mut allowed = laid.allowed.clone();
    allowed.push((t.acks, t.acks + 64));
    let before = Before::take(drv);
    let used = publish_and_run(drv, ctrlq, &laid.heads, kicks, what, |_| {});
    let tag = format!("{what} CTRL");
    let m1 = before.check(drv, &used, &laid.heads, true, &allowed, &tag);
    let m0 = &before.counters;
    assert_eq!(
        delta(m0, &m1, &["ctrl_ok", "ctrl_err", "ctrl_bad_chains"]),
        used.len() as u64,
        "{tag}: every completion is counted: {m1}"
    );
    assert!(used.iter().all(|u| u.len <= 1), "{tag}: {used:?}");
    let active = drv.device.active_pairs();
    assert!(
        (1..=pairs).contains(&active),
        "{tag}: {active} pairs active"
    );
    // Untouched well-formed commands get the documented ack (the last of a head
    // published twice wins; heads are distinct here).
    for (head, k) in &laid.intact {
        // The command as it is in guest RAM now: the RX stage may have written over it
        // (a writable RX descriptor may point at it).
        let i = k % c.cmds.len();
        let n = t.cmd_bytes[i].len();
        let now = drv.ram.read(t.tg.hdrs[t.first + i], n);
        let m = Cmd {
            class: now[0],
            cmd: now[1],
            data: now[2..].to_vec(),
        };
        let u = used.iter().find(|u| u.id == u32::from(*head));
        let u = u.unwrap_or_else(|| panic!("{tag}: head {head} did not complete"));
        if n > 2 + 2 * (4 + 6 * 4096) {
            // Over the command limit: refused as a bad chain, no ack.
            assert_eq!(u.len, 0, "{tag}: head {head} ({} bytes)", n);
            continue;
        }
        let want = match (m.class, m.cmd) {
            (VIRTIO_NET_CTRL_RX, 0..=5) if m.data.len() == 1 => VIRTIO_NET_OK,
            (VIRTIO_NET_CTRL_MAC, 0) => VIRTIO_NET_OK,
            (VIRTIO_NET_CTRL_MQ, 0)
                if acked & feature(VIRTIO_NET_F_MQ) != 0 && m.data.len() == 2 =>
            {
                let p = u16::from_le_bytes([m.data[0], m.data[1]]);
                if (1..=pairs).contains(&p) {
                    VIRTIO_NET_OK
                } else {
                    VIRTIO_NET_ERR
                }
            }
            _ => VIRTIO_NET_ERR,
        };
        assert_eq!(u.len, 1, "{tag}: head {head} ({m:?})");
        assert_eq!(
            drv.ram.read(t.acks + (*k as u64 % 64), 1)[0],
            want,
            "{tag}: ack of {m:?}"
        );
    }
}

/// How many times each stage kicks its queue (1 to 3).
fn kicks(c: &NetCase) -> usize {
    1 + usize::from(c.kicks % 3)
}

/// TX: hostile chains of header + frame in pieces; every completion is a frame sent or a
/// counted drop, only frames with an acceptable header reach `backend`, and untouched
/// well-formed chains are sent.
fn check_tx(
    drv: &mut TestDriver<Net>,
    c: &NetCase,
    tg: &Targets,
    tx_frames: &[Vec<u8>],
    backend: &MemBackend,
    qsize: u16,
    what: &str,
) {
    let txq = 1u16;
    let acked = drv.acked();
    let kicks = kicks(c);
    let tx_chains: Vec<Vec<Desc>> =
        c.tx.structured
            .iter()
            .flat_map(|s| s.chains.iter())
            .enumerate()
            .map(|(k, &(pieces, _))| {
                let f = k % tx_frames.len();
                let (a, len) = (tg.hdrs[f], tx_frames[f].len() as u32);
                readable_pieces(a, len, u32::from(pieces).min(len))
            })
            .collect();
    let laid = write_queue(drv, txq, qsize, &c.tx, &tx_chains, tg, &c.indirect);
    let tx_allowed = rings(drv, txq);
    let before = Before::take(drv);
    let used = publish_and_run(drv, txq, &laid.heads, kicks, what, |_| {});
    let tag = format!("{what} TX");
    let m1 = before.check(drv, &used, &laid.heads, true, &tx_allowed, &tag);
    let m0 = &before.counters;
    assert!(used.iter().all(|u| u.len == 0), "{tag}: {used:?}");
    let sent = backend.take_sent();
    assert_eq!(delta(m0, &m1, &["tx_frames"]), sent.len() as u64, "{tag}");
    assert_eq!(
        delta(
            m0,
            &m1,
            &[
                "tx_frames",
                "tx_dropped_oversized",
                "tx_dropped_malformed",
                "tx_dropped_bad_header",
                "tx_dropped_backend",
                "tx_bounce_failures"
            ]
        ),
        used.len() as u64,
        "{tag}: every completion is a frame sent or a counted drop: {m1}"
    );
    for f in &sent {
        assert!(
            (VNET_HDR_LEN + MIN_FRAME_LEN..=MAX_BUFFER_LEN).contains(&f.len()),
            "{tag}: a {}-byte frame reached the backend",
            f.len()
        );
        let h = VnetHeader::from_bytes(f[..VNET_HDR_LEN].try_into().unwrap());
        assert_eq!(h.num_buffers, 0, "{tag}");
        h.check_tx(acked, f.len() - VNET_HDR_LEN)
            .unwrap_or_else(|e| panic!("{tag}: a frame with a bad header was sent: {e}"));
    }
    for (head, k) in &laid.intact {
        // An untouched well-formed chain: sent as is if its header is acceptable.
        let f = &tx_frames[k % tx_frames.len()];
        let h = VnetHeader::from_bytes(f[..VNET_HDR_LEN].try_into().unwrap());
        let good = f.len() >= VNET_HDR_LEN + MIN_FRAME_LEN
            && h.check_tx(acked, f.len() - VNET_HDR_LEN).is_ok();
        let found = sent.iter().any(|s| s[VNET_HDR_LEN..] == f[VNET_HDR_LEN..]);
        assert!(
            !good || found,
            "{tag}: the well-formed frame of head {head} was not sent"
        );
    }
}

fn run_case(c: &NetCase) {
    let (dname, dma, pool) = dma_for(c.bounce);
    let qsize = 1u16 << (1 + c.qsize_log2 % 4); // 2..16
    let pairs = u16::from(c.pairs);
    let backends: Vec<MemBackend> = (0..pairs).map(|_| MemBackend::new().unwrap()).collect();
    let config = NetConfig {
        queue_pairs: pairs,
        ..NetConfig::default()
    };
    let dev = Net::new(
        config,
        backends
            .iter()
            .map(|b| Box::new(b.clone()) as Box<dyn NetBackend>)
            .collect(),
        dma,
    )
    .expect("device");
    let mut drv = TestDriver::new(dev, RAM);
    let drop: u64 = DROPPABLE
        .iter()
        .enumerate()
        .filter(|&(i, _)| c.drop & (1 << i) != 0)
        .map(|(_, &f)| f)
        .sum();
    drv.negotiate(!drop);
    if drv.activate(qsize).is_err() {
        // A feature set the device refuses (e.g. GUEST_TSO4 without GUEST_CSUM): a driver
        // would fail FEATURES_OK; carry on with every feature.
        drv.reset();
        drv.negotiate(u64::MAX);
        drv.activate(qsize).expect("activate with every feature");
    }
    let acked = drv.acked();
    let what = format!("{dname} qsize={qsize} pairs={pairs} acked={acked:#x}");
    let used_before = pool.as_ref().map_or(0, |p| p.used());
    // The control queue follows the pairs in use: queue 2 without MQ (virtio 1.2 5.1.2).
    let ctrlq = if acked & feature(VIRTIO_NET_F_MQ) != 0 {
        2 * pairs
    } else {
        2
    };
    let rxq = 0u16;
    let ctrl = acked & feature(VIRTIO_NET_F_CTRL_VQ) != 0;

    // Targets: TX headers (each followed by its frame), control commands, then the rest.
    let tx_frames: Vec<Vec<u8>> = c
        .tx_hdrs
        .iter()
        .map(|(h, n)| {
            let mut v = h.to_bytes().to_vec();
            v.extend(payload(*n, usize::from(*n % 2048)));
            v
        })
        .collect();
    let cmd_bytes: Vec<Vec<u8>> = c
        .cmds
        .iter()
        .map(|m| {
            let mut v = vec![m.class, m.cmd];
            v.extend_from_slice(&m.data);
            v
        })
        .collect();
    let mut hdrs: Vec<u64> = tx_frames.iter().map(|f| drv.ram.alloc_bytes(f)).collect();
    hdrs.extend(cmd_bytes.iter().map(|b| drv.ram.alloc_bytes(b)));
    let tg = Targets::new(&mut drv.ram, hdrs, c.indirect.len());
    tg.write_table(&drv.ram, &c.indirect);
    let acks = drv.ram.alloc(64, 1);
    canary(&drv.ram, acks, 64);
    let kicks = kicks(c);

    check_tx(&mut drv, c, &tg, &tx_frames, &backends[0], qsize, &what);

    // ---- RX: writable buffers of awkward sizes; frames injected.
    let sizes = [1u32, 11, 12, 13, 64, 1526, 4096, 65_562];
    let rx_lens: Vec<Vec<u32>> =
        c.rx.structured
            .iter()
            .flat_map(|s| s.chains.iter())
            .map(|&(pieces, sel)| {
                (0..pieces)
                    .map(|i| sizes[usize::from(sel.rotate_right(3 * u32::from(i))) % sizes.len()])
                    .collect()
            })
            .collect();
    let total: u64 = rx_lens
        .iter()
        .flatten()
        .map(|&l| u64::from(l).next_multiple_of(64))
        .sum();
    let rx_area = drv.ram.alloc(total, 4096);
    canary(&drv.ram, rx_area, total);
    let mut next = rx_area;
    let rx_chains: Vec<Vec<Desc>> = rx_lens
        .iter()
        .map(|lens| {
            lens.iter()
                .map(|&len| {
                    let a = next;
                    next += u64::from(len).next_multiple_of(64);
                    Desc {
                        addr: a,
                        len,
                        flags: VRING_DESC_F_WRITE,
                        next: 0,
                    }
                })
                .collect()
        })
        .collect();
    let laid = write_queue(&drv, rxq, qsize, &c.rx, &rx_chains, &tg, &c.indirect);
    let before = Before::take(&mut drv);
    let frames: Vec<Vec<u8>> = c
        .rx_frames
        .iter()
        .enumerate()
        .map(|(i, (h, sel, raw))| {
            let n = rx_len(*sel, *raw);
            let mut v = h.to_bytes().to_vec();
            v.extend(payload(i as u16, n.saturating_sub(VNET_HDR_LEN)));
            v.truncate(n);
            v
        })
        .collect();
    let w = drv.owner(rxq).expect("RX has a worker");
    let per = frames.len().div_ceil(kicks).max(1);
    let mut chunks = frames.chunks(per);
    let used = publish_and_run(&mut drv, rxq, &laid.heads, kicks, &what, |drv| {
        for f in chunks.next().unwrap_or_default() {
            backends[0].inject(f.clone());
        }
        drv.fd_event(w, TOKEN_BACKEND)
            .unwrap_or_else(|e| panic!("RX fd event broke the worker: {e}"));
    });
    for f in chunks.flatten() {
        backends[0].inject(f.clone());
    }
    drv.fd_event(w, TOKEN_BACKEND)
        .unwrap_or_else(|e| panic!("{what}: RX fd event broke the worker: {e}"));
    let mut used = used;
    used.extend(drv.reap(rxq));
    let tag = format!("{what} RX");
    let m1 = before.check(&drv, &used, &laid.heads, false, &laid.allowed, &tag);
    let m0 = &before.counters;
    for u in &used {
        assert!(
            u64::from(u.len) <= laid.writable_bytes,
            "{tag}: used.len {} of head {} exceeds the {} writable bytes offered",
            u.len,
            u.id,
            laid.writable_bytes
        );
    }
    assert_eq!(
        delta(
            m0,
            &m1,
            &[
                "rx_bad_chains",
                "rx_buffers_used",
                "rx_chains_returned_empty"
            ]
        ),
        used.len() as u64,
        "{tag}: every completion is a bad chain, a buffer of a delivered frame or a held chain \
         that could not go back on the ring: {m1}"
    );
    let accounted = delta(
        m0,
        &m1,
        &[
            "rx_frames",
            "rx_dropped_too_small",
            "rx_dropped_malformed",
            "rx_bounce_failures",
        ],
    ) + backends[0].state().rx.len() as u64;
    assert!(
        accounted == frames.len() as u64 || accounted + 1 == frames.len() as u64,
        "{tag}: {} frames injected, {accounted} delivered, dropped or waiting \
         (one may be held by the worker): {m1}",
        frames.len()
    );
    for u in used.iter().filter(|u| u.len > 0) {
        if acked & feature(VIRTIO_NET_F_MRG_RXBUF) == 0 {
            assert!(
                u.len as usize >= VNET_HDR_LEN + MIN_FRAME_LEN,
                "{tag}: {u:?}"
            );
        }
    }

    if ctrl {
        let t = CtrlTargets {
            tg: &tg,
            first: tx_frames.len(),
            cmd_bytes: &cmd_bytes,
            acks,
        };
        check_ctrl(&mut drv, c, &t, ctrlq, qsize, kicks, &what);
    }

    check_after_reset(
        &mut drv,
        &backends,
        pool.as_deref(),
        acked,
        qsize,
        used_before,
        &what,
    );
}

proptest! {
    #![proptest_config(bounce::testing::fuzz_config(512))]
    #[test]
    fn hostile_tx_rx_and_control_chains(c in net_case()) {
        run_case(&c);
    }
}
