//! A net device over in-memory backends, as `bouncevm-vhost net` configures it, and the
//! frames its tap would hand over.
#![allow(dead_code)]

use bounce::Dma;
use devices::net::{MemBackend, Net, NetBackend, NetConfig};

/// A net device over in-memory backends, configured as `bouncevm-vhost net` configures it
/// (the frontend steers the queue pairs).
pub fn net_device(pairs: u16) -> (Net, Vec<MemBackend>) {
    let bes: Vec<MemBackend> = (0..pairs).map(|_| MemBackend::new().unwrap()).collect();
    let boxed = bes
        .iter()
        .map(|b| Box::new(b.clone()) as Box<dyn NetBackend>)
        .collect();
    let cfg = NetConfig {
        queue_pairs: pairs,
        frontend_steering: true,
        ..NetConfig::default()
    };
    (Net::new(cfg, boxed, Dma::direct()).unwrap(), bes)
}

/// A frame as the tap hands it over: a zeroed vnet header, then `len` bytes from `seed`.
pub fn net_frame(len: usize, seed: u8) -> Vec<u8> {
    let mut f = vec![0u8; 12];
    f.extend((0..len).map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed)));
    f
}
