//! The virtio-pci function: configuration space, BAR decoding, the common-config state
//! machine and activation.

use devices::metrics::lock;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use devices::virtio::{features as vf, VirtioDevice};
use kvm_ioctls::IoEventAddress;
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::msix::{MsixInterrupts, ENTRY_SIZE, NO_VECTOR};
use super::worker::{WorkerSetup, WorkerThread};
use super::*;
use crate::pci::{BarKind, BarReprogram, PciBar, PciConfiguration, PciDevice, PciHeader, PciRoot};
use crate::vm::{IoeventMatch, Vm};

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

#[derive(Debug)]
struct QueueSlot {
    queue: Queue,
    vector: u16,
    kick: Arc<EventFd>,
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
    avail_features: u64,
    device_feature_select: u32,
    driver_feature_select: u32,
    driver_features: u64,
    status: u8,
    config_generation: u8,
    queue_select: u16,
    queues: Vec<QueueSlot>,
    /// Notify base address the queues' ioeventfds are registered at, and which queues.
    ioevents: Option<(u64, Vec<usize>)>,
    workers: Vec<WorkerThread>,
    needs_reset: Arc<AtomicBool>,
    /// Kinds of bad driver writes already logged (each is logged once).
    logged: HashSet<&'static str>,
    /// Bad driver writes (every one, logged or not), FEATURES_OK refusals among them.
    bad_writes: devices::metrics::Counter,
    activations: u64,
}

