//! The virtio-pci common configuration structure (virtio 1.2, 4.1.4.3) as a plain state
//! machine: its registers, feature negotiation, `device_status` and the queue registers,
//! validated at the register boundary. It holds no KVM object, eventfd or thread: a write
//! that needs the transport to act (start or stop the device, route the config vector)
//! returns an [`Effect`] the transport carries out, so the whole register behaviour is
//! unit-tested here without `/dev/kvm`.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use devices::metrics::Counter;
use devices::virtio::spec::{
    feature, VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
    VIRTIO_F_VERSION_1,
};
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;

use super::msix::NO_VECTOR;
use super::{Error, Result, COMMON_CFG_LEN};

/// Register offsets inside the structure.
mod reg {
    pub const DEVICE_FEATURE_SELECT: u64 = 0x00;
    pub const DEVICE_FEATURE: u64 = 0x04;
    pub const DRIVER_FEATURE_SELECT: u64 = 0x08;
    pub const DRIVER_FEATURE: u64 = 0x0c;
    pub const CONFIG_MSIX_VECTOR: u64 = 0x10;
    pub const NUM_QUEUES: u64 = 0x12;
    pub const DEVICE_STATUS: u64 = 0x14;
    pub const CONFIG_GENERATION: u64 = 0x15;
    pub const QUEUE_SELECT: u64 = 0x16;
    pub const QUEUE_SIZE: u64 = 0x18;
    pub const QUEUE_MSIX_VECTOR: u64 = 0x1a;
    pub const QUEUE_ENABLE: u64 = 0x1c;
    pub const QUEUE_NOTIFY_OFF: u64 = 0x1e;
    pub const QUEUE_DESC_LO: u64 = 0x20;
    pub const QUEUE_DESC_HI: u64 = 0x24;
    pub const QUEUE_AVAIL_LO: u64 = 0x28;
    pub const QUEUE_AVAIL_HI: u64 = 0x2c;
    pub const QUEUE_USED_LO: u64 = 0x30;
    pub const QUEUE_USED_HI: u64 = 0x34;
    pub const QUEUE_NOTIFY_DATA: u64 = 0x38;
    pub const QUEUE_RESET: u64 = 0x3a;
}

/// What the transport must do after a register write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Effect {
    /// The driver wrote 0 to `device_status`: stop the workers, reset the device, then the
    /// registers ([`CommonConfig::reset`]; after the workers stopped, so that none can set
    /// DEVICE_NEEDS_RESET on the new incarnation).
    Reset,
    /// The driver set DRIVER_OK: activate the device.
    Activate,
    /// The configuration-change vector changed (validated): route it.
    ConfigVector(u16),
}

/// The registers of one queue.
#[derive(Debug)]
pub(crate) struct QueueRegs {
    /// Size, ring addresses and ready (`queue_enable`) as the driver set them.
    pub queue: Queue,
    /// `queue_msix_vector`.
    pub vector: u16,
}

/// The common configuration of one function.
#[derive(Debug)]
pub(crate) struct CommonConfig {
    avail_features: u64,
    device_feature_select: u32,
    driver_feature_select: u32,
    driver_features: u64,
    status: u8,
    config_generation: u8,
    config_vector: u16,
    queue_select: u16,
    queues: Vec<QueueRegs>,
    /// Number of MSI-X vectors (a vector at or above it is refused).
    vectors: usize,
    /// Set by the transport or a worker when the device is broken (shown in `device_status`).
    needs_reset: Arc<AtomicBool>,
    /// Kinds of bad driver writes already logged (each is logged once).
    logged: HashSet<&'static str>,
    /// Bad driver writes (every one, logged or not), FEATURES_OK refusals among them.
    bad_writes: Counter,
    /// Device id, for logs.
    id: String,
}

