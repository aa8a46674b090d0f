//! `aio=io_uring`: raw images through Linux io_uring.
//!
//! Modelled on QEMU's `block/io_uring.c`: ops are prepared into the submission ring as they
//! come (`submit`), the batch goes to the kernel in one `io_uring_enter` (`kick`), and
//! completions are reaped in whatever order the kernel posts them; an eventfd registered with
//! the ring tells the transport when there are some. Each op has at most one SQE in flight and
//! moves through stages on its completions:
//! - reads and writes: `READ`/`WRITE` for one piece, `READV`/`WRITEV` of at most `IOV_MAX`
//!   pieces at a time for more; a short transfer is resubmitted for its remainder (QEMU's
//!   `luring_resubmit_short_read`), a transfer of 0 bytes ends a read at the end of the file;
//! - `fua` (write cache off): an `FSYNC` with `DATASYNC` after the data is written;
//! - FLUSH: one `FSYNC(DATASYNC)`;
//! - discard and write-zeroes: one `FALLOCATE` per range, in order (`PUNCH_HOLE` or
//!   `ZERO_RANGE`, with `KEEP_SIZE`); where the file system has no such mode, a discard
//!   succeeds as the hint it is and write-zeroes falls back to the disk's blocking path.
//!
//! At most `cq_entries` SQEs are in the kernel at once; more wait in a backlog, so the
//! completion ring can never overflow.
//!
//! The ring is set up with `COOP_TASKRUN`: the kernel finishes a completion (posts the CQE,
//! raises the eventfd) the next time the queue's thread enters the kernel, or wakes it if it
//! sleeps, instead of interrupting it with an IPI while it runs. The thread enters the kernel
//! at every kick and every poll, so nothing waits long; on a virtual machine, where an IPI
//! is a VM exit, this halved the CPU time per 4 KiB read on tmpfs (8.9 to 3.9 µs with bounce
//! off, bouncevm-load at iodepth 32, cache=none; medians of 4 rounds side by side, docs/studies/blk-host-speed.md).
//!
//! The image file is registered with the ring (`IORING_REGISTER_FILES`), so no op looks
//! it up. A [`FixedRegion`] (the bounce pool) is registered as fixed buffers: a one-piece
//! read or write inside it is a `READ_FIXED`/`WRITE_FIXED`, whose pages the kernel pinned
//! once, at registration, instead of on every O_DIRECT request. A kernel that refuses either
//! registration (`RLIMIT_MEMLOCK` for the buffers) gets the plain ops, with a warning once.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::types::{SubmitArgs, Timespec};
use io_uring::{opcode, squeue, types, IoUring};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// The longest one [`IoEngine::wait`] blocks in the kernel: a reset or teardown waiting for
/// I/O in flight checks its own time limit between waits.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// How long the ring's drop keeps waiting for ops that make no progress.
const DROP_IDLE: Duration = Duration::from_secs(1);

use super::engine::{EngineStats, FixedRegion, IoBuf, IoDone, IoEngine, IoOp, Range, Tag};
use super::Disk;

/// Largest iovec count of one `readv`/`writev` (Linux `UIO_MAXIOV`).
const IOV_MAX: usize = 1024;

/// Largest fixed buffer the kernel registers (Linux `SZ_1G` in `io_buffer_validate`); a
/// larger region is registered as several.
const FIXED_CHUNK: usize = 1 << 30;

/// How SQEs name the image file.
#[derive(Debug, Clone, Copy)]
enum FileRef {
    /// Index 0 of the ring's registered files.
    Registered,
    /// The descriptor itself (the kernel refused the registration).
    Fd(RawFd),
}

/// Builds an op on the image file, named as `file` says (the two target types of the
/// `io-uring` crate are distinct types, so the builder is written once per kind).
macro_rules! on_file {
    ($file:expr, |$t:ident| $build:expr) => {
        match $file {
            FileRef::Registered => {
                let $t = types::Fixed(0);
                $build
            }
            FileRef::Fd(fd) => {
                let $t = types::Fd(fd);
                $build
            }
        }
    };
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Data transfer, next piece at `iov`.
    Data,
    /// The fsync after a write-through write or range op, or a FLUSH.
    Sync,
    /// Range `i` of a discard or write-zeroes.
    Range(usize),
}

