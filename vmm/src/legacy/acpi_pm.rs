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
//! sleep types are ignored: logged once, counted always ([`AcpiPm::ignored_sleeps`]), since
//! the guest can write them in a loop. Accesses of any width at any offset are taken byte
//! by byte.
//!
//! The fixed-feature power button (the FADT does not set `PWR_BUTTON`, so it exists):
//! [`PowerButton::press`] sets `PWRBTN_STS` (bit 8 of PM1a_STS), as QEMU's
//! `acpi_pm1_evt_power_down` does. The SCI (ISA IRQ 9, level, active high) is asserted
//! while any status bit is set whose enable bit is set (only `PWRBTN` exists), and
//! deasserted when the guest clears the status (write 1) or the enable bit. There is no PM
//! timer, no sleep button and no GPE block.

use std::sync::{Arc, Mutex};

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
/// PM1_STS / PM1_EN `PWRBTN`: the power button was pressed / may raise the SCI.
pub const PWRBTN: u16 = 1 << 8;
/// The `SLP_TYP` of S5 (soft off), as the DSDT's `\_S5_` package says.
pub const SLP_TYP_S5: u16 = crate::boot::acpi::S5_SLP_TYP as u16;

const CNT_OFFSET: u64 = (PM1A_CNT_BLK - PM1A_EVT_BLK) as u64;

/// A level-triggered interrupt line (the SCI).
pub trait IrqLine: Send + std::fmt::Debug {
    /// Drives the line high (`true`) or low.
    fn set_level(&self, high: bool);
}

/// The PM1a status, enable and control registers.
#[derive(Debug)]
pub struct AcpiPm {
    exit: ExitHandle,
    sci: Option<Box<dyn IrqLine>>,
    sci_level: bool,
    status: u16,
    enable: u16,
    control: u16,
    ignored_sleeps: u64,
}

impl AcpiPm {
    /// The registers, ending the VM through `exit` on an S5 request and raising `sci`.
    pub fn new(exit: ExitHandle, sci: Option<Box<dyn IrqLine>>) -> Self {
        AcpiPm {
            exit,
            sci,
            sci_level: false,
            status: 0,
            enable: 0,
            control: 0,
            ignored_sleeps: 0,
        }
    }

    /// Sleep requests other than S5 the guest made (ignored).
    pub fn ignored_sleeps(&self) -> u64 {
        self.ignored_sleeps
    }

    /// PM1a_STS as the guest reads it.
    pub fn status(&self) -> u16 {
        self.status
    }

    /// Whether the SCI is asserted.
    pub fn sci_asserted(&self) -> bool {
        self.sci_level
    }

    /// Sets `PWRBTN_STS` (the guest's button driver clears it) and updates the SCI.
    pub fn press_power_button(&mut self) {
        self.status |= PWRBTN;
        self.update_sci();
    }

    fn update_sci(&mut self) {
        let level = self.status & self.enable & PWRBTN != 0;
        if level != self.sci_level {
            self.sci_level = level;
            if let Some(l) = &self.sci {
                l.set_level(level);
            }
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
            self.ignored_sleeps += 1;
            if self.ignored_sleeps == 1 {
                tracing::warn!(
                    slp_typ,
                    "guest requested an unsupported ACPI sleep state; ignored (logged once, counted)"
                );
            }
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
        self.update_sci();
        if control {
            self.control_written();
        }
    }
}

/// The power button of one [`AcpiPm`] (for QMP `system_powerdown`).
#[derive(Debug, Clone)]
pub struct PowerButton(pub Arc<Mutex<AcpiPm>>);

impl PowerButton {
    /// Presses the button: see [`AcpiPm::press_power_button`].
    pub fn press(&self) {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .press_power_button();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pm() -> (AcpiPm, ExitHandle) {
        let exit = ExitHandle::new().unwrap();
        (AcpiPm::new(exit.clone(), None), exit)
    }

    #[derive(Debug, Clone, Default)]
    struct Line(Arc<Mutex<Vec<bool>>>);
    impl IrqLine for Line {
        fn set_level(&self, high: bool) {
            self.0.lock().unwrap().push(high);
        }
    }

    #[test]
    fn power_button_sets_pwrbtn_sts_and_raises_the_sci_while_enabled() {
        let exit = ExitHandle::new().unwrap();
        let line = Line::default();
        let mut d = AcpiPm::new(exit.clone(), Some(Box::new(line.clone())));
        // Not enabled: the status bit is set, the SCI stays low.
        d.press_power_button();
        assert_eq!(read16(&mut d, 0) & PWRBTN, PWRBTN);
        assert!(line.0.lock().unwrap().is_empty());
        // Enabling with the status pending raises it (level semantics).
        d.write(0x600, 2, &PWRBTN.to_le_bytes());
        assert_eq!(*line.0.lock().unwrap(), vec![true]);
        assert!(d.sci_asserted());
        // A second press while pending changes nothing.
        d.press_power_button();
        assert_eq!(*line.0.lock().unwrap(), vec![true]);
        // Write 1 to clear drops the line.
        d.write(0x600, 0, &PWRBTN.to_le_bytes());
        assert_eq!(read16(&mut d, 0) & PWRBTN, 0);
        assert_eq!(*line.0.lock().unwrap(), vec![true, false]);
        // Enabled: a press raises it at once; disabling drops it.
        d.press_power_button();
        d.write(0x600, 2, &0u16.to_le_bytes());
        assert_eq!(*line.0.lock().unwrap(), vec![true, false, true, false]);
        assert!(!exit.is_requested(), "the button only asks the guest");
        let b = PowerButton(Arc::new(Mutex::new(d)));
        b.press();
        assert_eq!(b.0.lock().unwrap().status() & PWRBTN, PWRBTN);
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
        assert_eq!(d.ignored_sleeps(), 5, "counted always (logged once)");
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
