//! Bus 0: its functions, BAR allocation and the two configuration access methods.

use devices::metrics::lock;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use super::{
    BarReprogram, Error, PciDevice, PciHostBridge, Result, NUM_CONFIG_REGISTERS,
    NUM_LEGACY_CONFIG_REGISTERS,
};
use crate::bus::{Bus, BusDevice};
use crate::layout::{PCI_MMIO32_SIZE, PCI_MMIO32_START};

/// A PCI function shared between the root and its BAR regions.
pub type SharedPciDevice = Arc<Mutex<dyn PciDevice>>;

const NUM_SLOTS: u8 = 32;

#[derive(Debug)]
struct Allocator {
    next: u64,
    end: u64,
}

/// The functions of bus 0 and the MMIO bus their BARs live on.
///
/// Slot 0 holds the [`PciHostBridge`]. Functions are single-function devices at function 0.
pub struct PciRoot {
    mmio: Arc<Bus>,
    devices: Mutex<BTreeMap<u8, SharedPciDevice>>,
    mmio32: Mutex<Allocator>,
    /// Moved BARs that could not be mapped (a guest misprogramming its window can do this
    /// at will: logged once, counted always).
    bar_map_failures: devices::metrics::Counter,
    bar_map_logged: devices::metrics::LogOnce,
}

impl std::fmt::Debug for PciRoot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let slots: Vec<u8> = self.lock_devices().keys().copied().collect();
        f.debug_struct("PciRoot").field("slots", &slots).finish()
    }
}

impl PciRoot {
    /// Bus 0 with a host bridge at slot 0; BARs are mapped on `mmio`.
    pub fn new(mmio: Arc<Bus>) -> Arc<Self> {
        let mut devices: BTreeMap<u8, SharedPciDevice> = BTreeMap::new();
        devices.insert(0, Arc::new(Mutex::new(PciHostBridge::new())));
        Arc::new(PciRoot {
            mmio,
            devices: Mutex::new(devices),
            mmio32: Mutex::new(Allocator {
                next: PCI_MMIO32_START,
                end: PCI_MMIO32_START + PCI_MMIO32_SIZE,
            }),
            bar_map_failures: devices::metrics::Counter::default(),
            bar_map_logged: devices::metrics::LogOnce::default(),
        })
    }

    fn lock_devices(&self) -> std::sync::MutexGuard<'_, BTreeMap<u8, SharedPciDevice>> {
        lock(&self.devices)
    }

    /// Allocates `size` bytes (a power of two, aligned to itself) from the 32-bit BAR window.
    ///
    /// # Errors
    /// [`Error::InvalidBarSize`], [`Error::MmioExhausted`].
    pub fn allocate_mmio32(&self, size: u64) -> Result<u64> {
        if !size.is_power_of_two() || size < 0x1000 {
            return Err(Error::InvalidBarSize(size));
        }
        let mut a = lock(&self.mmio32);
        let start = a
            .next
            .checked_add(size - 1)
            .map(|v| v & !(size - 1))
            .ok_or(Error::MmioExhausted { size })?;
        let end = start
            .checked_add(size)
            .filter(|&e| e <= a.end)
            .ok_or(Error::MmioExhausted { size })?;
        a.next = end;
        Ok(start)
    }

    /// Puts `device` in the first free slot and maps its BARs. Returns the slot number.
    ///
    /// # Errors
    /// [`Error::NoFreeSlot`], [`Error::Bus`] when a BAR overlaps a registered range (nothing
    /// stays registered in that case).
    pub fn add_device(&self, device: SharedPciDevice) -> Result<u8> {
        let mut devices = self.lock_devices();
        let slot = (0..NUM_SLOTS)
            .find(|s| !devices.contains_key(s))
            .ok_or(Error::NoFreeSlot)?;
        let bars = lock(&device).bars();
        let mut mapped = Vec::new();
        for bar in &bars {
            let region = Arc::new(Mutex::new(PciBarRegion {
                device: device.clone(),
                bar: bar.index,
            }));
            if let Err(e) = self.mmio.insert(region, bar.addr, bar.size) {
                for addr in mapped {
                    let _ = self.mmio.remove(addr);
                }
                return Err(e.into());
            }
            mapped.push(bar.addr);
        }
        devices.insert(slot, device);
        tracing::info!(slot, ?bars, "PCI device added");
        Ok(slot)
    }

    fn device(&self, bus: u8, dev: u8, func: u8) -> Option<SharedPciDevice> {
        if bus != 0 || func != 0 {
            return None;
        }
        self.lock_devices().get(&dev).cloned()
    }

    /// Reads configuration register `reg` of `bus:dev.func`; absent functions read all ones.
    pub fn config_read(&self, bus: u8, dev: u8, func: u8, reg: usize) -> u32 {
        match self.device(bus, dev, func) {
            Some(d) if reg < NUM_CONFIG_REGISTERS => lock(&d).read_config_register(reg),
            _ => 0xffff_ffff,
        }
    }

    /// Writes configuration register `reg` of `bus:dev.func`; remaps a BAR the write moved.
    pub fn config_write(&self, bus: u8, dev: u8, func: u8, reg: usize, offset: u64, data: &[u8]) {
        let Some(d) = self.device(bus, dev, func) else {
            return;
        };
        if reg >= NUM_CONFIG_REGISTERS {
            return;
        }
        // The device lock is released before the bus is changed (see `crate::bus`).
        let moved = lock(&d).write_config_register(reg, offset, data);
        if let Some(m) = moved {
            self.move_bar(&d, m);
        }
    }

    /// Moved BARs that could not be mapped so far.
    pub fn bar_map_failures(&self) -> u64 {
        self.bar_map_failures.get()
    }

    fn move_bar(&self, device: &SharedPciDevice, m: BarReprogram) {
        let region = match self.mmio.remove(m.old) {
            Ok(r) => r,
            Err(_) => Arc::new(Mutex::new(PciBarRegion {
                device: device.clone(),
                bar: m.index,
            })),
        };
        if m.new == 0 {
            // Address 0 is how firmware parks a BAR; leave it unmapped.
            tracing::debug!(?m, "BAR parked at 0, unmapped");
            return;
        }
        if let Err(e) = self.mmio.insert(region, m.new, m.size) {
            // The function still answers config reads with the new address; accesses to it
            // just hit nothing. Guests only do this when they misprogram the window.
            self.bar_map_failures.inc();
            if self.bar_map_logged.first() {
                tracing::warn!(error = %e, ?m, "cannot map moved BAR (logged once, counted)");
            }
        } else {
            tracing::debug!(?m, "BAR moved");
        }
    }
}

