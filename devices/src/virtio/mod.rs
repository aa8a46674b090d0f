//! The boundary between device cores and transports.
//!
//! Lifecycle, as a transport sees it:
//! 1. it reads [`VirtioDevice::avail_features`], the queue count and sizes, and the
//!    configuration space ([`VirtioDevice::read_config`]);
//! 2. once the driver sets DRIVER_OK it calls [`VirtioDevice::activate`] with the features the
//!    driver acknowledged (bits never offered are dropped by the device) and gets back one
//!    [`QueueWorker`] per group of queues that must be served by one thread (a block queue; a
//!    net rx/tx pair; the net control queue);
//! 3. it runs each worker on a thread of its own: on a queue kick, or when one of the worker's
//!    own file descriptors ([`QueueWorker::extra_fds`]) becomes readable, it calls
//!    [`QueueWorker::handle`] with guest memory and the worker's queues, then signals the driver
//!    for every queue in the returned [`Signal`];
//! 4. on a driver reset it drops the workers and calls [`VirtioDevice::reset`].
//!
//! A worker that finds the driver broke the rules beyond recovery returns
//! [`WorkerError::Broken`]; the transport then sets DEVICE_NEEDS_RESET and stops the worker,
//! but keeps the VMM running.

pub mod chain;
pub mod dispatch;
pub mod driver;
pub mod headlog;
pub mod iobuf;
pub mod memlayout;
pub mod queue;
pub mod spec;

use std::os::fd::RawFd;

use virtio_queue::Queue;
use vm_memory::GuestMemory;

/// The queues of a [`QueueWorker`], as the transport lends them to [`QueueWorker::handle`]
/// (`queues[i]` is device queue `queue_indexes()[i]`).
pub type Queues<'a, 'q> = &'a mut [&'q mut Queue];

/// What [`QueueWorker::handle`] returns: the queues to notify, or why the worker stops.
pub type Handled = Result<Signal, WorkerError>;

/// Errors of activation.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    /// The driver acknowledged a combination of features the device cannot run with.
    #[error("bad feature combination: {0}")]
    Features(String),
    /// The backend (file, tap) could not be prepared.
    #[error("backend: {0}")]
    Backend(String),
    /// The device is already active.
    #[error("device is already active")]
    AlreadyActive,
}

/// Errors a worker returns to its transport.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The driver broke the rules so that the device cannot go on (e.g. a queue whose rings
    /// cannot be read). The transport sets DEVICE_NEEDS_RESET.
    #[error("device broken: {0}")]
    Broken(String),
    /// The event was not for this worker (an unknown queue position or token).
    #[error("unexpected event {0:?}")]
    UnexpectedEvent(WorkerEvent),
}

/// What woke a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerEvent {
    /// The driver kicked the queue at this position of [`QueueWorker::queue_indexes`].
    Kick(usize),
    /// One of the worker's own file descriptors is readable; the token from
    /// [`QueueWorker::extra_fds`].
    Fd(u32),
}

/// The queues (positions in [`QueueWorker::queue_indexes`]) that need a used-buffer
/// notification, as a bit mask.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Signal(pub u64);

impl Signal {
    /// No queue needs a notification.
    pub const NONE: Signal = Signal(0);

    /// Adds the queue at `position`.
    pub fn add(&mut self, position: usize) {
        if position < 64 {
            self.0 |= 1 << position;
        }
    }

    /// Every one of the first `n` queues (at most 64).
    pub fn first(n: usize) -> Self {
        let mut s = Self::NONE;
        (0..n).for_each(|p| s.add(p));
        s
    }

    /// True when the queue at `position` needs a notification.
    pub fn has(&self, position: usize) -> bool {
        position < 64 && self.0 & (1 << position) != 0
    }

    /// True when no queue needs one.
    pub fn is_empty(&self) -> bool {
        self.0 == 0
    }
}

