//! One job: one virtqueue driven by one thread, up to `iodepth` requests in flight,
//! completions taken in whatever order the back end produces them.
//!
//! Each in-flight request owns a *request index* (`req`): a header, a status byte, an
//! indirect table (when INDIRECT_DESC is negotiated) and a data buffer of `bs` bytes (4 KiB aligned, so a back end
//! with O_DIRECT can use it as is). The head index names the request (`req` with indirect
//! tables, `req * descriptors` without), so a used entry is checked against the requests in
//! flight: a head that is not in flight is a misbehaving back end.
//!
//! # Verification (`--verify`)
//! Jobs then work on disjoint ranges of the device and keep a generation per block. Every
//! write carries [`Pattern`] data for `(offset, generation + 1)` and the block's generation
//! moves on when the write completes; every read is checked against the block's current
//! generation, so stale data (an older write), misplaced data and corruption all fail. A block
//! is never read or written while a write to it is in flight. The run has up to three phases:
//! 1. *prefill* (when the pattern reads): the job's range is written once, at depth;
//! 2. the measured workload (the only phase in the statistics);
//! 3. *read-back*: every block written is read and checked (a write the back end acknowledged
//!    but lost is caught here).

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use devices::block::request::RequestHeader;
use devices::block::{REQ_HEADER_LEN, SECTOR_SIZE, STATUS_UNSET};
use devices::virtio::driver::{Buf, DriverQueue, Layout};
use devices::virtio::spec::{
    feature, VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_RING_F_EVENT_IDX,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use crate::pattern::Pattern;
use crate::session::{DeviceInfo, QueueSetup};
use crate::stats::DirStats;
use crate::{Error, LoadConfig, Result, Rw};

const PAGE: u64 = 4096;

/// Where the rings of a queue of `size` starting at `base` (page aligned) are: each part
/// starts on a page of its own, so a ring never shares a page with data buffers.
pub fn ring_layout(base: u64, size: u16) -> Layout {
    Layout::packed(base, size, PAGE)
}

/// Where one job's queue, request metadata and buffers are in guest memory.
#[derive(Clone, Copy, Debug)]
pub struct JobArea {
    /// Start (page aligned): the rings.
    pub base: u64,
    /// Request metadata (per request index): header, status, indirect table.
    reqs: u64,
    req_stride: u64,
    /// Data buffers.
    data: u64,
    data_stride: u64,
    descs_per_req: u16,
}

impl JobArea {
    fn meta_stride(segments: u32) -> u64 {
        // header 16 + status (padded to 16) + table.
        (32 + (u64::from(segments) + 2) * 16).next_multiple_of(64)
    }

    /// Bytes of one job's area.
    pub fn bytes(queue_size: u16, iodepth: u16, bs: u32, segments: u32) -> u64 {
        let meta = (u64::from(iodepth) * Self::meta_stride(segments)).next_multiple_of(PAGE);
        Layout::packed_bytes(queue_size, PAGE)
            + meta
            + u64::from(iodepth) * u64::from(bs).next_multiple_of(PAGE)
    }

    /// The area starting at `base` (page aligned).
    pub fn at(base: u64, queue_size: u16, iodepth: u16, bs: u32, segments: u32) -> Self {
        let reqs = base + Layout::packed_bytes(queue_size, PAGE);
        let req_stride = Self::meta_stride(segments);
        let data = reqs + (u64::from(iodepth) * req_stride).next_multiple_of(PAGE);
        Self {
            base,
            reqs,
            req_stride,
            data,
            data_stride: u64::from(bs).next_multiple_of(PAGE),
            // segments <= seg_max checked by the plan; + 2 fits u16 for any sane device.
            descs_per_req: u16::try_from(segments + 2).unwrap_or(u16::MAX),
        }
    }

    fn header(&self, req: u16) -> u64 {
        self.reqs + u64::from(req) * self.req_stride
    }
    fn status(&self, req: u16) -> u64 {
        self.header(req) + 16
    }
    fn table(&self, req: u16) -> u64 {
        self.header(req) + 32
    }
    fn data(&self, req: u16) -> u64 {
        self.data + u64::from(req) * self.data_stride
    }
}

/// What verification did in one job.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct VerifyReport {
    /// Blocks written before the measured phase.
    pub prefilled: u64,
    /// Reads of the measured phase whose data was checked.
    pub verified_reads: u64,
    /// Blocks read back and checked after the measured phase.
    pub checked: u64,
    /// Blocks never written (nothing to check).
    pub unwritten: u64,
}

