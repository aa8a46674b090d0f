//! What a vCPU thread shares with the rest of the VMM, and reading a vCPU's state for the
//! monitor (QMP `x-query-vcpus`, HMP `info registers`).
//!
//! Each vCPU has one [`VcpuShared`]: its kernel thread id, where its thread is
//! ([`ThreadState`]), its exit counters by reason and a state request slot. The run loop is
//! the only writer of the counters and the thread state, so it updates them with plain
//! relaxed loads and stores (no lock, no locked instruction, no allocation per exit); the
//! monitor reads them at any time.
//!
//! A vCPU fd is busy while its thread sits in `KVM_RUN`, so the monitor does not read the
//! registers itself: [`query`] puts a reply channel into the slot, raises the request flag
//! and kicks the thread with [`super::kick_signal`] until it answers or the bound passes.
//! The run loop sees the flag before its next `KVM_RUN`, enters `KVM_RUN` once with
//! `immediate_exit` set (KVM then completes a pending PIO/MMIO access, so the registers read
//! are consistent, and returns `EINTR` without entering the guest), reads the state with
//! `KVM_GET_*` ioctls only (nothing guest-visible changes: `KVM_GET_MP_STATE` and
//! `KVM_GET_VCPU_EVENTS` let KVM take in pending INIT/SIPI and NMI events first, as the next
//! `KVM_RUN` would, and QEMU makes the same calls on every register read) and goes on. A vCPU that does not
//! answer in time (its thread held in a long exit handler) is reported with what is known
//! without it: thread state and counters.
//!
//! The members of each vCPU's `x-query-vcpus` object (numbers are plain JSON integers):
//!
//! | member | what |
//! |---|---|
//! | `cpu-index`, `thread-id` | the vCPU id and its thread's kernel tid (0 before the thread runs) |
//! | `thread-state` | `kvm-run` (inside `KVM_RUN`: running guest code, or halted / waiting for SIPI in the kernel), `vmm` (handling an exit in the VMM), `not-started`, `exited`; bouncevm has no pause |
//! | `answered` | whether the vCPU thread read its own state within 500 ms; `false` (a thread held in a long exit handler, or not running) leaves out the members below `unhandled` |
//! | `exits` | `KVM_RUN` returns since the thread started, by reason: `io`, `mmio`, `hlt`, `shutdown`, `system-event`, `fail-entry`, `internal-error`, `intr` (signals: kicks, including each query's own, about two per answered query), `irq-window-open`, `ioapic-eoi`, `other`, `error` |
//! | `unhandled` | `pio`, `mmio`: accesses no device claimed |
//! | `mp-state` | `KVM_GET_MP_STATE` by name: `runnable`, `uninitialized` (an AP waiting for INIT/SIPI), `init-received`, `halted`, `sipi-received`, `stopped`, ... (`unknown-N` otherwise) |
//! | `regs`, `interrupts-enabled` | `KVM_GET_REGS`: `rax`...`r15`, `rip`, `rflags`; `interrupts-enabled` is RFLAGS.IF |
//! | `sregs` | `KVM_GET_SREGS`: `cr0`, `cr2`, `cr3`, `cr4`, `cr8`, `efer`, `apic-base`, the segments `cs` `ss` `ds` `es` `fs` `gs` `tr` `ldt` (`selector`, `base`, `limit`, `type`, `dpl`, `present`, `db`, `l`), `gdt`/`idt` (`base`, `limit`) |
//! | `events` | `KVM_GET_VCPU_EVENTS`: `interrupt` (`injected`, `vector`, `soft`, `shadow`: the STI/MOV-SS interrupt shadow), `nmi` (`injected`, `pending`, `masked`), `exception` (`injected`, `pending`, `vector`, `error-code`), `sipi-vector` |
//! | `lapic` | `KVM_GET_LAPIC`: `id`, `tpr`, `ppr`, `svr`, `irr-highest` / `isr-highest` (the highest vector pending / in service, `null` when none), `esr`, `icr`, `lvt-timer`, `timer-initial-count`, `timer-current-count`, `timer-divide`, `lvt-lint0`, `lvt-lint1`, `lvt-error` |
//! | `msrs` | `tsc`, `tsc-deadline` (`IA32_TSC_DEADLINE`; 0 when disarmed) |
//! | `errors` | the `KVM_GET_*` calls that failed, if any (their members are left out) |

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvm_bindings::{
    kvm_lapic_state, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, kvm_vcpu_events, Msrs,
};
use kvm_ioctls::VcpuFd;
use serde_json::{json, Map, Value};

