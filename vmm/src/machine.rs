//! A whole VM: KVM, memory, buses, devices and vCPU threads, and its lifecycle.
//!
//! ```no_run
//! use vmm::{Machine, MachineConfig};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut m = Machine::new(&MachineConfig { mem_size: 512 << 20, vcpus: 2 })?;
//! m.add_serial(std::io::stdout())?;
//! m.add_i8042()?;
//! m.add_acpi()?;
//! let _pci = m.add_pci()?;
//! m.load_linux(&vmm::boot::linux::LinuxBootConfig {
//!     kernel: "vmlinux".into(),
//!     initrd: None,
//!     cmdline: "console=ttyS0 reboot=k panic=-1".into(),
//!     prefer_pvh: true,
//! })?;
//! let exit = m.start()?.wait()?;
//! std::process::exit(exit.reason.exit_code());
//! # }
//! ```
//!
//! Lifecycle: [`Machine::new`] → add devices, configure vCPUs → [`Machine::start`] spawns
//! one thread per vCPU → [`RunningMachine::wait`] blocks until someone requests an exit
//! (guest reset, ACPI power-off, debug exit, error, or [`RunningMachine::stop`]), then kicks every vCPU out
//! of `KVM_RUN`, joins the threads and returns the [`MachineExit`].

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_ioctls::Kvm;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::boot;
use crate::bus::Bus;
use crate::exit::{ExitHandle, ExitReason};
use crate::layout::{
    ACPI_SCI_IRQ, COM1_IRQ, COM1_PORT, I8042_COMMAND_PORT, I8042_DATA_PORT, PCI_CONFIG_IO_LEN,
    PCI_CONFIG_IO_PORT, PCI_ECAM_SIZE, PCI_ECAM_START, PM1A_EVT_BLK, SERIAL_PORT_LEN,
};
use crate::legacy::{
    AcpiPm, DebugExit, IrqLine, IrqTrigger, PowerButton, SerialConsole, ACPI_PM_PORTS, I8042,
};
use crate::memory::{self, RamRange};
use crate::pci::{PciConfigIo, PciConfigMmio, PciRoot};
use crate::vcpu::{self, Vcpu, VcpuShared, VcpuStats};
use crate::vm::{self, Vm};

