//! The engines, driven directly: completion order, every cache mode, O_DIRECT alignment,
//! errors.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::io::Write;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::*;
use crate::testing::{gate_disk, SocketDisk};

/// Test memory for buffers: a page-aligned heap block cut into pieces at chosen offsets.
struct Arena(AlignedBuf, usize);

impl Arena {
    fn new(len: usize) -> Self {
        Self(AlignedBuf::new(len, 4096).unwrap(), len)
    }
    fn buf(&self, off: usize, len: usize) -> IoBuf {
        assert!(off + len <= self.1);
        // SAFETY-free: only an address computation inside the arena.
        IoBuf::new(self.0.io_buf().ptr().wrapping_add(off), len)
    }
    fn fill(&self, off: usize, data: &[u8]) {
        let s = unsafe { self.0.io_buf().as_volatile() };
        s.subslice(off, data.len()).unwrap().copy_from(data);
    }
    fn get(&self, off: usize, len: usize) -> Vec<u8> {
        let s = unsafe { self.0.io_buf().as_volatile() };
        let mut v = vec![0; len];
        s.subslice(off, len).unwrap().copy_to(&mut v);
        v
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8)
        .collect()
}

/// Submits every op, kicks once, and reaps until all completed; returns the completions in
/// the order they were reaped.
fn run_all(engine: &mut dyn IoEngine, ops: Vec<(Tag, IoOp)>) -> Vec<IoDone> {
    let n = ops.len();
    for (tag, op) in ops {
        // The arenas outlive the engine calls of every test.
        unsafe { engine.submit(tag, op) };
    }
    engine.kick();
    let mut out = Vec::new();
    while out.len() < n {
        engine.reap(&mut out);
        if out.len() < n {
            engine.wait();
        }
    }
    assert_eq!(engine.in_flight(), 0);
    out
}

/// Runs one op to completion and returns the bytes it transferred (panics if it failed).
fn run_one(engine: &mut dyn IoEngine, op: IoOp) -> u64 {
    ok(&run_all(engine, vec![(0, op)]), 0)
}

fn ok(done: &[IoDone], tag: Tag) -> u64 {
    let d = done.iter().find(|d| d.tag == tag).expect("completion");
    match &d.result {
        Ok(n) => *n,
        Err(e) => panic!("op {tag} failed: {e}"),
    }
}

fn image(dir: &Path, len: u64) -> std::path::PathBuf {
    let p = dir.join("disk.raw");
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(len).unwrap();
    p
}

fn engines_for(disk: &Arc<RawDisk>) -> Vec<Box<dyn IoEngine>> {
    AioMode::ALL
        .into_iter()
        .map(|m| new_engine(Some(m), disk, 64, None).unwrap())
        .collect()
}

const DISK: u64 = 1 << 20;

/// 64 writes of 4 KiB submitted at once, then 64 reads of them, verified byte for byte,
/// for every engine and every cache mode (O_DIRECT ones with aligned buffers: nothing
/// bounced).
#[test]
fn depth_write_then_read_verifies_for_every_engine_and_cache_mode() {
    for cache in CacheMode::ALL {
        let dir = tempfile::tempdir().unwrap();
        let path = image(dir.path(), DISK);
        let disk = Arc::new(RawDisk::open_with(&path, false, cache).unwrap());
        assert_eq!(disk.direct_align().is_some(), cache.direct(), "{cache}");
        for mut e in engines_for(&disk) {
            let arena = Arena::new(64 * 4096 * 2);
            let mut writes = Vec::new();
            for i in 0..64u64 {
                let data = pattern(i + e.name().len() as u64, 4096);
                arena.fill(i as usize * 4096, &data);
                writes.push((
                    i,
                    IoOp::Write {
                        offset: ((i * 37) % 256) * 4096,
                        bufs: smallvec::smallvec![arena.buf(i as usize * 4096, 4096)],
                        fua: !cache.write_cache(),
                    },
                ));
            }
            let done = run_all(&mut *e, writes);
            for i in 0..64 {
                assert_eq!(ok(&done, i), 4096);
            }
            let base = 64 * 4096;
            let reads = (0..64u64)
                .map(|i| {
                    (
                        100 + i,
                        IoOp::Read {
                            offset: ((i * 37) % 256) * 4096,
                            bufs: smallvec::smallvec![arena.buf(base + i as usize * 4096, 4096)],
                        },
                    )
                })
                .collect();
            let done = run_all(&mut *e, reads);
            for i in 0..64u64 {
                assert_eq!(ok(&done, 100 + i), 4096);
                assert_eq!(
                    arena.get(base + i as usize * 4096, 4096),
                    pattern(i + e.name().len() as u64, 4096),
                    "{cache} {} op {i}",
                    e.name()
                );
            }
            assert_eq!(e.stats().dio_bounced.load(Ordering::Relaxed), 0);
            assert_eq!(e.stats().completed.load(Ordering::Relaxed), 128);
        }
    }
}