use super::VcpuStats;

/// How long [`query`] waits for a vCPU thread to answer.
pub const QUERY_TIMEOUT: Duration = Duration::from_millis(500);

/// How often [`query`] re-sends the kick (a kick that lands just before `KVM_RUN` is lost).
const KICK_INTERVAL: Duration = Duration::from_millis(5);

/// `IA32_TSC_DEADLINE`.
const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;

/// Where a vCPU thread is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ThreadState {
    /// The thread has not run yet.
    NotStarted = 0,
    /// Inside `KVM_RUN` (running guest code, or halted / waiting for SIPI in the kernel).
    KvmRun = 1,
    /// Handling an exit in the VMM (a device access, a kick, a state request).
    Vmm = 2,
    /// The thread has ended.
    Exited = 3,
}

impl ThreadState {
    /// The name the monitor reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotStarted => "not-started",
            Self::KvmRun => "kvm-run",
            Self::Vmm => "vmm",
            Self::Exited => "exited",
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::KvmRun,
            2 => Self::Vmm,
            3 => Self::Exited,
            _ => Self::NotStarted,
        }
    }
}

/// The exit reasons a vCPU's counters tell apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum ExitKind {
    /// KVM_EXIT_IO.
    Io,
    /// KVM_EXIT_MMIO.
    Mmio,
    /// KVM_EXIT_HLT (a HLT that reached user space).
    Hlt,
    /// KVM_EXIT_SHUTDOWN (triple fault).
    Shutdown,
    /// KVM_EXIT_SYSTEM_EVENT.
    SystemEvent,
    /// KVM_EXIT_FAIL_ENTRY.
    FailEntry,
    /// KVM_EXIT_INTERNAL_ERROR.
    InternalError,
    /// `KVM_RUN` returned for a signal (`EINTR`, `EAGAIN`, KVM_EXIT_INTR): kicks, including
    /// those of state requests.
    Intr,
    /// KVM_EXIT_IRQ_WINDOW_OPEN.
    IrqWindowOpen,
    /// KVM_EXIT_IOAPIC_EOI.
    IoapicEoi,
    /// Any other exit.
    Other,
    /// `KVM_RUN` failed with another error.
    Error,
}

impl ExitKind {
    /// Every kind, in counter order.
    pub const ALL: [ExitKind; 12] = [
        Self::Io,
        Self::Mmio,
        Self::Hlt,
        Self::Shutdown,
        Self::SystemEvent,
        Self::FailEntry,
        Self::InternalError,
        Self::Intr,
        Self::IrqWindowOpen,
        Self::IoapicEoi,
        Self::Other,
        Self::Error,
    ];

    /// The name the monitor reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Io => "io",
            Self::Mmio => "mmio",
            Self::Hlt => "hlt",
            Self::Shutdown => "shutdown",
            Self::SystemEvent => "system-event",
            Self::FailEntry => "fail-entry",
            Self::InternalError => "internal-error",
            Self::Intr => "intr",
            Self::IrqWindowOpen => "irq-window-open",
            Self::IoapicEoi => "ioapic-eoi",
            Self::Other => "other",
            Self::Error => "error",
        }
    }
}