impl CommonConfig {
    /// `num_queues` queues of at most `max_size` entries, `vectors` MSI-X vectors.
    ///
    /// # Errors
    /// [`Error::QueueSize`] when `max_size` is not a valid queue size.
    pub fn new(
        id: &str,
        avail_features: u64,
        num_queues: usize,
        max_size: u16,
        vectors: usize,
    ) -> Result<Self> {
        let queues = (0..num_queues)
            .map(|_| {
                Ok(QueueRegs {
                    queue: Queue::new(max_size).map_err(|_| Error::QueueSize(max_size))?,
                    vector: NO_VECTOR,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            avail_features,
            device_feature_select: 0,
            driver_feature_select: 0,
            driver_features: 0,
            status: 0,
            config_generation: 0,
            config_vector: NO_VECTOR,
            queue_select: 0,
            queues,
            vectors,
            needs_reset: Arc::new(AtomicBool::new(false)),
            logged: HashSet::new(),
            bad_writes: Counter::default(),
            id: id.to_string(),
        })
    }

    /// The flag workers set when the device breaks (DEVICE_NEEDS_RESET).
    pub fn needs_reset(&self) -> &Arc<AtomicBool> {
        &self.needs_reset
    }

    /// Marks the device broken (DEVICE_NEEDS_RESET until the next reset).
    pub fn set_needs_reset(&self) {
        self.needs_reset.store(true, Ordering::SeqCst);
    }

    /// `device_status` as the driver reads it.
    pub fn status(&self) -> u8 {
        let mut s = self.status;
        if self.needs_reset.load(Ordering::SeqCst) {
            s |= VIRTIO_CONFIG_S_NEEDS_RESET;
        }
        s
    }

    /// The features both sides agree on.
    pub fn acked_features(&self) -> u64 {
        self.driver_features & self.avail_features
    }

    /// The queue registers.
    pub fn queues(&self) -> &[QueueRegs] {
        &self.queues
    }

    /// Bad driver writes counted so far.
    pub fn bad_writes(&self) -> u64 {
        self.bad_writes.get()
    }

    /// Counts a bad driver write; logs the first of each kind.
    pub fn bad_write(&mut self, kind: &'static str, detail: std::fmt::Arguments<'_>) {
        self.bad_writes.inc();
        if self.logged.insert(kind) {
            tracing::warn!(device = %self.id, "driver {kind}: {detail} (ignored; logged once)");
        }
    }

    /// Back to the state after construction (a status write of 0); the log-once set and the
    /// counter survive.
    pub fn reset(&mut self) {
        for q in &mut self.queues {
            q.queue.reset();
            q.vector = NO_VECTOR;
        }
        self.needs_reset.store(false, Ordering::SeqCst);
        self.status = 0;
        self.driver_features = 0;
        self.device_feature_select = 0;
        self.driver_feature_select = 0;
        self.queue_select = 0;
        self.config_vector = NO_VECTOR;
    }

    /// True when the access lies inside the structure.
    pub fn contains(offset: u64, len: usize) -> bool {
        offset
            .checked_add(len as u64)
            .is_some_and(|e| e <= COMMON_CFG_LEN)
    }

    /// A driver read of 1, 2, 4 or 8 bytes (an 8-byte read is two registers).
    pub fn read(&self, offset: u64, data: &mut [u8]) {
        let v = if data.len() == 8 {
            u64::from(self.read_reg(offset))
                | u64::from(self.read_reg(offset.wrapping_add(4))) << 32
        } else {
            u64::from(self.read_reg(offset))
        };
        let bytes = v.to_le_bytes();
        let n = data.len().min(8);
        data[..n].copy_from_slice(&bytes[..n]);
        data[n..].fill(0);
    }

    /// A driver write (an 8-byte write is two registers, low first); `mem` is where the rings
    /// must lie. Returns what the transport must do, in order.
    pub fn write(&mut self, offset: u64, data: &[u8], mem: &GuestMemoryMmap) -> Vec<Effect> {
        if data.is_empty() || data.len() > 8 {
            return Vec::new();
        }
        let mut b = [0u8; 8];
        b[..data.len()].copy_from_slice(data);
        let v = u64::from_le_bytes(b);
        let mut effects = Vec::new();
        effects.extend(self.write_reg(offset, v as u32, mem));
        if data.len() == 8 {
            effects.extend(self.write_reg(offset.wrapping_add(4), (v >> 32) as u32, mem));
        }
        effects
    }

    fn selected(&self) -> Option<&QueueRegs> {
        self.queues.get(usize::from(self.queue_select))
    }

    fn read_reg(&self, offset: u64) -> u32 {
        let q = self.selected();
        let addr = |f: fn(&Queue) -> u64, hi: bool| {
            q.map_or(0, |s| {
                let a = f(&s.queue);
                if hi {
                    (a >> 32) as u32
                } else {
                    a as u32
                }
            })
        };
        let word = |features: u64, select: u32| match select {
            0 => features as u32,
            1 => (features >> 32) as u32,
            _ => 0,
        };
        match offset {
            reg::DEVICE_FEATURE_SELECT => self.device_feature_select,
            reg::DEVICE_FEATURE => word(self.avail_features, self.device_feature_select),
            reg::DRIVER_FEATURE_SELECT => self.driver_feature_select,
            reg::DRIVER_FEATURE => word(self.driver_features, self.driver_feature_select),
            reg::CONFIG_MSIX_VECTOR => u32::from(self.config_vector),
            reg::NUM_QUEUES => self.queues.len() as u32,
            reg::DEVICE_STATUS => u32::from(self.status()),
            reg::CONFIG_GENERATION => u32::from(self.config_generation),
            reg::QUEUE_SELECT => u32::from(self.queue_select),
            reg::QUEUE_SIZE => q.map_or(0, |s| u32::from(s.queue.size())),
            reg::QUEUE_MSIX_VECTOR => q.map_or(u32::from(NO_VECTOR), |s| u32::from(s.vector)),
            reg::QUEUE_ENABLE => q.map_or(0, |s| u32::from(s.queue.ready())),
            // queue_notify_off (and notify data): queue q notifies at q * multiplier.
            reg::QUEUE_NOTIFY_OFF | reg::QUEUE_NOTIFY_DATA => {
                q.map_or(0, |_| u32::from(self.queue_select))
            }
            reg::QUEUE_DESC_LO => addr(|q| q.desc_table(), false),
            reg::QUEUE_DESC_HI => addr(|q| q.desc_table(), true),
            reg::QUEUE_AVAIL_LO => addr(|q| q.avail_ring(), false),
            reg::QUEUE_AVAIL_HI => addr(|q| q.avail_ring(), true),
            reg::QUEUE_USED_LO => addr(|q| q.used_ring(), false),
            reg::QUEUE_USED_HI => addr(|q| q.used_ring(), true),
            _ => 0,
        }
    }

    fn write_reg(&mut self, offset: u64, v: u32, mem: &GuestMemoryMmap) -> Option<Effect> {
        match offset {
            reg::DEVICE_FEATURE_SELECT => self.device_feature_select = v,
            reg::DRIVER_FEATURE_SELECT => self.driver_feature_select = v,
            reg::DRIVER_FEATURE => self.write_driver_features(v),
            reg::CONFIG_MSIX_VECTOR => {
                let vec = v as u16;
                if vec == NO_VECTOR || usize::from(vec) < self.vectors {
                    self.config_vector = vec;
                    return Some(Effect::ConfigVector(vec));
                }
                self.bad_write("config vector", format_args!("{vec} out of range"));
            }
            reg::DEVICE_STATUS => return self.write_status(v as u8),
            reg::QUEUE_SELECT => self.queue_select = v as u16,
            reg::QUEUE_SIZE => self.write_queue_size(v as u16),
            reg::QUEUE_MSIX_VECTOR => self.write_queue_vector(v as u16),
            reg::QUEUE_ENABLE => self.write_queue_enable(v as u16, mem),
            reg::QUEUE_DESC_LO => {
                self.write_queue_addr(|q, v| q.set_desc_table_address(Some(v), None), v)
            }
            reg::QUEUE_DESC_HI => {
                self.write_queue_addr(|q, v| q.set_desc_table_address(None, Some(v)), v)
            }
            reg::QUEUE_AVAIL_LO => {
                self.write_queue_addr(|q, v| q.set_avail_ring_address(Some(v), None), v)
            }
            reg::QUEUE_AVAIL_HI => {
                self.write_queue_addr(|q, v| q.set_avail_ring_address(None, Some(v)), v)
            }
            reg::QUEUE_USED_LO => {
                self.write_queue_addr(|q, v| q.set_used_ring_address(Some(v), None), v)
            }
            reg::QUEUE_USED_HI => {
                self.write_queue_addr(|q, v| q.set_used_ring_address(None, Some(v)), v)
            }
            reg::QUEUE_RESET => {
                self.bad_write("queue_reset", format_args!("per-queue reset not offered"))
            }
            _ => self.bad_write(
                "read-only common config write",
                format_args!("offset {offset:#x}"),
            ),
        }
        None
    }

    fn write_driver_features(&mut self, v: u32) {
        if self.status & VIRTIO_CONFIG_S_FEATURES_OK != 0 {
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
        if self.queues[i].queue.ready() || self.status & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
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
        if vec == NO_VECTOR || usize::from(vec) < self.vectors {
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

    fn write_queue_enable(&mut self, v: u16, mem: &GuestMemoryMmap) {
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
        let q = &mut self.queues[i].queue;
        q.set_ready(true);
        if !q.is_valid(mem) {
            q.set_ready(false);
            self.bad_write(
                "invalid queue",
                format_args!("queue {i}: rings outside guest memory or misaligned"),
            );
        }
    }

    fn write_status(&mut self, new: u8) -> Option<Effect> {
        if new == 0 {
            return Some(Effect::Reset);
        }
        let old = self.status;
        if new & old != old {
            self.bad_write(
                "status",
                format_args!("cleared bits {:#x} without a reset", old & !new),
            );
            return None;
        }
        let mut new = new & !VIRTIO_CONFIG_S_NEEDS_RESET;
        let added = new & !old;
        if added & VIRTIO_CONFIG_S_FEATURES_OK != 0
            && self.driver_features & feature(VIRTIO_F_VERSION_1) == 0
        {
            // The device refuses: the driver re-reads status and sees FEATURES_OK clear. A
            // driver may retry forever: logged once, counted always.
            self.bad_write(
                "features",
                format_args!("VERSION_1 not accepted: FEATURES_OK refused"),
            );
            new &= !VIRTIO_CONFIG_S_FEATURES_OK;
        }
        self.status = new;
        (added & VIRTIO_CONFIG_S_DRIVER_OK != 0).then_some(Effect::Activate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use devices::virtio::spec::{
        VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_RING_F_EVENT_IDX,
    };
    use vm_memory::GuestAddress;

    const OFFERED: u64 = feature(VIRTIO_F_VERSION_1) | feature(VIRTIO_RING_F_EVENT_IDX) | 1;

    fn setup() -> (CommonConfig, GuestMemoryMmap) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        (CommonConfig::new("t", OFFERED, 2, 256, 3).unwrap(), mem)
    }

    fn w32(c: &mut CommonConfig, mem: &GuestMemoryMmap, off: u64, v: u32) -> Vec<Effect> {
        c.write(off, &v.to_le_bytes(), mem)
    }

    fn w16(c: &mut CommonConfig, mem: &GuestMemoryMmap, off: u64, v: u16) -> Vec<Effect> {
        c.write(off, &v.to_le_bytes(), mem)
    }

    fn r(c: &CommonConfig, off: u64, len: usize) -> u64 {
        let mut b = vec![0u8; len];
        c.read(off, &mut b);
        let mut w = [0u8; 8];
        w[..len].copy_from_slice(&b);
        u64::from_le_bytes(w)
    }

    /// Negotiates VERSION_1 | bit 0 and sets FEATURES_OK.
    fn features_ok(c: &mut CommonConfig, mem: &GuestMemoryMmap) {
        w32(c, mem, reg::DRIVER_FEATURE_SELECT, 0);
        w32(c, mem, reg::DRIVER_FEATURE, 1);
        w32(c, mem, reg::DRIVER_FEATURE_SELECT, 1);
        w32(
            c,
            mem,
            reg::DRIVER_FEATURE,
            (feature(VIRTIO_F_VERSION_1) >> 32) as u32,
        );
        let s = VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK;
        assert!(c.write(reg::DEVICE_STATUS, &[s], mem).is_empty());
    }

    /// Configures queue `q` with rings at `base` and enables it.
    fn enable_queue(c: &mut CommonConfig, mem: &GuestMemoryMmap, q: u16, base: u64) {
        w16(c, mem, reg::QUEUE_SELECT, q);
        w16(c, mem, reg::QUEUE_SIZE, 16);
        c.write(reg::QUEUE_DESC_LO, &base.to_le_bytes(), mem);
        c.write(reg::QUEUE_AVAIL_LO, &(base + 0x100).to_le_bytes(), mem);
        c.write(reg::QUEUE_USED_LO, &(base + 0x200).to_le_bytes(), mem);
        w16(c, mem, reg::QUEUE_ENABLE, 1);
    }

    #[test]
    fn features_are_read_by_word_and_un_offered_bits_are_dropped() {
        let (mut c, mem) = setup();
        assert_eq!(r(&c, reg::DEVICE_FEATURE, 4), OFFERED & 0xffff_ffff);
        w32(&mut c, &mem, reg::DEVICE_FEATURE_SELECT, 1);
        assert_eq!(r(&c, reg::DEVICE_FEATURE, 4), OFFERED >> 32);
        w32(&mut c, &mem, reg::DEVICE_FEATURE_SELECT, 7);
        assert_eq!(r(&c, reg::DEVICE_FEATURE, 4), 0);
        w32(&mut c, &mem, reg::DRIVER_FEATURE, 0b11);
        assert_eq!(r(&c, reg::DRIVER_FEATURE, 4), 1, "bit 1 was never offered");
        assert_eq!(c.bad_writes(), 1);
        features_ok(&mut c, &mem);
        assert_eq!(c.acked_features(), feature(VIRTIO_F_VERSION_1) | 1);
        // After FEATURES_OK the features are frozen.
        w32(&mut c, &mem, reg::DRIVER_FEATURE_SELECT, 0);
        w32(&mut c, &mem, reg::DRIVER_FEATURE, 0);
        assert_eq!(c.acked_features(), feature(VIRTIO_F_VERSION_1) | 1);
        assert_eq!(c.bad_writes(), 2);
    }

    #[test]
    fn features_ok_without_version_1_is_refused() {
        let (mut c, mem) = setup();
        w32(&mut c, &mem, reg::DRIVER_FEATURE, 1);
        c.write(reg::DEVICE_STATUS, &[VIRTIO_CONFIG_S_FEATURES_OK], &mem);
        assert_eq!(r(&c, reg::DEVICE_STATUS, 1), 0);
        assert_eq!(c.bad_writes(), 1);
    }

    #[test]
    fn driver_ok_activates_zero_resets_and_bits_cannot_be_cleared() {
        let (mut c, mem) = setup();
        features_ok(&mut c, &mem);
        enable_queue(&mut c, &mem, 0, 0x1000);
        let live = VIRTIO_CONFIG_S_ACKNOWLEDGE
            | VIRTIO_CONFIG_S_DRIVER
            | VIRTIO_CONFIG_S_FEATURES_OK
            | VIRTIO_CONFIG_S_DRIVER_OK;
        assert_eq!(
            c.write(reg::DEVICE_STATUS, &[live], &mem),
            vec![Effect::Activate]
        );
        // Writing the same status again activates nothing more.
        assert!(c.write(reg::DEVICE_STATUS, &[live], &mem).is_empty());
        // Clearing a bit without a reset is refused.
        assert!(c
            .write(reg::DEVICE_STATUS, &[VIRTIO_CONFIG_S_ACKNOWLEDGE], &mem)
            .is_empty());
        assert_eq!(r(&c, reg::DEVICE_STATUS, 1), u64::from(live));
        // The queue is live: its registers no longer change.
        w16(&mut c, &mem, reg::QUEUE_SIZE, 8);
        assert_eq!(r(&c, reg::QUEUE_SIZE, 2), 16);
        c.set_needs_reset();
        assert_eq!(
            r(&c, reg::DEVICE_STATUS, 1),
            u64::from(live | VIRTIO_CONFIG_S_NEEDS_RESET)
        );
        assert_eq!(c.write(reg::DEVICE_STATUS, &[0], &mem), vec![Effect::Reset]);
        c.reset();
        assert_eq!(r(&c, reg::DEVICE_STATUS, 1), 0);
        assert_eq!(c.acked_features(), 0);
        assert!(!c.queues()[0].queue.ready());
        assert_eq!(
            r(&c, reg::QUEUE_SIZE, 2),
            256,
            "the size is back to the maximum"
        );
    }

    #[test]
    fn queue_registers_are_validated() {
        let (mut c, mem) = setup();
        assert_eq!(r(&c, reg::NUM_QUEUES, 2), 2);
        w16(&mut c, &mem, reg::QUEUE_SIZE, 3);
        assert_eq!(r(&c, reg::QUEUE_SIZE, 2), 256, "not a power of two");
        w16(&mut c, &mem, reg::QUEUE_MSIX_VECTOR, 3);
        assert_eq!(r(&c, reg::QUEUE_MSIX_VECTOR, 2), u64::from(NO_VECTOR));
        w16(&mut c, &mem, reg::QUEUE_MSIX_VECTOR, 2);
        assert_eq!(r(&c, reg::QUEUE_MSIX_VECTOR, 2), 2);
        // Rings beyond guest memory: the enable is refused.
        enable_queue(&mut c, &mem, 1, 0x10_0000);
        assert_eq!(r(&c, reg::QUEUE_ENABLE, 2), 0);
        assert_eq!(r(&c, reg::QUEUE_DESC_LO, 8), 0x10_0000, "8-byte accesses");
        assert_eq!(r(&c, reg::QUEUE_NOTIFY_OFF, 2), 1);
        enable_queue(&mut c, &mem, 1, 0x2000);
        assert_eq!(r(&c, reg::QUEUE_ENABLE, 2), 1);
        // A queue that does not exist reads as zero and takes no write.
        w16(&mut c, &mem, reg::QUEUE_SELECT, 5);
        assert_eq!(r(&c, reg::QUEUE_SIZE, 2), 0);
        let before = c.bad_writes();
        w16(&mut c, &mem, reg::QUEUE_SIZE, 16);
        w16(&mut c, &mem, reg::QUEUE_ENABLE, 0);
        w16(&mut c, &mem, reg::QUEUE_RESET, 1);
        w16(&mut c, &mem, reg::NUM_QUEUES, 9);
        assert_eq!(c.bad_writes(), before + 4);
    }

    #[test]
    fn the_config_vector_is_validated_and_routed() {
        let (mut c, mem) = setup();
        assert_eq!(r(&c, reg::CONFIG_MSIX_VECTOR, 2), u64::from(NO_VECTOR));
        assert_eq!(
            w16(&mut c, &mem, reg::CONFIG_MSIX_VECTOR, 2),
            vec![Effect::ConfigVector(2)]
        );
        assert!(w16(&mut c, &mem, reg::CONFIG_MSIX_VECTOR, 3).is_empty());
        assert_eq!(r(&c, reg::CONFIG_MSIX_VECTOR, 2), 2);
        // An 8-byte write at 0x10 sets the vector, then the status (0: reset), in order.
        let v = 1u64 | u64::from(0u32) << 32;
        assert_eq!(
            c.write(reg::CONFIG_MSIX_VECTOR, &v.to_le_bytes(), &mem),
            vec![Effect::ConfigVector(1), Effect::Reset]
        );
        c.reset();
        assert_eq!(r(&c, reg::CONFIG_MSIX_VECTOR, 2), u64::from(NO_VECTOR));
    }
}
