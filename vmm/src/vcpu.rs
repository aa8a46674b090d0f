//! vCPUs and their threads.
//!
//! A [`Vcpu`] is configured on the creating thread (registers, CPUID, MSRs: see [`crate::boot`])
//! and then moved into its own thread, which runs [`Vcpu::run_loop`]: `KVM_RUN`, dispatch the
//! exit to the PIO or MMIO [`Bus`], repeat, until the [`ExitHandle`] reports an exit.
//!
//! Stopping: a vCPU may sit inside `KVM_RUN` indefinitely (halted in the in-kernel LAPIC, or
//! spinning in guest code). [`kick`] sends it [`kick_signal`], whose handler does nothing;
//! the signal makes `KVM_RUN` return `EINTR`, and the loop then sees the exit flag. A signal
//! that lands between the flag check and `KVM_RUN` is lost, so the machine re-sends it until
//! the thread ends (see [`crate::machine::RunningMachine::wait`]).
//!
//! State for the monitor: each vCPU thread keeps its exit counters and where it is in a
//! [`VcpuShared`], and reads its own registers when the monitor asks ([`state::query`]).
//!
//! Known limitation: a string PIO instruction (`rep outsb`/`rep insw`, KVM_EXIT_IO with
//! `count > 1`) reaches the device as one access of `size * count` bytes, because kvm-ioctls
//! does not expose `size` and `count` separately. None of the devices here is driven that way
//! by Linux (the 8250, i8042 and conf1 drivers use single `in`/`out`); a device that is
//! (ATA PIO) needs the exit split per element first.

use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

use kvm_bindings::{kvm_mp_state, KVM_MP_STATE_RUNNABLE};
use kvm_ioctls::{VcpuExit, VcpuFd};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use crate::bus::Bus;
use crate::exit::{ExitHandle, ExitReason};

pub mod state;

pub use state::{ExitKind, ThreadState, VcpuShared};

/// Errors of vCPU handling.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A vCPU ioctl failed.
    #[error("vCPU {id}: {what}: {source}")]
    Ioctl {
        /// vCPU id.
        id: u8,
        /// The operation.
        what: &'static str,
        /// Underlying error.
        source: kvm_ioctls::Error,
    },
    /// Installing the kick signal handler failed.
    #[error("cannot install the vCPU kick signal handler: {0}")]
    Signal(#[source] vmm_sys_util::errno::Error),
    /// Spawning the thread failed.
    #[error("cannot spawn thread for vCPU {id}: {source}")]
    Spawn {
        /// vCPU id.
        id: u8,
        /// Underlying error.
        source: std::io::Error,
    },
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, Error>;

/// Counters of one vCPU's exits, returned when its thread ends (a summary of its
/// [`VcpuShared`] counters).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct VcpuStats {
    /// KVM_EXIT_IO exits.
    pub pio_exits: u64,
    /// KVM_EXIT_MMIO exits.
    pub mmio_exits: u64,
    /// PIO accesses no device claimed (reads return all ones).
    pub pio_unhandled: u64,
    /// MMIO accesses no device claimed (reads return all ones).
    pub mmio_unhandled: u64,
    /// `KVM_RUN` calls interrupted by a signal (kicks).
    pub interrupted: u64,
}

/// A vCPU before it is moved into its thread.
#[derive(Debug)]
pub struct Vcpu {
    id: u8,
    fd: VcpuFd,
    // Keeps guest memory mapped while this vCPU exists (see `Vm::register_memory`).
    _memory: GuestMemoryMmap,
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// The real-time signal used to kick vCPU threads out of `KVM_RUN` (`SIGRTMIN`).
pub fn kick_signal() -> libc::c_int {
    SIGRTMIN()
}

/// Installs the no-op handler for [`kick_signal`] once per process.
///
/// # Errors
/// [`Error::Signal`] if `sigaction` fails.
pub fn install_kick_handler() -> Result<()> {
    static INSTALLED: OnceLock<std::result::Result<(), i32>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| register_signal_handler(kick_signal(), kick_handler).map_err(|e| e.errno()))
        .map_err(|errno| Error::Signal(vmm_sys_util::errno::Error::new(errno)))
}

/// Sends [`kick_signal`] to a vCPU thread.
pub fn kick<T>(thread: &JoinHandle<T>) {
    if let Err(e) = thread.kill(kick_signal()) {
        tracing::debug!(error = %e, "kick failed (thread gone?)");
    }
}

impl Vcpu {
    /// Wraps a created vCPU fd; `memory` is the VM's guest memory.
    pub fn new(id: u8, fd: VcpuFd, memory: GuestMemoryMmap) -> Self {
        Vcpu {
            id,
            fd,
            _memory: memory,
        }
    }

    /// The vCPU id (also its APIC id).
    pub fn id(&self) -> u8 {
        self.id
    }

    /// The KVM vCPU fd, for register setup.
    pub fn fd(&self) -> &VcpuFd {
        &self.fd
    }