#[derive(Debug)]
struct Inflight {
    tag: Tag,
    /// The op, whose pieces are the iovec array of its `READV`/`WRITEV` (a piece is advanced
    /// in place after a short transfer).
    op: IoOp,
    /// Index of the first remaining piece.
    iov: usize,
    /// Bytes transferred so far.
    done: u64,
    stage: Stage,
}

/// The pieces of a read or write (none for the other ops).
fn pieces(op: &IoOp) -> &[IoBuf] {
    match op {
        IoOp::Read { bufs, .. } | IoOp::Write { bufs, .. } => bufs,
        _ => &[],
    }
}

/// One in-flight op's place. Boxed so that it never moves while the kernel may read the
/// iovec array inside it, whatever the table does; a finished op's box is reused by the
/// next one.
type Slot = Box<Option<Inflight>>;

/// An io_uring engine on a raw file.
pub struct UringEngine<D: Disk> {
    ring: IoUring,
    /// Keeps the file (and so `fd`) open while ops are in flight.
    disk: Arc<D>,
    fd: RawFd,
    file: FileRef,
    /// The registered region (its buffers are its `FIXED_CHUNK`-sized pieces, in order), kept
    /// alive by this field, which drops after `ring`.
    fixed: Option<FixedRegion>,
    eventfd: EventFd,
    entries: Vec<Slot>,
    /// Completions of one reap pass (kept to reuse its storage).
    cqes: Vec<(usize, i32)>,
    free: Vec<usize>,
    /// SQEs prepared but not yet in the submission ring.
    backlog: VecDeque<squeue::Entry>,
    /// SQEs handed to the kernel whose completion was not reaped yet.
    in_kernel: usize,
    /// Largest `in_kernel` the completion ring can take.
    cq_cap: usize,
    /// Ops that completed without reaching the kernel.
    ready: Vec<IoDone>,
    ops: usize,
    stats: Arc<EngineStats>,
    /// The last `io_uring_enter` error, logged once per kind.
    logged_submit_error: bool,
}

impl<D: Disk> std::fmt::Debug for UringEngine<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringEngine")
            .field("fd", &self.fd)
            .field("ops", &self.ops)
            .field("in_kernel", &self.in_kernel)
            .field("backlog", &self.backlog.len())
            .finish_non_exhaustive()
    }
}

fn uring_error(what: &str, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("io_uring: {what}: {e}"))
}

