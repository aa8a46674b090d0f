//! How a VM ends.
//!
//! Any thread (a vCPU handling an exit, a device, the host) ends the VM by calling
//! [`ExitHandle::request`] with an [`ExitReason`]. The first request wins; later ones are
//! logged and dropped. The request sets a flag the vCPU loops poll and signals an eventfd
//! that [`ExitHandle::wait`] (or an event loop) blocks on; the machine then kicks every vCPU
//! thread out of `KVM_RUN` and joins it.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Why the VM stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitReason {
    /// The guest asked for a reset (i8042 0xFE, KVM system-event reset). As with QEMU's
    /// `-no-reboot`, a reset ends the VM successfully.
    Reset,
    /// The guest triple-faulted (KVM_EXIT_SHUTDOWN). QEMU treats this as a reset, so under
    /// `-no-reboot` it also ends with status 0; it is logged as a warning.
    TripleFault,
    /// The guest powered off (ACPI S5 through the PM1a control register, KVM system-event
    /// shutdown) or the host asked for a power-down (QMP `system_powerdown`).
    PowerOff,
    /// The guest reported a crash (KVM system-event crash).
    GuestCrash,
    /// A vCPU executed HLT with nothing able to wake it (a KVM_EXIT_HLT reached user space).
    Halted {
        /// The vCPU that halted.
        vcpu: u8,
    },
    /// The guest wrote `value` to the debug-exit port.
    DebugExit {
        /// The value written.
        value: u32,
    },
    /// The host asked the VM to stop.
    Stopped,
    /// The VMM hit an error it cannot recover from.
    Error(String),
}

impl ExitReason {
    /// The process exit status this reason maps to.
    ///
    /// Reset, triple fault, power-off, halt and host stop give 0; a debug exit gives
    /// `(value << 1) | 1` truncated to 8 bits like QEMU's `isa-debug-exit`; crashes and
    /// errors give 1.
    pub fn exit_code(&self) -> i32 {
        match self {
            ExitReason::Reset
            | ExitReason::TripleFault
            | ExitReason::PowerOff
            | ExitReason::Halted { .. }
            | ExitReason::Stopped => 0,
            ExitReason::DebugExit { value } => (((value << 1) | 1) & 0xff) as i32,
            ExitReason::GuestCrash | ExitReason::Error(_) => 1,
        }
    }
}

/// Errors of the exit handle.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Creating or reading the eventfd failed.
    #[error("exit eventfd: {0}")]
    EventFd(#[source] std::io::Error),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug)]
struct Inner {
    requested: AtomicBool,
    reason: Mutex<Option<ExitReason>>,
    evt: EventFd,
}

/// A cloneable handle that ends the VM.
#[derive(Debug, Clone)]
pub struct ExitHandle {
    inner: Arc<Inner>,
}

impl ExitHandle {
    /// Creates a handle with no exit requested.
    ///
    /// # Errors
    /// [`Error::EventFd`] if the eventfd cannot be created.
    pub fn new() -> Result<Self> {
        let evt = EventFd::new(EFD_NONBLOCK).map_err(Error::EventFd)?;
        Ok(ExitHandle {
            inner: Arc::new(Inner {
                requested: AtomicBool::new(false),
                reason: Mutex::new(None),
                evt,
            }),
        })
    }

    /// Asks the VM to end. Returns `true` if this was the first request.
    pub fn request(&self, reason: ExitReason) -> bool {
        let mut first_reason = self.inner.reason.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(first) = first_reason.as_ref() {
            tracing::debug!(?reason, ?first, "exit already requested");
            return false;
        }
        match &reason {
            ExitReason::TripleFault => tracing::warn!("guest triple fault: ending the VM"),
            ExitReason::Error(e) => tracing::error!(error = %e, "ending the VM on error"),
            r => tracing::info!(reason = ?r, "VM exit requested"),
        }
        *first_reason = Some(reason);
        self.inner.requested.store(true, Ordering::SeqCst);
        drop(first_reason);
        if let Err(e) = self.inner.evt.write(1) {
            // The flag is set, so polling vCPUs still stop; only a blocked waiter could miss it.
            tracing::error!(error = %e, "cannot signal the exit eventfd");
        }
        true
    }

    /// Whether an exit has been requested.
    pub fn is_requested(&self) -> bool {
        self.inner.requested.load(Ordering::SeqCst)
    }

    /// The requested reason, if any.
    pub fn reason(&self) -> Option<ExitReason> {
        self.inner
            .reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The eventfd that becomes readable when an exit is requested (for event loops).
    pub fn as_raw_fd(&self) -> RawFd {
        self.inner.evt.as_raw_fd()
    }

    /// Blocks until an exit is requested and returns its reason.
    ///
    /// # Errors
    /// [`Error::EventFd`] if polling the eventfd fails.
    pub fn wait(&self) -> Result<ExitReason> {
        loop {
            if let Some(r) = self.reason() {
                return Ok(r);
            }
            let mut pfd = libc::pollfd {
                fd: self.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: `pfd` is a valid pollfd for the duration of the call and nfds is 1.
            let rc = unsafe { libc::poll(&mut pfd, 1, -1) };
            if rc < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(Error::EventFd(e));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_request_wins() {
        let h = ExitHandle::new().unwrap();
        assert!(!h.is_requested());
        assert!(h.request(ExitReason::Reset));
        assert!(!h.request(ExitReason::Error("late".into())));
        assert_eq!(h.wait().unwrap(), ExitReason::Reset);
        assert!(h.is_requested());
    }

    #[test]
    fn wait_blocks_until_request() {
        let h = ExitHandle::new().unwrap();
        let h2 = h.clone();
        let t = std::thread::spawn(move || h2.wait().unwrap());
        std::thread::sleep(std::time::Duration::from_millis(20));
        h.request(ExitReason::DebugExit { value: 3 });
        assert_eq!(t.join().unwrap(), ExitReason::DebugExit { value: 3 });
    }

    #[test]
    fn exit_codes() {
        assert_eq!(ExitReason::Reset.exit_code(), 0);
        assert_eq!(ExitReason::TripleFault.exit_code(), 0);
        assert_eq!(ExitReason::DebugExit { value: 0 }.exit_code(), 1);
        assert_eq!(ExitReason::DebugExit { value: 0x10 }.exit_code(), 0x21);
        assert_eq!(ExitReason::Error("x".into()).exit_code(), 1);
    }
}