/// The MMIO window of one BAR, routed to its function.
#[derive(Debug)]
pub struct PciBarRegion {
    device: SharedPciDevice,
    bar: usize,
}

impl BusDevice for PciBarRegion {
    fn read(&mut self, _base: u64, offset: u64, data: &mut [u8]) {
        lock(&self.device).read_bar(self.bar, offset, data);
    }

    fn write(&mut self, _base: u64, offset: u64, data: &[u8]) {
        lock(&self.device).write_bar(self.bar, offset, data);
    }
}

const CONFIG_ADDRESS_ENABLE: u32 = 1 << 31;
/// Bits of CONFIG_ADDRESS that are kept: enable, bus, device, function, register.
const CONFIG_ADDRESS_MASK: u32 = 0x80ff_fffc;

/// PCI configuration mechanism #1: CONFIG_ADDRESS at 0xCF8, CONFIG_DATA at 0xCFC-0xCFF.
/// Register at 0xCF8 with length 8.
pub struct PciConfigIo {
    root: Arc<PciRoot>,
    address: u32,
}

impl std::fmt::Debug for PciConfigIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PciConfigIo")
            .field("address", &format_args!("{:#x}", self.address))
            .finish()
    }
}

impl PciConfigIo {
    /// Configuration mechanism #1 for `root`.
    pub fn new(root: Arc<PciRoot>) -> Self {
        PciConfigIo { root, address: 0 }
    }

    /// Decodes CONFIG_ADDRESS: `(bus, dev, func, reg)`, or `None` when disabled.
    fn target(&self) -> Option<(u8, u8, u8, usize)> {
        if self.address & CONFIG_ADDRESS_ENABLE == 0 {
            return None;
        }
        let a = self.address;
        Some((
            (a >> 16) as u8,
            ((a >> 11) & 0x1f) as u8,
            ((a >> 8) & 0x7) as u8,
            ((a >> 2) & 0x3f) as usize,
        ))
    }
}

/// Whether an access of `len` bytes at byte `offset` stays inside one dword.
fn fits_dword(offset: u64, len: usize) -> bool {
    len > 0 && (offset as usize).checked_add(len).is_some_and(|e| e <= 4) && offset < 4
}

impl BusDevice for PciConfigIo {
    fn read(&mut self, _base: u64, offset: u64, data: &mut [u8]) {
        let value = match offset {
            0 if data.len() == 4 => self.address,
            4..=7 => match self.target() {
                Some((b, d, f, r)) if r < NUM_LEGACY_CONFIG_REGISTERS => {
                    self.root.config_read(b, d, f, r)
                }
                _ => 0xffff_ffff,
            },
            _ => 0xffff_ffff,
        };
        let shift = offset.saturating_sub(4);
        if offset >= 4 && !fits_dword(shift, data.len()) {
            data.fill(0xff);
            return;
        }
        let bytes = (value >> (shift * 8)).to_le_bytes();
        for (i, b) in data.iter_mut().enumerate() {
            *b = bytes.get(i).copied().unwrap_or(0xff);
        }
    }

