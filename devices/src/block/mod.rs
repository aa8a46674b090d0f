//! virtio-blk (virtio 1.2, section 5.2) on top of the bounce module.
//!
//! Layout, as in Firecracker's block device:
//! - this file: protocol constants, the error enum, the device configuration;
//! - [`device`]: the [`Block`] device (features, configuration space, lifecycle);
//! - [`worker`]: its per-queue [`BlockWorker`]s (submission, completion, back-pressure);
//! - [`request`]: one [`request::Request`] from its descriptor chain to its status: parsing
//!   into a [`request::RequestType`], mapping and planning its host I/O, the status byte;
//! - [`inflight`]: the table of requests in flight, the guest-memory pin, the retry timer;
//! - [`io`]: disk backends behind the [`io::Disk`] trait (raw file, qcow2 through `imago`,
//!   memory);
//! - [`metrics`]: per-device counters, serialisable to JSON.
//!
//! Every byte the device moves between the guest and a disk goes through the device's
//! [`bounce::Dma`] handle: the request header, the data buffers, discard segments, the id
//! string and the status byte. Queue rings and descriptor tables are read by `virtio-queue` and
//! the chain walker, as on a real platform where the rings are shared (decrypted) memory.

pub mod device;
pub mod inflight;
pub mod io;
pub mod metrics;
pub mod request;
pub mod worker;

use std::mem::{offset_of, size_of};

use crate::virtio::spec::{
    virtio_blk_config, virtio_blk_discard_write_zeroes, virtio_blk_outhdr, VIRTIO_BLK_ID_BYTES,
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_UNSUPP,
};

pub use device::Block;
pub use io::{Disk, DiskImage, MemDisk, Qcow2Disk, RawDisk};
pub use metrics::BlockMetrics;
pub use worker::BlockWorker;

/// Sector size of the virtio-blk protocol: sector numbers and capacity are in these units
/// whatever the logical block size.
pub const SECTOR_SHIFT: u32 = 9;
/// 512.
pub const SECTOR_SIZE: u64 = 1 << SECTOR_SHIFT;

/// Length of the request header (`struct virtio_blk_outhdr`: type, reserved, sector).
pub const REQ_HEADER_LEN: usize = size_of::<virtio_blk_outhdr>();
/// A status byte no virtio-blk status has: a driver writes it before submitting, so a
/// completion that leaves it shows a device that did not write the status.
pub const STATUS_UNSET: u8 = 0xff;
/// Length of one discard / write-zeroes segment (`struct virtio_blk_discard_write_zeroes`).
pub const DISCARD_SEG_LEN: usize = size_of::<virtio_blk_discard_write_zeroes>();
/// Bytes of the id string answered to GET_ID (`VIRTIO_BLK_ID_BYTES`, a small `u32`).
pub const ID_BYTES: usize = VIRTIO_BLK_ID_BYTES as usize;
/// Size of the configuration space this device exposes (up to and including
/// `write_zeroes_may_unmap` and its padding; the secure-erase and zoned fields are not offered).
pub const CONFIG_SPACE_LEN: usize = offset_of!(virtio_blk_config, max_secure_erase_sectors);

