//! How a broken device is reported to the frontend.
//!
//! A worker that finds the driver broke the rules ([`devices::virtio::WorkerError::Broken`]:
//! a ring outside guest memory, an avail index far ahead) cannot go on, and the guest must see
//! I/O fail rather than hang. vhost-user has two channels for that, both carried by
//! [`Report`]:
//! - the vring error eventfd (`SET_VRING_ERR`), signalled for every queue of the broken
//!   worker. `vhost-user-backend` keeps that fd private, so the relay keeps a duplicate of
//!   each one as it passes;
//! - the device status (`VHOST_USER_PROTOCOL_F_STATUS`): `GET_STATUS` answers the status the
//!   frontend last set with `DEVICE_NEEDS_RESET` added while a worker is broken. The relay
//!   answers `SET_STATUS`/`GET_STATUS` itself (the `vhost` crate's dispatcher does not
//!   handle them).
//!
//! The flag clears when the frontend resets the device (status 0, `RESET_OWNER`,
//! `RESET_DEVICE`) or the device is activated again.

use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Mutex;

use devices::virtio::spec::VIRTIO_CONFIG_S_NEEDS_RESET;

/// Error reporting shared by the relay and the adapter of one connection.
#[derive(Debug)]
pub struct Report {
    /// Duplicates of the frontend's vring error eventfds, by queue index.
    err_fds: Mutex<Vec<Option<File>>>,
    /// The status the frontend last set (`SET_STATUS`).
    status: AtomicU8,
    needs_reset: AtomicBool,
}

/// What signalling the error fds of a broken worker's queues did (the adapter counts it).
#[derive(Debug, Default)]
pub struct ErrorSignals {
    /// Error fds signalled.
    pub signalled: u64,
    /// Error fds that could not be signalled (a counter full, an fd the frontend closed).
    pub failed: u64,
    /// The queue and the error of the last failure.
    pub last_failure: Option<(u16, std::io::Error)>,
}

impl Report {
    /// A report for a device of `num_queues` queues.
    pub fn new(num_queues: usize) -> Self {
        Self {
            err_fds: Mutex::new((0..num_queues).map(|_| None).collect()),
            status: AtomicU8::new(0),
            needs_reset: AtomicBool::new(false),
        }
    }

    fn fds(&self) -> std::sync::MutexGuard<'_, Vec<Option<File>>> {
        self.err_fds
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records (or, with `None`, forgets) the error eventfd of queue `index`; an index the
    /// device does not have is ignored (the backend refuses that message anyway).
    pub fn set_err_fd(&self, index: usize, fd: Option<OwnedFd>) {
        if let Some(entry) = self.fds().get_mut(index) {
            *entry = fd.map(File::from);
        }
    }

    /// True when queue `index` has an error eventfd.
    pub fn has_err_fd(&self, index: usize) -> bool {
        self.fds().get(index).is_some_and(Option::is_some)
    }

    /// A worker serving `queues` is broken: sets DEVICE_NEEDS_RESET and signals the error
    /// eventfd of each of those queues (non-blocking, as the relay's checks made it).
    pub fn broken(&self, queues: &[u16]) -> ErrorSignals {
        self.needs_reset.store(true, Ordering::Release);
        let fds = self.fds();
        let mut out = ErrorSignals::default();
        for &q in queues {
            let Some(Some(fd)) = fds.get(usize::from(q)) else {
                continue;
            };
            // An eventfd write is 8 bytes of native-endian counter increment.
            match (&*fd).write_all(&1u64.to_ne_bytes()) {
                Ok(()) => out.signalled += 1,
                Err(e) => {
                    out.failed += 1;
                    out.last_failure = Some((q, e));
                }
            }
        }
        out
    }

    /// The device runs again (activated afresh): DEVICE_NEEDS_RESET clears.
    pub fn clear(&self) {
        self.needs_reset.store(false, Ordering::Release);
    }

    /// True while a worker is broken and the frontend has not reset the device.
    pub fn needs_reset(&self) -> bool {
        self.needs_reset.load(Ordering::Acquire)
    }

    /// `SET_STATUS`: 0 is a device reset.
    pub fn set_status(&self, status: u8) {
        self.status.store(status, Ordering::Release);
        if status == 0 {
            self.clear();
        }
    }

    /// `GET_STATUS`: the status last set, with DEVICE_NEEDS_RESET while broken.
    pub fn status(&self) -> u8 {
        let s = self.status.load(Ordering::Acquire);
        if self.needs_reset() {
            s | VIRTIO_CONFIG_S_NEEDS_RESET
        } else {
            s
        }
    }

    /// A frontend reset (`RESET_OWNER`, `RESET_DEVICE`): status 0, error fds forgotten.
    pub fn reset(&self) {
        self.set_status(0);
        self.close_fds();
    }

    /// Closes the error fds (the session ended: none may outlive it).
    pub fn close_fds(&self) {
        for fd in self.fds().iter_mut() {
            *fd = None;
        }
    }

    /// The state for the statistics (what was signalled is counted with the transport's
    /// counters, which outlive the session).
    pub fn stats(&self) -> serde_json::Value {
        serde_json::json!({
            "needs_reset": self.needs_reset(),
            "status": self.status(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::net::UnixStream;

    /// A stand-in for an eventfd: what the report writes comes out of the other end.
    fn pair() -> (UnixStream, OwnedFd) {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        (a, OwnedFd::from(b))
    }

    fn read(s: &UnixStream) -> Option<u64> {
        let mut b = [0u8; 8];
        (&*s).read_exact(&mut b).ok()?;
        Some(u64::from_ne_bytes(b))
    }

    #[test]
    fn broken_signals_the_error_fds_and_sets_needs_reset_until_reset() {
        let r = Report::new(3);
        let (e0, f0) = pair();
        let (e2, f2) = pair();
        r.set_err_fd(0, Some(f0));
        r.set_err_fd(2, Some(f2));
        r.set_err_fd(7, None);
        r.set_status(0x0f);
        assert_eq!(r.status(), 0x0f);
        let sent = r.broken(&[0, 1]);
        assert_eq!(
            (sent.signalled, sent.failed),
            (1, 0),
            "queue 1 has no error fd"
        );
        assert_eq!(read(&e0), Some(1));
        assert_eq!(read(&e2), None, "queue 2's worker is not broken");
        assert_eq!(r.status(), 0x0f | VIRTIO_CONFIG_S_NEEDS_RESET);
        r.set_status(0);
        assert_eq!(r.status(), 0);
        r.broken(&[2]);
        assert_eq!(read(&e2), Some(1));
        r.clear();
        assert!(!r.needs_reset());
        r.reset();
        assert!(!r.has_err_fd(0) && !r.has_err_fd(2));
    }
}
