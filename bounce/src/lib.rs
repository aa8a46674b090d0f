//! bounce
