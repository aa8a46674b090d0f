//! The i8042 keyboard controller, reduced to its CPU reset line.
//!
//! Writing 0xFE to the command port (0x64) pulses the reset line; like QEMU with
//! `-no-reboot`, this ends the VM with [`ExitReason::Reset`] (status 0). Linux's default
//! `reboot=k` path uses exactly this. Everything else reads as 0 (no data, controller ready)
//! and is ignored. The FADT declares no 8042 (see [`crate::boot::acpi`]), so Linux's i8042
//! driver does not probe it (a probe would poll the status port 10,000 times in vain).

use vm_superio::{I8042Device, Trigger};

use crate::bus::BusDevice;
use crate::exit::{ExitHandle, ExitReason};
use crate::layout::I8042_DATA_PORT;

/// Requests [`ExitReason::Reset`] when triggered.
#[derive(Debug)]
struct ResetLine(ExitHandle);

impl Trigger for ResetLine {
    type E = std::convert::Infallible;

    fn trigger(&self) -> Result<(), Self::E> {
        self.0.request(ExitReason::Reset);
        Ok(())
    }
}

/// The i8042 device. Register it at both 0x60 and 0x64 (one port each); the port number is
/// recovered from the bus base.
pub struct I8042 {
    dev: I8042Device<ResetLine>,
}

// Hand-written Debug for a device without Debug; alike in shape only.
impl std::fmt::Debug for I8042 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("I8042").finish_non_exhaustive()
    }
}

impl I8042 {
    /// An i8042 whose reset ends the VM through `exit`.
    pub fn new(exit: ExitHandle) -> Self {
        I8042 {
            dev: I8042Device::new(ResetLine(exit)),
        }
    }

    fn register(base: u64, offset: u64) -> Option<u8> {
        let port = base.checked_add(offset)?;
        u8::try_from(port.checked_sub(u64::from(I8042_DATA_PORT))?).ok()
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, base: u64, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let (Some(reg), Some(first)) = (Self::register(base, offset), data.first_mut()) {
            *first = self.dev.read(reg);
        }
    }

    fn write(&mut self, base: u64, offset: u64, data: &[u8]) {
        if let (Some(reg), Some(&value)) = (Self::register(base, offset), data.first()) {
            // The trigger is infallible.
            let _ = self.dev.write(reg, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_command_requests_reset() {
        let exit = ExitHandle::new().unwrap();
        let mut d = I8042::new(exit.clone());
        d.write(0x60, 0, &[0xfe]);
        d.write(0x64, 0, &[0xaa]);
        assert!(!exit.is_requested());
        d.write(0x64, 0, &[0xfe]);
        assert_eq!(exit.reason(), Some(ExitReason::Reset));
    }
}
