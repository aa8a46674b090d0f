//! bouncevm's vhost-user back end: serves any [`devices::virtio::VirtioDevice`] (bouncevm's
//! virtio-blk and virtio-net cores, every DMA through the bounce module) to a vhost-user
//! frontend such as QEMU's `vhost-user-blk-pci` and `vhost-user-net-pci`. The crate's binary is
//! `bouncevm-vhost`; it needs no KVM and builds on any Linux architecture.
//!
//! - [`backend`]: [`VhostUserDevice`], the adapter between a device core and
//!   `vhost-user-backend` (features, configuration space, one thread per queue group, worker
//!   file descriptors, signalling);
//! - [`checks`]: what a front end's control messages must satisfy (queue sizes, eventfds,
//!   memory regions inside their files, in any order);
//! - [`inflight`]: `VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD` for block: the requests in flight
//!   recorded in a region the front end keeps, served again after a restart;
//! - [`layout`]: which queues share a thread;
//! - [`relay`]: passes the control messages between the frontend and `vhost-user-backend`,
//!   accepting QEMU 7.2's `SET_VRING_ENABLE` before `SET_FEATURES`;
//! - [`report`]: a broken worker reported to the frontend (vring error fds, DEVICE_NEEDS_RESET);
//! - [`server`]: the listening socket, one connection after another, signals, statistics;
//! - [`slots`]: regions added one by one (`CONFIGURE_MEM_SLOTS`), copies counted as references;
//! - [`vring`]: the vring type: a kick consumed and a call signalled without a lock, the queue
//!   and the adapter's per-thread state behind one lock.

#![warn(missing_docs)]

pub mod backend;
pub mod checks;
pub mod inflight;
pub mod layout;
#[cfg(test)]
mod lock_count;
pub mod relay;
pub mod report;
pub mod server;
pub mod slots;
pub mod vring;

pub use backend::{Memory, VhostUserDevice};
pub use bouncevm_common::SignalFd;
pub use layout::QueueLayout;
pub use server::{PrintHandle, PrintPeers, Server, ServerError, StopHandle};