/// Scatter-gather pieces at odd addresses and odd lengths under O_DIRECT go through the
/// engine's aligned bounce buffer (counted) and still read and write the right bytes; the
/// same with the page cache needs no bounce.
#[test]
fn unaligned_buffers_are_bounced_only_with_o_direct() {
    for cache in [CacheMode::None, CacheMode::DirectSync, CacheMode::Writeback] {
        let dir = tempfile::tempdir().unwrap();
        let path = image(dir.path(), DISK);
        let disk = Arc::new(RawDisk::open_with(&path, false, cache).unwrap());
        for mut e in engines_for(&disk) {
            let arena = Arena::new(64 * 1024);
            let data = pattern(9, 8192);
            // 8 KiB as three pieces: 1000 bytes at offset 3, 5000 at 2000, 2192 at 9001.
            let pieces = [(3usize, 1000usize), (2000, 5000), (9001, 2192)];
            let mut at = 0;
            for (off, len) in pieces {
                arena.fill(off, &data[at..at + len]);
                at += len;
            }
            let bufs: Vec<IoBuf> = pieces.iter().map(|&(o, l)| arena.buf(o, l)).collect();
            assert_eq!(
                run_one(
                    &mut *e,
                    IoOp::Write {
                        offset: 8192,
                        bufs: bufs.iter().copied().collect(),
                        fua: false,
                    }
                ),
                8192
            );
            // Read back into other odd pieces.
            let rpieces = [(20001usize, 4095usize), (30001, 4097)];
            let rbufs: Vec<IoBuf> = rpieces.iter().map(|&(o, l)| arena.buf(o, l)).collect();
            assert_eq!(
                run_one(
                    &mut *e,
                    IoOp::Read {
                        offset: 8192,
                        bufs: rbufs.iter().copied().collect(),
                    }
                ),
                8192
            );
            let mut got = arena.get(20001, 4095);
            got.extend(arena.get(30001, 4097));
            assert_eq!(got, data, "{cache} {}", e.name());
            let bounced = e.stats().dio_bounced.load(Ordering::Relaxed);
            assert_eq!(bounced, if cache.direct() { 2 } else { 0 }, "{cache}");
        }
        // The bytes really are in the file.
        let mut f = std::fs::read(&path).unwrap();
        f.truncate(16384);
        assert_eq!(&f[8192..], &pattern(9, 8192)[..]);
    }
}

/// FUA writes, flushes, discards and write-zeroes through every engine.
#[test]
fn flush_discard_and_write_zeroes_for_every_engine() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), DISK);
    let disk = Arc::new(RawDisk::open_with(&path, false, CacheMode::None).unwrap());
    for mut e in engines_for(&disk) {
        let arena = Arena::new(3 * 65536);
        arena.fill(0, &[0xAB; 3 * 65536]);
        assert_eq!(
            run_one(
                &mut *e,
                IoOp::Write {
                    offset: 0,
                    bufs: smallvec::smallvec![arena.buf(0, 3 * 65536)],
                    fua: true,
                }
            ),
            3 * 65536
        );
        let r = |offset, len, unmap| Range { offset, len, unmap };
        let done = run_all(
            &mut *e,
            vec![
                (2, IoOp::Flush),
                (
                    3,
                    IoOp::Discard {
                        ranges: vec![r(0, 4096, false)],
                        fua: false,
                    },
                ),
                (
                    4,
                    IoOp::WriteZeroes {
                        ranges: vec![r(65536, 4096, false), r(131072, 8192, true)],
                        fua: true,
                    },
                ),
                (
                    5,
                    IoOp::Discard {
                        ranges: vec![],
                        fua: true,
                    },
                ),
            ],
        );
        for t in 2..=5 {
            ok(&done, t);
        }
        let f = std::fs::read(&path).unwrap();
        assert!(
            f[65536..65536 + 4096].iter().all(|&b| b == 0),
            "{}",
            e.name()
        );
        assert!(f[131072..131072 + 8192].iter().all(|&b| b == 0));
        assert!(f[65536 + 4096..131072].iter().all(|&b| b == 0xAB));
        // tmpfs and ext4 punch holes: the discarded range reads as zeros.
        assert!(f[..4096].iter().all(|&b| b == 0));
    }
}

