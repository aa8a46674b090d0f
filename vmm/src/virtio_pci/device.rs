//! The virtio-pci function: configuration space, BAR decoding, activation and ioeventfd
//! wiring around the register state machine of [`CommonConfig`].

use devices::metrics::lock;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use devices::virtio::spec::{
    feature, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_ID_BLOCK, VIRTIO_ID_NET, VIRTIO_RING_F_EVENT_IDX,
};
use devices::virtio::VirtioDevice;
use kvm_ioctls::IoEventAddress;
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::common::{CommonConfig, Effect};
use super::msix::{MsixInterrupts, ENTRY_SIZE};
use super::worker::{WorkerSetup, WorkerThread};
use super::*;
use crate::pci::{BarKind, BarReprogram, PciBar, PciConfiguration, PciDevice, PciHeader, PciRoot};
use crate::vm::{IoeventMatch, IoeventOp, Vm};

/// A device core shared between its transport and the monitor (for statistics).
pub type SharedVirtioDevice = Arc<Mutex<dyn VirtioDevice<GuestMemoryMmap>>>;

const CAP_ID_VENDOR: u8 = 0x09;
const CAP_ID_MSIX: u8 = 0x11;
const MSIX_ENABLE: u32 = 1 << 31;
const MSIX_FUNCTION_MASK: u32 = 1 << 30;

/// Transport options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioPciOptions {
    /// Register ioeventfds for the notify addresses (otherwise every notification is an
    /// MMIO exit handled by the transport).
    pub ioeventfd: bool,
}

impl Default for VirtioPciOptions {
    fn default() -> Self {
        VirtioPciOptions { ioeventfd: true }
    }
}

/// A modern virtio-pci function around a [`VirtioDevice`].
pub struct VirtioPciDevice {
    id: String,
    config: PciConfiguration,
    msix_cap_reg: usize,
    device: SharedVirtioDevice,
    vm: Arc<Vm>,
    irq: Arc<MsixInterrupts>,
    options: VirtioPciOptions,
    /// The common configuration registers (features, status, queue registers).
    common: CommonConfig,
    /// The notification eventfd of each queue.
    kicks: Vec<Arc<EventFd>>,
    /// Notify base address the queues' ioeventfds are registered at, and which queues.
    ioevents: Option<(u64, Vec<usize>)>,
    workers: Vec<WorkerThread>,
    activations: u64,
}

impl std::fmt::Debug for VirtioPciDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtioPciDevice")
            .field("id", &self.id)
            .field("status", &self.common.status())
            .field("queues", &self.kicks.len())
            .field("workers", &self.workers.len())
            .finish_non_exhaustive()
    }
}

fn vendor_cap(cfg_type: u8, offset: u64, length: u64, extra: Option<u32>) -> Vec<u8> {
    // virtio_pci_cap after cap_vndr and cap_next: cap_len, cfg_type, bar, id, padding[2],
    // offset, length (+ notify_off_multiplier for NOTIFY_CFG).
    let cap_len = if extra.is_some() { 20u8 } else { 16u8 };
    let mut b = vec![cap_len, cfg_type, MODERN_BAR as u8, 0, 0, 0];
    b.extend_from_slice(&(offset as u32).to_le_bytes());
    b.extend_from_slice(&(length as u32).to_le_bytes());
    if let Some(m) = extra {
        b.extend_from_slice(&m.to_le_bytes());
    }
    b
}

/// The PCI identity of a virtio function of type `dev_type` (QEMU's, see the module doc).
fn header(dev_type: u32) -> PciHeader {
    let (class, subclass) = match dev_type {
        VIRTIO_ID_NET => (0x02, 0x00),
        VIRTIO_ID_BLOCK => (0x01, 0x00),
        _ => (0xff, 0x00),
    };
    PciHeader {
        vendor_id: VIRTIO_PCI_VENDOR_ID,
        device_id: VIRTIO_PCI_DEVICE_ID_BASE.wrapping_add(dev_type as u16),
        revision: 1,
        class,
        subclass,
        prog_if: 0,
        subsystem_vendor_id: VIRTIO_PCI_SUBSYSTEM_VENDOR_ID,
        subsystem_id: VIRTIO_PCI_SUBSYSTEM_ID,
        interrupt_pin: 0,
    }
}