impl<D: Disk> UringEngine<D> {
    /// A ring for `depth` ops in flight on `disk`, which must have a file descriptor, with
    /// `fixed` registered as fixed buffers when the kernel allows it.
    ///
    /// # Errors
    /// The disk has no file descriptor (qcow2, memory), or the kernel refused io_uring
    /// (`io_uring_setup` failing with ENOSYS or EPERM on hosts without it).
    pub fn new(disk: Arc<D>, depth: u16, fixed: Option<&FixedRegion>) -> io::Result<Self> {
        let fd = disk.raw_fd().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::Unsupported,
                format!(
                    "aio=io_uring needs a raw image file (this disk is {})",
                    disk.kind()
                ),
            )
        })?;
        let entries = u32::from(depth).next_power_of_two().clamp(8, 4096);
        let ring = match IoUring::builder().setup_coop_taskrun().build(entries) {
            Ok(r) => r,
            // No IPI to the queue's thread for each completion (see the module docs);
            // kernels before 5.19 do not know the flag.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                IoUring::new(entries).map_err(|e| uring_error("io_uring_setup", e))?
            }
            Err(e) => return Err(uring_error("io_uring_setup", e)),
        };
        let eventfd = EventFd::new(EFD_NONBLOCK).map_err(|e| uring_error("eventfd", e))?;
        ring.submitter()
            .register_eventfd(eventfd.as_raw_fd())
            .map_err(|e| uring_error("register eventfd", e))?;
        let cq_cap = ring.params().cq_entries() as usize;
        let file = match ring.submitter().register_files(&[fd]) {
            Ok(()) => FileRef::Registered,
            Err(e) => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!("io_uring: register the image file: {e}; using its fd");
                });
                FileRef::Fd(fd)
            }
        };
        let stats = Arc::<EngineStats>::default();
        let fixed = fixed
            .filter(|r| !r.is_empty())
            .and_then(|r| match Self::register(&ring, r) {
                Ok(()) => {
                    stats.fixed_regions.fetch_add(1, Ordering::Relaxed);
                    Some(r.clone())
                }
                Err(e) => {
                    static WARNED: std::sync::Once = std::sync::Once::new();
                    WARNED.call_once(|| {
                        tracing::warn!(
                            "io_uring: register {} bytes of bounce pool as fixed buffers: {e} \
                             (RLIMIT_MEMLOCK?); its I/O pins pages per request",
                            r.len()
                        );
                    });
                    None
                }
            });
        Ok(Self {
            ring,
            disk,
            fd,
            file,
            fixed,
            eventfd,
            entries: Vec::new(),
            cqes: Vec::new(),
            free: Vec::new(),
            backlog: VecDeque::new(),
            in_kernel: 0,
            cq_cap,
            ready: Vec::new(),
            ops: 0,
            stats,
            logged_submit_error: false,
        })
    }

    /// Registers `region` as fixed buffers of `ring`, in pieces of at most `FIXED_CHUNK`.
    fn register(ring: &IoUring, region: &FixedRegion) -> io::Result<()> {
        let start = region.start() as usize;
        let iovecs: Vec<libc::iovec> = (0..region.len())
            .step_by(FIXED_CHUNK)
            .map(|off| libc::iovec {
                iov_base: (start + off) as *mut libc::c_void,
                iov_len: (region.len() - off).min(FIXED_CHUNK),
            })
            .collect();
        // SAFETY: the region is one readable and writable mapping that stays mapped while its
        // owner lives (`FixedRegion::new`'s contract); the engine keeps the owner in a field
        // that drops after the ring, and dropping the ring unregisters the buffers.
        unsafe { ring.submitter().register_buffers(&iovecs) }
    }

    /// The fixed buffer `buf` lies in, with its index, when all of it is in one.
    fn fixed_buffer(&self, buf: &IoBuf) -> Option<u16> {
        let off = self.fixed.as_ref()?.offset_of(buf)?;
        let index = off / FIXED_CHUNK;
        // The piece must not cross into the next buffer; indexes fit u16 (the kernel takes at
        // most 2^14 buffers).
        let last = (off + buf.len().max(1) - 1) / FIXED_CHUNK;
        (index == last).then(|| u16::try_from(index).ok()).flatten()
    }

    /// The op in flight in `entry`.
    fn entry(&self, entry: usize) -> Option<&Inflight> {
        Option::as_ref(self.entries.get(entry)?)
    }

    /// The op in flight in `entry`, to move it on.
    fn entry_mut(&mut self, entry: usize) -> Option<&mut Inflight> {
        Option::as_mut(self.entries.get_mut(entry)?)
    }

    /// Builds the next SQE of the op in `entry` for its current stage.
    fn prepare(&mut self, entry: usize) {
        let Some(e) = self.entry(entry) else {
            return;
        };
        let file = self.file;
        let sqe = match e.stage {
            Stage::Data => self.data_sqe(e),
            Stage::Sync => on_file!(file, |t| opcode::Fsync::new(t)
                .flags(types::FsyncFlags::DATASYNC)
                .build()),
            Stage::Range(i) => {
                let (r, zeroes) = match &e.op {
                    IoOp::Discard { ranges, .. } => (ranges.get(i), false),
                    IoOp::WriteZeroes { ranges, .. } => (ranges.get(i), true),
                    _ => (None, false),
                };
                let r = r.copied().unwrap_or(Range {
                    offset: 0,
                    len: 0,
                    unmap: false,
                });
                let mode = if zeroes && !r.unmap {
                    libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
                } else {
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
                };
                on_file!(file, |t| opcode::Fallocate::new(t, r.len)
                    .offset(r.offset)
                    .mode(mode)
                    .build())
            }
        };
        self.backlog.push_back(sqe.user_data(entry as u64));
    }

    /// The SQE that moves the remaining pieces of a read or write: a plain or fixed-buffer
    /// `READ`/`WRITE` for one piece, a `READV`/`WRITEV` on the op's own pieces (at most
    /// `IOV_MAX`) for more.
    fn data_sqe(&self, e: &Inflight) -> squeue::Entry {
        let file = self.file;
        let (offset, read) = match &e.op {
            IoOp::Write { offset, .. } => (*offset, false),
            IoOp::Read { offset, .. } => (*offset, true),
            _ => (0, true),
        };
        let rest = pieces(&e.op).get(e.iov..).unwrap_or_default();
        let at = offset.saturating_add(e.done);
        if let [one] = rest {
            if let Ok(len) = u32::try_from(one.len()) {
                let ptr = one.ptr();
                let fixed = self.fixed_buffer(one);
                if fixed.is_some() && e.iov == 0 && e.done == 0 {
                    self.stats.fixed_ops.fetch_add(1, Ordering::Relaxed);
                }
                return match (fixed, read) {
                    (Some(i), true) => on_file!(file, |t| opcode::ReadFixed::new(t, ptr, len, i)
                        .offset(at)
                        .build()),
                    (Some(i), false) => {
                        on_file!(file, |t| opcode::WriteFixed::new(t, ptr, len, i)
                            .offset(at)
                            .build())
                    }
                    (None, true) => {
                        on_file!(file, |t| opcode::Read::new(t, ptr, len).offset(at).build())
                    }
                    (None, false) => {
                        on_file!(file, |t| opcode::Write::new(t, ptr, len).offset(at).build())
                    }
                };
            }
        }
        // rest.len() <= IOV_MAX fits a u32; `IoBuf` is laid out as `struct iovec`.
        let n = rest.len().min(IOV_MAX) as u32;
        let iov = rest.as_ptr().cast::<libc::iovec>();
        if read {
            on_file!(file, |t| opcode::Readv::new(t, iov, n).offset(at).build())
        } else {
            on_file!(file, |t| opcode::Writev::new(t, iov, n).offset(at).build())
        }
    }

    fn finish(&mut self, entry: usize, result: io::Result<u64>) {
        // The kernel is done with the op's pieces: its last SQE completed.
        if let Some(e) = self.entries.get_mut(entry).and_then(|s| s.take()) {
            self.free.push(entry);
            self.ops -= 1;
            self.ready.push(IoDone { tag: e.tag, result });
        }
    }

    /// After the data or range stages: sync when asked, else done.
    fn after_data(&mut self, entry: usize, fua: bool, done: u64) {
        if fua {
            if let Some(e) = self.entry_mut(entry) {
                e.stage = Stage::Sync;
            }
            self.prepare(entry);
        } else {
            self.finish(entry, Ok(done));
        }
    }

    /// Moves the op in `entry` on by one completion with result `res`.
    fn complete(&mut self, entry: usize, res: i32) {
        let Some(e) = self.entry_mut(entry) else {
            tracing::warn!("io_uring: completion for unknown entry {entry}");
            return;
        };
        if res == -libc::EINTR || res == -libc::EAGAIN {
            self.stats.resubmitted.fetch_add(1, Ordering::Relaxed);
            self.prepare(entry);
            return;
        }
        match e.stage {
            Stage::Data => self.data_done(entry, res),
            Stage::Sync => {
                let done = e.done;
                if res < 0 {
                    self.finish(entry, Err(io::Error::from_raw_os_error(-res)))
                } else {
                    self.finish(entry, Ok(done))
                }
            }
            Stage::Range(i) => self.range_done(entry, i, res),
        }
    }

    /// A data SQE moved `res` bytes (or failed): the op's pieces are advanced past them in
    /// place, and what is left is resubmitted (QEMU's `luring_resubmit_short_read`).
    fn data_done(&mut self, entry: usize, res: i32) {
        let Some(e) = self.entry_mut(entry) else {
            return;
        };
        // A negative result is an errno.
        let Ok(mut n) = usize::try_from(res) else {
            return self.finish(entry, Err(io::Error::from_raw_os_error(-res)));
        };
        e.done += n as u64;
        let (fua, read, bufs) = match &mut e.op {
            IoOp::Write { fua, bufs, .. } => (*fua, false, &mut bufs[..]),
            IoOp::Read { bufs, .. } => (false, true, &mut bufs[..]),
            _ => (false, true, &mut [][..]),
        };
        while n > 0 && e.iov < bufs.len() {
            let b = &mut bufs[e.iov];
            if n >= b.len() {
                n -= b.len();
                e.iov += 1;
            } else {
                b.advance(n);
                n = 0;
            }
        }
        let (done, left) = (e.done, e.iov < bufs.len());
        if !left {
            return self.after_data(entry, fua, done);
        }
        if res == 0 {
            // End of file: a read returns what it got, a write cannot go on.
            let result = if read {
                Ok(done)
            } else {
                Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "write took no bytes",
                ))
            };
            return self.finish(entry, result);
        }
        self.stats.resubmitted.fetch_add(1, Ordering::Relaxed);
        self.prepare(entry);
    }

    /// The fallocate of range `i` of a discard or write-zeroes ended with `res`.
    fn range_done(&mut self, entry: usize, i: usize, res: i32) {
        let Some(e) = self.entry(entry) else {
            return;
        };
        let (ranges, fua, zeroes) = match &e.op {
            IoOp::Discard { ranges, fua } => (ranges, *fua, false),
            IoOp::WriteZeroes { ranges, fua } => (ranges, *fua, true),
            _ => return self.finish(entry, Ok(0)),
        };
        let (Some(&r), nranges) = (ranges.get(i), ranges.len()) else {
            return self.finish(entry, Ok(0));
        };
        if res < 0 {
            let unsupported = res == -libc::EOPNOTSUPP || res == -libc::ENOSYS;
            if !unsupported {
                return self.finish(entry, Err(io::Error::from_raw_os_error(-res)));
            }
            if zeroes {
                // No fallocate mode for it: write the zeros the blocking way (rare: every
                // Linux file system with O_DIRECT has ZERO_RANGE or holes).
                if let Err(err) = self.disk.write_zeroes(r.offset, r.len, r.unmap) {
                    return self.finish(entry, Err(err));
                }
            }
            // A discard is a hint: a file system that cannot punch holes keeps the blocks,
            // and the request still succeeds.
        }
        if i + 1 < nranges {
            if let Some(e) = self.entry_mut(entry) {
                e.stage = Stage::Range(i + 1);
            }
            return self.prepare(entry);
        }
        self.after_data(entry, fua, 0);
    }

    /// Moves backlog SQEs into the submission ring while the completion ring has room.
    fn fill_sq(&mut self) -> usize {
        let mut pushed = 0;
        let mut sq = self.ring.submission();
        while self.in_kernel < self.cq_cap {
            let Some(sqe) = self.backlog.front() else {
                break;
            };
            // SAFETY: every pointer in the SQE (iovec arrays, buffers) stays valid until its
            // completion: iovec arrays are the pieces of ops in `self.entries`, boxed so they
            // do not move when the table grows; buffers by the submit contract.
            if unsafe { sq.push(sqe) }.is_err() {
                break;
            }
            self.backlog.pop_front();
            self.in_kernel += 1;
            pushed += 1;
        }
        sq.sync();
        pushed
    }
}

