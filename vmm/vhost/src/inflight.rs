//! `VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`: the block device's requests in flight, recorded in a
//! region the front end keeps, so that a back end started after a crash serves them again.
//!
//! The front end asks for the region once (`GET_INFLIGHT_FD`: queue count and size): the back
//! end creates a memfd ([`Region::create`], zeroed, sealed against growing and shrinking) and
//! hands its fd over. The front end gives it back at every start (`SET_INFLIGHT_FD`), to
//! whichever back end process serves it then; QEMU's `vhost-user-blk` does so after each
//! reconnect (`reconnect=N` on its chardev). The layout is the vhost-user specification's
//! ("Inflight I/O tracking", split virtqueues), one queue region after another, each
//! [`queue_region_len`] bytes (64-byte aligned, as libvhost-user lays them out):
//!
//! | offset | field | |
//! |---|---|---|
//! | 0 | `features: u64` | 0 |
//! | 8 | `version: u16` | 0: never used (initialized on first use), 1: in use |
//! | 10 | `desc_num: u16` | the queue size |
//! | 12 | `last_batch_head: u16` | the last head put on the used ring |
//! | 14 | `used_idx: u16` | the used ring's index once that head's record is complete |
//! | 16 + 16 i | `inflight: u8`, `padding[5]`, `next: u16`, `counter: u64` | head `i` |
//!
//! Each queue's worker keeps its part through a [`QueueLog`] (a [`HeadLog`]: the block worker
//! and the queue loop in `devices` call it): a popped head gets the next counter, then
//! `inflight = 1`; a used one is linked into the last batch (`next`, `last_batch_head`), its used
//! entry written, then `inflight = 0` and `used_idx` set to the ring's index. A crash at any
//! point leaves a record [`QueueLog::resume`] completes: a used index behind the ring's means
//! the last batch reached the ring, so its heads are no longer in flight; every head still
//! marked is served again, in counter order.
//!
//! The region is the front end's memory as much as ours: what a `SET_INFLIGHT_FD` hands over
//! ([`Region::adopt`]) must be a memfd sealed against shrinking (so the mapping can never
//! SIGBUS), large enough (`fstat`) for its queues, and hold a record that makes sense
//! ([`Region::check`]: versions, sizes, flags, distinct counters); and since the front end can
//! write it at any time, [`QueueLog::resume`] checks it again when it reads it (a used index
//! more than a queue behind, a batch list out of range or looping, a head marked twice in
//! order). A region refused at `SET_INFLIGHT_FD` is a failure reply and the end of the session;
//! one found bad at resume breaks the queue's worker (DEVICE_NEEDS_RESET). Nothing read from
//! the region is ever an index without a bound check.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use devices::virtio::headlog::HeadLog;
use vm_memory::{Bytes, FileOffset, MmapRegion, VolatileMemory};

// Sizes and offsets of the inflight region's format (QEMU's layout): constants, alike in
// shape only to other tables.
/// Alignment of each queue's region.
const QUEUE_ALIGN: usize = 64;
/// Bytes of a queue region's header (features, version, desc_num, last_batch_head, used_idx).
const HEADER: usize = 16;
/// Bytes of one descriptor's state (inflight, padding, next, counter).
const DESC: usize = 16;
/// Header field offsets.
const VERSION: usize = 8;
const DESC_NUM: usize = 10;
const LAST_BATCH_HEAD: usize = 12;
const USED_IDX: usize = 14;
/// Offsets inside a descriptor's state.
const INFLIGHT: usize = 0;
const NEXT: usize = 6;
const COUNTER: usize = 8;
/// The region format this back end writes.
const FORMAT_VERSION: u16 = 1;
/// Counters at or above this are refused: the next one must never overflow.
const COUNTER_LIMIT: u64 = 1 << 63;
/// Bytes of the inflight description (mmap size, mmap offset, queue count, queue size, padding).
pub const DESCRIPTION_LEN: usize = 24;

/// Bytes of one queue's region for a queue of `queue_size` (header and descriptor states,
/// rounded up to 64 bytes).
pub fn queue_region_len(queue_size: u16) -> usize {
    (HEADER + DESC * usize::from(queue_size)).next_multiple_of(QUEUE_ALIGN)
}

