//! Type-0 PCI configuration space with write masks, BARs and a capability list.

use super::{Error, Result, NUM_BARS, NUM_CONFIG_REGISTERS};

const COMMAND_REG: usize = 1;
/// Writable command bits: I/O space, memory space, bus master, parity error response,
/// SERR# enable, INTx disable.
const COMMAND_WRITABLE: u32 = 0x0000_0547;
const STATUS_CAP_LIST: u32 = 1 << (16 + 4);
const BAR0_REG: usize = 4;
const CAP_PTR_REG: usize = 13;
const INTERRUPT_REG: usize = 15;
const FIRST_CAP_OFFSET: usize = 0x40;
const LEGACY_CONFIG_END: usize = 0x100;

const BAR_MEM64: u32 = 0b100;
const BAR_PREFETCH: u32 = 0b1000;

/// Identity of a function, written into its header.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PciHeader {
    /// Vendor id.
    pub vendor_id: u16,
    /// Device id.
    pub device_id: u16,
    /// Revision id.
    pub revision: u8,
    /// Class code (base class).
    pub class: u8,
    /// Subclass.
    pub subclass: u8,
    /// Programming interface.
    pub prog_if: u8,
    /// Subsystem vendor id.
    pub subsystem_vendor_id: u16,
    /// Subsystem id.
    pub subsystem_id: u16,
    /// Interrupt pin (0 none, 1 INTA#..4 INTD#).
    pub interrupt_pin: u8,
}

/// The kind of a memory BAR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarKind {
    /// 32-bit memory BAR.
    Memory32,
    /// 64-bit memory BAR (uses two BAR registers).
    Memory64,
}

/// A memory BAR: index, current guest address, size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciBar {
    /// BAR index (0..6; for a 64-bit BAR, the lower register).
    pub index: usize,
    /// Guest physical address.
    pub addr: u64,
    /// Size in bytes (power of two).
    pub size: u64,
    /// 32- or 64-bit.
    pub kind: BarKind,
    /// Prefetchable bit.
    pub prefetchable: bool,
}

/// A BAR the guest moved from `old` to `new`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BarReprogram {
    /// BAR index.
    pub index: usize,
    /// Address before the write.
    pub old: u64,
    /// Address after the write.
    pub new: u64,
    /// BAR size.
    pub size: u64,
}

/// A function's configuration space.
///
/// Invariants: `regs[r] & !writable[r]` never changes after construction except through the
/// builder methods; `bars[i]` is `Some` for the lower register of each BAR, and `decoded[i]`
/// holds the address the BAR is mapped at on the bus (moved only by a non-sizing write).
#[derive(Debug, Clone)]
pub struct PciConfiguration {
    regs: Box<[u32; NUM_CONFIG_REGISTERS]>,
    writable: Box<[u32; NUM_CONFIG_REGISTERS]>,
    bars: [Option<PciBar>; NUM_BARS],
    bar_upper_used: [bool; NUM_BARS],
    /// Byte offset of the last capability added (0 if none).
    last_cap: usize,
    /// First free byte offset for the next capability.
    next_cap: usize,
}

impl PciConfiguration {
    /// A type-0 header for `h` with no BARs and no capabilities.
    pub fn new(h: &PciHeader) -> Self {
        let mut regs = Box::new([0u32; NUM_CONFIG_REGISTERS]);
        let mut writable = Box::new([0u32; NUM_CONFIG_REGISTERS]);
        regs[0] = u32::from(h.device_id) << 16 | u32::from(h.vendor_id);
        regs[2] = u32::from(h.class) << 24
            | u32::from(h.subclass) << 16
            | u32::from(h.prog_if) << 8
            | u32::from(h.revision);
        regs[11] = u32::from(h.subsystem_id) << 16 | u32::from(h.subsystem_vendor_id);
        regs[INTERRUPT_REG] = u32::from(h.interrupt_pin) << 8;
        writable[COMMAND_REG] = COMMAND_WRITABLE;
        // Cache line size and latency timer are plain read/write registers.
        writable[3] = 0x0000_ffff;
        // Interrupt line.
        writable[INTERRUPT_REG] = 0x0000_00ff;
        PciConfiguration {
            regs,
            writable,
            bars: [None; NUM_BARS],
            bar_upper_used: [false; NUM_BARS],
            last_cap: 0,
            next_cap: FIRST_CAP_OFFSET,
        }
    }

