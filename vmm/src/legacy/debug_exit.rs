//! A debug-exit port like QEMU's `isa-debug-exit`: a write of `v` ends the VM with
//! [`ExitReason::DebugExit`], whose exit status is `(v << 1) | 1`.

use crate::bus::BusDevice;
use crate::exit::{ExitHandle, ExitReason};

/// The debug-exit device (register it with length 1..=4).
#[derive(Debug)]
pub struct DebugExit {
    exit: ExitHandle,
}

impl DebugExit {
    /// A debug-exit port ending the VM through `exit`.
    pub fn new(exit: ExitHandle) -> Self {
        DebugExit { exit }
    }
}

impl BusDevice for DebugExit {
    fn read(&mut self, _base: u64, _offset: u64, data: &mut [u8]) {
        data.fill(0xff);
    }

    fn write(&mut self, _base: u64, _offset: u64, data: &[u8]) {
        let mut value = [0u8; 4];
        let n = data.len().min(4);
        value[..n].copy_from_slice(&data[..n]);
        self.exit.request(ExitReason::DebugExit {
            value: u32::from_le_bytes(value),
        });
    }
}
