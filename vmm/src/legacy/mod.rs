//! Legacy PC devices on the PIO bus: a 16550 UART, the i8042 reset line, a debug-exit port and
//! the ACPI PM1a registers (S5 power-off).

mod acpi_pm;
mod debug_exit;
mod i8042;
mod serial;

pub use acpi_pm::{AcpiPm, IrqLine, PowerButton, ACPI_PM_PORTS, PWRBTN};
pub use debug_exit::DebugExit;
pub use i8042::I8042;
pub use serial::{IrqTrigger, SerialConsole};