    /// Adds memory BAR `index` at `addr` of `size` bytes.
    ///
    /// # Errors
    /// [`Error::InvalidBarIndex`], [`Error::BarInUse`], [`Error::InvalidBarSize`],
    /// [`Error::InvalidBarAddress`].
    pub fn add_bar(&mut self, bar: PciBar) -> Result<()> {
        let i = bar.index;
        let regs_needed = match bar.kind {
            BarKind::Memory32 => 1,
            BarKind::Memory64 => 2,
        };
        if i.checked_add(regs_needed).is_none_or(|end| end > NUM_BARS) {
            return Err(Error::InvalidBarIndex(i));
        }
        for j in i..i + regs_needed {
            if self.bars[j].is_some() || self.bar_upper_used[j] {
                return Err(Error::BarInUse(j));
            }
        }
        if !bar.size.is_power_of_two() || bar.size < 0x1000 {
            return Err(Error::InvalidBarSize(bar.size));
        }
        let aligned = bar.addr & (bar.size - 1) == 0;
        let fits = bar.kind == BarKind::Memory64
            || bar.addr.checked_add(bar.size).is_some_and(|e| e <= 1 << 32);
        if !aligned || !fits {
            return Err(Error::InvalidBarAddress {
                addr: bar.addr,
                size: bar.size,
            });
        }
        let mut flags = 0;
        if bar.kind == BarKind::Memory64 {
            flags |= BAR_MEM64;
        }
        if bar.prefetchable {
            flags |= BAR_PREFETCH;
        }
        let mask = !(bar.size - 1);
        self.regs[BAR0_REG + i] = (bar.addr as u32) | flags;
        self.writable[BAR0_REG + i] = mask as u32;
        if bar.kind == BarKind::Memory64 {
            self.regs[BAR0_REG + i + 1] = (bar.addr >> 32) as u32;
            self.writable[BAR0_REG + i + 1] = (mask >> 32) as u32;
            self.bar_upper_used[i + 1] = true;
        }
        self.bars[i] = Some(bar);
        Ok(())
    }

    /// The BARs with the addresses they are currently decoded at.
    pub fn bars(&self) -> Vec<PciBar> {
        self.bars.iter().flatten().copied().collect()
    }

    fn programmed_address(&self, bar: &PciBar) -> u64 {
        let lo = u64::from(self.regs[BAR0_REG + bar.index] & !0xf);
        match bar.kind {
            BarKind::Memory32 => lo,
            BarKind::Memory64 => lo | u64::from(self.regs[BAR0_REG + bar.index + 1]) << 32,
        }
    }