/// The features every device here offers before its own: VERSION_1 (no legacy drivers),
/// EVENT_IDX, INDIRECT_DESC, and ACCESS_PLATFORM when `access_platform` (the driver then maps
/// its buffers through the DMA API, which a bouncing device needs from a guest with an IOMMU).
pub fn common_features(access_platform: bool) -> u64 {
    let f = spec::feature(spec::VIRTIO_F_VERSION_1)
        | spec::feature(spec::VIRTIO_RING_F_EVENT_IDX)
        | spec::feature(spec::VIRTIO_RING_F_INDIRECT_DESC);
    if access_platform {
        f | spec::feature(spec::VIRTIO_F_ACCESS_PLATFORM)
    } else {
        f
    }
}

/// Copies the window of `space` (a device's configuration space) that starts at `offset` into
/// `data`: what [`VirtioDevice::read_config`] answers. Bytes past the end of `space`, and every
/// byte of a window whose offset does not fit in memory, read as zero; the driver controls
/// `offset` and `data.len()`, so nothing here can overflow or index out of bounds.
pub fn read_config_window(space: &[u8], offset: u64, data: &mut [u8]) {
    data.fill(0);
    let Some(tail) = usize::try_from(offset).ok().and_then(|o| space.get(o..)) else {
        return;
    };
    let n = data.len().min(tail.len());
    data[..n].copy_from_slice(&tail[..n]);
}

/// A device as its transport sees it: identity, features, configuration space, lifecycle.
/// `Debug` so that what holds a device (the transport, the monitor's tables) can derive it.
pub trait VirtioDevice<M: GuestMemory>: Send + std::fmt::Debug {
    /// The virtio device type ([`spec::VIRTIO_ID_BLOCK`], [`spec::VIRTIO_ID_NET`]).
    fn device_type(&self) -> u32;

    /// Number of queues the device offers (for net: 2 per queue pair, plus the control queue).
    fn num_queues(&self) -> usize;

    /// Largest queue size the device accepts.
    fn queue_max_size(&self) -> u16;

    /// The queues that must be served by one thread, known before activation and whatever
    /// features the driver acknowledges: every worker [`VirtioDevice::activate`] returns
    /// serves queues of one group only. The groups cover `0..num_queues()` once each. A
    /// transport that fixes its threads up front (vhost-user) lays them out from this, and
    /// never from the device type. The default: every queue on its own.
    fn queue_groups(&self) -> Vec<Vec<u16>> {
        // num_queues is at most u16::MAX + 1 queues for any device here; saturate anyway.
        (0..self.num_queues())
            .map(|q| vec![u16::try_from(q).unwrap_or(u16::MAX)])
            .collect()
    }

    /// Feature bits the device offers.
    fn avail_features(&self) -> u64;

    /// Reads the device configuration space at `offset`. Reads past its end return zeros.
    fn read_config(&self, offset: u64, data: &mut [u8]);

    /// Writes the device configuration space. Writes to read-only fields are logged and
    /// counted, never applied.
    fn write_config(&mut self, offset: u64, data: &[u8]);

    /// Starts the device with the features the driver acknowledged (bits that were never
    /// offered are dropped) and returns its workers.
    ///
    /// # Errors
    /// [`ActivateError`] when the device cannot start; the transport sets
    /// DEVICE_NEEDS_RESET.
    fn activate(
        &mut self,
        acked_features: u64,
    ) -> Result<Vec<Box<dyn QueueWorker<M>>>, ActivateError>;

    /// Returns the device to its initial state (the workers were dropped).
    fn reset(&mut self);

    /// The device's statistics (and those of its bounce pool) as JSON.
    fn stats(&self) -> serde_json::Value;
}

/// Serves a fixed group of queues from one thread.
pub trait QueueWorker<M: GuestMemory>: Send {
    /// The device queue indexes this worker serves, in the order `handle` receives them.
    fn queue_indexes(&self) -> Vec<u16>;

    /// File descriptors the transport must poll for input for this worker (a tap, a timer),
    /// each with a token passed back in [`WorkerEvent::Fd`].
    ///
    /// Transports must poll them **edge-triggered** (`EPOLLET`): a worker may leave an fd
    /// readable on purpose (a net worker stops reading its tap while the guest has posted no
    /// receive buffers, and resumes on the next queue kick), so a level-triggered loop would
    /// spin.
    fn extra_fds(&self) -> Vec<(RawFd, u32)> {
        Vec::new()
    }