    fn write(&mut self, _base: u64, offset: u64, data: &[u8]) {
        match offset {
            0 => {
                // Only dword writes change CONFIG_ADDRESS (byte writes to 0xCF8-0xCFB are
                // used by old probes for mechanism #2 and must not disturb it).
                if let Ok(v) = <[u8; 4]>::try_from(data) {
                    self.address = u32::from_le_bytes(v) & CONFIG_ADDRESS_MASK;
                }
            }
            4..=7 => {
                let shift = offset - 4;
                if !fits_dword(shift, data.len()) {
                    return;
                }
                if let Some((b, d, f, r)) = self.target() {
                    if r < NUM_LEGACY_CONFIG_REGISTERS {
                        self.root.config_write(b, d, f, r, shift, data);
                    }
                }
            }
            _ => {}
        }
    }
}

/// The ECAM (memory-mapped configuration) window for bus 0: byte offset
/// `dev << 15 | func << 12 | register offset`. Register at [`crate::layout::PCI_ECAM_START`]
/// with length [`crate::layout::PCI_ECAM_SIZE`].
pub struct PciConfigMmio {
    root: Arc<PciRoot>,
}

impl std::fmt::Debug for PciConfigMmio {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PciConfigMmio").finish_non_exhaustive()
    }
}

impl PciConfigMmio {
    /// The ECAM window for `root`.
    pub fn new(root: Arc<PciRoot>) -> Self {
        PciConfigMmio { root }
    }

    fn decode(offset: u64) -> (u8, u8, u8, usize, u64) {
        (
            ((offset >> 20) & 0xff) as u8,
            ((offset >> 15) & 0x1f) as u8,
            ((offset >> 12) & 0x7) as u8,
            ((offset >> 2) & 0x3ff) as usize,
            offset & 3,
        )
    }
}

impl BusDevice for PciConfigMmio {
    fn read(&mut self, _base: u64, offset: u64, data: &mut [u8]) {
        let (b, d, f, r, byte) = Self::decode(offset);
        if !fits_dword(byte, data.len()) {
            data.fill(0xff);
            return;
        }
        let bytes = (self.root.config_read(b, d, f, r) >> (byte * 8)).to_le_bytes();
        data.copy_from_slice(&bytes[..data.len()]);
    }