/// Errors of the block device: each one decides a request's status and a counter.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum BlockError {
    /// The descriptor chain is malformed: a loop, too long, a bad index, a nested or
    /// unnegotiated indirect table, a zero-length descriptor, a readable descriptor after a
    /// writable one, or buffers too short or in the wrong direction for the request.
    #[error("bad descriptor chain: {0}")]
    BadChain(&'static str),
    /// The chain walker refused the chain.
    #[error("bad descriptor chain: {0}")]
    Chain(crate::virtio::chain::ChainError),
    /// A buffer lies (partly) outside guest memory.
    #[error("buffer {addr:#x}+{len:#x} is outside guest memory")]
    GuestAccess {
        /// Guest address.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// The bounce module refused a mapping (pool full, too large, ...).
    #[error("bounce: {0}")]
    Bounce(bounce::Error),
    /// The request addresses sectors beyond the end of the disk (or its arithmetic
    /// overflows).
    #[error("sectors {sector}+{sectors} are beyond the disk end ({capacity} sectors)")]
    OutOfRange {
        /// First sector.
        sector: u64,
        /// Number of sectors (may be a byte count rounded up).
        sectors: u64,
        /// Disk capacity in sectors.
        capacity: u64,
    },
    /// A data length that is not a multiple of the sector size.
    #[error("data length {0} is not a multiple of 512")]
    Unaligned(u64),
    /// A write-type request on a read-only disk.
    #[error("write to a read-only disk")]
    ReadOnly,
    /// The backend failed.
    #[error("I/O error: {0}")]
    Io(String),
    /// The backend transferred fewer bytes than asked.
    #[error("short transfer: {done} of {expected} bytes")]
    Short {
        /// Bytes asked for.
        expected: u64,
        /// Bytes transferred.
        done: u64,
    },
    /// An unknown or unnegotiated request type, or a segment with unsupported flags.
    #[error("unsupported request {0}")]
    Unsupported(u32),
    /// A discard or write-zeroes request beyond the advertised limits.
    #[error("discard/write-zeroes limits exceeded: {0}")]
    Limits(&'static str),
    /// A device configuration that cannot run.
    #[error("invalid block device configuration: {0}")]
    Config(String),
}

impl BlockError {
    /// The status byte this error completes a request with.
    pub fn status(&self) -> u8 {
        match self {
            Self::Unsupported(_) => VIRTIO_BLK_S_UNSUPP,
            _ => VIRTIO_BLK_S_IOERR,
        }
    }
}

impl From<bounce::Error> for BlockError {
    fn from(e: bounce::Error) -> Self {
        match e {
            bounce::Error::OrigAccess { addr, len } => Self::GuestAccess {
                addr,
                len: len as u64,
            },
            bounce::Error::ZeroLength => Self::BadChain("zero-length buffer"),
            bounce::Error::Io(s) => Self::Io(s),
            other => Self::Bounce(other),
        }
    }
}

impl From<crate::virtio::chain::ChainError> for BlockError {
    fn from(e: crate::virtio::chain::ChainError) -> Self {
        match e {
            crate::virtio::chain::ChainError::OutsideMemory { addr, len } => Self::GuestAccess {
                addr,
                len: u64::from(len),
            },
            other => Self::Chain(other),
        }
    }
}

impl From<crate::virtio::chain::CopyError> for BlockError {
    fn from(e: crate::virtio::chain::CopyError) -> Self {
        match e {
            crate::virtio::chain::CopyError::Dma(e) => e.into(),
            _ => Self::BadChain("buffer shorter than the request"),
        }
    }
}

/// Result alias of the block device.
pub type Result<T> = std::result::Result<T, BlockError>;

/// How a block device is set up (what `-drive` and `-device virtio-blk-pci` say).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockConfig {
    /// The id string answered to GET_ID (at most 20 bytes are used).
    pub serial: String,
    /// Refuse writes and offer VIRTIO_BLK_F_RO.
    pub readonly: bool,
    /// Number of request queues (1..=64); VIRTIO_BLK_F_MQ is offered when more than one.
    pub num_queues: u16,
    /// Largest queue size the device accepts (a power of two, 2..=32768).
    pub queue_size: u16,
    /// Offer VIRTIO_F_ACCESS_PLATFORM.
    pub access_platform: bool,
    /// Logical block size reported in `blk_size` (a power of two, 512..=65536).
    pub blk_size: u32,
    /// Offer DISCARD and WRITE_ZEROES.
    pub discard: bool,
    /// `aio=`: the host I/O engine; `None` picks io_uring for raw images (the thread pool
    /// where the kernel refuses io_uring), the thread pool for qcow2, and the synchronous path
    /// for memory disks, which never block.
    pub aio: Option<io::AioMode>,
    /// `cache=`: the write cache the guest sees and what FLUSH does (the image must be
    /// opened for the same mode: [`io::DiskImage::open_with`]).
    pub cache: io::CacheMode,
    /// What a request does when the bounce pool is momentarily full.
    pub on_full: io::OnFull,
    /// How long a stop, reset or teardown waits for host I/O in flight before giving it up:
    /// its memory is then kept (leaked) for the kernel that may still write into it, and
    /// counted in `leaked_requests`.
    pub give_up_after: std::time::Duration,
}

impl Default for BlockConfig {
    fn default() -> Self {
        Self {
            serial: String::from("bouncevm-blk"),
            readonly: false,
            num_queues: 1,
            queue_size: 256,
            access_platform: true,
            blk_size: 512,
            discard: true,
            aio: None,
            cache: io::CacheMode::Writeback,
            on_full: io::OnFull::Wait,
            give_up_after: std::time::Duration::from_secs(30),
        }
    }
}

impl BlockConfig {
    /// Checks the values a device cannot run with.
    ///
    /// # Errors
    /// A message naming the bad field.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if !(1..=64).contains(&self.num_queues) {
            return Err(format!("num_queues {} not in 1..=64", self.num_queues));
        }
        if !self.queue_size.is_power_of_two() || self.queue_size < 2 || self.queue_size > 32768 {
            return Err(format!(
                "queue_size {} is not a power of two in 2..=32768",
                self.queue_size
            ));
        }
        if !self.blk_size.is_power_of_two() || !(512..=65536).contains(&self.blk_size) {
            return Err(format!(
                "blk_size {} is not a power of two in 512..=65536",
                self.blk_size
            ));
        }
        Ok(())
    }
}