    /// Handles one event. `queues[i]` is device queue `queue_indexes()[i]`. Returns the
    /// queues whose driver must be notified.
    ///
    /// Transports call it only once every one of the worker's queues is fully set up by the
    /// driver (sizes, ring addresses) and enabled: virtio-pci starts workers at DRIVER_OK for
    /// enabled queues only, and the vhost-user adapter drops events until the frontend has
    /// configured and enabled the rings (a tap can become readable earlier than that).
    ///
    /// # Errors
    /// [`WorkerError::Broken`] when the device cannot go on.
    fn handle(&mut self, event: WorkerEvent, mem: &M, queues: Queues<'_, '_>) -> Handled;

    /// The transport dropped an event for this worker because the driver has set up its
    /// queues but disabled one of them (vhost-user `SET_VRING_ENABLE` 0: QEMU disables the
    /// net queue pairs the guest does not use). A worker that shares a backend with others
    /// stops taking traffic it cannot deliver (a net pair detaches its tap queue, so the tap
    /// steers flows to the pairs in use); it is served again from its next event. The
    /// default does nothing.
    fn queues_disabled(&mut self) {}

    /// The transport is about to stop the worker's queues and report their ring positions
    /// (vhost-user `GET_VRING_BASE`, `RESET_DEVICE`): finishes every request popped so far
    /// (waits for its host I/O, writes its status and used entry), so the position reported
    /// counts only requests the driver got back. Returns the queues to notify. The default,
    /// for workers that finish or give back what they pop within [`QueueWorker::handle`],
    /// does nothing.
    ///
    /// # Errors
    /// [`WorkerError::Broken`] when a used entry cannot be written.
    fn quiesce(&mut self, _mem: &M, _queues: &mut [&mut Queue]) -> Result<Signal, WorkerError> {
        Ok(Signal::NONE)
    }

    /// Gives the worker a record of its queues' heads in flight ([`headlog::HeadLog`], one
    /// per queue in [`QueueWorker::queue_indexes`] order) that outlives it: from the next
    /// [`QueueWorker::handle`] on, the worker resumes from it first (serving again the heads
    /// it lists) and keeps it as it pops and uses heads. Transports hand it over before the
    /// worker has served anything. Returns false (and drops the logs) when the worker keeps
    /// no such record: the default, for devices whose requests cannot be served twice or
    /// that finish each one within `handle`.
    fn track_heads(&mut self, _logs: Vec<Box<dyn headlog::HeadLog>>) -> bool {
        false
    }

    /// The worker's statistics as JSON (merged into the device's by the transport if it
    /// wants them).
    fn stats(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}

#[cfg(test)]
mod tests {
    use super::read_config_window;

    /// Byte `i` of a read at `offset`, one byte at a time.
    fn byte(space: &[u8], offset: u64, i: usize) -> u8 {
        offset
            .checked_add(i as u64)
            .and_then(|o| usize::try_from(o).ok())
            .and_then(|o| space.get(o).copied())
            .unwrap_or(0)
    }

    #[test]
    fn a_config_window_reads_the_space_and_zeros_past_its_end() {
        let space: Vec<u8> = (1..=12).collect();
        for offset in (0..20).chain([u64::MAX - 3, u64::MAX]) {
            for len in [0, 1, 2, 4, 8, 13, 64] {
                let mut data = vec![0xAA; len];
                read_config_window(&space, offset, &mut data);
                let want: Vec<u8> = (0..len).map(|i| byte(&space, offset, i)).collect();
                assert_eq!(data, want, "offset {offset} len {len}");
            }
        }
        let mut data = [0xAA; 4];
        read_config_window(&space, 10, &mut data);
        assert_eq!(data, [11, 12, 0, 0]);
        read_config_window(&[], 0, &mut data);
        assert_eq!(data, [0; 4]);
    }
}
