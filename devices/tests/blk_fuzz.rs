//! Property test: random descriptor tables and heads never make the device panic, touch
//! memory outside the guest, leak bounce slots or lose a head; every published head is
//! completed exactly once, and a good request works afterwards.

mod common;

use bounce::{Dma, Policy, PoolConfig};
use common::*;
use devices::block::{BlockConfig, MemDisk};
use devices::testing::{first_fit_pool, RawDesc};
use proptest::prelude::*;

const QSIZE: u16 = 16;

#[derive(Clone, Debug)]
struct FuzzDesc {
    addr: u8,
    off: u16,
    len: u8,
    raw_len: u32,
    flags: u16,
    next: u16,
}

fn fuzz_desc() -> impl Strategy<Value = FuzzDesc> {
    (
        any::<u8>(),
        any::<u16>(),
        any::<u8>(),
        any::<u32>(),
        0u16..8,
        0u16..20,
    )
        .prop_map(|(addr, off, len, raw_len, flags, next)| FuzzDesc {
            addr,
            off,
            len,
            raw_len,
            flags,
            next,
        })
}

#[derive(Clone, Debug)]
struct Case {
    table: Vec<FuzzDesc>,
    indirect: Vec<FuzzDesc>,
    headers: Vec<(u32, u64)>,
    heads: Vec<u16>,
    /// 0: off; 1: forced swiotlb, first-fit; 2: forced swiotlb, areas; 3: forced iova, iova-rcache.
    bounce: u8,
    /// Well-formed chains of these lengths instead of random tables, then `mutations` applied.
    structured: Option<Vec<u8>>,
    mutations: Vec<(u8, u8, FuzzDesc)>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(fuzz_desc(), QSIZE as usize),
        prop::collection::vec(fuzz_desc(), 1..24),
        prop::collection::vec(
            (
                prop_oneof![
                    Just(0u32),
                    Just(1),
                    Just(4),
                    Just(8),
                    Just(11),
                    Just(13),
                    any::<u32>()
                ],
                prop_oneof![0u64..64, Just(u64::MAX), any::<u64>()],
            ),
            4,
        ),
        prop::collection::vec(0..QSIZE, 1..=QSIZE as usize),
        0u8..4,
        prop::option::of(prop::collection::vec(2u8..6, 1..6)),
        prop::collection::vec((any::<u8>(), 0u8..5, fuzz_desc()), 0..3),
    )
        .prop_map(
            |(table, indirect, headers, heads, bounce, structured, mutations)| Case {
                table,
                indirect,
                headers,
                heads,
                bounce,
                structured,
                mutations,
            },
        )
}