/// What a job did.
#[derive(Clone, Debug)]
pub struct JobOutcome {
    /// Job number.
    pub job: u16,
    /// Reads of the measured phase.
    pub read: DirStats,
    /// Writes of the measured phase.
    pub write: DirStats,
    /// Time of the measured phase (first submission to last completion).
    pub elapsed: Duration,
    /// Verification, if on.
    pub verify: Option<VerifyReport>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Read,
    Write,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Prefill,
    Main,
    ReadBack,
}

#[derive(Clone, Copy, Debug)]
struct InFlight {
    op: Op,
    block: u64,
    gen: u32,
    submitted: Instant,
}

enum Next {
    Io(Op, u64),
    /// Nothing can be issued until something completes.
    Wait,
    /// The phase has issued everything.
    Done,
}

/// Where a running job is: its phase, the sequential cursor, and what it measured.
struct Progress {
    phase: Phase,
    cursor: u64,
    /// Requests issued in the measured phase.
    issued: u64,
    main_start: Instant,
    deadline: Option<Instant>,
    last_done: Instant,
    /// The measured phase's duration (start to its last completion), once over.
    elapsed: Duration,
    report: VerifyReport,
    read: DirStats,
    write: DirStats,
}

impl Progress {
    fn new(prefill: bool, runtime: Option<Duration>) -> Self {
        let phase = if prefill { Phase::Prefill } else { Phase::Main };
        let main_start = Instant::now();
        Self {
            phase,
            cursor: 0,
            issued: 0,
            main_start,
            deadline: match phase {
                Phase::Main => runtime.map(|r| main_start + r),
                _ => None,
            },
            last_done: main_start,
            elapsed: Duration::ZERO,
            report: VerifyReport::default(),
            read: DirStats::default(),
            write: DirStats::default(),
        }
    }

    /// Moves on once a phase is over and drained; true when the job is finished.
    fn next_phase(&mut self, verify: bool, runtime: Option<Duration>) -> bool {
        match self.phase {
            Phase::Prefill => {
                self.phase = Phase::Main;
                self.cursor = 0;
                self.main_start = Instant::now();
                self.deadline = runtime.map(|r| self.main_start + r);
                false
            }
            Phase::Main => {
                self.elapsed = self.last_done.saturating_duration_since(self.main_start);
                if !verify {
                    return true;
                }
                self.phase = Phase::ReadBack;
                self.cursor = 0;
                false
            }
            Phase::ReadBack => true,
        }
    }
}

/// One job, ready to run on its own thread.
#[derive(Debug)]
pub struct Job {
    id: u16,
    rw: Rw,
    bs: u32,
    iodepth: u16,
    rwmixread: u8,
    runtime: Option<Duration>,
    timeout: Duration,
    mem: GuestMemoryMmap,
    ring: DriverQueue,
    /// The buffers of the request being written (capacity for a whole chain, reused).
    chain: Vec<Buf>,
    area: JobArea,
    indirect: bool,
    segment: u32,
    /// Device byte offset of the job's range and its blocks.
    start: u64,
    blocks: u64,
    kick: EventFd,
    call: EventFd,
    watch: RawFd,
    stop: Arc<AtomicBool>,
    rng: StdRng,
    pattern: Pattern,
    /// Per block: generation written (0 = never), with `--verify`.
    gens: Option<Vec<u32>>,
    /// Per block: a request is in flight, with `--verify`.
    busy: Vec<bool>,
    inflight: Vec<Option<InFlight>>,
    free: Vec<u16>,
    in_flight: usize,
    scratch: Vec<u8>,
    expect: Vec<u8>,
}

fn eventfd_dup(e: &EventFd) -> Result<EventFd> {
    e.try_clone().map_err(|source| Error::Os {
        what: "duplicating an eventfd",
        source,
    })
}