/// Why an inflight description or region is refused.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum InflightError {
    /// The message body is not an inflight description, or does not carry one fd.
    #[error("inflight description of {body} bytes with {fds} fds")]
    Malformed {
        /// The body's length.
        body: usize,
        /// The fds attached.
        fds: usize,
    },
    /// A queue count the device does not have.
    #[error("{num} queues asked for a device of {max}")]
    Queues {
        /// Asked for.
        num: u16,
        /// The device's queue count.
        max: usize,
    },
    /// A queue size the device would refuse.
    #[error("queue size {size} is not a power of two between 1 and {max}")]
    QueueSize {
        /// Asked for.
        size: u16,
        /// The device's largest queue size.
        max: usize,
    },
    /// A region smaller than its queues need.
    #[error(
        "a {size:#x}-byte region cannot hold {queues} queues of {queue_size} ({needed:#x} bytes)"
    )]
    TooSmall {
        /// The region's size (the description's, or the file's past the offset).
        size: u64,
        /// Queues.
        queues: u16,
        /// Queue size.
        queue_size: u16,
        /// Bytes needed.
        needed: u64,
    },
    /// An fd that cannot hold a region that may never shrink under the mapping.
    #[error("the inflight fd is not a memfd sealed against shrinking ({0})")]
    NotSealed(String),
    /// Creating or mapping the region failed.
    #[error("inflight region: {0}")]
    Os(String),
    /// A queue's record that is not in this format.
    #[error("queue {queue}: version {version}, {desc_num} descriptors (expected version 0 or 1 and {queue_size})")]
    Format {
        /// Queue index.
        queue: u16,
        /// The record's version.
        version: u16,
        /// The record's descriptor count.
        desc_num: u16,
        /// The queue size of the description (or of the ring).
        queue_size: u16,
    },
    /// An `inflight` flag other than 0 or 1.
    #[error("queue {queue}: head {head} has inflight flag {flag}")]
    Flag {
        /// Queue index.
        queue: u16,
        /// Head index.
        head: u16,
        /// The flag.
        flag: u8,
    },
    /// Two heads in flight with the same counter, or a counter too large to continue from.
    #[error("queue {queue}: head {head}'s counter {counter:#x} is taken or too large")]
    Counter {
        /// Queue index.
        queue: u16,
        /// Head index.
        head: u16,
        /// Its counter.
        counter: u64,
    },
    /// A used index further behind the used ring's than a queue.
    #[error(
        "queue {queue}: the record's used index {recorded} is {behind} behind the ring's {ring}"
    )]
    UsedIndex {
        /// Queue index.
        queue: u16,
        /// The record's.
        recorded: u16,
        /// The ring's.
        ring: u16,
        /// The difference.
        behind: u16,
    },
    /// A last-batch list that leaves the queue or comes back to a head.
    #[error("queue {queue}: the last batch's list reaches head {head} out of range or twice")]
    Batch {
        /// Queue index.
        queue: u16,
        /// Where the walk went wrong.
        head: u16,
    },
}

/// The inflight description of `GET_INFLIGHT_FD` and `SET_INFLIGHT_FD`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Description {
    /// Bytes of the region.
    pub mmap_size: u64,
    /// Offset of the region in its fd.
    pub mmap_offset: u64,
    /// Queues it covers.
    pub num_queues: u16,
    /// Their size.
    pub queue_size: u16,
}

impl Description {
    /// Decodes a message body.
    ///
    /// # Errors
    /// [`InflightError::Malformed`] for a body shorter than a description.
    pub fn decode(body: &[u8], fds: usize) -> Result<Self, InflightError> {
        let malformed = || InflightError::Malformed {
            body: body.len(),
            fds,
        };
        let u64_at = |at: usize| -> Option<u64> {
            Some(u64::from_le_bytes(body.get(at..at + 8)?.try_into().ok()?))
        };
        let u16_at = |at: usize| -> Option<u16> {
            Some(u16::from_le_bytes(body.get(at..at + 2)?.try_into().ok()?))
        };
        Ok(Self {
            mmap_size: u64_at(0).ok_or_else(malformed)?,
            mmap_offset: u64_at(8).ok_or_else(malformed)?,
            num_queues: u16_at(16).ok_or_else(malformed)?,
            queue_size: u16_at(18).ok_or_else(malformed)?,
        })
    }