    /// Appends a capability with id `id` and `body` (the bytes after the id and next
    /// pointer). Returns its byte offset in configuration space. The body is read-only to the
    /// guest unless the device opens bits with [`PciConfiguration::set_writable_mask`] or
    /// intercepts the writes itself.
    ///
    /// # Errors
    /// [`Error::CapabilityTooBig`] when it does not fit below 0x100.
    pub fn add_capability(&mut self, id: u8, body: &[u8]) -> Result<usize> {
        let len = body.len() + 2;
        let offset = self.next_cap;
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= LEGACY_CONFIG_END)
            .ok_or(Error::CapabilityTooBig { len })?;
        self.write_bytes(offset, &[id, 0]);
        self.write_bytes(offset + 2, body);
        if self.last_cap == 0 {
            self.regs[CAP_PTR_REG] = offset as u32;
            self.regs[COMMAND_REG] |= STATUS_CAP_LIST;
        } else {
            self.write_bytes(self.last_cap + 1, &[offset as u8]);
        }
        self.last_cap = offset;
        // Capabilities are dword aligned.
        self.next_cap = (end + 3) & !3;
        Ok(offset)
    }

    fn write_bytes(&mut self, offset: usize, bytes: &[u8]) {
        for (i, b) in bytes.iter().enumerate() {
            let at = offset + i;
            let Some(reg) = self.regs.get_mut(at / 4) else {
                return;
            };
            let shift = (at % 4) * 8;
            *reg = (*reg & !(0xff << shift)) | u32::from(*b) << shift;
        }
    }

    /// Sets which bits of register `reg` the guest may write (ignored if out of range).
    pub fn set_writable_mask(&mut self, reg: usize, mask: u32) {
        if let Some(w) = self.writable.get_mut(reg) {
            *w = mask;
        }
    }

    /// Reads register `reg`; out-of-range registers read as all ones.
    pub fn read_reg(&self, reg: usize) -> u32 {
        self.regs.get(reg).copied().unwrap_or(0xffff_ffff)
    }

    /// Applies a guest write of `data` at byte `offset` of register `reg`, honouring the
    /// write mask. Returns the BAR move it causes, if any.
    ///
    /// A write of all ones to a BAR register is BAR sizing: the register then reads back the
    /// size mask, but the BAR stays decoded at its old address (so a guest that sizes and
    /// restores a BAR never moves it). Any other write that changes the BAR's address is
    /// reported, so the caller moves the MMIO range.
    pub fn write_reg(&mut self, reg: usize, offset: u64, data: &[u8]) -> Option<BarReprogram> {
        let offset = usize::try_from(offset).ok()?;
        if reg >= NUM_CONFIG_REGISTERS
            || data.is_empty()
            || offset.checked_add(data.len()).is_none_or(|end| end > 4)
        {
            tracing::debug!(
                reg,
                offset,
                len = data.len(),
                "ignored malformed config write"
            );
            return None;
        }
        let mut value = [0u8; 4];
        value[offset..offset + data.len()].copy_from_slice(data);
        let value = u32::from_le_bytes(value);
        let lanes = if data.len() == 4 {
            u32::MAX
        } else {
            ((1u32 << (data.len() * 8)) - 1) << (offset * 8)
        };
        let mask = self.writable[reg] & lanes;
        self.regs[reg] = (self.regs[reg] & !mask) | (value & mask);

        if !(BAR0_REG..BAR0_REG + NUM_BARS).contains(&reg) {
            return None;
        }
        let idx = reg - BAR0_REG;
        // Find the BAR this register belongs to (its lower half or, for 64-bit, upper half).
        let lower = if self.bars[idx].is_some() {
            idx
        } else if idx > 0 && self.bar_upper_used[idx] {
            idx - 1
        } else {
            return None;
        };
        let sizing = value & lanes == lanes;
        let bar = self.bars[lower]?;
        let new = self.programmed_address(&bar);
        if sizing || new == bar.addr {
            return None;
        }
        if let Some(b) = self.bars[lower].as_mut() {
            b.addr = new;
        }
        Some(BarReprogram {
            index: lower,
            old: bar.addr,
            new,
            size: bar.size,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> PciConfiguration {
        PciConfiguration::new(&PciHeader {
            vendor_id: 0x1af4,
            device_id: 0x1042,
            class: 0x01,
            subclass: 0x80,
            revision: 1,
            ..Default::default()
        })
    }

    #[test]
    fn header_ids() {
        let c = cfg();
        assert_eq!(c.read_reg(0), 0x1042_1af4);
        assert_eq!(c.read_reg(2), 0x0180_0001);
        assert_eq!(c.read_reg(5000), 0xffff_ffff);
    }

    #[test]
    fn read_only_fields_stay() {
        let mut c = cfg();
        c.write_reg(0, 0, &[0, 0, 0, 0]);
        assert_eq!(c.read_reg(0), 0x1042_1af4);
        c.write_reg(1, 0, &[0xff, 0xff]);
        assert_eq!(c.read_reg(1) & 0xffff, COMMAND_WRITABLE);
    }

    #[test]
    fn bar_sizing_and_move() {
        let mut c = cfg();
        c.add_bar(PciBar {
            index: 0,
            addr: 0xc000_0000,
            size: 0x4000,
            kind: BarKind::Memory32,
            prefetchable: false,
        })
        .unwrap();
        assert_eq!(c.write_reg(4, 0, &[0xff; 4]), None);
        assert_eq!(c.read_reg(4), 0xffff_c000);
        // Restoring the old value is not a move.
        assert_eq!(c.write_reg(4, 0, &0xc000_0000u32.to_le_bytes()), None);
        let m = c.write_reg(4, 0, &0xc001_0000u32.to_le_bytes());
        assert_eq!(
            m,
            Some(BarReprogram {
                index: 0,
                old: 0xc000_0000,
                new: 0xc001_0000,
                size: 0x4000
            })
        );
        assert_eq!(c.bars()[0].addr, 0xc001_0000);
    }

    #[test]
    fn bar64_upper_half() {
        let mut c = cfg();
        c.add_bar(PciBar {
            index: 2,
            addr: 0x1_0000_0000,
            size: 0x1_0000,
            kind: BarKind::Memory64,
            prefetchable: true,
        })
        .unwrap();
        assert_eq!(c.read_reg(6), 0b1100);
        assert_eq!(c.read_reg(7), 1);
        c.write_reg(7, 0, &[0xff; 4]);
        assert_eq!(c.read_reg(7), 0xffff_ffff);
        c.write_reg(7, 0, &1u32.to_le_bytes());
        let m = c.write_reg(7, 0, &2u32.to_le_bytes()).unwrap();
        assert_eq!((m.index, m.new), (2, 0x2_0000_0000));
        assert!(matches!(
            c.add_bar(PciBar {
                index: 3,
                addr: 0,
                size: 0x1000,
                kind: BarKind::Memory32,
                prefetchable: false
            }),
            Err(Error::BarInUse(3))
        ));
    }

    #[test]
    fn bad_bars_rejected() {
        let mut c = cfg();
        let bar = |index, addr, size, kind| PciBar {
            index,
            addr,
            size,
            kind,
            prefetchable: false,
        };
        assert!(c.add_bar(bar(6, 0, 0x1000, BarKind::Memory32)).is_err());
        assert!(c
            .add_bar(bar(usize::MAX, 0, 0x1000, BarKind::Memory64))
            .is_err());
        assert!(c.add_bar(bar(5, 0, 0x1000, BarKind::Memory64)).is_err());
        assert!(c.add_bar(bar(0, 0, 0x1800, BarKind::Memory32)).is_err());
        assert!(c.add_bar(bar(0, 0x800, 0x1000, BarKind::Memory32)).is_err());
        assert!(c
            .add_bar(bar(0, 0xffff_f000, 0x2000, BarKind::Memory32))
            .is_err());
    }

    #[test]
    fn capability_list() {
        let mut c = cfg();
        let a = c.add_capability(0x09, &[1, 2, 3]).unwrap();
        let b = c.add_capability(0x11, &[0; 10]).unwrap();
        assert_eq!(a, 0x40);
        assert_eq!(b, 0x48);
        assert_eq!(c.read_reg(13) & 0xff, 0x40);
        assert_ne!(c.read_reg(1) & STATUS_CAP_LIST, 0);
        assert_eq!(c.read_reg(0x40 / 4), 0x0201_4809);
        assert_eq!(c.read_reg(0x48 / 4) & 0xffff, 0x0011);
        assert!(c.add_capability(0x09, &[0; 200]).is_err());
    }

    #[test]
    fn malformed_writes_are_ignored() {
        let mut c = cfg();
        assert_eq!(c.write_reg(1, 3, &[1, 2]), None);
        assert_eq!(c.write_reg(1, u64::MAX, &[1]), None);
        assert_eq!(c.write_reg(NUM_CONFIG_REGISTERS, 0, &[1]), None);
        assert_eq!(c.write_reg(1, 0, &[]), None);
    }
}
