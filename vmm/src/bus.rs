//! Address buses that route PIO and MMIO exits to devices.
//!
//! A [`Bus`] maps non-overlapping, non-empty address ranges to [`BusDevice`]s. The same device
//! may be registered at several ranges (the i8042 answers at 0x60 and 0x64). Accesses are
//! dispatched with the range's base and the offset into it.
//!
//! Locking: the range table sits behind an `RwLock`; a lookup clones the device's `Arc` and
//! drops the table lock *before* locking the device. So a device may change the bus while it
//! handles an access (a PCI BAR write moves the BAR's MMIO range) without deadlocking against
//! other vCPUs.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};

/// A device reachable through a [`Bus`].
///
/// `data.len()` is the access size (1, 2, 4 or 8 bytes from KVM exits, anything from tests).
/// Implementations must tolerate any `offset`/`data` the guest produces: never panic, ignore
/// writes they do not understand and fill reads with a defined value.
pub trait BusDevice: Send {
    /// Handles a read of `data.len()` bytes at `base + offset`.
    fn read(&mut self, base: u64, offset: u64, data: &mut [u8]);
    /// Handles a write of `data` at `base + offset`.
    fn write(&mut self, base: u64, offset: u64, data: &[u8]);
}

/// A device shared between the bus and its owner.
pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

/// Errors of bus registration.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// The range has length zero or wraps around the address space.
    #[error("invalid {bus} range base {base:#x} len {len:#x}")]
    InvalidRange {
        /// Bus name.
        bus: &'static str,
        /// Requested base.
        base: u64,
        /// Requested length.
        len: u64,
    },
    /// The range overlaps an already registered range.
    #[error("{bus} range {base:#x}+{len:#x} overlaps {other_base:#x}+{other_len:#x}")]
    Overlap {
        /// Bus name.
        bus: &'static str,
        /// Requested base.
        base: u64,
        /// Requested length.
        len: u64,
        /// Base of the existing range.
        other_base: u64,
        /// Length of the existing range.
        other_len: u64,
    },
    /// No range starts at this base.
    #[error("no {bus} range registered at {base:#x}")]
    NotFound {
        /// Bus name.
        bus: &'static str,
        /// Requested base.
        base: u64,
    },
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, Error>;

struct Entry {
    len: u64,
    device: SharedDevice,
}

/// A set of address ranges, each routed to a device.
pub struct Bus {
    name: &'static str,
    ranges: RwLock<BTreeMap<u64, Entry>>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ranges: Vec<(u64, u64)> = match self.ranges.read() {
            Ok(r) => r.iter().map(|(b, e)| (*b, e.len)).collect(),
            Err(_) => Vec::new(),
        };
        f.debug_struct("Bus")
            .field("name", &self.name)
            .field("ranges", &ranges)
            .finish()
    }
}

impl Bus {
    /// Creates an empty bus; `name` ("pio", "mmio") appears in errors and logs.
    pub fn new(name: &'static str) -> Self {
        Bus {
            name,
            ranges: RwLock::new(BTreeMap::new()),
        }
    }

