//! Legacy PC devices on the PIO bus: a 16550 UART, the i8042 reset line and a debug-exit port.

mod debug_exit;
mod i8042;
mod serial;

pub use debug_exit::DebugExit;
pub use i8042::I8042;
pub use serial::{IrqTrigger, SerialConsole};
