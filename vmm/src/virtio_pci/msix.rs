//! MSI-X for a virtio-pci function: the vector table and PBA, and delivery through KVM.
//!
//! Every vector owns an eventfd registered as an irqfd on a GSI of its own. The GSI's MSI
//! route (address/data from the table) is committed to KVM when the vector becomes
//! deliverable (MSI-X enabled, function not masked, entry not masked) and when the driver
//! changes an unmasked entry. A worker thread signals a vector by writing its eventfd; while
//! the vector is not deliverable the signal is recorded in the PBA instead and fired when it
//! becomes deliverable again (PCI 3.0, 6.8.3.5).
//!
//! The config vector lives here too, so a worker that finds the device broken can raise a
//! configuration-change interrupt without taking the transport's lock.

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{Error, Result};
use crate::vm::Vm;

/// "No vector" (virtio 1.2, 4.1.4.3: `VIRTIO_MSI_NO_VECTOR`).
pub const NO_VECTOR: u16 = 0xffff;
/// Size of one MSI-X table entry.
pub const ENTRY_SIZE: u64 = 16;
/// ISR bit for a used-buffer notification.
pub const ISR_QUEUE: u8 = 1;
/// ISR bit for a configuration change.
pub const ISR_CONFIG: u8 = 2;
/// Vector control bit 0: the entry is masked.
const ENTRY_MASKED: u32 = 1;

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Entry {
    addr_lo: u32,
    addr_hi: u32,
    data: u32,
    ctrl: u32,
}

impl Entry {
    fn masked_at_reset() -> Self {
        Entry {
            ctrl: ENTRY_MASKED,
            ..Entry::default()
        }
    }
    fn address(&self) -> u64 {
        u64::from(self.addr_hi) << 32 | u64::from(self.addr_lo)
    }
}

/// A table entry and the route last committed for it.
type Row = (Entry, Option<(u64, u32)>);

#[derive(Debug)]
struct Vector {
    evt: EventFd,
    gsi: u32,
    /// Mirrors bit 0 of the entry's vector control (read lock-free by workers).
    masked: AtomicBool,
    /// The PBA bit.
    pending: AtomicBool,
}

/// The MSI-X state of one function and its KVM routes.
#[derive(Debug)]
pub struct MsixInterrupts {
    vm: Arc<Vm>,
    vectors: Vec<Vector>,
    /// The table as the driver wrote it, plus the route last committed for each vector.
    table: Mutex<Vec<Row>>,
    enabled: AtomicBool,
    function_masked: AtomicBool,
    isr: AtomicU8,
    config_vector: AtomicU16,
}

impl MsixInterrupts {
    /// `count` vectors, each with an eventfd registered as an irqfd on a fresh GSI. All
    /// entries start masked and MSI-X starts disabled.
    ///
    /// # Errors
    /// [`Error::EventFd`], [`Error::Vm`] (GSI allocation, irqfd registration).
    pub fn new(vm: Arc<Vm>, count: usize) -> Result<Self> {
        let mut vectors = Vec::with_capacity(count);
        for _ in 0..count {
            let evt = EventFd::new(EFD_NONBLOCK).map_err(Error::EventFd)?;
            let gsi = vm.allocate_msi_gsi()?;
            vm.register_irqfd(&evt, gsi)?;
            vectors.push(Vector {
                evt,
                gsi,
                masked: AtomicBool::new(true),
                pending: AtomicBool::new(false),
            });
        }
        Ok(MsixInterrupts {
            vm,
            table: Mutex::new(vec![(Entry::masked_at_reset(), None); count]),
            vectors,
            enabled: AtomicBool::new(false),
            function_masked: AtomicBool::new(false),
            isr: AtomicU8::new(0),
            config_vector: AtomicU16::new(NO_VECTOR),
        })
    }

    /// Number of vectors.
    pub fn len(&self) -> usize {
        self.vectors.len()
    }

    /// True when there are no vectors.
    pub fn is_empty(&self) -> bool {
        self.vectors.is_empty()
    }