/// Host errors come back as completions: a write to a read-only file (EBADF), a read past
/// the end (short), io_uring on a disk without a file.
#[test]
fn errors_are_completions() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), 8192);
    let disk = Arc::new(RawDisk::open_with(&path, true, CacheMode::Writeback).unwrap());
    for m in AioMode::ALL {
        let mut e = new_engine(Some(m), &disk, 8, None).unwrap();
        let arena = Arena::new(16384);
        let done = run_all(
            &mut *e,
            vec![
                (
                    1,
                    IoOp::Write {
                        offset: 0,
                        bufs: smallvec::smallvec![arena.buf(0, 4096)],
                        fua: false,
                    },
                ),
                (
                    2,
                    IoOp::Read {
                        offset: 4096,
                        bufs: smallvec::smallvec![arena.buf(4096, 4096), arena.buf(8192, 4096)],
                    },
                ),
            ],
        );
        let w = done.iter().find(|d| d.tag == 1).unwrap();
        assert!(
            w.result.is_err(),
            "{m}: write to a read-only file succeeded"
        );
        assert_eq!(ok(&done, 2), 4096, "{m}: read past the end is short");
    }
    let mem = Arc::new(MemDisk::new(4096).unwrap());
    let err = new_engine(Some(AioMode::IoUring), &mem, 8, None).unwrap_err();
    assert!(err.to_string().contains("io_uring"), "{err}");
    // The default for a memory disk (which never blocks) is the synchronous path.
    assert_eq!(new_engine(None, &mem, 8, None).unwrap().name(), "sync");
    let raw = Arc::new(RawDisk::open(&path, true).unwrap());
    assert_eq!(new_engine(None, &raw, 8, None).unwrap().name(), "io_uring");
}

/// A file system that refuses O_DIRECT gets one line naming the flag and the mode, and no
/// fallback: procfs is one on every Linux (this kernel's tmpfs accepts O_DIRECT).
#[test]
fn o_direct_refused_is_a_clear_error() {
    for cache in [CacheMode::None, CacheMode::DirectSync] {
        let err = RawDisk::open_with(Path::new("/proc/self/status"), true, cache).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("O_DIRECT"), "{msg}");
        assert!(msg.contains(&format!("cache={cache}")), "{msg}");
        assert!(!msg.contains('\n'));
        let err = DiskImage::open_with(
            Path::new("/proc/self/status"),
            ImageFormat::Raw,
            true,
            cache,
        )
        .unwrap_err();
        assert!(err.to_string().contains("O_DIRECT"));
    }
    // Without O_DIRECT the open itself succeeds (whatever happens next is another error).
    if let Err(e) = RawDisk::open_with(Path::new("/proc/self/status"), true, CacheMode::Writeback) {
        assert!(!e.to_string().contains("O_DIRECT"), "{e}");
    }
    // The mapping itself, with an injected EINVAL.
    let e = direct_io_refused(
        Path::new("/x.img"),
        CacheMode::None,
        &std::io::Error::from_raw_os_error(libc::EINVAL),
    );
    assert!(e
        .to_string()
        .starts_with("/x.img: cannot open with O_DIRECT (cache=none)"));
}

/// The thread pool completes a later op first when an earlier one is slow: the read of
/// sector 0 is held until the seven ops after it have been reaped.
#[test]
fn thread_pool_completes_out_of_order() {
    let (disk, tx) = gate_disk(MemDisk::new(DISK).unwrap());
    let disk = Arc::new(disk);
    disk.inner.write_bytes(0, &pattern(1, 4096)).unwrap();
    let mut e = ThreadEngine::new(Arc::clone(&disk), 8).unwrap();
    let arena = Arena::new(8 * 4096);
    for i in 0..8u64 {
        unsafe {
            e.submit(
                i,
                IoOp::Read {
                    offset: i * 4096,
                    bufs: smallvec::smallvec![arena.buf(i as usize * 4096, 4096)],
                },
            )
        };
    }
    e.kick();
    let mut out = Vec::new();
    while out.len() < 7 {
        e.wait();
        e.reap(&mut out);
    }
    assert!(out.iter().all(|d| d.tag != 0), "op 0 completed while held");
    assert_eq!(e.in_flight(), 1);
    tx.send(()).unwrap();
    while out.len() < 8 {
        e.wait();
        e.reap(&mut out);
    }
    assert_eq!(out.last().unwrap().tag, 0);
    assert_eq!(arena.get(0, 4096), pattern(1, 4096));
}