impl std::fmt::Debug for VirtioPciDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtioPciDevice")
            .field("id", &self.id)
            .field("status", &self.status)
            .field("queues", &self.queues.len())
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
        let queues = (0..nq)
            .map(|_| {
                Ok(QueueSlot {
                    queue: Queue::new(max_size).map_err(|_| Error::QueueSize(max_size))?,
                    vector: NO_VECTOR,
                    kick: Arc::new(EventFd::new(EFD_NONBLOCK).map_err(Error::EventFd)?),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let (class, subclass) = match dev_type {
            devices::virtio::device_type::NET => (0x02, 0x00),
            devices::virtio::device_type::BLOCK => (0x01, 0x00),
            _ => (0xff, 0x00),
        };
        let header = PciHeader {
            vendor_id: VIRTIO_PCI_VENDOR_ID,
            device_id: VIRTIO_PCI_DEVICE_ID_BASE.wrapping_add(dev_type as u16),
            revision: 1,
            class,
            subclass,
            prog_if: 0,
            subsystem_vendor_id: VIRTIO_PCI_SUBSYSTEM_VENDOR_ID,
            subsystem_id: VIRTIO_PCI_SUBSYSTEM_ID,
            interrupt_pin: 0,
        };
        let mut config = PciConfiguration::new(&header);
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
        let vectors = nq + 1;
        let mut msix = Vec::new();
        msix.extend_from_slice(&((vectors - 1) as u16).to_le_bytes());
        msix.extend_from_slice(&(MSIX_BAR as u32).to_le_bytes());
        msix.extend_from_slice(&((MSIX_PBA_OFFSET as u32) | MSIX_BAR as u32).to_le_bytes());
        let msix_off = config.add_capability(CAP_ID_MSIX, &msix)?;
        let msix_cap_reg = msix_off / 4;
        config.set_writable_mask(msix_cap_reg, MSIX_ENABLE | MSIX_FUNCTION_MASK);
        config.add_capability(
            CAP_ID_VENDOR,
            &vendor_cap(
                cap_type::COMMON_CFG,
                COMMON_CFG_OFFSET,
                COMMON_CFG_LEN,
                None,
            ),
        )?;
        config.add_capability(
            CAP_ID_VENDOR,
            &vendor_cap(cap_type::ISR_CFG, ISR_CFG_OFFSET, 1, None),
        )?;
        config.add_capability(
            CAP_ID_VENDOR,
            &vendor_cap(
                cap_type::DEVICE_CFG,
                DEVICE_CFG_OFFSET,
                DEVICE_CFG_LEN,
                None,
            ),
        )?;
        config.add_capability(
            CAP_ID_VENDOR,
            &vendor_cap(
                cap_type::NOTIFY_CFG,
                NOTIFY_CFG_OFFSET,
                nq as u64 * u64::from(NOTIFY_OFF_MULTIPLIER),
                Some(NOTIFY_OFF_MULTIPLIER),
            ),
        )?;
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
            avail_features,
            device_feature_select: 0,
            driver_feature_select: 0,
            driver_features: 0,
            status: 0,
            config_generation: 0,
            queue_select: 0,
            queues,
            ioevents: None,
            workers: Vec::new(),
            needs_reset: Arc::new(AtomicBool::new(false)),
            logged: HashSet::new(),
            bad_writes: devices::metrics::Counter::default(),
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
        let mut s = self.status;
        if self.needs_reset.load(Ordering::SeqCst) {
            s |= status::DEVICE_NEEDS_RESET;
        }
        s
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
        self.bad_writes.get()
    }

    fn bad_write(&mut self, kind: &'static str, detail: std::fmt::Arguments<'_>) {
        self.bad_writes.inc();
        if self.logged.insert(kind) {
            tracing::warn!(device = %self.id, "driver {kind}: {detail} (ignored; logged once)");
        }
    }

    fn selected(&self) -> Option<&QueueSlot> {
        self.queues.get(usize::from(self.queue_select))
    }

    fn common_read(&self, offset: u64) -> u32 {
        let q = self.selected();
        let qaddr = |f: fn(&Queue) -> u64, hi: bool| {
            q.map_or(0, |s| {
                let a = f(&s.queue);
                if hi {
                    (a >> 32) as u32
                } else {
                    a as u32
                }
            })
        };
        match offset {
            0x00 => self.device_feature_select,
            0x04 => match self.device_feature_select {
                0 => self.avail_features as u32,
                1 => (self.avail_features >> 32) as u32,
                _ => 0,
            },
            0x08 => self.driver_feature_select,
            0x0c => match self.driver_feature_select {
                0 => self.driver_features as u32,
                1 => (self.driver_features >> 32) as u32,
                _ => 0,
            },
            0x10 => u32::from(self.irq.config_vector()),
            0x12 => self.queues.len() as u32,
            0x14 => u32::from(self.status()),
            0x15 => u32::from(self.config_generation),
            0x16 => u32::from(self.queue_select),
            0x18 => q.map_or(0, |s| u32::from(s.queue.size())),
            0x1a => q.map_or(u32::from(NO_VECTOR), |s| u32::from(s.vector)),
            0x1c => q.map_or(0, |s| u32::from(s.queue.ready())),
            // queue_notify_off: queue q notifies at q * multiplier.
            0x1e | 0x38 => q.map_or(0, |_| u32::from(self.queue_select)),
            0x20 => qaddr(|q| q.desc_table(), false),
            0x24 => qaddr(|q| q.desc_table(), true),
            0x28 => qaddr(|q| q.avail_ring(), false),
            0x2c => qaddr(|q| q.avail_ring(), true),
            0x30 => qaddr(|q| q.used_ring(), false),
            0x34 => qaddr(|q| q.used_ring(), true),
            _ => 0,
        }
    }

    fn read_common(&self, offset: u64, data: &mut [u8]) {
        let v = if data.len() == 8 {
            u64::from(self.common_read(offset))
                | u64::from(self.common_read(offset.wrapping_add(4))) << 32
        } else {
            u64::from(self.common_read(offset))
        };
        let bytes = v.to_le_bytes();
        let n = data.len().min(8);
        data[..n].copy_from_slice(&bytes[..n]);
        data[n..].fill(0);
    }

    fn write_common(&mut self, offset: u64, data: &[u8]) {
        if data.is_empty() || data.len() > 8 {
            return;
        }
        let mut b = [0u8; 8];
        b[..data.len()].copy_from_slice(data);
        let v = u64::from_le_bytes(b);
        if data.len() == 8 {
            self.common_write(offset, v as u32);
            self.common_write(offset.wrapping_add(4), (v >> 32) as u32);
        } else {
            self.common_write(offset, v as u32);
        }
    }

    fn common_write(&mut self, offset: u64, v: u32) {
        match offset {
            0x00 => self.device_feature_select = v,
            0x08 => self.driver_feature_select = v,
            0x0c => self.write_driver_features(v),
            0x10 => {
                let vec = v as u16;
                if vec == NO_VECTOR || usize::from(vec) < self.irq.len() {
                    self.irq.set_config_vector(vec);
                } else {
                    self.bad_write("config vector", format_args!("{vec} out of range"));
                }
            }
            0x14 => self.write_status(v as u8),
            0x16 => self.queue_select = v as u16,
            0x18 => self.write_queue_size(v as u16),
            0x1a => self.write_queue_vector(v as u16),
            0x1c => self.write_queue_enable(v as u16),
            0x20 => self.write_queue_addr(|q, v| q.set_desc_table_address(Some(v), None), v),
            0x24 => self.write_queue_addr(|q, v| q.set_desc_table_address(None, Some(v)), v),
            0x28 => self.write_queue_addr(|q, v| q.set_avail_ring_address(Some(v), None), v),
            0x2c => self.write_queue_addr(|q, v| q.set_avail_ring_address(None, Some(v)), v),
            0x30 => self.write_queue_addr(|q, v| q.set_used_ring_address(Some(v), None), v),
            0x34 => self.write_queue_addr(|q, v| q.set_used_ring_address(None, Some(v)), v),
            0x3a => self.bad_write("queue_reset", format_args!("per-queue reset not offered")),
            _ => self.bad_write(
                "read-only common config write",
                format_args!("offset {offset:#x}"),
            ),
        }
    }

    fn write_driver_features(&mut self, v: u32) {
        if self.status & status::FEATURES_OK != 0 {
            let sel = self.driver_feature_select;
            self.bad_write(
                "feature write after FEATURES_OK",
                format_args!("{v:#x} to word {sel}"),
            );
            return;
        }
        let (shift, mask) = match self.driver_feature_select {
            0 => (0, 0xffff_ffffu64),
            1 => (32, 0xffff_ffff_0000_0000u64),
            s => {
                if v != 0 {
                    self.bad_write("feature word", format_args!("select {s} does not exist"));
                }
                return;
            }
        };
        let asked = u64::from(v) << shift;
        let offered = asked & self.avail_features;
        if offered != asked {
            self.bad_write(
                "un-offered features",
                format_args!("dropped {:#x}", asked & !self.avail_features),
            );
        }
        self.driver_features = (self.driver_features & !mask) | offered;
    }

    /// The selected queue, if it may still be configured (exists, not enabled, device not
    /// live); logs once otherwise.
    fn configurable_queue(&mut self, what: &'static str) -> Option<usize> {
        let i = usize::from(self.queue_select);
        if i >= self.queues.len() {
            self.bad_write(what, format_args!("queue {i} does not exist"));
            return None;
        }
        if self.queues[i].queue.ready() || self.status & status::DRIVER_OK != 0 {
            self.bad_write(what, format_args!("queue {i} is already live"));
            return None;
        }
        Some(i)
    }

    fn write_queue_size(&mut self, size: u16) {
        let Some(i) = self.configurable_queue("queue_size write") else {
            return;
        };
        if let Err(e) = self.queues[i].queue.try_set_size(size) {
            self.bad_write("queue_size", format_args!("{size} for queue {i}: {e}"));
        }
    }

    fn write_queue_vector(&mut self, vec: u16) {
        let Some(i) = self.configurable_queue("queue_msix_vector write") else {
            return;
        };
        if vec == NO_VECTOR || usize::from(vec) < self.irq.len() {
            self.queues[i].vector = vec;
        } else {
            // The spec lets the device answer NO_VECTOR when it cannot use the vector.
            self.bad_write("queue vector", format_args!("{vec} out of range"));
            self.queues[i].vector = NO_VECTOR;
        }
    }

    fn write_queue_addr(&mut self, set: fn(&mut Queue, u32), v: u32) {
        let Some(i) = self.configurable_queue("queue address write") else {
            return;
        };
        set(&mut self.queues[i].queue, v);
    }

    fn write_queue_enable(&mut self, v: u16) {
        if v != 1 {
            self.bad_write(
                "queue_enable",
                format_args!("wrote {v} (only 1 is allowed)"),
            );
            return;
        }
        let Some(i) = self.configurable_queue("queue_enable write") else {
            return;
        };
        let vm = self.vm.clone();
        let q = &mut self.queues[i].queue;
        q.set_ready(true);
        if !q.is_valid(vm.memory()) {
            q.set_ready(false);
            self.bad_write(
                "invalid queue",
                format_args!("queue {i}: rings outside guest memory or misaligned"),
            );
        }
    }

    fn write_status(&mut self, new: u8) {
        if new == 0 {
            self.reset();
            return;
        }
        let old = self.status;
        if new & old != old {
            self.bad_write(
                "status",
                format_args!("cleared bits {:#x} without a reset", old & !new),
            );
            return;
        }
        let mut new = new & !status::DEVICE_NEEDS_RESET;
        let added = new & !old;
        if added & status::FEATURES_OK != 0 && self.driver_features & vf::VERSION_1 == 0 {
            // The device refuses: the driver re-reads status and sees FEATURES_OK clear. A
            // driver may retry forever: logged once, counted always.
            self.bad_write(
                "features",
                format_args!("VERSION_1 not accepted: FEATURES_OK refused"),
            );
            new &= !status::FEATURES_OK;
        }
        self.status = new;
        if added & status::DRIVER_OK != 0 {
            self.activate();
        }
    }

    fn fail_activation(&mut self, why: std::fmt::Arguments<'_>) {
        tracing::error!(device = %self.id, "activation failed: {why}; DEVICE_NEEDS_RESET");
        self.stop_workers();
        self.unregister_ioevents();
        self.needs_reset.store(true, Ordering::SeqCst);
        self.irq.signal_config();
    }

    fn activate(&mut self) {
        if self.status & status::FEATURES_OK == 0 {
            self.fail_activation(format_args!("DRIVER_OK without FEATURES_OK"));
            return;
        }
        if !self.workers.is_empty() || self.needs_reset.load(Ordering::SeqCst) {
            return;
        }
        let acked = self.driver_features & self.avail_features;
        let result = lock(&self.device).activate(acked);
        let workers = match result {
            Ok(w) => w,
            Err(e) => {
                self.fail_activation(format_args!("{e}"));
                return;
            }
        };
        self.activations += 1;
        let event_idx = acked & vf::RING_EVENT_IDX != 0;
        let mut live = Vec::new();
        let mut setups = Vec::new();
        for w in workers {
            let idx = w.queue_indexes();
            let mut queues = Vec::new();
            let mut kicks = Vec::new();
            let mut vectors = Vec::new();
            let mut all_ready = true;
            for &q in &idx {
                let Some(slot) = self.queues.get(usize::from(q)) else {
                    self.fail_activation(format_args!(
                        "worker wants queue {q}, which does not exist"
                    ));
                    return;
                };
                all_ready &= slot.queue.ready();
                let Ok(mut queue) = Queue::try_from(slot.queue.state()) else {
                    self.fail_activation(format_args!("queue {q} state cannot be copied"));
                    return;
                };
                queue.set_event_idx(event_idx);
                queues.push(queue);
                kicks.push(slot.kick.clone());
                vectors.push(slot.vector);
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
                needs_reset: self.needs_reset.clone(),
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

    fn register_ioevents(&mut self, queues: Vec<usize>) {
        if !self.options.ioeventfd {
            return;
        }
        let base = self.notify_base();
        let mut done = Vec::new();
        for &q in &queues {
            let addr = base + q as u64 * u64::from(NOTIFY_OFF_MULTIPLIER);
            if let Err(e) = self.vm.register_ioeventfd(
                &self.queues[q].kick,
                IoEventAddress::Mmio(addr),
                IoeventMatch::Any,
            ) {
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
            let addr = base + q as u64 * u64::from(NOTIFY_OFF_MULTIPLIER);
            if let Err(e) = self.vm.unregister_ioeventfd(
                &self.queues[q].kick,
                IoEventAddress::Mmio(addr),
                IoeventMatch::Any,
            ) {
                tracing::warn!(device = %self.id, queue = q, error = %e, "ioeventfd unregistration failed");
            }
        }
    }

    fn reset(&mut self) {
        self.stop_workers();
        self.unregister_ioevents();
        lock(&self.device).reset();
        for s in &mut self.queues {
            s.queue.reset();
            s.vector = NO_VECTOR;
            // Drop a notification left over from the old incarnation.
            let _ = s.kick.read();
        }
        self.irq.reset();
        self.needs_reset.store(false, Ordering::SeqCst);
        self.status = 0;
        self.driver_features = 0;
        self.device_feature_select = 0;
        self.driver_feature_select = 0;
        self.queue_select = 0;
        tracing::debug!(device = %self.id, "virtio-pci device reset");
    }

    fn read_modern(&mut self, offset: u64, data: &mut [u8]) {
        let len = data.len() as u64;
        if offset.checked_add(len).is_some_and(|e| e <= COMMON_CFG_LEN) {
            self.read_common(offset, data);
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
        let len = data.len() as u64;
        if offset.checked_add(len).is_some_and(|e| e <= COMMON_CFG_LEN) {
            self.write_common(offset, data);
        } else if (DEVICE_CFG_OFFSET..DEVICE_CFG_OFFSET + DEVICE_CFG_LEN).contains(&offset) {
            lock(&self.device).write_config(offset - DEVICE_CFG_OFFSET, data);
        } else if offset >= NOTIFY_CFG_OFFSET {
            // Only reached when no ioeventfd caught the write.
            let q = (offset - NOTIFY_CFG_OFFSET) / u64::from(NOTIFY_OFF_MULTIPLIER);
            match usize::try_from(q).ok().and_then(|q| self.queues.get(q)) {
                Some(s) => {
                    if let Err(e) = s.kick.write(1) {
                        tracing::warn!(device = %self.id, error = %e, "queue kick failed");
                    }
                }
                None => self.bad_write("notify", format_args!("queue {q} does not exist")),
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
    fn read_config_register(&mut self, reg: usize) -> u32 {
        self.config.read_reg(reg)
    }

    fn write_config_register(
        &mut self,
        reg: usize,
        offset: u64,
        data: &[u8],
    ) -> Option<BarReprogram> {
        let moved = self.config.write_reg(reg, offset, data);
        if reg == self.msix_cap_reg {
            self.sync_msix_control();
        }
        if let Some(m) = &moved {
            self.bar_moved(m);
        }
        moved
    }

    fn bars(&self) -> Vec<PciBar> {
        self.config.bars()
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
