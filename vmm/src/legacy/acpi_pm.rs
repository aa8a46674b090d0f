//! The ACPI PM1a fixed-hardware registers the FADT of [`crate::boot::acpi`] points at.
//!
//! One 6-port range at [`PM1A_EVT_BLK`] (0x600):
//!
//! ```text
//! +0  PM1a_STS  (16 bits, write 1 to clear)
//! +2  PM1a_EN   (16 bits, read/write)
//! +4  PM1a_CNT  (16 bits) = PM1A_CNT_BLK: SCI_EN (bit 0) always reads 1, SLP_TYP (bits
//!     10-12), SLP_EN (bit 13, write-only)
//! ```
//!
//! A write that leaves `SLP_EN` set with `SLP_TYP` = 5 (the DSDT's `\_S5_`) ends the VM with
//! [`ExitReason::PowerOff`] (status 0; the VMM then flushes the disks as on any exit). Other
//! sleep types are logged and ignored. Accesses of any width at any offset are taken byte
//! by byte. Nothing raises the SCI: there are no fixed buttons, no PM timer and no GPEs.

use crate::bus::BusDevice;
use crate::exit::{ExitHandle, ExitReason};
use crate::layout::{PM1A_CNT_BLK, PM1A_EVT_BLK};

/// Number of ports the device decodes from [`PM1A_EVT_BLK`].
pub const ACPI_PM_PORTS: u16 = 6;
/// PM1_CNT `SCI_EN`: the system is in ACPI mode.
pub const SCI_EN: u16 = 1 << 0;
/// PM1_CNT `SLP_EN`: enter the sleep state in `SLP_TYP`.
pub const SLP_EN: u16 = 1 << 13;
/// PM1_CNT `SLP_TYP` shift (3 bits).
pub const SLP_TYP_SHIFT: u16 = 10;
/// The `SLP_TYP` of S5 (soft off), as the DSDT's `\_S5_` package says.
pub const SLP_TYP_S5: u16 = crate::boot::acpi::S5_SLP_TYP as u16;

const CNT_OFFSET: u64 = (PM1A_CNT_BLK - PM1A_EVT_BLK) as u64;

/// The PM1a status, enable and control registers.
#[derive(Debug)]
pub struct AcpiPm {
    exit: ExitHandle,
    status: u16,
    enable: u16,
    control: u16,
}

impl AcpiPm {
    /// The registers, ending the VM through `exit` on an S5 request.
    pub fn new(exit: ExitHandle) -> Self {
        AcpiPm {
            exit,
            status: 0,
            enable: 0,
            control: 0,
        }
    }

    fn read_byte(&self, off: u64) -> u8 {
        let (reg, shift) = match off {
            0 | 1 => (self.status, off * 8),
            2 | 3 => (self.enable, (off - 2) * 8),
            4 | 5 => ((self.control & !SLP_EN) | SCI_EN, (off - 4) * 8),
            _ => return 0xff,
        };
        (reg >> shift) as u8
    }

    fn write_byte(&mut self, off: u64, v: u8) {
        let set = |reg: &mut u16, shift: u64| {
            *reg = (*reg & !(0xff << shift)) | (u16::from(v) << shift);
        };
        match off {
            // Write 1 to clear.
            0 | 1 => self.status &= !(u16::from(v) << (off * 8)),
            2 | 3 => set(&mut self.enable, (off - 2) * 8),
            4 | 5 => set(&mut self.control, (off - 4) * 8),
            _ => {}
        }
    }

    fn control_written(&mut self) {
        if self.control & SLP_EN == 0 {
            return;
        }
        let slp_typ = (self.control >> SLP_TYP_SHIFT) & 7;
        // SLP_EN is write-only: it triggers once.
        self.control &= !SLP_EN;
        if slp_typ == SLP_TYP_S5 {
            tracing::info!("guest entered ACPI S5: powering off");
            self.exit.request(ExitReason::PowerOff);
        } else {
            tracing::warn!(
                slp_typ,
                "guest requested an unsupported ACPI sleep state; ignored"
            );
        }
    }
}

impl BusDevice for AcpiPm {
    fn read(&mut self, _base: u64, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            *b = offset
                .checked_add(i as u64)
                .map_or(0xff, |o| self.read_byte(o));
        }
    }

    fn write(&mut self, _base: u64, offset: u64, data: &[u8]) {
        let mut control = false;
        for (i, &v) in data.iter().enumerate() {
            let Some(o) = offset.checked_add(i as u64) else {
                break;
            };
            self.write_byte(o, v);
            control |= o == CNT_OFFSET || o == CNT_OFFSET + 1;
        }
        if control {
            self.control_written();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pm() -> (AcpiPm, ExitHandle) {
        let exit = ExitHandle::new().unwrap();
        (AcpiPm::new(exit.clone()), exit)
    }

    fn read16(d: &mut AcpiPm, off: u64) -> u16 {
        let mut b = [0u8; 2];
        d.read(0x600, off, &mut b);
        u16::from_le_bytes(b)
    }

    #[test]
    fn control_reads_with_sci_en() {
        let (mut d, _) = pm();
        assert_eq!(read16(&mut d, 4), SCI_EN);
        d.write(0x600, 4, &0x0400u16.to_le_bytes());
        assert_eq!(read16(&mut d, 4), 0x0400 | SCI_EN);
    }

    #[test]
    fn status_is_write_one_to_clear_and_enable_is_plain() {
        let (mut d, _) = pm();
        d.status = 0x8101;
        d.write(0x600, 0, &0x0100u16.to_le_bytes());
        assert_eq!(read16(&mut d, 0), 0x8001);
        d.write(0x600, 0, &[0xff]);
        assert_eq!(read16(&mut d, 0), 0x8000);
        d.write(0x600, 2, &0x0120u16.to_le_bytes());
        assert_eq!(read16(&mut d, 2), 0x0120);
        // A 32-bit read of the event block returns status then enable.
        let mut b = [0u8; 4];
        d.read(0x600, 0, &mut b);
        assert_eq!(u32::from_le_bytes(b), 0x0120_8000);
        let mut b = [0u8; 2];
        d.read(0x600, 6, &mut b);
        assert_eq!(b, [0xff, 0xff]);
    }

    #[test]
    fn s5_with_slp_en_powers_off() {
        let (mut d, exit) = pm();
        // ACPICA first writes SLP_TYP without SLP_EN, then with it.
        d.write(0x600, 4, &(SLP_TYP_S5 << SLP_TYP_SHIFT).to_le_bytes());
        assert!(!exit.is_requested());
        d.write(
            0x600,
            4,
            &((SLP_TYP_S5 << SLP_TYP_SHIFT) | SLP_EN).to_le_bytes(),
        );
        assert_eq!(exit.reason(), Some(ExitReason::PowerOff));
        assert_eq!(ExitReason::PowerOff.exit_code(), 0);
    }

    #[test]
    fn other_sleep_types_are_ignored() {
        let (mut d, exit) = pm();
        for typ in [0u16, 1, 3, 4, 7] {
            d.write(0x600, 4, &((typ << SLP_TYP_SHIFT) | SLP_EN).to_le_bytes());
        }
        assert!(!exit.is_requested());
        // SLP_EN reads back as 0.
        assert_eq!(read16(&mut d, 4) & SLP_EN, 0);
        // A byte write of the high half also counts.
        d.write(
            0x600,
            5,
            &[((SLP_TYP_S5 << SLP_TYP_SHIFT | SLP_EN) >> 8) as u8],
        );
        assert_eq!(exit.reason(), Some(ExitReason::PowerOff));
    }
}