/// io_uring reports completions as the kernel posts them: a read that waits for data
/// completes after a write submitted behind it in the same batch; its eventfd fired.
#[test]
fn io_uring_completes_out_of_order_and_raises_its_eventfd() {
    let (ours, mut peer) = std::os::unix::net::UnixStream::pair().unwrap();
    let disk = Arc::new(SocketDisk(ours));
    let mut e = UringEngine::new(disk, 8, None).unwrap();
    let fd = e.notifier().unwrap();
    let arena = Arena::new(8192);
    arena.fill(4096, &pattern(5, 512));
    unsafe {
        e.submit(
            1,
            IoOp::Read {
                offset: 0,
                bufs: smallvec::smallvec![arena.buf(0, 512)],
            },
        );
        e.submit(
            2,
            IoOp::Write {
                offset: 0,
                bufs: smallvec::smallvec![arena.buf(4096, 512)],
                fua: false,
            },
        );
    }
    e.kick();
    let mut out = Vec::new();
    while out.is_empty() {
        e.wait();
        e.reap(&mut out);
    }
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].tag, 2, "the later write completes first");
    assert_eq!(e.in_flight(), 1);
    let mut got = [0u8; 512];
    std::io::Read::read_exact(&mut peer, &mut got).unwrap();
    assert_eq!(&got[..], &pattern(5, 512)[..]);
    peer.write_all(&pattern(6, 512)).unwrap();
    // The eventfd becomes readable for the read's completion.
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let r = unsafe { libc::poll(&mut pfd, 1, 10_000) };
    assert_eq!(r, 1, "eventfd not raised");
    e.reap(&mut out);
    assert_eq!(out.len(), 2);
    assert_eq!(out[1].tag, 1);
    assert_eq!(ok(&out, 1), 512);
    assert_eq!(arena.get(0, 512), pattern(6, 512));
}

/// A read of more pieces than one readv takes (IOV_MAX) is split and still lands right.
#[test]
fn io_uring_splits_more_than_iov_max_pieces() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), DISK);
    std::fs::write(&path, pattern(3, DISK as usize)).unwrap();
    let disk = Arc::new(RawDisk::open(&path, true).unwrap());
    let mut e = UringEngine::new(disk, 8, None).unwrap();
    let arena = Arena::new(3000 * 64);
    let bufs = (0..3000).map(|i| arena.buf(i * 64, 64)).collect();
    assert_eq!(run_one(&mut e, IoOp::Read { offset: 512, bufs }), 3000 * 64);
    assert_eq!(
        arena.get(0, 3000 * 64),
        pattern(3, DISK as usize)[512..512 + 3000 * 64]
    );
}

/// May this process pin `bytes` more (root, or a memlock limit that covers them)? io_uring
/// accounts fixed buffers there.
fn may_pin(bytes: u64) -> bool {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } == 0;
    let root = unsafe { libc::geteuid() } == 0;
    root || (ok && lim.rlim_cur >= bytes)
}