    /// The message body.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(DESCRIPTION_LEN);
        b.extend_from_slice(&self.mmap_size.to_le_bytes());
        b.extend_from_slice(&self.mmap_offset.to_le_bytes());
        b.extend_from_slice(&self.num_queues.to_le_bytes());
        b.extend_from_slice(&self.queue_size.to_le_bytes());
        b.resize(DESCRIPTION_LEN, 0);
        b
    }

    /// Checks the queue count and size against the device's (`max_queues`, `max_queue_size`)
    /// and returns the bytes the queues need.
    ///
    /// # Errors
    /// [`InflightError::Queues`], [`InflightError::QueueSize`].
    pub fn needed(&self, max_queues: usize, max_queue_size: usize) -> Result<usize, InflightError> {
        if self.num_queues == 0 || usize::from(self.num_queues) > max_queues {
            return Err(InflightError::Queues {
                num: self.num_queues,
                max: max_queues,
            });
        }
        if !self.queue_size.is_power_of_two() || usize::from(self.queue_size) > max_queue_size {
            return Err(InflightError::QueueSize {
                size: self.queue_size,
                max: max_queue_size,
            });
        }
        // At most 65535 queues of 64 + 16 * 32768 bytes: fits usize on 64-bit hosts; checked
        // anyway.
        queue_region_len(self.queue_size)
            .checked_mul(usize::from(self.num_queues))
            .ok_or(InflightError::TooSmall {
                size: self.mmap_size,
                queues: self.num_queues,
                queue_size: self.queue_size,
                needed: u64::MAX,
            })
    }
}

/// A mapped inflight region: `num_queues` queue regions of `queue_size` descriptors.
#[derive(Debug)]
pub struct Region {
    map: MmapRegion<()>,
    num_queues: u16,
    queue_size: u16,
}

fn errno_string() -> String {
    std::io::Error::last_os_error().to_string()
}

