//! Errors of the bounce module.

/// Everything that can go wrong when mapping, syncing or unmapping.
///
/// Variants carry the numbers that failed so a caller can log or count them.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum Error {
    /// The pool has no run of free slots that satisfies the request (Linux: "swiotlb buffer is
    /// full"). `size` is the allocation size in bytes including alignment padding.
    #[error(
        "bounce buffer is full (sz: {size} bytes), total {total} (slots), used {used} (slots)"
    )]
    PoolFull {
        /// Requested allocation size in bytes, padding included.
        size: usize,
        /// Slots in the pool.
        total: usize,
        /// Slots in use when the request failed.
        used: usize,
    },
    /// A zero-length mapping was requested.
    #[error("zero-length DMA mapping")]
    ZeroLength,
    /// The mapping is larger than the largest mapping the pool can ever satisfy.
    #[error("mapping of {size} bytes exceeds the maximum mapping size of {max} bytes")]
    TooLarge {
        /// Requested mapping size.
        size: usize,
        /// Largest possible mapping for these masks.
        max: usize,
    },
    /// The masks cannot be satisfied by any slot of this pool.
    #[error("unsatisfiable alignment: {reason}")]
    BadAlignment {
        /// What is wrong with the masks.
        reason: &'static str,
    },
    /// `orig + size` overflows the address space.
    #[error("original range {orig:#x}+{size:#x} overflows")]
    Overflow {
        /// Original address.
        orig: u64,
        /// Size.
        size: usize,
    },
    /// The address is not the start of a live mapping of this pool (never mapped, already
    /// unmapped, or not the address that map returned).
    #[error("device address {addr:#x} is not a live mapping")]
    NotMapped {
        /// The device address given.
        addr: u64,
    },
    /// A device range lies (partly) outside the pool or outside its mapping.
    #[error("device range {addr:#x}+{len:#x} is outside the bounce pool")]
    OutOfPool {
        /// Device address.
        addr: u64,
        /// Length.
        len: usize,
    },
    /// The original buffer is not (entirely) backed by memory.
    #[error("original range {addr:#x}+{len:#x} is not accessible")]
    OrigAccess {
        /// Original address.
        addr: u64,
        /// Length.
        len: usize,
    },
    /// The pool's memory could not be mapped.
    #[error("cannot map {bytes} bytes of bounce memory: {reason}")]
    PoolMemory {
        /// Size asked for.
        bytes: usize,
        /// The system's reason.
        reason: String,
    },
    /// An I/O error of a device backend while it accessed a DMA buffer.
    #[error("I/O error on a DMA buffer: {0}")]
    Io(String),
    /// A pool configuration that cannot be built.
    #[error("invalid pool configuration: {0}")]
    Config(String),
}

/// Whose fault an [`Error`] is, which decides what a device does with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// The guest's buffer is bad (not guest memory, overflowing, empty): the request fails
    /// and the guest is told so.
    GuestFault,
    /// The pool is momentarily full: the same request may succeed once mappings are
    /// released (back-pressure, not an I/O error).
    Exhausted,
    /// The request can never be mapped by this pool (larger than its largest mapping, or
    /// alignment masks no slot satisfies): a device limit.
    Limit,
    /// The backend's I/O on a DMA buffer failed.
    Io,
    /// A bug or a setup failure of the device or the pool (unmapping what was not mapped,
    /// an access outside the pool, pool memory that cannot be mapped, a bad configuration).
    Internal,
}

impl Error {
    /// Classifies the error (see [`ErrorClass`]).
    pub fn class(&self) -> ErrorClass {
        match self {
            Self::OrigAccess { .. } | Self::Overflow { .. } | Self::ZeroLength => {
                ErrorClass::GuestFault
            }
            Self::PoolFull { .. } => ErrorClass::Exhausted,
            Self::TooLarge { .. } | Self::BadAlignment { .. } => ErrorClass::Limit,
            Self::Io(_) => ErrorClass::Io,
            Self::NotMapped { .. }
            | Self::OutOfPool { .. }
            | Self::PoolMemory { .. }
            | Self::Config(_) => ErrorClass::Internal,
        }
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;