/// A one-piece read or write inside the registered region is a fixed-buffer op (counted);
/// pieces outside it and multi-piece ops take the plain ops; every byte lands right, with and
/// without O_DIRECT.
#[test]
fn io_uring_uses_fixed_buffers_inside_the_registered_region() {
    for cache in [CacheMode::Writeback, CacheMode::None] {
        let dir = tempfile::tempdir().unwrap();
        let path = image(dir.path(), DISK);
        let disk = Arc::new(RawDisk::open_with(&path, false, cache).unwrap());
        // Declared before the engine, so it outlives it.
        let pool = Arena::new(64 * 4096);
        let other = Arena::new(8 * 4096);
        let region = unsafe { FixedRegion::new(pool.buf(0, 0).ptr(), 64 * 4096, Arc::new(())) };
        let mut e = new_engine(Some(AioMode::IoUring), &disk, 64, Some(&region)).unwrap();
        let registered = e.stats().fixed_regions.load(Ordering::Relaxed);
        if may_pin(64 * 4096) {
            assert_eq!(registered, 1, "{cache}: the region was not registered");
        }
        let mut writes = Vec::new();
        for i in 0..16u64 {
            pool.fill(i as usize * 4096, &pattern(i, 4096));
            writes.push((
                i,
                IoOp::Write {
                    offset: i * 4096,
                    bufs: smallvec::smallvec![pool.buf(i as usize * 4096, 4096)],
                    fua: false,
                },
            ));
        }
        // One piece outside the region, and two pieces inside it (a writev).
        other.fill(0, &pattern(100, 4096));
        writes.push((
            100,
            IoOp::Write {
                offset: 16 * 4096,
                bufs: smallvec::smallvec![other.buf(0, 4096)],
                fua: false,
            },
        ));
        writes.push((
            101,
            IoOp::Write {
                offset: 17 * 4096,
                bufs: smallvec::smallvec![pool.buf(0, 4096), pool.buf(4096, 4096)],
                fua: false,
            },
        ));
        let done = run_all(&mut *e, writes);
        for i in 0..16 {
            assert_eq!(ok(&done, i), 4096);
        }
        assert_eq!(ok(&done, 100), 4096);
        assert_eq!(ok(&done, 101), 8192);
        // Read everything back into the region's second half, one piece each.
        let reads = (0..19u64)
            .map(|i| {
                (
                    200 + i,
                    IoOp::Read {
                        offset: i * 4096,
                        bufs: smallvec::smallvec![pool.buf((32 + i as usize) * 4096, 4096)],
                    },
                )
            })
            .collect();
        let done = run_all(&mut *e, reads);
        let want = |i: u64| match i {
            0..=15 => pattern(i, 4096),
            16 => pattern(100, 4096),
            17 => pattern(0, 4096),
            _ => pattern(1, 4096),
        };
        for i in 0..19u64 {
            assert_eq!(ok(&done, 200 + i), 4096);
            assert_eq!(
                pool.get((32 + i as usize) * 4096, 4096),
                want(i),
                "{cache} {i}"
            );
        }
        // 16 writes and 19 reads were one piece inside the registered region.
        let fixed = e.stats().fixed_ops.load(Ordering::Relaxed);
        assert_eq!(fixed, if registered == 1 { 35 } else { 0 }, "{cache}");
    }
}

/// A region the kernel refuses to register (here: part of it cannot be pinned) leaves the
/// engine working with the plain ops, none counted as fixed.
#[test]
fn io_uring_works_when_the_region_cannot_be_registered() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), DISK);
    let disk = Arc::new(RawDisk::open(&path, false).unwrap());
    // Two pages: the first readable and writable, the second inaccessible.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            8192,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(map, libc::MAP_FAILED);
    let base = map.cast::<u8>();
    assert_eq!(
        unsafe { libc::mprotect(base.add(4096).cast(), 4096, libc::PROT_NONE) },
        0
    );
    {
        let region = unsafe { FixedRegion::new(base, 8192, Arc::new(())) };
        let mut e = UringEngine::new(Arc::clone(&disk), 8, Some(&region)).unwrap();
        assert_eq!(e.stats().fixed_regions.load(Ordering::Relaxed), 0);
        let buf = IoBuf::new(base, 4096);
        unsafe { buf.as_volatile() }.copy_from(&pattern(9, 4096));
        assert_eq!(
            run_one(
                &mut e,
                IoOp::Write {
                    offset: 0,
                    bufs: smallvec::smallvec![buf],
                    fua: false,
                }
            ),
            4096
        );
        unsafe { buf.as_volatile() }.copy_from(&[0u8; 4096][..]);
        assert_eq!(
            run_one(
                &mut e,
                IoOp::Read {
                    offset: 0,
                    bufs: smallvec::smallvec![buf],
                }
            ),
            4096
        );
        let mut back = vec![0u8; 4096];
        unsafe { buf.as_volatile() }.copy_to(&mut back[..]);
        assert_eq!(back, pattern(9, 4096));
        assert_eq!(e.stats().fixed_ops.load(Ordering::Relaxed), 0);
    }
    assert_eq!(unsafe { libc::munmap(map, 8192) }, 0);
}