impl Region {
    /// `GET_INFLIGHT_FD`: a new zeroed region for the queues `desc` asks for (checked against
    /// the device's `max_queues` and `max_queue_size`), and the reply's description and fd.
    ///
    /// # Errors
    /// What [`Description::needed`] refuses; [`InflightError::Os`] when the memfd cannot be
    /// made.
    pub fn create(
        desc: &Description,
        max_queues: usize,
        max_queue_size: usize,
    ) -> Result<(Description, OwnedFd), InflightError> {
        let needed = desc.needed(max_queues, max_queue_size)?;
        // SAFETY: memfd_create reads the NUL-terminated name and takes flags; it returns a new
        // descriptor or -1.
        let raw = unsafe {
            libc::memfd_create(
                c"bouncevm-inflight".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return Err(InflightError::Os(format!(
                "memfd_create: {}",
                errno_string()
            )));
        }
        // SAFETY: `raw` was just created and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let file = File::from(fd);
        file.set_len(needed as u64)
            .map_err(|e| InflightError::Os(format!("sizing the memfd: {e}")))?;
        // SAFETY: F_ADD_SEALS on a descriptor we own, with an integer argument.
        let sealed = unsafe {
            libc::fcntl(
                file.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL,
            )
        };
        if sealed < 0 {
            return Err(InflightError::Os(format!(
                "sealing the memfd: {}",
                errno_string()
            )));
        }
        let reply = Description {
            mmap_size: needed as u64,
            mmap_offset: 0,
            num_queues: desc.num_queues,
            queue_size: desc.queue_size,
        };
        Ok((reply, file.into()))
    }

    /// `SET_INFLIGHT_FD`: maps the region `desc` describes in `fd`, after checking the
    /// description against the device, the fd (a memfd sealed, or sealable, against
    /// shrinking, whose size covers the queues) and the record ([`Region::check`]).
    ///
    /// # Errors
    /// The first check that fails.
    pub fn adopt(
        desc: &Description,
        fd: OwnedFd,
        max_queues: usize,
        max_queue_size: usize,
    ) -> Result<Self, InflightError> {
        let needed = desc.needed(max_queues, max_queue_size)?;
        let too_small = |size| InflightError::TooSmall {
            size,
            queues: desc.num_queues,
            queue_size: desc.queue_size,
            needed: needed as u64,
        };
        if desc.mmap_size < needed as u64 {
            return Err(too_small(desc.mmap_size));
        }
        seal_against_shrinking(&fd)?;
        let file = File::from(fd);
        let meta = file
            .metadata()
            .map_err(|e| InflightError::NotSealed(format!("fstat: {e}")))?;
        if !meta.file_type().is_file() {
            return Err(InflightError::NotSealed("not a regular file".into()));
        }
        let past_offset = meta.len().saturating_sub(desc.mmap_offset);
        if past_offset < needed as u64 {
            return Err(too_small(past_offset));
        }
        // Only what the queues need is mapped, whatever size the description claims.
        let map = MmapRegion::from_file(FileOffset::new(file, desc.mmap_offset), needed)
            .map_err(|e| InflightError::Os(format!("mapping: {e}")))?;
        let region = Self {
            map,
            num_queues: desc.num_queues,
            queue_size: desc.queue_size,
        };
        region.check()?;
        Ok(region)
    }

    /// Queues the region covers.
    pub fn num_queues(&self) -> u16 {
        self.num_queues
    }

    /// Checks every queue's record: version 0 (never used), or version 1 with the queue size,
    /// flags 0 or 1, and distinct counters below 2^63 for the heads in flight.
    ///
    /// # Errors
    /// [`InflightError::Format`], [`InflightError::Flag`], [`InflightError::Counter`].
    pub fn check(&self) -> Result<(), InflightError> {
        (0..self.num_queues).try_for_each(|q| self.in_flight(q, self.queue_size).map(drop))
    }

    /// Byte offset of queue `q`'s region.
    fn base(&self, q: u16) -> usize {
        usize::from(q) * queue_region_len(self.queue_size)
    }

    fn load<T: vm_memory::AtomicAccess>(&self, at: usize) -> Option<T> {
        self.map
            .as_volatile_slice()
            .load(at, Ordering::Acquire)
            .ok()
    }

    fn store<T: vm_memory::AtomicAccess>(&self, at: usize, v: T) {
        // In range by construction (every caller bounds its index); a failure would only
        // mean a write lost, never memory outside the mapping touched.
        let _ = self.map.as_volatile_slice().store(v, at, Ordering::Release);
    }

    /// The offset of head `head`'s state in queue `q`, if the head is in the region.
    fn desc(&self, q: u16, head: u16) -> Option<usize> {
        (q < self.num_queues && head < self.queue_size)
            .then(|| self.base(q) + HEADER + DESC * usize::from(head))
    }

    /// Queue `q`'s version and descriptor count, checked for a queue of `queue_size`.
    fn format(&self, q: u16, queue_size: u16) -> Result<u16, InflightError> {
        let base = self.base(q);
        let version: u16 = self.load(base + VERSION).unwrap_or(u16::MAX);
        let desc_num: u16 = self.load(base + DESC_NUM).unwrap_or(u16::MAX);
        let ok = match version {
            0 => true,
            FORMAT_VERSION => desc_num == queue_size,
            _ => false,
        };
        if ok && queue_size <= self.queue_size {
            Ok(version)
        } else {
            Err(InflightError::Format {
                queue: q,
                version,
                desc_num,
                queue_size,
            })
        }
    }

    /// The heads of queue `q` (of `queue_size`) marked in flight, with their counters, in
    /// counter order (none for a record never used).
    fn in_flight(&self, q: u16, queue_size: u16) -> Result<Vec<(u64, u16)>, InflightError> {
        if self.format(q, queue_size)? == 0 {
            return Ok(Vec::new());
        }
        let mut heads = Vec::new();
        for head in 0..queue_size {
            let Some(at) = self.desc(q, head) else {
                break;
            };
            let flag: u8 = self.load(at + INFLIGHT).unwrap_or(u8::MAX);
            match flag {
                0 => {}
                1 => {
                    let counter: u64 = self.load(at + COUNTER).unwrap_or(u64::MAX);
                    heads.push((counter, head));
                }
                _ => {
                    return Err(InflightError::Flag {
                        queue: q,
                        head,
                        flag,
                    })
                }
            }
        }
        heads.sort_unstable();
        let taken = heads.windows(2).find(|w| w[0].0 == w[1].0).map(|w| w[1]);
        let too_large = heads.iter().find(|h| h.0 >= COUNTER_LIMIT).copied();
        if let Some((counter, head)) = taken.or(too_large) {
            return Err(InflightError::Counter {
                queue: q,
                head,
                counter,
            });
        }
        Ok(heads)
    }

    /// Starts queue `q`'s record over for a queue of `queue_size`: no head in flight.
    fn initialize(&self, q: u16, queue_size: u16, used_idx: u16) {
        for head in 0..queue_size {
            if let Some(at) = self.desc(q, head) {
                self.store(at + INFLIGHT, 0u8);
                self.store(at + NEXT, 0u16);
                self.store(at + COUNTER, 0u64);
            }
        }
        let base = self.base(q);
        self.store(base + DESC_NUM, queue_size);
        self.store(base + LAST_BATCH_HEAD, 0u16);
        self.store(base + USED_IDX, used_idx);
        self.store(base + VERSION, FORMAT_VERSION);
    }

    /// Clears the in-flight marks of queue `q`'s last batch (`count` heads from
    /// `last_batch_head` along `next`), which reached the used ring before the record said so.
    fn finish_last_batch(&self, q: u16, queue_size: u16, count: u16) -> Result<(), InflightError> {
        let base = self.base(q);
        let mut head: u16 = self.load(base + LAST_BATCH_HEAD).unwrap_or(u16::MAX);
        let mut seen = vec![false; usize::from(queue_size)];
        for _ in 0..count {
            let bad = InflightError::Batch { queue: q, head };
            let at = self
                .desc(q, head)
                .filter(|_| head < queue_size)
                .ok_or(bad.clone())?;
            let slot = seen.get_mut(usize::from(head)).ok_or(bad.clone())?;
            if std::mem::replace(slot, true) {
                return Err(bad);
            }
            self.store(at + INFLIGHT, 0u8);
            head = self.load(at + NEXT).unwrap_or(u16::MAX);
        }
        Ok(())
    }
}

/// Adds F_SEAL_SHRINK to `fd` (a memfd) unless it has it: the region can then never shrink
/// under the mapping, so no access to it can SIGBUS.
fn seal_against_shrinking(fd: &OwnedFd) -> Result<(), InflightError> {
    let raw = fd.as_raw_fd();
    // SAFETY: F_ADD_SEALS on a descriptor we own, with an integer argument. It fails with
    // EPERM when the seals are sealed (F_SEAL_SEAL), EINVAL when the file cannot be sealed.
    unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
    // SAFETY: F_GET_SEALS on a descriptor we own; no argument.
    let seals = unsafe { libc::fcntl(raw, libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(InflightError::NotSealed(errno_string()));
    }
    if seals & libc::F_SEAL_SHRINK == 0 {
        return Err(InflightError::NotSealed(format!("seals {seals:#x}")));
    }
    Ok(())
}

/// One queue's part of a [`Region`], kept by that queue's worker.
#[derive(Debug)]
pub struct QueueLog {
    region: Arc<Region>,
    queue: u16,
    /// The queue size the record was resumed for (heads at or above it are never written).
    queue_size: u16,
    /// The next pop's counter.
    counter: u64,
}

impl QueueLog {
    /// The log of queue `queue` of `region` (resumed before use: [`HeadLog::resume`]).
    pub fn new(region: Arc<Region>, queue: u16) -> Self {
        Self {
            region,
            queue,
            queue_size: 0,
            counter: 0,
        }
    }

    fn desc(&self, head: u16) -> Option<usize> {
        (head < self.queue_size)
            .then(|| self.region.desc(self.queue, head))
            .flatten()
    }
}

impl HeadLog for QueueLog {
    fn resume(&mut self, used_idx: u16, queue_size: u16) -> Result<Vec<u16>, String> {
        let (r, q) = (&self.region, self.queue);
        self.queue_size = 0;
        if r.format(q, queue_size).map_err(|e| e.to_string())? == 0 {
            r.initialize(q, queue_size, used_idx);
            self.queue_size = queue_size;
            self.counter = 0;
            return Ok(Vec::new());
        }
        let base = r.base(q);
        let recorded: u16 = r.load(base + USED_IDX).unwrap_or(u16::MAX);
        if recorded != used_idx {
            let behind = used_idx.wrapping_sub(recorded);
            if behind > queue_size {
                return Err(InflightError::UsedIndex {
                    queue: q,
                    recorded,
                    ring: used_idx,
                    behind,
                }
                .to_string());
            }
            r.finish_last_batch(q, queue_size, behind)
                .map_err(|e| e.to_string())?;
            r.store(base + USED_IDX, used_idx);
        }
        let heads = r.in_flight(q, queue_size).map_err(|e| e.to_string())?;
        // Below COUNTER_LIMIT (checked): the next counter cannot overflow.
        self.counter = heads.last().map_or(0, |&(c, _)| c + 1);
        self.queue_size = queue_size;
        Ok(heads.into_iter().map(|(_, h)| h).collect())
    }

    fn popped(&mut self, head: u16) {
        if let Some(at) = self.desc(head) {
            self.region.store(at + COUNTER, self.counter);
            self.region.store(at + INFLIGHT, 1u8);
            // Popped at most once per head between uses, and at most 2^63 - 1 resumed from:
            // years of pops at any rate before this could wrap.
            self.counter = self.counter.wrapping_add(1);
        }
    }

    fn unpopped(&mut self, head: u16) {
        if let Some(at) = self.desc(head) {
            self.region.store(at + INFLIGHT, 0u8);
        }
    }

    fn using(&mut self, head: u16) {
        if let Some(at) = self.desc(head) {
            let base = self.region.base(self.queue);
            let last: u16 = self.region.load(base + LAST_BATCH_HEAD).unwrap_or(0);
            self.region.store(at + NEXT, last);
            self.region.store(base + LAST_BATCH_HEAD, head);
        }
    }

    fn used(&mut self, head: u16, used_idx: u16) {
        if let Some(at) = self.desc(head) {
            self.region.store(at + INFLIGHT, 0u8);
            self.region
                .store(self.region.base(self.queue) + USED_IDX, used_idx);
        }
    }
}

/// The region of a session, shared by the relay (which sets it on `SET_INFLIGHT_FD`) and the
/// adapter (which hands each worker its queue's log before the worker serves anything).
#[derive(Debug, Default)]
pub struct Inflight {
    region: Mutex<Option<Arc<Region>>>,
    /// Bumped at every change, so a worker thread notices one without taking the lock.
    generation: AtomicU64,
}

impl Inflight {
    /// Replaces the session's region (`None`: forgets it, as a device reset does).
    pub fn set(&self, region: Option<Region>) {
        *self
            .region
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = region.map(Arc::new);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Changes so far.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The logs of `queues` (one per queue, in order), or `None` when there is no region or
    /// it does not cover them all.
    pub fn logs(&self, queues: &[u16]) -> Option<Vec<Box<dyn HeadLog>>> {
        let region = self
            .region
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()?;
        if queues.iter().any(|&q| q >= region.num_queues()) {
            return None;
        }
        Some(
            queues
                .iter()
                .map(|&q| Box::new(QueueLog::new(Arc::clone(&region), q)) as Box<dyn HeadLog>)
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QS: u16 = 8;

    fn desc(num_queues: u16, queue_size: u16) -> Description {
        Description {
            mmap_size: 0,
            mmap_offset: 0,
            num_queues,
            queue_size,
        }
    }

    /// A region from GET_INFLIGHT_FD, handed back with SET_INFLIGHT_FD (the fd kept for the
    /// test to write as a front end would).
    fn adopted(num_queues: u16) -> (Arc<Region>, File) {
        let (reply, fd) = Region::create(&desc(num_queues, QS), 4, 256).unwrap();
        let file = File::from(fd.try_clone().unwrap());
        (Arc::new(Region::adopt(&reply, fd, 4, 256).unwrap()), file)
    }

    /// A one-queue region whose queue-0 log has popped `heads`, in that order.
    fn popped(heads: &[u16]) -> (Arc<Region>, File, QueueLog) {
        let (region, file) = adopted(1);
        let mut log = QueueLog::new(Arc::clone(&region), 0);
        log.resume(0, QS).unwrap();
        heads.iter().for_each(|&h| log.popped(h));
        (region, file, log)
    }

    /// Writes `bytes` at `at` of the region through the front end's fd.
    fn poke(file: &File, at: usize, bytes: &[u8]) {
        use std::os::unix::fs::FileExt;
        file.write_all_at(bytes, at as u64).unwrap();
    }

    fn head_state(q: u16, head: u16) -> usize {
        usize::from(q) * queue_region_len(QS) + HEADER + DESC * usize::from(head)
    }

    #[test]
    fn regions_are_laid_out_as_libvhost_user_does() {
        assert_eq!(queue_region_len(1), 64);
        assert_eq!(queue_region_len(128), 16 * 128 + 64);
        assert_eq!(queue_region_len(256), 4160);
        let (reply, _fd) = Region::create(&desc(2, 128), 4, 256).unwrap();
        assert_eq!((reply.mmap_size, reply.mmap_offset), (2 * 2112, 0));
        let d = Description::decode(&reply.encode(), 1).unwrap();
        assert_eq!(d, reply);
    }

    #[test]
    fn popped_heads_are_resumed_in_pop_order_and_used_ones_are_not() {
        let (region, _f) = adopted(2);
        let mut log = QueueLog::new(Arc::clone(&region), 1);
        assert_eq!(log.resume(0, QS).unwrap(), Vec::<u16>::new());
        for h in [5, 2, 7, 0] {
            log.popped(h);
        }
        log.using(2);
        log.used(2, 1);
        // A new back end finds 5, 7, 0 in flight, in that order.
        let mut next = QueueLog::new(Arc::clone(&region), 1);
        assert_eq!(next.resume(1, QS).unwrap(), vec![5, 7, 0]);
        // Queue 0 was never used.
        assert_eq!(
            QueueLog::new(Arc::clone(&region), 0).resume(0, QS).unwrap(),
            Vec::<u16>::new()
        );
        // New pops come after the resubmitted ones.
        next.popped(3);
        assert_eq!(
            QueueLog::new(region, 1).resume(1, QS).unwrap(),
            vec![5, 7, 0, 3]
        );
    }

    #[test]
    fn a_used_entry_that_reached_the_ring_before_its_record_is_not_served_again() {
        let (region, _f, mut log) = popped(&[4, 6]);
        // Crash after the used entry of 6 (the ring's index is now 1), before `used`.
        log.using(6);
        assert_eq!(QueueLog::new(region, 0).resume(1, QS).unwrap(), vec![4]);
    }

    #[test]
    fn hostile_regions_are_refused_at_set_inflight_fd() {
        let max = (4, 256);
        // Queue counts and sizes the device does not have.
        for d in [
            desc(0, QS),
            desc(5, QS),
            desc(1, 0),
            desc(1, 12),
            desc(1, 512),
        ] {
            let (_, fd) = Region::create(&desc(1, QS), 4, 256).unwrap();
            assert!(Region::adopt(&d, fd, max.0, max.1).is_err(), "{d:?}");
        }
        // A description smaller than its queues, and a file smaller than its description.
        let (mut reply, fd) = Region::create(&desc(1, QS), 4, 256).unwrap();
        reply.mmap_size -= 1;
        assert!(matches!(
            Region::adopt(&reply, fd, max.0, max.1),
            Err(InflightError::TooSmall { .. })
        ));
        let (mut reply, fd) = Region::create(&desc(1, QS), 4, 256).unwrap();
        reply.mmap_offset = 4096;
        assert!(matches!(
            Region::adopt(&reply, fd, max.0, max.1),
            Err(InflightError::TooSmall { .. })
        ));
        // A file that cannot be sealed against shrinking (it could SIGBUS the mapping).
        let dir = std::env::temp_dir().join(format!("inflight-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let plain = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.join("region"))
            .unwrap();
        plain.set_len(4096).unwrap();
        let mut d = desc(1, QS);
        d.mmap_size = 4096;
        assert!(matches!(
            Region::adopt(&d, plain.into(), max.0, max.1),
            Err(InflightError::NotSealed(_))
        ));
        let _ = std::fs::remove_dir_all(&dir);
        // Records that make no sense: a version, a descriptor count, a flag, two heads with
        // one counter, a counter too large to continue from.
        let version = |f: &File| poke(f, VERSION, &7u16.to_le_bytes());
        let desc_num = |f: &File| {
            poke(f, VERSION, &1u16.to_le_bytes());
            poke(f, DESC_NUM, &(QS * 2).to_le_bytes());
        };
        let flag = |f: &File| {
            poke(f, VERSION, &1u16.to_le_bytes());
            poke(f, DESC_NUM, &QS.to_le_bytes());
            poke(f, head_state(0, 3) + INFLIGHT, &[2]);
        };
        let counters = |f: &File| {
            poke(f, VERSION, &1u16.to_le_bytes());
            poke(f, DESC_NUM, &QS.to_le_bytes());
            for h in [1, 5] {
                poke(f, head_state(0, h) + INFLIGHT, &[1]);
                poke(f, head_state(0, h) + COUNTER, &9u64.to_le_bytes());
            }
        };
        let huge = |f: &File| {
            poke(f, VERSION, &1u16.to_le_bytes());
            poke(f, DESC_NUM, &QS.to_le_bytes());
            poke(f, head_state(0, 1) + INFLIGHT, &[1]);
            poke(f, head_state(0, 1) + COUNTER, &u64::MAX.to_le_bytes());
        };
        let cases: [&dyn Fn(&File); 5] = [&version, &desc_num, &flag, &counters, &huge];
        for (i, corrupt) in cases.iter().enumerate() {
            let (reply, fd) = Region::create(&desc(1, QS), 4, 256).unwrap();
            corrupt(&File::from(fd.try_clone().unwrap()));
            assert!(Region::adopt(&reply, fd, max.0, max.1).is_err(), "case {i}");
        }
    }

    #[test]
    fn a_record_corrupted_after_it_was_taken_is_refused_at_resume() {
        let (region, f, _log) = popped(&[1, 2]);
        // The ring's used index far ahead of the record's.
        assert!(QueueLog::new(Arc::clone(&region), 0)
            .resume(100, QS)
            .unwrap_err()
            .contains("behind"));
        // A last batch whose list loops (2 -> 1 -> 2) or leaves the queue.
        poke(&f, LAST_BATCH_HEAD, &2u16.to_le_bytes());
        poke(&f, head_state(0, 2) + NEXT, &1u16.to_le_bytes());
        poke(&f, head_state(0, 1) + NEXT, &2u16.to_le_bytes());
        assert!(QueueLog::new(Arc::clone(&region), 0).resume(3, QS).is_err());
        poke(&f, head_state(0, 1) + NEXT, &500u16.to_le_bytes());
        assert!(QueueLog::new(Arc::clone(&region), 0).resume(3, QS).is_err());
        // A ring of another size than the record's.
        assert!(QueueLog::new(Arc::clone(&region), 0)
            .resume(0, QS / 2)
            .is_err());
        // Within bounds, the batch of two is completed and nothing is left in flight.
        assert_eq!(
            QueueLog::new(Arc::clone(&region), 0).resume(2, QS).unwrap(),
            Vec::<u16>::new()
        );
        // Writes for heads outside the queue are dropped, never outside the mapping.
        let mut log = QueueLog::new(Arc::clone(&region), 0);
        log.resume(2, QS).unwrap();
        log.popped(u16::MAX);
        log.used(QS, 9);
        assert_eq!(
            QueueLog::new(region, 0).resume(2, QS).unwrap(),
            Vec::<u16>::new()
        );
    }
}