/// The configuration space of a function with `nq` queues: header, the two BARs (allocated
/// from `root`), the MSI-X capability and the four virtio capabilities. Returns it with the
/// register index of the MSI-X capability's control word.
fn config_space(dev_type: u32, nq: usize, root: &PciRoot) -> Result<(PciConfiguration, usize)> {
    let mut config = PciConfiguration::new(&header(dev_type));
    config.add_bar(PciBar {
        index: MSIX_BAR,
        addr: root.allocate_mmio32(MSIX_BAR_SIZE)?,
        size: MSIX_BAR_SIZE,
        kind: BarKind::Memory32,
        prefetchable: false,
    })?;
    config.add_bar(PciBar {
        index: MODERN_BAR,
        addr: root.allocate_mmio32(MODERN_BAR_SIZE)?,
        size: MODERN_BAR_SIZE,
        kind: BarKind::Memory64,
        prefetchable: true,
    })?;
    // Table size is N-1 for N vectors: one per queue and the configuration vector.
    let mut msix = Vec::new();
    msix.extend_from_slice(&(nq as u16).to_le_bytes());
    msix.extend_from_slice(&(MSIX_BAR as u32).to_le_bytes());
    msix.extend_from_slice(&((MSIX_PBA_OFFSET as u32) | MSIX_BAR as u32).to_le_bytes());
    let msix_cap_reg = config.add_capability(CAP_ID_MSIX, &msix)? / 4;
    config.set_writable_mask(msix_cap_reg, MSIX_ENABLE | MSIX_FUNCTION_MASK);
    let notify_len = nq as u64 * u64::from(NOTIFY_OFF_MULTIPLIER);
    for cap in [
        vendor_cap(
            cap_type::COMMON_CFG,
            COMMON_CFG_OFFSET,
            COMMON_CFG_LEN,
            None,
        ),
        vendor_cap(cap_type::ISR_CFG, ISR_CFG_OFFSET, 1, None),
        vendor_cap(
            cap_type::DEVICE_CFG,
            DEVICE_CFG_OFFSET,
            DEVICE_CFG_LEN,
            None,
        ),
        vendor_cap(
            cap_type::NOTIFY_CFG,
            NOTIFY_CFG_OFFSET,
            notify_len,
            Some(NOTIFY_OFF_MULTIPLIER),
        ),
    ] {
        config.add_capability(CAP_ID_VENDOR, &cap)?;
    }
    Ok((config, msix_cap_reg))
}