impl Job {
    /// A job on queue `id` over `len` bytes from device byte `start`.
    ///
    /// # Errors
    /// When the rings cannot be written or the eventfds duplicated.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &LoadConfig,
        id: u16,
        info: &DeviceInfo,
        mem: GuestMemoryMmap,
        area: JobArea,
        indirect: bool,
        start: u64,
        len: u64,
        queue: &QueueSetup,
        watch: RawFd,
        stop: Arc<AtomicBool>,
    ) -> Result<Self> {
        let event_idx = info.has(feature(VIRTIO_RING_F_EVENT_IDX));
        let ring = DriverQueue::new(queue.layout, event_idx).map_err(Self::mem_err)?;
        ring.clear_rings(&mem).map_err(Self::mem_err)?;
        let blocks = len / u64::from(cfg.bs);
        let pattern = Pattern::new(cfg.seed ^ (u64::from(id) << 56) ^ now_nanos());
        let segment = info.size_max.unwrap_or(cfg.bs).min(cfg.bs);
        let nblocks = usize::try_from(blocks).unwrap_or(usize::MAX);
        let job = Self {
            id,
            rw: cfg.rw,
            bs: cfg.bs,
            iodepth: cfg.iodepth,
            rwmixread: cfg.rwmixread,
            runtime: cfg.runtime,
            timeout: cfg.timeout,
            ring,
            chain: Vec::with_capacity(usize::from(area.descs_per_req)),
            area,
            indirect,
            segment,
            start,
            blocks,
            kick: eventfd_dup(&queue.kick)?,
            call: eventfd_dup(&queue.call)?,
            watch,
            stop,
            rng: StdRng::seed_from_u64(cfg.seed.wrapping_add(u64::from(id))),
            pattern,
            gens: cfg.verify.then(|| vec![0; nblocks]),
            busy: if cfg.verify {
                vec![false; nblocks]
            } else {
                Vec::new()
            },
            inflight: vec![None; usize::from(cfg.iodepth)],
            free: (0..cfg.iodepth).rev().collect(),
            in_flight: 0,
            scratch: vec![0; cfg.bs as usize],
            expect: Vec::new(),
            mem,
        };
        // Without --verify, write buffers still carry non-zero, non-repeating data.
        if !cfg.verify {
            let mut buf = vec![0u8; cfg.bs as usize];
            for s in 0..cfg.iodepth {
                job.pattern
                    .fill(&mut buf, u64::from(s) * u64::from(cfg.bs), 0);
                job.mem
                    .write_slice(&buf, GuestAddress(job.area.data(s)))
                    .map_err(|e| Error::Memory(e.to_string()))?;
            }
        }
        Ok(job)
    }

    /// The job number.
    pub fn id(&self) -> u16 {
        self.id
    }

    fn head(&self, req: u16) -> u16 {
        if self.indirect {
            req
        } else {
            req * self.area.descs_per_req
        }
    }

    fn req_of(&self, id: u32) -> Option<u16> {
        let id = u16::try_from(id).ok()?;
        let req = if self.indirect {
            id
        } else {
            if id % self.area.descs_per_req != 0 {
                return None;
            }
            id / self.area.descs_per_req
        };
        (req < self.iodepth).then_some(req)
    }

    fn mem_err(e: impl std::fmt::Display) -> Error {
        Error::Memory(e.to_string())
    }

    /// Writes the request of `req` and puts it on the available ring.
    fn submit(&mut self, req: u16, op: Op, block: u64, gen: u32) -> Result<()> {
        let offset = self.start + block * u64::from(self.bs);
        let t = match op {
            Op::Read => VIRTIO_BLK_T_IN,
            Op::Write => VIRTIO_BLK_T_OUT,
        };
        let hdr = RequestHeader::encode(t, offset / SECTOR_SIZE);
        let mem = &self.mem;
        mem.write_slice(&hdr, GuestAddress(self.area.header(req)))
            .map_err(Self::mem_err)?;
        mem.write_obj(STATUS_UNSET, GuestAddress(self.area.status(req)))
            .map_err(Self::mem_err)?;
        if op == Op::Write && self.gens.is_some() {
            self.pattern.fill(&mut self.scratch, offset, gen);
            mem.write_slice(&self.scratch, GuestAddress(self.area.data(req)))
                .map_err(Self::mem_err)?;
        }
        // Descriptors: header, data segments, status; in the request's indirect table or at
        // its fixed indexes of the queue's table.
        let head = self.head(req);
        let chain = &mut self.chain;
        chain.clear();
        chain.push(Buf::ro(self.area.header(req), REQ_HEADER_LEN as u32));
        let mut done = 0u32;
        while done < self.bs {
            let len = self.segment.min(self.bs - done);
            let addr = self.area.data(req) + u64::from(done);
            chain.push(Buf {
                addr,
                len,
                writable: op == Op::Read,
            });
            done += len;
        }
        chain.push(Buf::wo(self.area.status(req), 1));
        if self.indirect {
            let table = self.area.table(req);
            self.ring.write_indirect(&self.mem, head, table, chain)
        } else {
            self.ring.write_chain(&self.mem, head, chain)
        }
        .map_err(Self::mem_err)?;
        if let Some(b) = self
            .busy
            .get_mut(usize::try_from(block).unwrap_or(usize::MAX))
        {
            *b = true;
        }
        self.inflight[usize::from(req)] = Some(InFlight {
            op,
            block,
            gen,
            submitted: Instant::now(),
        });
        self.in_flight += 1;
        self.ring.push(&self.mem, head).map_err(Self::mem_err)
    }

    fn block_busy(&self, block: u64) -> bool {
        usize::try_from(block)
            .ok()
            .and_then(|b| self.busy.get(b))
            .copied()
            .unwrap_or(false)
    }

    fn gen_of(&self, block: u64) -> u32 {
        self.gens
            .as_ref()
            .and_then(|g| g.get(usize::try_from(block).ok()?))
            .copied()
            .unwrap_or(0)
    }

    /// Runs the job to the end.
    ///
    /// # Errors
    /// Anything the back end did wrong, a timeout, a failed verify.
    pub fn run(mut self) -> Result<JobOutcome> {
        let res = self.run_inner();
        if res.is_err() {
            self.stop.store(true, Ordering::Relaxed);
        }
        res
    }

    fn run_inner(&mut self) -> Result<JobOutcome> {
        let verify = self.gens.is_some();
        let mut p = Progress::new(verify && self.rw.reads(), self.runtime);
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Err(Error::Stopped);
            }
            let phase_done = self.submit_batch(&mut p, verify)?;
            if self.reap(&mut p, verify)? > 0 {
                continue;
            }
            if self.in_flight == 0 {
                if !phase_done {
                    // Nothing in flight means every request index is free and no block is busy, so
                    // the phase either issued something or is over: this cannot happen.
                    return Err(Error::Misbehaved(format!(
                        "job {}: internal error: idle with nothing to issue",
                        self.id
                    )));
                }
                if p.next_phase(verify, self.runtime) {
                    break;
                }
                continue;
            }
            if self
                .ring
                .arm(&self.mem)
                .map_err(|e| Error::Misbehaved(e.to_string()))?
            {
                continue;
            }
            self.wait()?;
        }
        Ok(JobOutcome {
            job: self.id,
            read: p.read,
            write: p.write,
            elapsed: p.elapsed,
            verify: verify.then_some(p.report),
        })
    }

    /// The next request of a sequential phase (prefill writes, read-back reads; read-back
    /// skips blocks never written).
    fn next_sequential(&self, p: &mut Progress) -> Next {
        while p.phase == Phase::ReadBack && p.cursor < self.blocks && self.gen_of(p.cursor) == 0 {
            p.report.unwritten += 1;
            p.cursor += 1;
        }
        if p.cursor >= self.blocks {
            return Next::Done;
        }
        p.cursor += 1;
        let op = if p.phase == Phase::Prefill {
            Op::Write
        } else {
            Op::Read
        };
        Next::Io(op, p.cursor - 1)
    }

    /// Submits requests up to the depth and kicks the queue if the device wants it. Returns
    /// true when the phase has issued everything.
    fn submit_batch(&mut self, p: &mut Progress, verify: bool) -> Result<bool> {
        let mut pushed = false;
        let mut phase_done = false;
        while let Some(&req) = self.free.last() {
            let next = match p.phase {
                Phase::Prefill | Phase::ReadBack => self.next_sequential(p),
                Phase::Main => self.next_main(&mut p.cursor, p.issued, p.deadline),
            };
            match next {
                Next::Io(op, block) => {
                    let gen = match op {
                        Op::Write if verify => match self.gen_of(block).wrapping_add(1) {
                            0 => 1,
                            g => g,
                        },
                        _ => self.gen_of(block),
                    };
                    self.free.pop();
                    self.submit(req, op, block, gen)?;
                    if p.phase == Phase::Main {
                        p.issued += 1;
                    }
                    pushed = true;
                }
                Next::Wait => break,
                Next::Done => {
                    phase_done = true;
                    break;
                }
            }
        }
        if pushed && self.ring.publish(&self.mem).map_err(Self::mem_err)? {
            self.kick.write(1).map_err(|source| Error::Os {
                what: "kicking the queue",
                source,
            })?;
        }
        Ok(phase_done)
    }

    /// Completes every used entry; returns how many.
    fn reap(&mut self, p: &mut Progress, verify: bool) -> Result<usize> {
        let mut reaped = 0;
        while let Some(u) = self
            .ring
            .next_used(&self.mem)
            .map_err(|e| Error::Misbehaved(e.to_string()))?
        {
            reaped += 1;
            let req = self.req_of(u.id).ok_or_else(|| {
                Error::Misbehaved(format!(
                    "job {}: used entry names head {}, not a request head",
                    self.id, u.id
                ))
            })?;
            let f = self.inflight[usize::from(req)].take().ok_or_else(|| {
                Error::Misbehaved(format!(
                    "job {}: used entry for head {} which is not in flight",
                    self.id, u.id
                ))
            })?;
            let now = Instant::now();
            self.complete(req, f)?;
            self.free.push(req);
            self.in_flight -= 1;
            p.last_done = now;
            match p.phase {
                Phase::Prefill => p.report.prefilled += 1,
                Phase::ReadBack => p.report.checked += 1,
                Phase::Main => {
                    let d = if f.op == Op::Read {
                        if verify {
                            p.report.verified_reads += 1;
                        }
                        &mut p.read
                    } else {
                        &mut p.write
                    };
                    d.ios += 1;
                    d.bytes += u64::from(self.bs);
                    d.lat.record(now.saturating_duration_since(f.submitted));
                }
            }
        }
        Ok(reaped)
    }

    fn next_main(&mut self, cursor: &mut u64, issued: u64, deadline: Option<Instant>) -> Next {
        match deadline {
            Some(d) if Instant::now() >= d => return Next::Done,
            None if issued >= self.blocks => return Next::Done,
            _ => {}
        }
        let op = match self.rw {
            Rw::Read | Rw::RandRead => Op::Read,
            Rw::Write | Rw::RandWrite => Op::Write,
            Rw::RandRw => {
                if self.rng.gen_range(0..100u8) < self.rwmixread {
                    Op::Read
                } else {
                    Op::Write
                }
            }
        };
        if self.rw.random() {
            for _ in 0..8 {
                let b = self.rng.gen_range(0..self.blocks);
                if !self.block_busy(b) {
                    return Next::Io(op, b);
                }
            }
            Next::Wait
        } else {
            let b = *cursor % self.blocks;
            if self.block_busy(b) {
                return Next::Wait;
            }
            *cursor += 1;
            Next::Io(op, b)
        }
    }

    /// Checks a completed request: status, data (reads, with verify), generation (writes).
    fn complete(&mut self, req: u16, f: InFlight) -> Result<()> {
        let offset = self.start + f.block * u64::from(self.bs);
        let st: u8 = self
            .mem
            .read_obj(GuestAddress(self.area.status(req)))
            .map_err(Self::mem_err)?;
        if let Some(b) = self
            .busy
            .get_mut(usize::try_from(f.block).unwrap_or(usize::MAX))
        {
            *b = false;
        }
        if st == STATUS_UNSET {
            return Err(Error::Misbehaved(format!(
                "job {}: {} at byte {offset} completed without a status byte",
                self.id,
                f.op.name()
            )));
        }
        if st != VIRTIO_BLK_S_OK {
            return Err(Error::Io {
                job: self.id,
                op: f.op.name(),
                offset,
                len: self.bs,
                status: st,
            });
        }
        let Some(gens) = self.gens.as_mut() else {
            return Ok(());
        };
        let b = usize::try_from(f.block).unwrap_or(usize::MAX);
        match f.op {
            Op::Write => {
                if let Some(g) = gens.get_mut(b) {
                    *g = f.gen;
                }
            }
            Op::Read => {
                if f.gen != 0 {
                    self.mem
                        .read_slice(&mut self.scratch, GuestAddress(self.area.data(req)))
                        .map_err(Self::mem_err)?;
                    self.pattern
                        .check(&self.scratch, offset, f.gen, &mut self.expect)
                        .map_err(|mismatch| Error::Verify {
                            job: self.id,
                            mismatch,
                        })?;
                }
            }
        }
        Ok(())
    }

    /// Sleeps until the back end signals the call eventfd, the connection closes, or the
    /// timeout passes.
    fn wait(&mut self) -> Result<()> {
        let mut fds = [
            libc::pollfd {
                fd: self.call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.watch,
                events: libc::POLLRDHUP,
                revents: 0,
            },
        ];
        let ms = i32::try_from(self.timeout.as_millis()).unwrap_or(i32::MAX);
        let start = Instant::now();
        loop {
            // SAFETY: fds is a valid array of two pollfd for the duration of the call; poll
            // writes only their revents.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Error::Os {
                    what: "polling the call eventfd",
                    source: e,
                });
            }
            if n == 0 {
                return Err(Error::Timeout {
                    job: self.id,
                    secs: start.elapsed().as_secs_f64(),
                    inflight: self.in_flight,
                });
            }
            break;
        }
        if fds[1].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
        {
            return Err(Error::Disconnected {
                job: self.id,
                inflight: self.in_flight,
            });
        }
        if fds[0].revents & libc::POLLIN != 0 {
            // Non-blocking: EAGAIN only if another reader raced us, which cannot happen.
            let _ = self.call.read();
        }
        Ok(())
    }
}

fn now_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(0))
        .unwrap_or(0)
}
