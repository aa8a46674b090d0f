//! A 16550A UART ([`vm_superio::Serial`]) on the PIO bus, writing guest output to any
//! [`Write`], with its interrupt line delivered through an irqfd.

use std::io::Write;

use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;

/// Raises an interrupt line by writing to an eventfd registered as a KVM irqfd.
#[derive(Debug)]
pub struct IrqTrigger(EventFd);

impl IrqTrigger {
    /// Wraps `evt`, which the caller registers with [`crate::vm::Vm::register_irqfd`].
    pub fn new(evt: EventFd) -> Self {
        IrqTrigger(evt)
    }

    /// The eventfd.
    pub fn eventfd(&self) -> &EventFd {
        &self.0
    }
}

impl Trigger for IrqTrigger {
    type E = std::io::Error;

    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// A 16550 serial port whose transmitted bytes go to `W`.
pub struct SerialConsole<W: Write + Send> {
    uart: Serial<IrqTrigger, vm_superio::serial::NoEvents, W>,
}

impl<W: Write + Send> std::fmt::Debug for SerialConsole<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SerialConsole").finish_non_exhaustive()
    }
}

impl<W: Write + Send> SerialConsole<W> {
    /// A UART signalling `irq` and writing to `out`.
    pub fn new(irq: IrqTrigger, out: W) -> Self {
        SerialConsole {
            uart: Serial::new(irq, out),
        }
    }

    /// Queues host input for the guest to read (raises the receive interrupt if enabled).
    ///
    /// # Errors
    /// The FIFO is full or the interrupt could not be raised.
    pub fn enqueue_input(
        &mut self,
        input: &[u8],
    ) -> Result<usize, vm_superio::serial::Error<std::io::Error>> {
        self.uart.enqueue_raw_bytes(input)
    }

    /// The output sink.
    pub fn writer(&self) -> &W {
        self.uart.writer()
    }
}

impl<W: Write + Send> BusDevice for SerialConsole<W> {
    fn read(&mut self, _base: u64, offset: u64, data: &mut [u8]) {
        // The UART has byte-wide registers 0..8; wider or out-of-range reads get all ones
        // beyond the first byte.
        data.fill(0xff);
        if let (Ok(off), Some(first)) = (u8::try_from(offset), data.first_mut()) {
            if off < 8 {
                *first = self.uart.read(off);
            }
        }
    }

    fn write(&mut self, _base: u64, offset: u64, data: &[u8]) {
        let (Ok(off), Some(&value)) = (u8::try_from(offset), data.first()) else {
            return;
        };
        if off >= 8 {
            return;
        }
        if let Err(e) = self.uart.write(off, value) {
            tracing::warn!(error = %e, "serial write failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transmit_reaches_the_sink() {
        let evt = EventFd::new(0).unwrap();
        let mut s = SerialConsole::new(IrqTrigger::new(evt), Vec::new());
        for b in b"hi" {
            s.write(0x3f8, 0, &[*b]);
        }
        // Out-of-range and empty accesses are ignored.
        s.write(0x3f8, 9, b"x");
        s.write(0x3f8, 0, &[]);
        assert_eq!(s.writer(), b"hi");
        // LSR (offset 5): transmitter empty bits set.
        let mut lsr = [0u8; 1];
        s.read(0x3f8, 5, &mut lsr);
        assert_eq!(lsr[0] & 0x60, 0x60);
    }

    #[test]
    fn thr_empty_interrupt_signals_the_irqfd() {
        let evt = EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
        let mut s = SerialConsole::new(IrqTrigger::new(evt.try_clone().unwrap()), Vec::new());
        // IER: enable THR-empty interrupt; the UART raises it at once.
        s.write(0x3f8, 1, &[0x02]);
        assert_eq!(evt.read().unwrap(), 1);
    }
}