    /// The bus name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    fn table(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<u64, Entry>> {
        // A poisoned lock only means a writer panicked; the map itself is still consistent
        // because every mutation is a single insert or remove.
        self.ranges.read().unwrap_or_else(|e| e.into_inner())
    }

    fn table_mut(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<u64, Entry>> {
        self.ranges.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `device` for `[base, base + len)`.
    ///
    /// # Errors
    /// [`Error::InvalidRange`] for an empty or wrapping range, [`Error::Overlap`] when any
    /// address of the range is already registered.
    pub fn insert(&self, device: SharedDevice, base: u64, len: u64) -> Result<()> {
        let bus = self.name;
        let end = match base.checked_add(len) {
            Some(end) if len > 0 => end,
            _ => return Err(Error::InvalidRange { bus, base, len }),
        };
        let mut table = self.table_mut();
        // The closest range starting at or below `base` and the first one starting above it
        // are the only candidates for overlap, because registered ranges never overlap.
        let below = table
            .range(..=base)
            .next_back()
            .filter(|(&b, e)| b + e.len > base);
        let above = table.range(base..).next().filter(|(&b, _)| b < end);
        if let Some((&other_base, e)) = below.or(above) {
            return Err(Error::Overlap {
                bus,
                base,
                len,
                other_base,
                other_len: e.len,
            });
        }
        table.insert(base, Entry { len, device });
        tracing::debug!(bus, base, len, "registered bus range");
        Ok(())
    }

    /// Unregisters the range starting at `base` and returns its device.
    ///
    /// # Errors
    /// [`Error::NotFound`] when no range starts at `base`.
    pub fn remove(&self, base: u64) -> Result<SharedDevice> {
        self.table_mut()
            .remove(&base)
            .map(|e| e.device)
            .ok_or(Error::NotFound {
                bus: self.name,
                base,
            })
    }

    /// Finds the device covering `addr`; returns `(base, offset, device)`.
    ///
    /// Accesses that start inside a range are routed to it even if they run past its end;
    /// the device sees the offset and the length and decides.
    pub fn resolve(&self, addr: u64) -> Option<(u64, u64, SharedDevice)> {
        let table = self.table();
        let (&base, entry) = table.range(..=addr).next_back()?;
        let offset = addr - base;
        (offset < entry.len).then(|| (base, offset, entry.device.clone()))
    }

    /// Dispatches a read; returns `false` (and leaves `data` untouched) when no device
    /// covers `addr`.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        self.with_device(addr, |dev, base, offset| dev.read(base, offset, data))
    }

    /// Dispatches a write; returns `false` when no device covers `addr`.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        self.with_device(addr, |dev, base, offset| dev.write(base, offset, data))
    }

    /// Runs `access` on the device covering `addr` (locked) with its base and the offset;
    /// `false` when no device covers it.
    fn with_device(&self, addr: u64, access: impl FnOnce(&mut dyn BusDevice, u64, u64)) -> bool {
        let Some((base, offset, dev)) = self.resolve(addr) else {
            return false;
        };
        access(
            &mut *dev.lock().unwrap_or_else(|e| e.into_inner()),
            base,
            offset,
        );
        true
    }

    /// The registered ranges as `(base, len)`, in address order.
    pub fn ranges(&self) -> Vec<(u64, u64)> {
        self.table().iter().map(|(b, e)| (*b, e.len)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Recorder {
        last: Option<(u64, u64, Vec<u8>)>,
    }

    impl BusDevice for Recorder {
        fn read(&mut self, base: u64, offset: u64, data: &mut [u8]) {
            for (i, b) in data.iter_mut().enumerate() {
                *b = (base as u8)
                    .wrapping_add(offset as u8)
                    .wrapping_add(i as u8);
            }
        }
        fn write(&mut self, base: u64, offset: u64, data: &[u8]) {
            self.last = Some((base, offset, data.to_vec()));
        }
    }

    fn dev() -> Arc<Mutex<Recorder>> {
        Arc::new(Mutex::new(Recorder::default()))
    }

    #[test]
    fn dispatch_uses_base_and_offset() {
        let bus = Bus::new("test");
        let d = dev();
        bus.insert(d.clone(), 0x100, 0x10).unwrap();
        assert!(bus.write(0x104, &[1, 2]));
        assert_eq!(d.lock().unwrap().last, Some((0x100, 4, vec![1, 2])));
        let mut buf = [0u8; 2];
        assert!(bus.read(0x10f, &mut buf));
        assert_eq!(buf, [0x0f, 0x10]);
        assert!(!bus.read(0x110, &mut buf));
        assert!(!bus.write(0xff, &[0]));
    }

    #[test]
    fn overlapping_ranges_are_rejected() {
        let bus = Bus::new("test");
        bus.insert(dev(), 0x100, 0x10).unwrap();
        for (base, len) in [
            (0x100, 1),
            (0xf0, 0x11),
            (0x10f, 1),
            (0x0, 0x1000),
            (0x108, 4),
        ] {
            assert!(
                matches!(bus.insert(dev(), base, len), Err(Error::Overlap { .. })),
                "{base:#x}+{len:#x}"
            );
        }
        bus.insert(dev(), 0xf0, 0x10).unwrap();
        bus.insert(dev(), 0x110, 0x10).unwrap();
        assert_eq!(
            bus.ranges(),
            vec![(0xf0, 0x10), (0x100, 0x10), (0x110, 0x10)]
        );
    }

    #[test]
    fn invalid_ranges_are_rejected() {
        let bus = Bus::new("test");
        assert!(matches!(
            bus.insert(dev(), 0x100, 0),
            Err(Error::InvalidRange { .. })
        ));
        assert!(matches!(
            bus.insert(dev(), u64::MAX, 2),
            Err(Error::InvalidRange { .. })
        ));
        bus.insert(dev(), u64::MAX - 1, 1).unwrap();
    }

    #[test]
    fn remove_frees_the_range() {
        let bus = Bus::new("test");
        bus.insert(dev(), 0x100, 0x10).unwrap();
        assert!(bus.remove(0x101).is_err());
        bus.remove(0x100).unwrap();
        assert!(!bus.write(0x100, &[0]));
        bus.insert(dev(), 0x100, 0x10).unwrap();
    }
}
