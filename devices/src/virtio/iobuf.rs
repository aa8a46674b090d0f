//! Device-visible memory as addresses and lengths, for I/O that happens after the mapping
//! call returns: [`bounce::Dma::device_pieces`] says where a mapping's bytes are (one piece
//! for a bounced buffer, one per guest memory region otherwise), and an [`IoBuf`] holds one
//! such piece. The block device hands the pieces to its I/O engine; the net device gathers a
//! frame from them.

use vm_memory::VolatileSlice;

/// One contiguous piece of device-visible memory: an address and a length.
///
/// Laid out as a `struct iovec`, so a list of them is the iovec array of a vectored
/// transfer as it is (io_uring `READV`/`WRITEV` take an op's pieces in place).
///
/// Holding one is harmless; the memory is only accessed by a block I/O engine after an
/// `unsafe` [`IoEngine::submit`](crate::block::io::IoEngine::submit) whose caller vouched for
/// it, or by a net worker while it holds the buffer's mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct IoBuf {
    /// Start address.
    pub(crate) ptr: *mut u8,
    /// Length in bytes.
    pub(crate) len: usize,
}

// `IoBuf` is `struct iovec`: same size, alignment and field offsets.
const _: () = {
    assert!(std::mem::size_of::<IoBuf>() == std::mem::size_of::<libc::iovec>());
    assert!(std::mem::align_of::<IoBuf>() == std::mem::align_of::<libc::iovec>());
    assert!(std::mem::offset_of!(IoBuf, ptr) == std::mem::offset_of!(libc::iovec, iov_base));
    assert!(std::mem::offset_of!(IoBuf, len) == std::mem::offset_of!(libc::iovec, iov_len));
};

// SAFETY: an `IoBuf` is an address and a length with no ownership; the memory it names is
// only accessed under the contract of `IoEngine::submit` (or by the worker holding the mapping),
// from whichever thread runs the I/O.
unsafe impl Send for IoBuf {}

impl IoBuf {
    /// The piece `ptr..ptr + len`.
    pub fn new(ptr: *mut u8, len: usize) -> Self {
        Self { ptr, len }
    }

    /// Start address.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Drops the first `n` bytes of the piece (all of it when `n` is larger): what is left
    /// after a transfer that moved `n` bytes.
    pub fn advance(&mut self, n: usize) {
        let n = n.min(self.len);
        self.ptr = self.ptr.wrapping_add(n);
        self.len -= n;
    }

    /// True when the address and the length are multiples of `align` (a power of two).
    pub fn is_aligned(&self, align: usize) -> bool {
        (self.ptr as usize) % align == 0 && self.len % align == 0
    }

    /// The memory as a volatile slice.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be valid for reads and writes for the slice's whole use.
    pub unsafe fn as_volatile(&self) -> VolatileSlice<'static> {
        // SAFETY: validity for the slice's use is the caller's duty (see above).
        unsafe { VolatileSlice::new(self.ptr, self.len) }
    }
}

/// The pieces of one read or write: inline up to four (a 4 KiB request is one piece, or one
/// per guest memory region it spans), so a request allocates nothing on the way to the host.
pub type IoBufs = smallvec::SmallVec<[IoBuf; 4]>;