/// The name of a `KVM_GET_MP_STATE` value.
pub fn mp_state_name(mp_state: u32) -> String {
    let name = match mp_state {
        kvm_bindings::KVM_MP_STATE_RUNNABLE => "runnable",
        kvm_bindings::KVM_MP_STATE_UNINITIALIZED => "uninitialized",
        kvm_bindings::KVM_MP_STATE_INIT_RECEIVED => "init-received",
        kvm_bindings::KVM_MP_STATE_HALTED => "halted",
        kvm_bindings::KVM_MP_STATE_SIPI_RECEIVED => "sipi-received",
        kvm_bindings::KVM_MP_STATE_STOPPED => "stopped",
        kvm_bindings::KVM_MP_STATE_CHECK_STOP => "check-stop",
        kvm_bindings::KVM_MP_STATE_OPERATING => "operating",
        kvm_bindings::KVM_MP_STATE_LOAD => "load",
        kvm_bindings::KVM_MP_STATE_AP_RESET_HOLD => "ap-reset-hold",
        kvm_bindings::KVM_MP_STATE_SUSPENDED => "suspended",
        other => return format!("unknown-{other}"),
    };
    name.to_string()
}

/// Adds one to a counter only its owner thread writes (a load and a store, no locked
/// instruction).
fn bump(c: &AtomicU64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What one vCPU thread shares with the monitor (see the module documentation). Aligned to
/// its own cache lines: the blocks of all vCPUs sit side by side in one slice, and each
/// thread writes its counters on every exit.
#[derive(Debug)]
#[repr(align(128))]
pub struct VcpuShared {
    id: u8,
    tid: AtomicI32,
    state: AtomicU8,
    exits: [AtomicU64; ExitKind::ALL.len()],
    pio_unhandled: AtomicU64,
    mmio_unhandled: AtomicU64,
    wanted: AtomicBool,
    reply: Mutex<Option<SyncSender<Box<VcpuSnapshot>>>>,
}

impl VcpuShared {
    /// The shared block of vCPU `id`, thread not started.
    pub fn new(id: u8) -> Self {
        VcpuShared {
            id,
            tid: AtomicI32::new(0),
            state: AtomicU8::new(ThreadState::NotStarted as u8),
            exits: Default::default(),
            pio_unhandled: AtomicU64::new(0),
            mmio_unhandled: AtomicU64::new(0),
            wanted: AtomicBool::new(false),
            reply: Mutex::new(None),
        }
    }

    /// The vCPU id.
    pub fn id(&self) -> u8 {
        self.id
    }

    /// The kernel thread id of the vCPU thread (0 until it runs).
    pub fn thread_id(&self) -> i32 {
        self.tid.load(Ordering::Relaxed)
    }

    /// Where the thread is.
    pub fn thread_state(&self) -> ThreadState {
        ThreadState::from_u8(self.state.load(Ordering::Relaxed))
    }

    /// Exits of `kind` since the thread started.
    pub fn exits(&self, kind: ExitKind) -> u64 {
        self.exits[kind as usize].load(Ordering::Relaxed)
    }

    /// The counters as the thread returns them when it ends.
    pub fn stats(&self) -> VcpuStats {
        VcpuStats {
            pio_exits: self.exits(ExitKind::Io),
            mmio_exits: self.exits(ExitKind::Mmio),
            pio_unhandled: self.pio_unhandled.load(Ordering::Relaxed),
            mmio_unhandled: self.mmio_unhandled.load(Ordering::Relaxed),
            interrupted: self.exits(ExitKind::Intr),
        }
    }

    /// Called by the vCPU thread when it starts.
    pub(super) fn thread_started(&self) {
        // SAFETY: gettid has no preconditions.
        self.tid.store(unsafe { libc::gettid() }, Ordering::Relaxed);
        self.set_thread_state(ThreadState::Vmm);
    }

    /// Called by the vCPU thread around `KVM_RUN` and when it ends.
    pub(super) fn set_thread_state(&self, s: ThreadState) {
        self.state.store(s as u8, Ordering::Relaxed);
    }

    /// Counts one exit (vCPU thread only).
    pub(super) fn count(&self, kind: ExitKind) {
        bump(&self.exits[kind as usize]);
    }

    /// Counts a PIO access no device claimed (vCPU thread only).
    pub(super) fn count_pio_unhandled(&self) {
        bump(&self.pio_unhandled);
    }

    /// Counts an MMIO access no device claimed (vCPU thread only).
    pub(super) fn count_mmio_unhandled(&self) {
        bump(&self.mmio_unhandled);
    }

    /// Whether the monitor waits for this vCPU's state (one load per exit).
    pub(super) fn state_wanted(&self) -> bool {
        self.wanted.load(Ordering::Acquire)
    }

    /// Reads the vCPU's state and hands it to the waiting monitor, if it still waits (vCPU
    /// thread only, outside `KVM_RUN`).
    pub(super) fn answer(&self, fd: &VcpuFd) {
        self.wanted.store(false, Ordering::Release);
        let Some(tx) = lock(&self.reply).take() else {
            return;
        };
        // The receiver may have given up meanwhile; nothing else to do then.
        let _ = tx.try_send(Box::new(VcpuSnapshot::read(fd)));
    }

    /// Sends the kick signal to the thread while it can be in `KVM_RUN`.
    fn kick(&self) {
        let tid = self.thread_id();
        if tid == 0 || !matches!(self.thread_state(), ThreadState::KvmRun | ThreadState::Vmm) {
            return;
        }
        // The handler was installed when the thread was spawned; without it SIGRTMIN would
        // end the process.
        if super::install_kick_handler().is_err() {
            return;
        }
        let pid = std::process::id() as libc::pid_t;
        // SAFETY: tgkill only sends a signal; a thread id reused by another thread of this
        // process gets the no-op kick handler, nothing else.
        unsafe { libc::tgkill(pid, tid, super::kick_signal()) };
    }

    fn request(&self) -> Option<Receiver<Box<VcpuSnapshot>>> {
        if !matches!(self.thread_state(), ThreadState::KvmRun | ThreadState::Vmm) {
            return None;
        }
        let (tx, rx) = sync_channel(1);
        *lock(&self.reply) = Some(tx);
        self.wanted.store(true, Ordering::Release);
        self.kick();
        Some(rx)
    }

    fn withdraw(&self) {
        lock(&self.reply).take();
    }

    /// What is known without the thread's help: ids, thread state and counters.
    fn outline(&self, answered: bool) -> Map<String, Value> {
        let mut exits = Map::new();
        for k in ExitKind::ALL {
            exits.insert(k.as_str().into(), self.exits(k).into());
        }
        let mut m = Map::new();
        m.insert("cpu-index".into(), self.id.into());
        m.insert("thread-id".into(), self.thread_id().into());
        m.insert("thread-state".into(), self.thread_state().as_str().into());
        m.insert("answered".into(), answered.into());
        m.insert("exits".into(), Value::Object(exits));
        m.insert(
            "unhandled".into(),
            json!({
                "pio": self.pio_unhandled.load(Ordering::Relaxed),
                "mmio": self.mmio_unhandled.load(Ordering::Relaxed),
            }),
        );
        m
    }
}

/// Asks every vCPU in `vcpus` for its state and waits up to `timeout` for all of them; one
/// JSON object per vCPU, in order (see `vmm/README.md`, `x-query-vcpus`). Never blocks longer
/// than `timeout` plus a kick interval.
pub fn query(vcpus: &[VcpuShared], timeout: Duration) -> Vec<Value> {
    let deadline = Instant::now() + timeout;
    let mut pending: Vec<Option<Receiver<Box<VcpuSnapshot>>>> =
        vcpus.iter().map(VcpuShared::request).collect();
    let mut answers: Vec<Option<Box<VcpuSnapshot>>> = vcpus.iter().map(|_| None).collect();
    loop {
        for (i, slot) in pending.iter_mut().enumerate() {
            let Some(rx) = slot else { continue };
            match rx.try_recv() {
                Ok(s) => {
                    answers[i] = Some(s);
                    *slot = None;
                }
                Err(TryRecvError::Disconnected) => *slot = None,
                Err(TryRecvError::Empty) => {}
            }
        }
        let now = Instant::now();
        if pending.iter().all(Option::is_none) || now >= deadline {
            break;
        }
        for (v, slot) in vcpus.iter().zip(&pending) {
            if slot.is_some() {
                v.kick();
            }
        }
        std::thread::sleep(KICK_INTERVAL.min(deadline - now));
    }
    for (v, slot) in vcpus.iter().zip(&pending) {
        if slot.is_some() {
            v.withdraw();
        }
    }
    vcpus
        .iter()
        .zip(answers)
        .map(|(v, a)| {
            let mut m = v.outline(a.is_some());
            if let Some(s) = a {
                m.extend(s.to_json());
            }
            Value::Object(m)
        })
        .collect()
}

/// One vCPU's state as read by its own thread: each ioctl's result.
#[derive(Debug, Clone)]
pub struct VcpuSnapshot {
    /// KVM_GET_MP_STATE.
    pub mp_state: Result<u32, kvm_ioctls::Error>,
    /// KVM_GET_REGS.
    pub regs: Result<kvm_regs, kvm_ioctls::Error>,
    /// KVM_GET_SREGS.
    pub sregs: Result<kvm_sregs, kvm_ioctls::Error>,
    /// KVM_GET_VCPU_EVENTS.
    pub events: Result<kvm_vcpu_events, kvm_ioctls::Error>,
    /// KVM_GET_LAPIC.
    pub lapic: Result<kvm_lapic_state, kvm_ioctls::Error>,
    /// KVM_GET_MSRS of `IA32_TSC` and `IA32_TSC_DEADLINE` (`None`: not returned).
    pub tsc: Result<(Option<u64>, Option<u64>), kvm_ioctls::Error>,
}

/// LAPIC register offsets (Intel SDM vol. 3, table "Local APIC Register Address Map"); the
/// LINT entries are the ones boot set-up programs.
mod apic {
    pub(crate) use crate::boot::msr::{APIC_LVT0 as LVT_LINT0, APIC_LVT1 as LVT_LINT1};
    pub const ID: usize = 0x20;
    pub const TPR: usize = 0x80;
    pub const PPR: usize = 0xa0;
    pub const SVR: usize = 0xf0;
    pub const ISR: usize = 0x100;
    pub const IRR: usize = 0x200;
    pub const ESR: usize = 0x280;
    pub const ICR_LO: usize = 0x300;
    pub const ICR_HI: usize = 0x310;
    pub const LVT_TIMER: usize = 0x320;
    pub const LVT_ERROR: usize = 0x370;
    pub const TIMER_INITIAL: usize = 0x380;
    pub const TIMER_CURRENT: usize = 0x390;
    pub const TIMER_DIVIDE: usize = 0x3e0;
}

/// The highest vector set in the 256-bit LAPIC register array at `base` (ISR, IRR: eight
/// 32-bit words, 16 bytes apart).
fn highest_vector(lapic: &kvm_lapic_state, base: usize) -> Option<u32> {
    (0..8u32).rev().find_map(|word| {
        let bits = crate::boot::msr::lapic_reg(lapic, base + word as usize * 0x10);
        (bits != 0).then(|| word * 32 + 31 - bits.leading_zeros())
    })
}

fn segment_json(s: &kvm_segment) -> Value {
    json!({
        "selector": s.selector, "base": s.base, "limit": s.limit, "type": s.type_,
        "dpl": s.dpl, "present": s.present != 0, "db": s.db != 0, "l": s.l != 0,
    })
}

impl VcpuSnapshot {
    /// Reads the state of the vCPU behind `fd` (`KVM_GET_*` only).
    pub fn read(fd: &VcpuFd) -> Self {
        let tsc = {
            let entry = |index| kvm_msr_entry {
                index,
                ..Default::default()
            };
            match Msrs::from_entries(&[
                entry(crate::boot::msr::MSR_IA32_TSC),
                entry(MSR_IA32_TSC_DEADLINE),
            ]) {
                Err(_) => Ok((None, None)),
                Ok(mut msrs) => fd.get_msrs(&mut msrs).map(|n| {
                    let e = msrs.as_slice();
                    let value = |i: usize| (i < n).then(|| e[i].data);
                    (value(0), value(1))
                }),
            }
        };
        VcpuSnapshot {
            mp_state: fd.get_mp_state().map(|s| s.mp_state),
            regs: fd.get_regs(),
            sregs: fd.get_sregs(),
            events: fd.get_vcpu_events(),
            lapic: fd.get_lapic(),
            tsc,
        }
    }

    /// The JSON members of the snapshot (merged into the vCPU's object by [`query`]); an
    /// ioctl that failed is left out and named in `errors`.
    pub fn to_json(&self) -> Map<String, Value> {
        let mut m = Map::new();
        let mut errors = Vec::new();
        let mut fail = |what: &str, e: &kvm_ioctls::Error| errors.push(format!("{what}: {e}"));
        match &self.mp_state {
            Ok(s) => {
                m.insert("mp-state".into(), mp_state_name(*s).into());
            }
            Err(e) => fail("KVM_GET_MP_STATE", e),
        }
        match &self.regs {
            Ok(r) => {
                m.insert(
                    "regs".into(),
                    json!({
                        "rax": r.rax, "rbx": r.rbx, "rcx": r.rcx, "rdx": r.rdx,
                        "rsi": r.rsi, "rdi": r.rdi, "rbp": r.rbp, "rsp": r.rsp,
                        "r8": r.r8, "r9": r.r9, "r10": r.r10, "r11": r.r11,
                        "r12": r.r12, "r13": r.r13, "r14": r.r14, "r15": r.r15,
                        "rip": r.rip, "rflags": r.rflags,
                    }),
                );
                m.insert("interrupts-enabled".into(), (r.rflags & 0x200 != 0).into());
            }
            Err(e) => fail("KVM_GET_REGS", e),
        }
        match &self.sregs {
            Ok(s) => {
                m.insert(
                    "sregs".into(),
                    json!({
                        "cr0": s.cr0, "cr2": s.cr2, "cr3": s.cr3, "cr4": s.cr4, "cr8": s.cr8,
                        "efer": s.efer, "apic-base": s.apic_base,
                        "cs": segment_json(&s.cs), "ss": segment_json(&s.ss),
                        "ds": segment_json(&s.ds), "es": segment_json(&s.es),
                        "fs": segment_json(&s.fs), "gs": segment_json(&s.gs),
                        "tr": segment_json(&s.tr), "ldt": segment_json(&s.ldt),
                        "gdt": {"base": s.gdt.base, "limit": s.gdt.limit},
                        "idt": {"base": s.idt.base, "limit": s.idt.limit},
                    }),
                );
            }
            Err(e) => fail("KVM_GET_SREGS", e),
        }
        match &self.events {
            Ok(ev) => {
                m.insert(
                    "events".into(),
                    json!({
                        "exception": {
                            "injected": ev.exception.injected != 0,
                            "pending": ev.exception.pending != 0,
                            "vector": ev.exception.nr,
                            "error-code": (ev.exception.has_error_code != 0)
                                .then_some(ev.exception.error_code),
                        },
                        "interrupt": {
                            "injected": ev.interrupt.injected != 0,
                            "vector": ev.interrupt.nr,
                            "soft": ev.interrupt.soft != 0,
                            "shadow": ev.interrupt.shadow,
                        },
                        "nmi": {
                            "injected": ev.nmi.injected != 0,
                            "pending": ev.nmi.pending != 0,
                            "masked": ev.nmi.masked != 0,
                        },
                        "sipi-vector": ev.sipi_vector,
                    }),
                );
            }
            Err(e) => fail("KVM_GET_VCPU_EVENTS", e),
        }
        match &self.lapic {
            Ok(l) => {
                let reg = |off| crate::boot::msr::lapic_reg(l, off);
                m.insert(
                    "lapic".into(),
                    json!({
                        "id": reg(apic::ID) >> 24,
                        "tpr": reg(apic::TPR),
                        "ppr": reg(apic::PPR),
                        "svr": reg(apic::SVR),
                        "irr-highest": highest_vector(l, apic::IRR),
                        "isr-highest": highest_vector(l, apic::ISR),
                        "esr": reg(apic::ESR),
                        "icr": (u64::from(reg(apic::ICR_HI)) << 32) | u64::from(reg(apic::ICR_LO)),
                        "lvt-timer": reg(apic::LVT_TIMER),
                        "lvt-lint0": reg(apic::LVT_LINT0),
                        "lvt-lint1": reg(apic::LVT_LINT1),
                        "lvt-error": reg(apic::LVT_ERROR),
                        "timer-initial-count": reg(apic::TIMER_INITIAL),
                        "timer-current-count": reg(apic::TIMER_CURRENT),
                        "timer-divide": reg(apic::TIMER_DIVIDE),
                    }),
                );
            }
            Err(e) => fail("KVM_GET_LAPIC", e),
        }
        match &self.tsc {
            Ok((tsc, deadline)) => {
                m.insert("msrs".into(), json!({"tsc": tsc, "tsc-deadline": deadline}));
            }
            Err(e) => fail("KVM_GET_MSRS", e),
        }
        if !errors.is_empty() {
            m.insert("errors".into(), errors.into());
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot() -> VcpuSnapshot {
        let mut lapic = kvm_lapic_state::default();
        let mut set = |off, v| crate::boot::msr::set_lapic_reg(&mut lapic, off, v);
        set(apic::ID, 1 << 24);
        set(apic::TPR, 0x10);
        // Vector 0xec (236) in IRR: word 7, bit 12; vector 0x30 in IRR and ISR: word 1, bit 16.
        set(apic::IRR + 7 * 0x10, 1 << 12);
        set(apic::IRR + 0x10, 1 << 16);
        set(apic::ISR + 0x10, 1 << 16);
        set(apic::LVT_TIMER, 0x000200ec);
        set(apic::TIMER_INITIAL, 1000);
        set(apic::TIMER_CURRENT, 400);
        let regs = kvm_regs {
            rip: 0x1004,
            rflags: 0x202,
            rax: 7,
            ..Default::default()
        };
        let mut events = kvm_vcpu_events::default();
        events.interrupt.injected = 1;
        events.interrupt.nr = 0xec;
        events.interrupt.shadow = 1;
        events.nmi.pending = 1;
        events.sipi_vector = 0x9a;
        VcpuSnapshot {
            mp_state: Ok(kvm_bindings::KVM_MP_STATE_HALTED),
            regs: Ok(regs),
            sregs: Ok(kvm_sregs {
                cr0: 0x11,
                efer: 0x500,
                ..Default::default()
            }),
            events: Ok(events),
            lapic: Ok(lapic),
            tsc: Ok((Some(5), None)),
        }
    }

    /// Every KVM mp-state has its uapi name; an unknown value is named by its number.
    #[test]
    fn mp_state_names() {
        let names: Vec<String> = (0..=10).map(mp_state_name).collect();
        assert_eq!(
            names,
            [
                "runnable",
                "uninitialized",
                "init-received",
                "halted",
                "sipi-received",
                "stopped",
                "check-stop",
                "operating",
                "load",
                "ap-reset-hold",
                "suspended"
            ]
        );
        assert_eq!(mp_state_name(77), "unknown-77");
    }

    /// The snapshot's JSON: registers, events and LAPIC decoded, highest IRR/ISR vectors.
    #[test]
    fn snapshot_json_shape() {
        let j = Value::Object(snapshot().to_json());
        assert_eq!(j["mp-state"], "halted");
        assert_eq!(j["regs"]["rip"], 0x1004);
        assert_eq!(j["regs"]["rax"], 7);
        assert_eq!(j["regs"]["rflags"], 0x202);
        assert_eq!(j["interrupts-enabled"], true);
        assert_eq!(j["sregs"]["cr0"], 0x11);
        assert_eq!(j["sregs"]["efer"], 0x500);
        assert_eq!(j["sregs"]["cs"]["selector"], 0);
        assert_eq!(
            j["events"]["interrupt"],
            json!({"injected": true, "vector": 0xec, "soft": false, "shadow": 1})
        );
        assert_eq!(
            j["events"]["nmi"],
            json!({"injected": false, "pending": true, "masked": false})
        );
        assert_eq!(j["events"]["sipi-vector"], 0x9a);
        assert_eq!(j["events"]["exception"]["error-code"], Value::Null);
        assert_eq!(j["lapic"]["id"], 1);
        assert_eq!(j["lapic"]["tpr"], 0x10);
        assert_eq!(j["lapic"]["irr-highest"], 0xec);
        assert_eq!(j["lapic"]["isr-highest"], 0x30);
        assert_eq!(j["lapic"]["lvt-timer"], 0x200ec);
        assert_eq!(j["lapic"]["timer-initial-count"], 1000);
        assert_eq!(j["lapic"]["timer-current-count"], 400);
        assert_eq!(j["msrs"], json!({"tsc": 5, "tsc-deadline": null}));
        assert!(j.get("errors").is_none());
    }

    /// A failed ioctl leaves its member out and is named in `errors`; empty IRR/ISR are null.
    #[test]
    fn snapshot_json_with_failed_ioctls() {
        let mut s = snapshot();
        s.lapic = Ok(kvm_lapic_state::default());
        s.regs = Err(kvm_ioctls::Error::new(libc::EBUSY));
        s.tsc = Err(kvm_ioctls::Error::new(libc::EINVAL));
        let j = Value::Object(s.to_json());
        assert!(j.get("regs").is_none() && j.get("msrs").is_none());
        assert!(j.get("interrupts-enabled").is_none());
        let errors = j["errors"].as_array().unwrap();
        assert_eq!(errors.len(), 2, "{j}");
        assert!(errors[0].as_str().unwrap().starts_with("KVM_GET_REGS"));
        assert!(errors[1].as_str().unwrap().starts_with("KVM_GET_MSRS"));
        assert_eq!(j["lapic"]["irr-highest"], Value::Null);
        assert_eq!(j["lapic"]["isr-highest"], Value::Null);
    }

    /// A vCPU whose thread never ran (or has ended) is answered at once from its counters.
    #[test]
    fn unstarted_and_exited_vcpus_answer_without_their_thread() {
        let v = [VcpuShared::new(0), VcpuShared::new(1)];
        v[1].set_thread_state(ThreadState::Exited);
        v[1].count(ExitKind::Io);
        v[1].count(ExitKind::Io);
        v[1].count_mmio_unhandled();
        let t = Instant::now();
        let a = query(&v, QUERY_TIMEOUT);
        assert!(t.elapsed() < QUERY_TIMEOUT, "{:?}", t.elapsed());
        assert_eq!(a[0]["thread-state"], "not-started");
        assert_eq!(a[0]["answered"], false);
        assert_eq!(a[1]["cpu-index"], 1);
        assert_eq!(a[1]["thread-state"], "exited");
        assert_eq!(a[1]["exits"]["io"], 2);
        assert_eq!(a[1]["exits"]["intr"], 0);
        assert_eq!(a[1]["unhandled"], json!({"pio": 0, "mmio": 1}));
        assert!(a[1].get("regs").is_none());
        assert_eq!(v[1].stats().pio_exits, 2);
        assert_eq!(v[1].stats().mmio_unhandled, 1);
    }

    /// A thread that is in the VMM but never serves the request is reported `answered: false`
    /// within the bound, and its request is withdrawn.
    #[test]
    fn a_vcpu_that_does_not_answer_is_reported_within_the_bound() {
        super::super::install_kick_handler().unwrap();
        let v = [VcpuShared::new(0)];
        v[0].thread_started();
        let t = Instant::now();
        let a = query(&v, Duration::from_millis(100));
        let took = t.elapsed();
        assert!(took >= Duration::from_millis(100), "{took:?}");
        // The bound, plus slack for a host whose cores other work keeps busy.
        assert!(took < Duration::from_secs(2), "{took:?}");
        assert_eq!(a[0]["answered"], false);
        assert_eq!(a[0]["thread-state"], "vmm");
        assert!(v[0].state_wanted());
        assert!(lock(&v[0].reply).is_none());
    }
}
