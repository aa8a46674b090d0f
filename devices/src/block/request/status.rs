//! The status byte: mapped before anything else of a request, written last.
//!
//! A request whose status byte cannot be located or written cannot tell the driver anything
//! ([`Unusable`]): the device must stop. Everything else completes with a status: through
//! the byte's mapping, or, when the pool was too full to map it (or the mapped write
//! failed), straight to guest memory with [`bounce::Dma::write_direct`], so the driver never
//! reads a stale "OK".

use bounce::{DmaBatch, DmaBuffer};
use vm_memory::GuestMemory;

use super::{Request, RequestCtx};
use crate::block::BlockError;

/// How a chain ended: the used length and the status written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The used length to report: data bytes written plus the status byte.
    pub used_len: u32,
    /// The status written.
    pub status: u8,
}

/// A chain whose status byte cannot be found or written: no completion can tell the driver
/// it failed, so the device must stop (DEVICE_NEEDS_RESET, as QEMU's `virtio_error`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unusable request chain: {0}")]
pub struct Unusable(pub BlockError);

/// Where the status byte goes: through a mapping made before anything else, or, when the
/// pool was full at that point, straight to guest memory.
#[derive(Debug)]
pub(super) enum StatusBuf {
    Mapped(DmaBuffer),
    Direct(u64),
}

impl RequestCtx {
    /// Counts `e` as the reason a request has no usable status byte.
    pub(super) fn unusable(&self, e: BlockError) -> Unusable {
        self.metrics.count_error(&e);
        self.metrics.no_status.inc();
        Unusable(e)
    }

    /// Where the status byte goes, given the result of mapping it: through the mapping, or,
    /// when the pool was full, straight to guest memory.
    pub(super) fn status_buf(
        &self,
        mapped: bounce::Result<DmaBuffer>,
        addr: u64,
    ) -> Result<StatusBuf, Unusable> {
        match mapped {
            Ok(b) => Ok(StatusBuf::Mapped(b)),
            Err(e) if e.class() == bounce::error::ErrorClass::Exhausted => {
                self.metrics.status_direct.inc();
                Ok(StatusBuf::Direct(addr))
            }
            Err(e) => Err(self.unusable(BlockError::from(e))),
        }
    }

    /// Writes status `st` and returns the completion of a request that wrote `written` data
    /// bytes to the guest.
    pub(super) fn complete<M: GuestMemory + ?Sized, R>(
        &self,
        mem: &M,
        req: &mut Request<R>,
        st: u8,
        written: u64,
        batch: &mut DmaBatch<'_>,
    ) -> Result<Completion, Unusable> {
        self.write_status(mem, req.status.take(), st, batch)?;
        Ok(Completion {
            // written <= writable_len - 1 < u32::MAX (a chain holds at most 2^16 buffers of
            // at most 2^32 - 1 bytes; the saturation is a guard only).
            used_len: u32::try_from(written.saturating_add(1)).unwrap_or(u32::MAX),
            status: st,
        })
    }

    /// Unmaps the status byte of a request that completes without a status (pool full with
    /// `may_wait`, device reset): the byte is left untouched.
    pub(super) fn release_status<M: GuestMemory + ?Sized, R>(
        &self,
        mem: &M,
        req: &mut Request<R>,
        batch: &mut DmaBatch<'_>,
    ) {
        if let Some(StatusBuf::Mapped(b)) = req.status.take() {
            if let Err(e) = batch.unmap(mem, b) {
                self.metrics.count_error(&BlockError::from(e));
            }
        }
    }

    fn write_status<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        status: Option<StatusBuf>,
        st: u8,
        batch: &mut DmaBatch<'_>,
    ) -> Result<(), Unusable> {
        let addr = match status {
            Some(StatusBuf::Mapped(b)) => {
                let wrote = self.dma.write(mem, &b, 0, &[st]);
                let unmapped = batch.unmap(mem, b);
                match wrote.and(unmapped) {
                    Ok(()) => return Ok(()),
                    Err(e) => {
                        self.metrics.count_error(&BlockError::from(e));
                        self.metrics.status_direct.inc();
                        b.guest_addr()
                    }
                }
            }
            Some(StatusBuf::Direct(a)) => a,
            None => {
                return Err(self.unusable(BlockError::BadChain("no device-writable status byte")))
            }
        };
        self.dma
            .write_direct(mem, addr, &[st])
            .map_err(|e| self.unusable(BlockError::from(e)))
    }
}