    fn write(&mut self, _base: u64, offset: u64, data: &[u8]) {
        let (b, d, f, r, byte) = Self::decode(offset);
        if fits_dword(byte, data.len()) {
            self.root.config_write(b, d, f, r, byte, data);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{BarKind, PciBar, PciConfiguration, PciHeader};
    use super::*;

    #[derive(Debug)]
    struct BarDev {
        config: PciConfiguration,
        last_write: Option<(usize, u64, Vec<u8>)>,
    }

    impl PciDevice for BarDev {
        fn config(&self) -> &PciConfiguration {
            &self.config
        }
        fn config_mut(&mut self) -> &mut PciConfiguration {
            &mut self.config
        }
        fn read_bar(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
            data.fill(bar as u8 + offset as u8);
        }
        fn write_bar(&mut self, bar: usize, offset: u64, data: &[u8]) {
            self.last_write = Some((bar, offset, data.to_vec()));
        }
    }

    /// A function with `header` and one 4 KiB 32-bit BAR 0 at `addr`.
    fn bar_dev(header: &PciHeader, addr: u64) -> Arc<Mutex<BarDev>> {
        let mut config = PciConfiguration::new(header);
        config
            .add_bar(PciBar {
                index: 0,
                addr,
                size: 0x1000,
                kind: BarKind::Memory32,
                prefetchable: false,
            })
            .unwrap();
        Arc::new(Mutex::new(BarDev {
            config,
            last_write: None,
        }))
    }

    fn setup() -> (Arc<Bus>, Arc<PciRoot>, Arc<Mutex<BarDev>>, u64) {
        let mmio = Arc::new(Bus::new("mmio"));
        let root = PciRoot::new(mmio.clone());
        let addr = root.allocate_mmio32(0x1000).unwrap();
        let dev = bar_dev(
            &PciHeader {
                vendor_id: 0x1af4,
                device_id: 0x1041,
                ..Default::default()
            },
            addr,
        );
        assert_eq!(root.add_device(dev.clone()).unwrap(), 1);
        (mmio, root, dev, addr)
    }

    fn conf1_read(io: &mut PciConfigIo, dev: u32, reg: u32) -> u32 {
        io.write(
            0xcf8,
            0,
            &(0x8000_0000 | dev << 11 | reg << 2).to_le_bytes(),
        );
        let mut v = [0u8; 4];
        io.read(0xcf8, 4, &mut v);
        u32::from_le_bytes(v)
    }

    #[test]
    fn conf1_finds_bridge_and_device() {
        let (_mmio, root, _dev, _) = setup();
        let mut io = PciConfigIo::new(root);
        assert_eq!(conf1_read(&mut io, 0, 0), 0x0d57_8086);
        assert_eq!(conf1_read(&mut io, 0, 2) >> 16, 0x0600);
        assert_eq!(conf1_read(&mut io, 1, 0), 0x1041_1af4);
        assert_eq!(conf1_read(&mut io, 2, 0), 0xffff_ffff);
        // Address register reads back; byte reads of the data port pick the right lane.
        let mut a = [0u8; 4];
        io.read(0xcf8, 0, &mut a);
        assert_eq!(u32::from_le_bytes(a), 0x8000_1000);
        io.write(0xcf8, 0, &0x8000_0800u32.to_le_bytes());
        let mut b = [0u8; 2];
        io.read(0xcf8, 6, &mut b);
        assert_eq!(u16::from_le_bytes(b), 0x1041);
        // Disabled address: all ones.
        io.write(0xcf8, 0, &0u32.to_le_bytes());
        io.read(0xcf8, 4, &mut a);
        assert_eq!(a, [0xff; 4]);
        // Accesses crossing the dword are ignored.
        io.read(0xcf8, 7, &mut b);
        assert_eq!(b, [0xff; 2]);
    }

    #[test]
    fn ecam_reads_match_conf1() {
        let (_mmio, root, _dev, _) = setup();
        let mut ecam = PciConfigMmio::new(root);
        let mut v = [0u8; 4];
        ecam.read(0, 1 << 15, &mut v);
        assert_eq!(u32::from_le_bytes(v), 0x1041_1af4);
        ecam.read(0, 3 << 15, &mut v);
        assert_eq!(v, [0xff; 4]);
        // Another function or bus: absent.
        ecam.read(0, 1 << 15 | 1 << 12, &mut v);
        assert_eq!(v, [0xff; 4]);
        ecam.read(0, 1 << 20, &mut v);
        assert_eq!(v, [0xff; 4]);
    }

    #[test]
    fn bar_access_and_relocation() {
        let (mmio, root, dev, addr) = setup();
        let mut d = [0u8; 4];
        assert!(mmio.read(addr + 8, &mut d));
        assert_eq!(d, [8; 4]);
        assert!(mmio.write(addr + 4, &[7]));
        assert_eq!(dev.lock().unwrap().last_write, Some((0, 4, vec![7])));
        // Size the BAR, restore it: still mapped at the same place.
        root.config_write(0, 1, 0, 4, 0, &[0xff; 4]);
        assert_eq!(root.config_read(0, 1, 0, 4), 0xffff_f000);
        root.config_write(0, 1, 0, 4, 0, &(addr as u32).to_le_bytes());
        assert!(mmio.read(addr, &mut d));
        // Move it.
        let new = addr + 0x10_0000;
        root.config_write(0, 1, 0, 4, 0, &(new as u32).to_le_bytes());
        assert!(!mmio.read(addr, &mut d));
        assert!(mmio.read(new + 1, &mut d));
        assert_eq!(d, [1; 4]);
    }

    #[test]
    fn allocator_aligns_and_exhausts() {
        let root = PciRoot::new(Arc::new(Bus::new("mmio")));
        let a = root.allocate_mmio32(0x1000).unwrap();
        let b = root.allocate_mmio32(0x10_0000).unwrap();
        assert_eq!(a, PCI_MMIO32_START);
        assert_eq!(b % 0x10_0000, 0);
        assert!(b > a);
        assert!(root.allocate_mmio32(0x3000).is_err());
        assert!(root.allocate_mmio32(PCI_MMIO32_SIZE).is_err());
    }

    #[test]
    fn overlapping_bar_is_rejected() {
        let (mmio, root, _dev, addr) = setup();
        let dev = bar_dev(&PciHeader::default(), addr);
        assert!(matches!(root.add_device(dev), Err(Error::Bus(_))));
        assert_eq!(mmio.ranges().len(), 1);
        assert_eq!(root.config_read(0, 2, 0, 0), 0xffff_ffff);
    }
}