    pub(crate) fn ioctl_err(&self, what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Error {
        let id = self.id;
        move |source| Error::Ioctl { id, what, source }
    }

    /// Marks the vCPU runnable. With the in-kernel LAPIC, application processors start in
    /// "wait for INIT/SIPI" state; a test that gives an AP its own entry state calls this so
    /// it runs immediately. Linux boots APs itself through INIT/SIPI and does not need it.
    ///
    /// # Errors
    /// [`Error::Ioctl`].
    pub fn set_runnable(&self) -> Result<()> {
        self.fd
            .set_mp_state(kvm_mp_state {
                mp_state: KVM_MP_STATE_RUNNABLE,
            })
            .map_err(self.ioctl_err("KVM_SET_MP_STATE"))
    }

    /// Moves the vCPU into a new thread named `vcpu<id>` running [`Vcpu::run_loop`], which
    /// reports to `shared[id]` (to a block of its own when `shared` is shorter).
    ///
    /// # Errors
    /// [`Error::Signal`], [`Error::Spawn`].
    pub fn spawn(
        self,
        pio: Arc<Bus>,
        mmio: Arc<Bus>,
        exit: ExitHandle,
        shared: Arc<[VcpuShared]>,
    ) -> Result<JoinHandle<VcpuStats>> {
        install_kick_handler()?;
        let id = self.id;
        std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .spawn(move || {
                let own = VcpuShared::new(id);
                let shared = shared.get(usize::from(id)).unwrap_or(&own);
                self.run_loop(&pio, &mmio, &exit, shared)
            })
            .map_err(|source| Error::Spawn { id, source })
    }

    /// Runs the vCPU until an exit is requested (by anyone) or the vCPU itself ends the VM,
    /// keeping `shared` (counters, thread state) current and answering its state requests.
    pub fn run_loop(
        mut self,
        pio: &Bus,
        mmio: &Bus,
        exit: &ExitHandle,
        shared: &VcpuShared,
    ) -> VcpuStats {
        let id = self.id;
        shared.thread_started();
        tracing::debug!(vcpu = id, "vCPU thread started");
        while !exit.is_requested() {
            // A state request: this KVM_RUN completes a pending PIO/MMIO access and returns
            // EINTR without entering the guest, so the state read after it is consistent.
            let wanted = shared.state_wanted();
            if wanted {
                self.fd.set_kvm_immediate_exit(1);
            }
            shared.set_thread_state(ThreadState::KvmRun);
            let result = self.fd.run();
            shared.set_thread_state(ThreadState::Vmm);
            let kind = match result {
                Ok(VcpuExit::IoIn(port, data)) => {
                    if !pio.read(u64::from(port), data) {
                        shared.count_pio_unhandled();
                        data.fill(0xff);
                        tracing::trace!(vcpu = id, port, "unhandled PIO read");
                    }
                    ExitKind::Io
                }
                Ok(VcpuExit::IoOut(port, data)) => {
                    if !pio.write(u64::from(port), data) {
                        shared.count_pio_unhandled();
                        tracing::trace!(vcpu = id, port, ?data, "unhandled PIO write");
                    }
                    ExitKind::Io
                }
                Ok(VcpuExit::MmioRead(addr, data)) => {
                    if !mmio.read(addr, data) {
                        shared.count_mmio_unhandled();
                        data.fill(0xff);
                        tracing::debug!(vcpu = id, addr, "unhandled MMIO read");
                    }
                    ExitKind::Mmio
                }
                Ok(VcpuExit::MmioWrite(addr, data)) => {
                    if !mmio.write(addr, data) {
                        shared.count_mmio_unhandled();
                        tracing::debug!(vcpu = id, addr, ?data, "unhandled MMIO write");
                    }
                    ExitKind::Mmio
                }
                Ok(VcpuExit::Hlt) => {
                    exit.request(ExitReason::Halted { vcpu: id });
                    ExitKind::Hlt
                }
                Ok(VcpuExit::Shutdown) => {
                    exit.request(ExitReason::TripleFault);
                    ExitKind::Shutdown
                }
                Ok(VcpuExit::SystemEvent(kind, data)) => {
                    match kind {
                        kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN => {
                            exit.request(ExitReason::PowerOff);
                        }
                        kvm_bindings::KVM_SYSTEM_EVENT_RESET => {
                            exit.request(ExitReason::Reset);
                        }
                        kvm_bindings::KVM_SYSTEM_EVENT_CRASH => {
                            exit.request(ExitReason::GuestCrash);
                        }
                        other => {
                            tracing::warn!(vcpu = id, kind = other, ?data, "ignored system event");
                        }
                    }
                    ExitKind::SystemEvent
                }
                Ok(VcpuExit::FailEntry(reason, cpu)) => {
                    exit.request(ExitReason::Error(format!(
                        "vCPU {id}: VM entry failed, hardware reason {reason:#x} on host cpu {cpu}"
                    )));
                    ExitKind::FailEntry
                }
                Ok(VcpuExit::InternalError) => {
                    let suberror = self.fd.get_kvm_run().__bindgen_anon_1;
                    // SAFETY: KVM fills the `internal` member of the exit union for
                    // KVM_EXIT_INTERNAL_ERROR; it is plain integers, valid for any bit pattern.
                    let sub = unsafe { suberror.internal.suberror };
                    exit.request(ExitReason::Error(format!(
                        "vCPU {id}: KVM internal error, suberror {sub}"
                    )));
                    ExitKind::InternalError
                }
                Ok(VcpuExit::Intr) => ExitKind::Intr,
                Ok(VcpuExit::IoapicEoi(_)) => ExitKind::IoapicEoi,
                Ok(VcpuExit::IrqWindowOpen) => ExitKind::IrqWindowOpen,
                Ok(other) => {
                    exit.request(ExitReason::Error(format!(
                        "vCPU {id}: unhandled exit {other:?}"
                    )));
                    ExitKind::Other
                }
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => ExitKind::Intr,
                Err(e) => {
                    exit.request(ExitReason::Error(format!("vCPU {id}: KVM_RUN: {e}")));
                    ExitKind::Error
                }
            };
            shared.count(kind);
            if wanted {
                self.fd.set_kvm_immediate_exit(0);
                if kind == ExitKind::Intr {
                    shared.answer(&self.fd);
                }
            }
        }
        shared.set_thread_state(ThreadState::Exited);
        let stats = shared.stats();
        tracing::debug!(vcpu = id, ?stats, "vCPU thread ends");
        stats
    }
}