impl VirtioPciDevice {
    /// Builds the function for `device` and allocates its BARs from `root`'s window. Add it
    /// to the bus with [`PciRoot::add_device`].
    ///
    /// # Errors
    /// [`Error::QueueCount`], [`Error::QueueSize`], and BAR, GSI, irqfd or eventfd setup
    /// failures.
    pub fn new(
        id: &str,
        device: SharedVirtioDevice,
        vm: Arc<Vm>,
        root: &PciRoot,
        options: VirtioPciOptions,
    ) -> Result<Self> {
        let (dev_type, nq, max_size, avail_features) = {
            let d = lock(&device);
            (
                d.device_type(),
                d.num_queues(),
                d.queue_max_size(),
                d.avail_features(),
            )
        };
        if nq == 0 || nq > MAX_QUEUES {
            return Err(Error::QueueCount(nq));
        }
        // One MSI-X vector per queue plus the configuration-change vector.
        let vectors = nq + 1;
        let common = CommonConfig::new(id, avail_features, nq, max_size, vectors)?;
        let kicks = (0..nq)
            .map(|_| {
                Ok(Arc::new(
                    EventFd::new(EFD_NONBLOCK).map_err(Error::EventFd)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let (config, msix_cap_reg) = config_space(dev_type, nq, root)?;
        let irq = Arc::new(MsixInterrupts::new(vm.clone(), vectors)?);
        tracing::info!(
            id,
            dev_type,
            queues = nq,
            max_size,
            features = format_args!("{avail_features:#x}"),
            "virtio-pci function created"
        );
        Ok(VirtioPciDevice {
            id: id.to_string(),
            config,
            msix_cap_reg,
            device,
            vm,
            irq,
            options,
            common,
            kicks,
            ioevents: None,
            workers: Vec::new(),
            activations: 0,
        })
    }

    /// The device id given at construction.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The device core.
    pub fn device(&self) -> &SharedVirtioDevice {
        &self.device
    }

    /// The device status as the driver reads it.
    pub fn status(&self) -> u8 {
        self.common.status()
    }

    /// Number of worker threads running.
    pub fn running_workers(&self) -> usize {
        self.workers.len()
    }

    /// How many times the device was activated.
    pub fn activations(&self) -> u64 {
        self.activations
    }

    /// The notify address of queue 0 as currently decoded (queue `q` is at `+ 4q`).
    pub fn notify_base(&self) -> u64 {
        self.modern_bar_addr() + NOTIFY_CFG_OFFSET
    }

    fn modern_bar_addr(&self) -> u64 {
        self.config
            .bars()
            .iter()
            .find(|b| b.index == MODERN_BAR)
            .map_or(0, |b| b.addr)
    }

    /// Stops the workers (used when the VMM shuts down; the device keeps its state).
    pub fn stop_workers(&mut self) {
        for w in self.workers.drain(..) {
            w.stop();
        }
    }

    /// Bad driver writes counted so far (each kind is logged once).
    pub fn bad_writes(&self) -> u64 {
        self.common.bad_writes()
    }

    /// Carries out what a common-config write asks of the transport.
    fn apply(&mut self, effect: Effect) {
        match effect {
            Effect::ConfigVector(v) => self.irq.set_config_vector(v),
            Effect::Activate => self.activate(),
            Effect::Reset => self.reset(),
        }
    }

    fn fail_activation(&mut self, why: std::fmt::Arguments<'_>) {
        tracing::error!(device = %self.id, "activation failed: {why}; DEVICE_NEEDS_RESET");
        self.stop_workers();
        self.unregister_ioevents();
        self.common.set_needs_reset();
        self.irq.signal_config();
    }

    fn activate(&mut self) {
        if self.common.status() & VIRTIO_CONFIG_S_FEATURES_OK == 0 {
            self.fail_activation(format_args!("DRIVER_OK without FEATURES_OK"));
            return;
        }
        if !self.workers.is_empty() || self.common.needs_reset().load(Ordering::SeqCst) {
            return;
        }
        let acked = self.common.acked_features();
        let result = lock(&self.device).activate(acked);
        let workers = match result {
            Ok(w) => w,
            Err(e) => {
                self.fail_activation(format_args!("{e}"));
                return;
            }
        };
        self.activations += 1;
        let event_idx = acked & feature(VIRTIO_RING_F_EVENT_IDX) != 0;
        let mut live = Vec::new();
        let mut setups = Vec::new();
        for w in workers {
            let idx = w.queue_indexes();
            let mut queues = Vec::new();
            let mut kicks = Vec::new();
            let mut vectors = Vec::new();
            let mut all_ready = true;
            for &q in &idx {
                let q = usize::from(q);
                let (Some(regs), Some(kick)) = (self.common.queues().get(q), self.kicks.get(q))
                else {
                    self.fail_activation(format_args!(
                        "worker wants queue {q}, which does not exist"
                    ));
                    return;
                };
                all_ready &= regs.queue.ready();
                let Ok(mut queue) = Queue::try_from(regs.queue.state()) else {
                    self.fail_activation(format_args!("queue {q} state cannot be copied"));
                    return;
                };
                queue.set_event_idx(event_idx);
                queues.push(queue);
                kicks.push(kick.clone());
                vectors.push(regs.vector);
            }
            if !all_ready {
                // Linux may enable fewer queues than offered (e.g. fewer CPUs than blk
                // queues); the worker of a queue it left alone never runs.
                tracing::debug!(device = %self.id, queues = ?idx, "queues not enabled, worker not started");
                continue;
            }
            live.extend(idx.iter().map(|&q| usize::from(q)));
            setups.push(WorkerSetup {
                name: self.id.clone(),
                worker: w,
                queues,
                kicks,
                vectors,
                irq: self.irq.clone(),
                mem: self.vm.memory().clone(),
                needs_reset: self.common.needs_reset().clone(),
            });
        }
        self.register_ioevents(live);
        for s in setups {
            match WorkerThread::spawn(s) {
                Ok(t) => self.workers.push(t),
                Err(e) => {
                    self.fail_activation(format_args!("cannot start worker thread: {e}"));
                    return;
                }
            }
        }
        tracing::info!(
            device = %self.id,
            acked = format_args!("{acked:#x}"),
            workers = self.workers.len(),
            ioeventfd = self.ioevents.is_some(),
            "virtio-pci device activated"
        );
    }

    /// Registers or unregisters the ioeventfd of queue `q`'s notification address in the
    /// notification area at `base`.
    fn queue_ioevent(&self, op: IoeventOp, base: u64, q: usize) -> crate::vm::Result<()> {
        let addr = base + q as u64 * u64::from(NOTIFY_OFF_MULTIPLIER);
        self.vm.ioeventfd(
            op,
            &self.kicks[q],
            IoEventAddress::Mmio(addr),
            IoeventMatch::Any,
        )
    }

    fn register_ioevents(&mut self, queues: Vec<usize>) {
        if !self.options.ioeventfd {
            return;
        }
        let base = self.notify_base();
        let mut done = Vec::new();
        for &q in &queues {
            if let Err(e) = self.queue_ioevent(IoeventOp::Register, base, q) {
                // The MMIO write path still kicks the queue (see `write_bar`).
                tracing::warn!(device = %self.id, queue = q, error = %e,
                    "ioeventfd registration failed; notifications take the MMIO exit path");
                continue;
            }
            done.push(q);
        }
        self.ioevents = Some((base, done));
    }

    fn unregister_ioevents(&mut self) {
        let Some((base, queues)) = self.ioevents.take() else {
            return;
        };
        for q in queues {
            if let Err(e) = self.queue_ioevent(IoeventOp::Unregister, base, q) {
                tracing::warn!(device = %self.id, queue = q, error = %e, "ioeventfd unregistration failed");
            }
        }
    }

    fn reset(&mut self) {
        self.stop_workers();
        self.unregister_ioevents();
        lock(&self.device).reset();
        for k in &self.kicks {
            // Drop a notification left over from the old incarnation.
            let _ = k.read();
        }
        self.irq.reset();
        self.common.reset();
        tracing::debug!(device = %self.id, "virtio-pci device reset");
    }

    fn read_modern(&mut self, offset: u64, data: &mut [u8]) {
        if CommonConfig::contains(offset, data.len()) {
            self.common.read(offset, data);
        } else if offset == ISR_CFG_OFFSET {
            data.fill(0);
            if let Some(b) = data.first_mut() {
                *b = self.irq.read_isr();
            }
        } else if (DEVICE_CFG_OFFSET..DEVICE_CFG_OFFSET + DEVICE_CFG_LEN).contains(&offset) {
            lock(&self.device).read_config(offset - DEVICE_CFG_OFFSET, data);
        } else {
            data.fill(0);
        }
    }

    fn write_modern(&mut self, offset: u64, data: &[u8]) {
        if CommonConfig::contains(offset, data.len()) {
            let effects = self.common.write(offset, data, self.vm.memory());
            for e in effects {
                self.apply(e);
            }
        } else if (DEVICE_CFG_OFFSET..DEVICE_CFG_OFFSET + DEVICE_CFG_LEN).contains(&offset) {
            lock(&self.device).write_config(offset - DEVICE_CFG_OFFSET, data);
        } else if offset >= NOTIFY_CFG_OFFSET {
            // Only reached when no ioeventfd caught the write.
            let q = (offset - NOTIFY_CFG_OFFSET) / u64::from(NOTIFY_OFF_MULTIPLIER);
            match usize::try_from(q).ok().and_then(|q| self.kicks.get(q)) {
                Some(k) => {
                    if let Err(e) = k.write(1) {
                        tracing::warn!(device = %self.id, error = %e, "queue kick failed");
                    }
                }
                None => self
                    .common
                    .bad_write("notify", format_args!("queue {q} does not exist")),
            }
        }
    }

    fn sync_msix_control(&self) {
        let ctl = self.config.read_reg(self.msix_cap_reg);
        self.irq
            .set_control(ctl & MSIX_ENABLE != 0, ctl & MSIX_FUNCTION_MASK != 0);
    }

    fn bar_moved(&mut self, m: &BarReprogram) {
        if m.index == MODERN_BAR {
            if let Some((_, queues)) = self.ioevents.clone() {
                self.unregister_ioevents();
                self.register_ioevents(queues);
            }
        }
    }
}

impl PciDevice for VirtioPciDevice {
    fn config(&self) -> &PciConfiguration {
        &self.config
    }

    fn config_mut(&mut self) -> &mut PciConfiguration {
        &mut self.config
    }

    fn config_written(&mut self, reg: usize, moved: Option<&BarReprogram>) {
        if reg == self.msix_cap_reg {
            self.sync_msix_control();
        }
        if let Some(m) = moved {
            self.bar_moved(m);
        }
    }

    fn read_bar(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        match bar {
            MODERN_BAR => self.read_modern(offset, data),
            MSIX_BAR if offset < MSIX_PBA_OFFSET => self.irq.read_table(offset, data),
            MSIX_BAR => self.irq.read_pba(offset - MSIX_PBA_OFFSET, data),
            _ => data.fill(0xff),
        }
    }

    fn write_bar(&mut self, bar: usize, offset: u64, data: &[u8]) {
        match bar {
            MODERN_BAR => self.write_modern(offset, data),
            MSIX_BAR if offset < self.irq.len() as u64 * ENTRY_SIZE => {
                self.irq.write_table(offset, data);
            }
            _ => {}
        }
    }
}

impl Drop for VirtioPciDevice {
    fn drop(&mut self) {
        self.stop_workers();
        self.unregister_ioevents();
    }
}