impl<D: Disk> IoEngine for UringEngine<D> {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    unsafe fn submit(&mut self, tag: Tag, op: IoOp) {
        let (stage, empty) = match &op {
            IoOp::Read { bufs, .. } | IoOp::Write { bufs, .. } => (Stage::Data, bufs.is_empty()),
            IoOp::Flush => (Stage::Sync, false),
            IoOp::Discard { ranges, .. } | IoOp::WriteZeroes { ranges, .. } => {
                (Stage::Range(0), ranges.is_empty())
            }
        };
        let fua = matches!(
            op,
            IoOp::Write { fua: true, .. }
                | IoOp::Discard { fua: true, .. }
                | IoOp::WriteZeroes { fua: true, .. }
        );
        let entry = self.free.pop().unwrap_or_else(|| {
            self.entries.push(Box::new(None));
            self.entries.len() - 1
        });
        // Written into the entry's box: the op's pieces stay where the kernel will read them.
        *self.entries[entry] = Some(Inflight {
            tag,
            op,
            iov: 0,
            done: 0,
            stage,
        });
        self.ops += 1;
        self.stats.note_submit(self.ops);
        if empty {
            self.after_data(entry, fua, 0);
        } else {
            self.prepare(entry);
        }
    }

    fn kick(&mut self) {
        loop {
            let pushed = self.fill_sq();
            if pushed == 0 && self.ring.submission().is_empty() {
                return;
            }
            match self.ring.submit() {
                Ok(_) => {
                    self.stats.submit_calls.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => {
                    // EBUSY/EAGAIN: the kernel is short of resources; what stays in the
                    // ring goes in with the next kick, which every completion brings.
                    if !self.logged_submit_error {
                        self.logged_submit_error = true;
                        tracing::warn!("io_uring: submit: {e} (retried on the next completion)");
                    }
                    return;
                }
            }
            if self.backlog.is_empty() || self.in_kernel >= self.cq_cap {
                return;
            }
        }
    }

    fn reap(&mut self, out: &mut Vec<IoDone>) {
        // Reset the eventfd before looking at the ring: a completion posted after this read
        // raises it again, so an edge-triggered poller misses nothing.
        let _ = self.eventfd.read();
        let mut cqes = std::mem::take(&mut self.cqes);
        loop {
            cqes.clear();
            cqes.extend(
                self.ring
                    .completion()
                    .map(|c| (c.user_data() as usize, c.result())),
            );
            if cqes.is_empty() {
                break;
            }
            self.in_kernel = self.in_kernel.saturating_sub(cqes.len());
            for &(entry, res) in &cqes {
                self.complete(entry, res);
            }
        }
        self.cqes = cqes;
        if !self.backlog.is_empty() {
            self.kick();
        }
        self.stats
            .completed
            .fetch_add(self.ready.len() as u64, Ordering::Relaxed);
        out.append(&mut self.ready);
    }

    fn wait(&mut self) {
        if !self.ready.is_empty() || self.ops == 0 {
            return;
        }
        if self.ring.completion().is_empty() {
            self.kick();
            // A bounded wait where the kernel takes a timeout with it (5.11 and later).
            let r = if self.ring.params().is_feature_ext_arg() {
                let slice = Timespec::new().nsec(WAIT_SLICE.subsec_nanos());
                let args = SubmitArgs::new().timespec(&slice);
                self.ring.submitter().submit_with_args(1, &args)
            } else {
                self.ring.submit_and_wait(1)
            };
            if let Err(e) = r {
                if !matches!(e.raw_os_error(), Some(libc::EINTR | libc::ETIME)) {
                    tracing::warn!("io_uring: wait: {e}");
                }
            }
        }
    }

    fn in_flight(&self) -> usize {
        self.ops
    }

    fn notifier(&self) -> Option<RawFd> {
        Some(self.eventfd.as_raw_fd())
    }

    fn stats(&self) -> &Arc<EngineStats> {
        &self.stats
    }
}

impl<D: Disk> Drop for UringEngine<D> {
    fn drop(&mut self) {
        // The kernel may still write into buffers and iovec arrays: wait for every op, until
        // no op has completed for DROP_IDLE (the worker above already waited for its
        // requests as long as it was told to); what is left is abandoned with the ring.
        let mut sink = Vec::new();
        let mut progress = Instant::now();
        while self.ops > 0 && progress.elapsed() < DROP_IDLE {
            self.kick();
            self.wait();
            self.reap(&mut sink);
            if !sink.is_empty() {
                progress = Instant::now();
            }
            sink.clear();
        }
        if self.ops > 0 {
            // The kernel may still read the ops' iovec arrays and write into their buffers:
            // their state is kept (leaked) rather than freed under it.
            tracing::error!(
                "io_uring: {} ops still pending when the ring closed; their buffers are kept (leaked)",
                self.ops
            );
            std::mem::forget(std::mem::take(&mut self.entries));
            std::mem::forget(self.fixed.take());
        }
    }
}