/// How long [`RunningMachine::wait`] keeps kicking a vCPU thread before giving up on it.
pub const VCPU_STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors of machine setup and lifecycle.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Guest memory.
    #[error(transparent)]
    Memory(#[from] memory::Error),
    /// KVM VM setup.
    #[error(transparent)]
    Vm(#[from] vm::Error),
    /// vCPU ioctl or thread.
    #[error(transparent)]
    Vcpu(#[from] vcpu::Error),
    /// Bus registration.
    #[error(transparent)]
    Bus(#[from] crate::bus::Error),
    /// Exit handle.
    #[error(transparent)]
    Exit(#[from] crate::exit::Error),
    /// Creating an interrupt eventfd failed.
    #[error("interrupt eventfd: {0}")]
    EventFd(#[source] std::io::Error),
    /// CPUID setup.
    #[error(transparent)]
    Cpuid(#[from] boot::cpuid::Error),
    /// MSR/FPU/LAPIC setup.
    #[error(transparent)]
    Msr(#[from] boot::msr::Error),
    /// Register setup.
    #[error(transparent)]
    Regs(#[from] boot::regs::Error),
    /// ACPI tables.
    #[error(transparent)]
    Acpi(#[from] boot::acpi::Error),
    /// Linux loading.
    #[error(transparent)]
    Linux(#[from] boot::linux::Error),
    /// Zero vCPUs requested.
    #[error("a machine needs at least one vCPU")]
    NoVcpus,
    /// A vCPU thread did not leave `KVM_RUN` within [`VCPU_STOP_TIMEOUT`].
    #[error("vCPU {0} did not stop")]
    VcpuStuck(u8),
    /// A vCPU thread panicked.
    #[error("vCPU {0} thread panicked")]
    VcpuPanicked(u8),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, Error>;

/// Size and shape of a machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MachineConfig {
    /// Guest RAM in bytes (multiple of 4 KiB); above 3 GiB it is split around the MMIO hole.
    pub mem_size: u64,
    /// Number of vCPUs (APIC ids 0..vcpus).
    pub vcpus: u8,
}

/// A VM being assembled.
#[derive(Debug)]
pub struct Machine {
    kvm: Kvm,
    vm: Arc<Vm>,
    ram: Vec<RamRange>,
    vcpus: Vec<Vcpu>,
    pio: Arc<Bus>,
    mmio: Arc<Bus>,
    exit: ExitHandle,
    pci: Option<Arc<PciRoot>>,
    rsdp: Option<u64>,
    power_button: Option<PowerButton>,
    vcpu_shared: Arc<[VcpuShared]>,
}

/// The SCI as a KVM irqchip line (`KVM_IRQ_LINE`, level).
#[derive(Debug)]
struct KvmIrqLine {
    vm: Arc<Vm>,
    irq: u32,
}

impl IrqLine for KvmIrqLine {
    fn set_level(&self, high: bool) {
        if let Err(e) = self.vm.set_irq_line(self.irq, high) {
            tracing::error!(irq = self.irq, error = %e, "cannot drive the SCI line");
        }
    }
}

impl Machine {
    /// Opens KVM, creates the VM, its memory and its vCPUs.
    ///
    /// # Errors
    /// [`Error::NoVcpus`], [`Error::TooManyVcpus`](vm::Error::TooManyVcpus) through
    /// [`Error::Vm`], and the setup errors of the submodules.
    pub fn new(cfg: &MachineConfig) -> Result<Machine> {
        if cfg.vcpus == 0 {
            return Err(Error::NoVcpus);
        }
        let kvm = vm::open_kvm()?;
        let max = kvm.get_max_vcpus();
        if usize::from(cfg.vcpus) > max {
            return Err(vm::Error::TooManyVcpus {
                requested: cfg.vcpus.into(),
                max,
            }
            .into());
        }
        let ram = memory::ram_ranges(cfg.mem_size)?;
        let mem = memory::create_guest_memory(cfg.mem_size)?;
        let vm = Arc::new(Vm::new(&kvm, mem)?);
        let vcpus = (0..cfg.vcpus)
            .map(|id| Ok(Vcpu::new(id, vm.create_vcpu(id)?, vm.memory().clone())))
            .collect::<Result<Vec<_>>>()?;
        Ok(Machine {
            kvm,
            vm,
            ram,
            vcpus,
            pio: Arc::new(Bus::new("pio")),
            mmio: Arc::new(Bus::new("mmio")),
            exit: ExitHandle::new()?,
            pci: None,
            rsdp: None,
            power_button: None,
            vcpu_shared: (0..cfg.vcpus).map(VcpuShared::new).collect(),
        })
    }

    /// The KVM system fd.
    pub fn kvm(&self) -> &Kvm {
        &self.kvm
    }

    /// The VM (share it with devices that register irqfds, ioeventfds or MSI routes).
    pub fn vm(&self) -> &Arc<Vm> {
        &self.vm
    }

    /// Guest memory.
    pub fn memory(&self) -> &GuestMemoryMmap {
        self.vm.memory()
    }

    /// The RAM ranges of guest memory.
    pub fn ram_ranges(&self) -> &[RamRange] {
        &self.ram
    }

    /// The PIO bus.
    pub fn pio_bus(&self) -> &Arc<Bus> {
        &self.pio
    }

    /// The MMIO bus.
    pub fn mmio_bus(&self) -> &Arc<Bus> {
        &self.mmio
    }

    /// The handle that ends this machine.
    pub fn exit_handle(&self) -> &ExitHandle {
        &self.exit
    }

    /// The vCPUs, in id order.
    pub fn vcpus(&self) -> &[Vcpu] {
        &self.vcpus
    }

    /// The PCI root, once [`Machine::add_pci`] was called.
    pub fn pci(&self) -> Option<&Arc<PciRoot>> {
        self.pci.as_ref()
    }

    /// Creates an eventfd wired to `gsi` of the in-kernel irqchip.
    ///
    /// # Errors
    /// [`Error::EventFd`], [`Error::Vm`].
    pub fn irq_eventfd(&self, gsi: u32) -> Result<EventFd> {
        let evt = EventFd::new(EFD_NONBLOCK).map_err(Error::EventFd)?;
        self.vm.register_irqfd(&evt, gsi)?;
        Ok(evt)
    }

    /// Adds a 16550 at COM1 (0x3f8, IRQ 4) writing to `out`; returns it (for input and
    /// inspection).
    ///
    /// # Errors
    /// [`Error::EventFd`], [`Error::Vm`], [`Error::Bus`].
    pub fn add_serial<W: Write + Send + 'static>(
        &mut self,
        out: W,
    ) -> Result<Arc<Mutex<SerialConsole<W>>>> {
        let irq = IrqTrigger::new(self.irq_eventfd(COM1_IRQ)?);
        let dev = Arc::new(Mutex::new(SerialConsole::new(irq, out)));
        self.pio
            .insert(dev.clone(), COM1_PORT.into(), SERIAL_PORT_LEN.into())?;
        Ok(dev)
    }

    /// Adds the i8042 at 0x60/0x64 (reset ends the VM with status 0).
    ///
    /// # Errors
    /// [`Error::Bus`].
    pub fn add_i8042(&mut self) -> Result<()> {
        let dev = Arc::new(Mutex::new(I8042::new(self.exit.clone())));
        self.pio.insert(dev.clone(), I8042_DATA_PORT.into(), 1)?;
        self.pio.insert(dev, I8042_COMMAND_PORT.into(), 1)?;
        Ok(())
    }

    /// Adds a debug-exit port at `port` (1..4-byte writes end the VM).
    ///
    /// # Errors
    /// [`Error::Bus`].
    pub fn add_debug_exit(&mut self, port: u16) -> Result<()> {
        let dev = Arc::new(Mutex::new(DebugExit::new(self.exit.clone())));
        self.pio.insert(dev, port.into(), 4)?;
        Ok(())
    }

    /// Adds ACPI: writes the tables of [`boot::acpi`] (RSDP at 0xE0000) for this machine's
    /// vCPUs and registers the PM1a registers ([`AcpiPm`]) at [`PM1A_EVT_BLK`], so a guest
    /// entering S5 (`poweroff`) ends the VM with [`ExitReason::PowerOff`], and the fixed
    /// power button ([`Machine::power_button`]) raises the SCI on IRQ [`ACPI_SCI_IRQ`].
    /// [`Machine::load_linux`] then hands the kernel the RSDP address. Without this call
    /// the machine has no ACPI (the MP table alone describes it, as with QEMU's `-no-acpi`).
    ///
    /// # Errors
    /// [`Error::Acpi`], [`Error::Bus`].
    pub fn add_acpi(&mut self) -> Result<()> {
        let rsdp = boot::acpi::write_acpi_tables(self.memory(), self.vcpus.len())?;
        let sci = KvmIrqLine {
            vm: self.vm.clone(),
            irq: ACPI_SCI_IRQ.into(),
        };
        let dev = Arc::new(Mutex::new(AcpiPm::new(
            self.exit.clone(),
            Some(Box::new(sci)),
        )));
        self.pio
            .insert(dev.clone(), PM1A_EVT_BLK.into(), ACPI_PM_PORTS.into())?;
        self.rsdp = Some(rsdp);
        self.power_button = Some(PowerButton(dev));
        Ok(())
    }

    /// The ACPI power button, once [`Machine::add_acpi`] was called.
    pub fn power_button(&self) -> Option<&PowerButton> {
        self.power_button.as_ref()
    }

    /// What each vCPU thread shares with the monitor (thread id, thread state, exit
    /// counters, state requests), in id order.
    pub fn vcpu_shared(&self) -> Arc<[VcpuShared]> {
        self.vcpu_shared.clone()
    }

    /// The ACPI RSDP address, once [`Machine::add_acpi`] was called.
    pub fn acpi_rsdp(&self) -> Option<u64> {
        self.rsdp
    }

    /// Adds PCI bus 0 with its host bridge, configuration mechanism #1 at 0xCF8 and the ECAM
    /// window at [`PCI_ECAM_START`]. Add functions through the returned root.
    ///
    /// # Errors
    /// [`Error::Bus`].
    pub fn add_pci(&mut self) -> Result<Arc<PciRoot>> {
        let root = PciRoot::new(self.mmio.clone());
        self.pio.insert(
            Arc::new(Mutex::new(PciConfigIo::new(root.clone()))),
            PCI_CONFIG_IO_PORT.into(),
            PCI_CONFIG_IO_LEN.into(),
        )?;
        self.mmio.insert(
            Arc::new(Mutex::new(PciConfigMmio::new(root.clone()))),
            PCI_ECAM_START,
            PCI_ECAM_SIZE,
        )?;
        self.pci = Some(root.clone());
        Ok(root)
    }

    /// Sets CPUID (with topology), boot MSRs, FPU and LAPIC LINT routing on every vCPU.
    ///
    /// # Errors
    /// [`Error::Cpuid`], [`Error::Msr`].
    pub fn configure_linux_vcpus(&self) -> Result<()> {
        let base = boot::cpuid::supported_cpuid(&self.kvm)?;
        let count = self.vcpus.len() as u8;
        for v in &self.vcpus {
            boot::cpuid::configure_vcpu_cpuid(v, &base, count)?;
            boot::msr::setup_msrs(v)?;
            boot::msr::setup_fpu(v)?;
            boot::msr::setup_lapic(v)?;
        }
        Ok(())
    }

    /// Loads a Linux kernel per `cfg`, configures every vCPU for Linux and sets the boot
    /// vCPU's entry state. Application processors stay in wait-for-SIPI; Linux starts them
    /// through the MP table and the in-kernel LAPIC.
    ///
    /// # Errors
    /// [`Error::Linux`], and the errors of [`Machine::configure_linux_vcpus`].
    pub fn load_linux(&self, cfg: &boot::linux::LinuxBootConfig) -> Result<()> {
        let entry = boot::linux::setup_linux_with_acpi(
            self.memory(),
            &self.ram,
            self.vcpus.len(),
            cfg,
            self.rsdp,
        )?;
        self.configure_linux_vcpus()?;
        if let Some(bsp) = self.vcpus.first() {
            entry.apply(bsp, self.memory())?;
        }
        Ok(())
    }

    /// Spawns one thread per vCPU.
    ///
    /// # Errors
    /// [`Error::Vcpu`] if a thread cannot be spawned (already started threads are stopped).
    pub fn start(self) -> Result<RunningMachine> {
        let Machine {
            vm,
            vcpus,
            pio,
            mmio,
            exit,
            pci,
            vcpu_shared,
            ..
        } = self;
        let mut running = RunningMachine {
            threads: Vec::new(),
            exit,
            _pci: pci,
            _vm: vm,
        };
        for v in vcpus {
            let id = v.id();
            let t = v.spawn(
                pio.clone(),
                mmio.clone(),
                running.exit.clone(),
                vcpu_shared.clone(),
            )?;
            running.threads.push((id, t));
        }
        tracing::info!(vcpus = running.threads.len(), "machine started");
        Ok(running)
    }

    /// [`Machine::start`] then [`RunningMachine::wait`].
    ///
    /// # Errors
    /// See both.
    pub fn run(self) -> Result<MachineExit> {
        self.start()?.wait()
    }
}

/// How a machine ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineExit {
    /// Why.
    pub reason: ExitReason,
    /// Per-vCPU exit counters, in id order.
    pub vcpu_stats: Vec<VcpuStats>,
}

/// A machine whose vCPU threads run.
///
/// Dropping it without [`RunningMachine::wait`] stops it (best effort).
#[derive(Debug)]
pub struct RunningMachine {
    threads: Vec<(u8, JoinHandle<VcpuStats>)>,
    exit: ExitHandle,
    _pci: Option<Arc<PciRoot>>,
    // Declared last: the vCPU threads are joined (in `wait` or `drop`) before the VM goes.
    _vm: Arc<Vm>,
}

impl RunningMachine {
    /// The handle that ends this machine.
    pub fn exit_handle(&self) -> &ExitHandle {
        &self.exit
    }

    /// Waits for an exit request, stops all vCPU threads and returns how the machine ended.
    ///
    /// # Errors
    /// [`Error::Exit`] if waiting fails; [`Error::VcpuStuck`] / [`Error::VcpuPanicked`] when
    /// a vCPU thread cannot be joined (the other threads are still stopped).
    pub fn wait(mut self) -> Result<MachineExit> {
        let reason = self.exit.wait()?;
        let vcpu_stats = self.join_all()?;
        tracing::info!(?reason, "machine stopped");
        Ok(MachineExit { reason, vcpu_stats })
    }

    /// Requests [`ExitReason::Stopped`] (unless an exit is already pending) and waits.
    ///
    /// # Errors
    /// See [`RunningMachine::wait`].
    pub fn stop(self) -> Result<MachineExit> {
        self.exit.request(ExitReason::Stopped);
        self.wait()
    }

    fn join_all(&mut self) -> Result<Vec<VcpuStats>> {
        let mut stats = Vec::new();
        let mut first_err = None;
        for (id, t) in std::mem::take(&mut self.threads) {
            let deadline = Instant::now() + VCPU_STOP_TIMEOUT;
            // Re-kick until the thread ends: a kick that lands just before KVM_RUN is lost.
            while !t.is_finished() && Instant::now() < deadline {
                vcpu::kick(&t);
                std::thread::sleep(Duration::from_millis(1));
            }
            if !t.is_finished() {
                tracing::error!(vcpu = id, "vCPU thread did not stop; leaving it detached");
                first_err.get_or_insert(Error::VcpuStuck(id));
                continue;
            }
            match t.join() {
                Ok(s) => stats.push(s),
                Err(_) => {
                    first_err.get_or_insert(Error::VcpuPanicked(id));
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(stats),
        }
    }
}

impl Drop for RunningMachine {
    fn drop(&mut self) {
        if self.threads.is_empty() {
            return;
        }
        self.exit.request(ExitReason::Stopped);
        if let Err(e) = self.join_all() {
            tracing::error!(error = %e, "stopping machine on drop");
        }
    }
}
