//! A block queue torn down while the kernel still holds one of its io_uring reads: the worker
//! and the engine give up waiting after their bounds and keep (leak) what the kernel may still
//! write into, rather than free or unmap it under the read, and say so once each.
//!
//! The read is on a socket whose peer never sends (a disk that never answers), so it stays
//! in the kernel. The worker gives up after `give_up_after` (or a number of waits), the ring
//! after a second without progress; a signal sent to the tearing-down thread over and over
//! (each wait returning `EINTR` at once) changes neither.

mod common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bounce::Dma;
use common::{Blk, Layout, RAM};
use devices::block::io::AioMode;
use devices::block::{BlockConfig, Disk, MemDisk};
use devices::testing::{gate_disk, SocketDisk};
use devices::virtio::spec::VIRTIO_BLK_T_IN;
use vm_memory::{GuestAddress, GuestMemoryBackend};

/// A log writer into a shared buffer.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        devices::metrics::lock(&self.0).extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn lines_with(&self, needle: &str) -> usize {
        String::from_utf8_lossy(&devices::metrics::lock(&self.0))
            .lines()
            .filter(|l| l.contains(needle))
            .count()
    }
}

extern "C" fn ignore(_: libc::c_int) {}

/// Interrupts the calling thread's blocking calls with SIGUSR2 (a handler that does nothing,
/// without SA_RESTART) until the returned flag is set.
fn interrupt_this_thread() -> (Arc<AtomicBool>, std::thread::JoinHandle<u64>) {
    // SAFETY: a zeroed sigaction with a handler of the right signature and an empty mask;
    // the handler touches nothing.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = ignore as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(libc::SIGUSR2, &sa, std::ptr::null_mut()), 0);
    }
    // SAFETY: pthread_self has no preconditions.
    let target = unsafe { libc::pthread_self() };
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    let t = std::thread::spawn(move || {
        let mut sent = 0u64;
        while !stop2.load(Ordering::Relaxed) {
            // SAFETY: `target` is the test thread, which outlives this loop (it joins us).
            unsafe { libc::pthread_kill(target, libc::SIGUSR2) };
            sent += 1;
            std::thread::yield_now();
        }
        sent
    });
    (stop, t)
}

/// True when one mapping of this process covers `start..start + len` (`/proc/self/maps`).
fn mapped(start: usize, len: usize) -> bool {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter_map(|l| {
            let (range, _) = l.split_once(' ')?;
            let (a, b) = range.split_once('-')?;
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        })
        .any(|(a, b)| a <= start && start + len <= b)
}

/// A block queue on `aio` over `disk`, with teardown limited to 300 ms, and one 4 KiB read
/// posted that is now with the disk, waiting for bytes that never come.
fn post_stuck<D: Disk>(disk: D, aio: AioMode) -> (Blk<D>, common::Posted) {
    let cfg = BlockConfig {
        aio: Some(aio),
        give_up_after: Duration::from_millis(300),
        ..BlockConfig::default()
    };
    let mut blk = Blk::new(disk, cfg, Dma::direct(), 0);
    let p = blk.post(0, VIRTIO_BLK_T_IN, 0, &[], 4096, Layout::Simple);
    blk.drv.kick(0).expect("kick");
    std::thread::sleep(Duration::from_millis(50));
    assert!(blk.drv.reap(0).is_empty(), "the read completed");
    (blk, p)
}

/// [`post_stuck`] on io_uring over a socket whose peer (returned: keep it open) never sends.
fn stuck_read() -> (Blk<SocketDisk>, UnixStream, common::Posted) {
    let (ours, peer) = UnixStream::pair().unwrap();
    let (blk, p) = post_stuck(SocketDisk(ours), AioMode::IoUring);
    (blk, peer, p)
}

/// Runs `f` with a log subscriber of this thread's own; returns what it logged.
fn logged(f: impl FnOnce()) -> Captured {
    let log = Captured::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    log
}

#[test]
fn a_read_the_kernel_never_completes_is_leaked_counted_and_logged_once_at_teardown() {
    let (mut blk, _peer, p) = stuck_read();
    let metrics = Arc::clone(blk.drv.device.metrics());
    let ram = blk.drv.ram.mem().get_host_address(GuestAddress(0)).unwrap() as usize;
    let ram_len = RAM as usize;
    assert!(
        mapped(ram, ram_len),
        "guest RAM not found in /proc/self/maps"
    );
    assert_eq!(blk.metric("leaked_requests"), 0);

    let (stop, spammer) = interrupt_this_thread();
    let started = Instant::now();
    let log = logged(|| blk.drv.reset());
    stop.store(true, Ordering::Relaxed);
    let signals = spammer.join().unwrap();
    eprintln!(
        "teardown gave up after {:?} and {signals} signals",
        started.elapsed()
    );

    assert_eq!(metrics.leaked_requests.get(), 1);
    assert_eq!(
        log.lines_with("requests still pending at reset; their memory is kept (leaked)"),
        1,
        "the worker's give-up is logged once"
    );
    assert_eq!(
        log.lines_with("ops still pending when the ring closed; their buffers are kept (leaked)"),
        1,
        "the engine's give-up is logged once"
    );
    // The request's buffer is guest memory: with the device and the driver's own memory
    // gone, the leaked request still holds it, mapped.
    let status_addr = p.st;
    drop(blk);
    assert!(
        mapped(ram, ram_len),
        "guest memory of a request the kernel may still write into was unmapped"
    );
    // SAFETY: the mapping is still there (checked just above) and is never unmapped: the
    // leaked request holds it for the life of the process.
    let status = unsafe { std::ptr::read_volatile((ram + status_addr as usize) as *const u8) };
    assert_eq!(
        status,
        devices::block::STATUS_UNSET,
        "nothing is written to the guest after the give-up"
    );
}

/// Teardown is bounded in time: with nothing interrupting it, a reset with a read that never
/// completes gives the read up after `give_up_after` (and the engine after its own second
/// without progress) instead of waiting for ever: on io_uring, and on the thread pool, whose
/// thread stays blocked in the read, detached.
#[test]
fn a_reset_with_a_read_that_never_completes_ends_after_the_time_limit() {
    let (blk, _peer, _) = stuck_read();
    reset_ends_after_the_limit(blk, "io_uring");
    // The gate's sender is kept for good: the read stays blocked in its thread.
    let (gated, tx) = gate_disk(MemDisk::new(16 << 20).unwrap());
    std::mem::forget(tx);
    let (blk, _) = post_stuck(gated, AioMode::Threads);
    reset_ends_after_the_limit(blk, "threads");
}

/// Resets `blk`, whose one read never completes: it ends after the limit with the read given
/// up, counted and logged once.
fn reset_ends_after_the_limit<D: Disk>(mut blk: Blk<D>, what: &str) {
    let metrics = Arc::clone(blk.drv.device.metrics());
    let started = Instant::now();
    let log = logged(|| blk.drv.reset());
    let took = started.elapsed();
    assert_eq!(metrics.leaked_requests.get(), 1, "{what}");
    assert_eq!(
        log.lines_with("requests still pending at reset; their memory is kept (leaked)"),
        1,
        "{what}"
    );
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(10),
        "{what}: the reset took {took:?}"
    );
}