    fn lock_table(&self) -> std::sync::MutexGuard<'_, Vec<Row>> {
        devices::metrics::lock(&self.table)
    }

    /// Signals `vector` (used-buffer notification): sets ISR bit 0 and fires or pends the
    /// vector. An out-of-range vector (including [`NO_VECTOR`]) only sets the ISR bit.
    pub fn signal_queue(&self, vector: u16) {
        self.isr.fetch_or(ISR_QUEUE, Ordering::SeqCst);
        self.fire(vector);
    }

    /// Raises a configuration-change interrupt on the config vector.
    pub fn signal_config(&self) {
        self.isr.fetch_or(ISR_CONFIG, Ordering::SeqCst);
        self.fire(self.config_vector());
    }

    fn deliverable(&self, v: &Vector) -> bool {
        self.enabled.load(Ordering::SeqCst)
            && !self.function_masked.load(Ordering::SeqCst)
            && !v.masked.load(Ordering::SeqCst)
    }

    fn fire(&self, vector: u16) {
        let Some(v) = self.vectors.get(usize::from(vector)) else {
            return;
        };
        if self.deliverable(v) {
            if let Err(e) = v.evt.write(1) {
                tracing::warn!(vector, error = %e, "MSI-X eventfd write failed");
            }
        } else {
            v.pending.store(true, Ordering::SeqCst);
        }
    }

    /// The config vector the driver programmed.
    pub fn config_vector(&self) -> u16 {
        self.config_vector.load(Ordering::SeqCst)
    }

    /// Sets the config vector (the transport validated it).
    pub fn set_config_vector(&self, v: u16) {
        self.config_vector.store(v, Ordering::SeqCst);
    }

    /// Reads and clears the ISR status byte.
    pub fn read_isr(&self) -> u8 {
        self.isr.swap(0, Ordering::SeqCst)
    }

    /// Clears the ISR and the config vector (device reset; the MSI-X table is PCI state and
    /// survives a virtio reset).
    pub fn reset(&self) {
        self.isr.store(0, Ordering::SeqCst);
        self.config_vector.store(NO_VECTOR, Ordering::SeqCst);
    }

    /// True when MSI-X is enabled in the capability.
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::SeqCst)
    }

    /// Applies the enable and function-mask bits of the capability's message control.
    pub fn set_control(&self, enabled: bool, function_masked: bool) {
        let was = (self.enabled(), self.function_masked.load(Ordering::SeqCst));
        self.enabled.store(enabled, Ordering::SeqCst);
        self.function_masked
            .store(function_masked, Ordering::SeqCst);
        if was != (enabled, function_masked) {
            tracing::debug!(enabled, function_masked, "MSI-X control");
            for i in 0..self.vectors.len() {
                self.update_vector(i);
            }
        }
    }

    /// Commits the route of vector `i` if it is deliverable and changed, then fires a
    /// pending signal.
    fn update_vector(&self, i: usize) {
        let Some(v) = self.vectors.get(i) else {
            return;
        };
        if !self.deliverable(v) {
            return;
        }
        {
            let mut table = self.lock_table();
            let Some((entry, routed)) = table.get_mut(i) else {
                return;
            };
            let want = (entry.address(), entry.data);
            if *routed != Some(want) {
                match self.vm.set_msi_route(v.gsi, want.0, want.1) {
                    Ok(()) => *routed = Some(want),
                    Err(e) => {
                        tracing::error!(vector = i, error = %e, "cannot set MSI route");
                        return;
                    }
                }
            }
        }
        if v.pending.swap(false, Ordering::SeqCst) {
            if let Err(e) = v.evt.write(1) {
                tracing::warn!(vector = i, error = %e, "MSI-X eventfd write failed");
            }
        }
    }

    /// Reads the table at `offset` (dword or qword accesses; anything else reads zeros).
    pub fn read_table(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let table = self.lock_table();
        let mut dwords = [0u32; 2];
        let n = match data.len() {
            4 => 1,
            8 => 2,
            _ => return,
        };
        for (k, d) in dwords.iter_mut().enumerate().take(n) {
            let Some(off) = offset.checked_add(4 * k as u64) else {
                return;
            };
            let Some((e, _)) = usize::try_from(off / ENTRY_SIZE)
                .ok()
                .and_then(|i| table.get(i))
            else {
                return;
            };
            *d = match off % ENTRY_SIZE {
                0 => e.addr_lo,
                4 => e.addr_hi,
                8 => e.data,
                12 => e.ctrl,
                _ => 0,
            };
        }
        let v = u64::from(dwords[1]) << 32 | u64::from(dwords[0]);
        data.copy_from_slice(&v.to_le_bytes()[..data.len()]);
    }

    /// Writes the table at `offset` (dword or qword accesses; others are ignored).
    pub fn write_table(&self, offset: u64, data: &[u8]) {
        let value = match data.len() {
            4 | 8 => {
                let mut b = [0u8; 8];
                b[..data.len()].copy_from_slice(data);
                u64::from_le_bytes(b)
            }
            _ => {
                tracing::debug!(offset, len = data.len(), "ignored MSI-X table write");
                return;
            }
        };
        let mut touched = Vec::new();
        {
            let mut table = self.lock_table();
            for k in 0..data.len() / 4 {
                let Some(off) = offset.checked_add(4 * k as u64) else {
                    break;
                };
                let Some(i) = usize::try_from(off / ENTRY_SIZE)
                    .ok()
                    .filter(|&i| i < table.len())
                else {
                    break;
                };
                let dword = (value >> (32 * k)) as u32;
                let (e, _) = &mut table[i];
                match off % ENTRY_SIZE {
                    0 => e.addr_lo = dword,
                    4 => e.addr_hi = dword,
                    8 => e.data = dword,
                    12 => {
                        e.ctrl = dword & ENTRY_MASKED;
                        self.vectors[i]
                            .masked
                            .store(e.ctrl & ENTRY_MASKED != 0, Ordering::SeqCst);
                    }
                    _ => {}
                }
                touched.push(i);
            }
        }
        for i in touched {
            self.update_vector(i);
        }
    }

    /// Reads the pending bit array at `offset`.
    pub fn read_pba(&self, offset: u64, data: &mut [u8]) {
        for (k, b) in data.iter_mut().enumerate() {
            *b = 0;
            let Some(byte) = offset
                .checked_add(k as u64)
                .and_then(|o| usize::try_from(o).ok())
            else {
                continue;
            };
            for bit in 0..8 {
                let pending = byte
                    .checked_mul(8)
                    .and_then(|b| b.checked_add(bit))
                    .and_then(|i| self.vectors.get(i))
                    .is_some_and(|v| v.pending.load(Ordering::SeqCst));
                if pending {
                    *b |= 1 << bit;
                }
            }
        }
    }
}

impl Drop for MsixInterrupts {
    fn drop(&mut self) {
        for v in &self.vectors {
            let _ = self.vm.unregister_irqfd(&v.evt, v.gsi);
            let _ = self.vm.clear_msi_route(v.gsi);
        }
    }
}
