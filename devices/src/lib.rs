//! virtio device cores for bouncevm: virtio-blk and virtio-net.
//!
//! A device here knows nothing of its transport. The KVM VMM drives it through virtio-pci and
//! the vhost-user server through the vhost-user protocol; both talk to it through the small
//! traits of [`virtio`]: feature negotiation and configuration space ([`virtio::VirtioDevice`]),
//! and per-queue workers that turn descriptor chains into I/O ([`virtio::QueueWorker`]).
//!
//! A device never reads or writes guest memory for its data buffers itself: every buffer goes
//! through a [`bounce::Dma`] handle, direct or bounced.
//!
//! What both transports' binaries share to build a device is here too: [`options`] (the
//! bounce option string and the pool it builds, MAC addresses, the virtio-blk queue limit)
//! and [`builder`] (image opening with format probing, the bounce pool, the tap and the device
//! core, built the same way whichever transport serves them).

#![warn(missing_docs)]

pub mod block;
pub mod builder;
pub mod metrics;
pub mod net;
pub mod options;
pub mod pools;
#[cfg(any(test, feature = "test-utils"))]
pub mod testing;
pub mod virtio;
