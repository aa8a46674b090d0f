//! libblkio (the `blkio` crate's `virtio-blk-vhost-user` driver, the library behind fio's
//! `libblkio` engine and QEMU's `blkio` block driver) as a front end nobody on this project
//! wrote: it connects to `bouncevm-vhost blk` (it needs REPLY_ACK, CONFIG and
//! CONFIGURE_MEM_SLOTS and registers its memory with ADD_MEM_REG), runs 2 queues with
//! [`DEPTH`] requests in flight on each, writes a pattern over the disk and reads it back,
//! checking every byte; bounce off and forced (libblkio never acknowledges ACCESS_PLATFORM:
//! the device bounces when forced either way). The same test against qemu-storage-daemon
//! shows the two back ends behave the same.

mod vhost_support;

use std::mem::MaybeUninit;
use std::path::Path;
use std::time::Duration;

use blkio::{Blkio, Blkioq, Completion, ReqFlags};
use vhost_support::child::Server;
use vhost_support::qsd::qsd;

/// Queues libblkio drives.
const QUEUES: usize = 2;
/// Requests in flight on each queue.
const DEPTH: usize = 16;
/// Bytes per request.
const BLOCK: usize = 64 * 1024;
/// Bytes of the disk covered: every request slot of every queue, four times over.
const SPAN: usize = 4 * QUEUES * DEPTH * BLOCK;

/// The byte at disk offset `at` in a write pass of `seed`.
fn pattern(at: usize, seed: u8) -> u8 {
    ((at / 4096) as u8).wrapping_mul(31) ^ (at as u8) ^ seed
}

/// Waits on `q` until `n` requests completed; each must have succeeded.
fn complete(q: &mut Blkioq, n: usize, what: &str) {
    let mut done = 0;
    let mut completions: Vec<MaybeUninit<Completion>> = std::iter::repeat_with(MaybeUninit::uninit)
        .take(n)
        .collect();
    while done < n {
        let mut timeout = Duration::from_secs(20);
        let got = q
            .do_io(&mut completions[..n - done], 1, Some(&mut timeout), None)
            .unwrap_or_else(|e| panic!("{what}: do_io: {}", e.message()));
        assert!(got > 0, "{what}: no completion within 20 s ({done} of {n})");
        for c in &completions[..got] {
            // SAFETY: do_io initialised the first `got` completions.
            #[allow(clippy::undocumented_unsafe_blocks)]
            let c = unsafe { c.assume_init_ref() };
            assert_eq!(c.ret, 0, "{what}: request {} failed", c.user_data);
        }
        done += got;
    }
}

/// Connects libblkio to the vhost-user socket `sock` with [`QUEUES`] queues, writes the disk's
/// first [`SPAN`] bytes at depth [`DEPTH`] per queue, reads them back at the same depth and
/// compares every byte.
fn write_then_read_back(sock: &Path, seed: u8) {
    let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
    b.set_str("path", sock.to_str().unwrap()).unwrap();
    b.connect()
        .unwrap_or_else(|e| panic!("libblkio cannot connect: {}", e.message()));
    b.set_i32("num-queues", QUEUES as i32).unwrap();
    let mut queues = b
        .start()
        .unwrap_or_else(|e| panic!("libblkio cannot start: {}", e.message()))
        .queues;
    assert_eq!(queues.len(), QUEUES);
    let capacity = b.get_u64("capacity").unwrap();
    assert!(capacity >= SPAN as u64, "a {capacity}-byte disk");
    let slots = QUEUES * DEPTH;
    let region = b.alloc_mem_region(2 * slots * BLOCK).unwrap();
    b.map_mem_region(&region).unwrap();
    let base = region.addr as *mut u8;
    // SAFETY: the region is `2 * slots * BLOCK` bytes of memory libblkio mapped for us, alive
    // until it is freed below; the device writes it only while a read is in flight, and the
    // test reads it only after the read completed.
    #[allow(clippy::undocumented_unsafe_blocks)]
    let mem = unsafe { std::slice::from_raw_parts_mut(base, 2 * slots * BLOCK) };
    let (wbufs, rbufs) = mem.split_at_mut(slots * BLOCK);
    let rounds = SPAN / (slots * BLOCK);
    for round in 0..rounds {
        // Slot s of queue q covers disk bytes [(round * slots + q * DEPTH + s) * BLOCK, +BLOCK).
        let offset = |q: usize, s: usize| (round * slots + q * DEPTH + s) * BLOCK;
        for (q, queue) in queues.iter_mut().enumerate() {
            for s in 0..DEPTH {
                let at = offset(q, s);
                let buf = &mut wbufs[(q * DEPTH + s) * BLOCK..][..BLOCK];
                for (i, byte) in buf.iter_mut().enumerate() {
                    *byte = pattern(at + i, seed);
                }
                queue.write(at as u64, buf.as_ptr(), BLOCK, at, ReqFlags::empty());
            }
        }
        for (q, queue) in queues.iter_mut().enumerate() {
            complete(queue, DEPTH, &format!("round {round} writes on queue {q}"));
        }
        for (q, queue) in queues.iter_mut().enumerate() {
            for s in 0..DEPTH {
                let at = offset(q, s);
                let buf = &mut rbufs[(q * DEPTH + s) * BLOCK..][..BLOCK];
                buf.fill(0);
                queue.read(at as u64, buf.as_mut_ptr(), BLOCK, at, ReqFlags::empty());
            }
        }
        for (q, queue) in queues.iter_mut().enumerate() {
            complete(queue, DEPTH, &format!("round {round} reads on queue {q}"));
        }
        for q in 0..QUEUES {
            for s in 0..DEPTH {
                let at = offset(q, s);
                let buf = &rbufs[(q * DEPTH + s) * BLOCK..][..BLOCK];
                if let Some(i) = (0..BLOCK).find(|&i| buf[i] != pattern(at + i, seed)) {
                    panic!(
                        "byte {} of the disk read back {:#x}, written {:#x}",
                        at + i,
                        buf[i],
                        pattern(at + i, seed)
                    );
                }
            }
        }
    }
    drop(queues);
    b.unmap_mem_region(&region);
    b.free_mem_region(&region);
}

/// One pass against `bouncevm-vhost blk --queues 2` with `bounce` flags; the statistics must
/// show the bounce pool used exactly when forced.
fn against_bouncevm(bounce: &[&str], seed: u8) {
    let mut args = vec!["--queues", "2"];
    args.extend_from_slice(bounce);
    let mut server = Server::start_with(&args);
    write_then_read_back(&server.sock, seed);
    server.assert_alive("after libblkio");
    let st = server.stats();
    let mapped = st["bounce"]["maps"].as_u64().unwrap_or(0);
    assert_eq!(
        mapped > 0,
        bounce.iter().any(|a| a.contains("force")),
        "bounce maps {mapped} with {bounce:?}: {st}"
    );
}

#[test]
fn libblkio_writes_and_reads_back_through_bouncevm_without_bouncing() {
    against_bouncevm(&[], 0x11);
}

#[test]
fn libblkio_writes_and_reads_back_through_bouncevm_bouncing_every_request() {
    against_bouncevm(&["--bounce", "policy=force"], 0x22);
}

#[test]
fn libblkio_writes_and_reads_back_through_qemu_storage_daemon() {
    let Some(qsd) = qsd(QUEUES) else {
        return;
    };
    write_then_read_back(&qsd.path, 0x33);
}