fn run_case(c: &Case) {
    let pool = match c.bounce {
        0 => None,
        1 => Some(first_fit_pool(&PoolConfig::swiotlb(256))),
        2 => {
            let mut cfg = PoolConfig::swiotlb(256);
            cfg.allocator = bounce::AllocatorKind::Areas;
            bounce::BouncePool::new(&cfg).ok().map(std::sync::Arc::new)
        }
        _ => bounce::BouncePool::new(&PoolConfig::iova(128))
            .ok()
            .map(std::sync::Arc::new),
    };
    let dma = match &pool {
        Some(p) => Dma::bounced(Policy::Force, p.clone()),
        None => Dma::direct(),
    };
    let cfg = BlockConfig {
        queue_size: QSIZE,
        ..BlockConfig::default()
    };
    let mut blk = Blk::new(MemDisk::new(1 << 20).unwrap(), cfg, dma, 0);
    let end = blk.drv.ram.size();
    // Areas the descriptors may point at: headers, a data area, the indirect table, the end of
    // RAM, outside RAM, the top of the address space.
    let hdrs: Vec<u64> = c
        .headers
        .iter()
        .map(|&(t, s)| blk.drv.ram.alloc_bytes(&header(t, s)))
        .collect();
    let data = blk.drv.ram.alloc(64 << 10, 4096);
    let table = blk.drv.ram.alloc(16 * c.indirect.len() as u64, 16);
    let resolve = |f: &FuzzDesc| -> (u64, u32) {
        let len = match f.len % 8 {
            0 => 0,
            1 => 1,
            2 => 16,
            3 => 512,
            4 => 4096,
            5 => 16 * c.indirect.len() as u32,
            6 => u32::from(f.off),
            _ => f.raw_len,
        };
        let addr = match f.addr % 8 {
            0 | 1 => hdrs[usize::from(f.addr / 8) % hdrs.len()],
            2 | 3 => data + u64::from(f.off % 0x8000),
            4 => table,
            5 => end - u64::from(f.off % 4096),
            6 => end + u64::from(f.off),
            _ => u64::MAX - u64::from(f.off),
        };
        (addr, len)
    };
    for (i, f) in c.indirect.iter().enumerate() {
        let (addr, len) = resolve(f);
        let mut e = [0u8; 16];
        e[0..8].copy_from_slice(&addr.to_le_bytes());
        e[8..12].copy_from_slice(&len.to_le_bytes());
        e[12..14].copy_from_slice(&f.flags.to_le_bytes());
        e[14..16].copy_from_slice(&f.next.to_le_bytes());
        blk.drv.ram.write(table + 16 * i as u64, &e);
    }
    let status_area = blk.drv.ram.alloc(64, 1);
    let mut descs: Vec<RawDesc> = Vec::new();
    let mut heads = c.heads.clone();
    if let Some(chains) = &c.structured {
        // Well-formed requests: header, data (direction by type), status.
        heads.clear();
        for (k, &n) in chains.iter().enumerate() {
            let start = descs.len() as u16;
            if start + u16::from(n) > QSIZE {
                break;
            }
            heads.push(start);
            let (t, _) = c.headers[k % c.headers.len()];
            let w = if t == 1 || t == 11 || t == 13 { 0 } else { 2 };
            for j in 0..n {
                let last = j + 1 == n;
                let next = descs.len() as u16 + 1;
                descs.push(if j == 0 {
                    RawDesc {
                        addr: hdrs[k % hdrs.len()],
                        len: 16,
                        flags: 1,
                        next,
                    }
                } else if last {
                    RawDesc {
                        addr: status_area + k as u64,
                        len: 1,
                        flags: 2,
                        next: 0,
                    }
                } else {
                    RawDesc {
                        addr: data + 4096 * u64::from(j),
                        len: 512 * u32::from(j),
                        flags: 1 | w,
                        next,
                    }
                });
            }
        }
        for (idx, field, f) in &c.mutations {
            let Some(d) = descs.get_mut(usize::from(*idx) % QSIZE as usize) else {
                continue;
            };
            let (addr, len) = resolve(f);
            match field {
                0 => d.addr = addr,
                1 => d.len = len,
                2 => d.flags = f.flags,
                3 => d.next = f.next,
                _ => {
                    *d = RawDesc {
                        addr,
                        len,
                        flags: f.flags,
                        next: f.next,
                    }
                }
            }
        }
        if heads.is_empty() {
            heads.push(0);
        }
    }
    for (i, f) in c.table.iter().enumerate() {
        let (addr, len) = resolve(f);
        if let Some(d) = descs.get(i) {
            blk.drv.vqs[0].write_desc(&blk.drv.ram, i as u16, *d);
            continue;
        }
        blk.drv.vqs[0].write_desc(
            &blk.drv.ram,
            i as u16,
            RawDesc {
                addr,
                len,
                flags: f.flags,
                next: f.next,
            },
        );
    }
    for &h in &heads {
        blk.drv.publish_raw(0, h);
    }
    // A chain whose status byte cannot be found breaks the device (DEVICE_NEEDS_RESET)
    // instead of completing silently; every completion carries a status byte.
    let kicked = blk.drv.kick(0);
    let used = blk.drv.reap(0);
    assert!(
        used.iter().all(|u| u.len >= 1),
        "a completion without a status byte: {used:?}"
    );
    let mut got: Vec<u32> = used.iter().map(|u| u.id).collect();
    let mut want: Vec<u32> = heads.iter().map(|&h| u32::from(h)).collect();
    got.sort_unstable();
    want.sort_unstable();
    if kicked.is_ok() {
        assert_eq!(got, want, "every published head completes exactly once");
    } else {
        for g in &got {
            let i = want
                .iter()
                .position(|w| w == g)
                .expect("completed a head never published");
            want.remove(i);
        }
        blk.drv.reset();
        blk.drv
            .activate(QSIZE)
            .expect("reactivate after NEEDS_RESET");
    }
    if let Some(p) = &pool {
        assert_eq!(p.used(), 0, "bounce slots leaked");
    }
    // The device still serves a good request.
    blk.drv
        .device
        .disk()
        .write_bytes(0, &pattern(1, 4096))
        .unwrap();
    let r = blk.read(0, 4096, Layout::Split(2));
    ok(&r);
    assert_eq!(r.data, pattern(1, 4096));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
    #[test]
    fn random_chains_never_panic_and_complete_once(c in case()) {
        run_case(&c);
    }
}
