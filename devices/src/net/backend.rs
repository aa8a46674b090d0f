//! What a queue pair talks to: a tap, or an in-memory backend for tests and benchmarks.
//!
//! Frames cross this boundary with their 12-byte vnet header in front, exactly as a tap with
//! `IFF_VNET_HDR` and TUNSETVNETHDRSZ 12 reads and writes them.

use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};

use vm_memory::VolatileSlice;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::tap::{offload_flags, Tap};

/// `head` followed by the bytes of `body`, in one buffer.
pub(crate) fn gather_frame(head: &[u8], body: &[VolatileSlice<'_>]) -> Vec<u8> {
    let len = head.len() + body.iter().map(|s| s.len()).sum::<usize>();
    let mut frame = Vec::with_capacity(len);
    frame.extend_from_slice(head);
    for s in body {
        let at = frame.len();
        frame.resize(at + s.len(), 0);
        s.copy_to(&mut frame[at..]);
    }
    frame
}

/// One queue pair's network backend.
pub trait NetBackend: Send + fmt::Debug {
    /// Sends one frame (vnet header first).
    ///
    /// # Errors
    /// The backend's I/O error; the frame is then dropped and counted by the caller.
    fn send(&mut self, frame: &[u8]) -> io::Result<()>;

    /// Sends one frame given as its vnet header `head` and the pieces of the rest, in order:
    /// a TX frame straight from where the device sees it (guest memory or the bounce pool),
    /// with no copy into a host buffer first. By default the pieces are gathered into one
    /// buffer for [`NetBackend::send`]; a tap writes them with one `writev`.
    ///
    /// # Errors
    /// As [`NetBackend::send`].
    fn send_slices(&mut self, head: &[u8], body: &[VolatileSlice<'_>]) -> io::Result<()> {
        self.send(&gather_frame(head, body))
    }

    /// Receives one frame (vnet header first) into `buf`, returning its length;
    /// `WouldBlock` when there is none.
    ///
    /// # Errors
    /// `WouldBlock`, or the backend's I/O error.
    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize>;

    /// A file descriptor that becomes readable when frames arrive, if the backend has one.
    fn rx_fd(&self) -> Option<RawFd>;

    /// Applies the features the guest acked (receive offloads). Called on activation.
    ///
    /// # Errors
    /// The backend's refusal.
    fn configure(&mut self, acked: u64) -> io::Result<()>;

    /// Enables or disables this queue pair's receive steering (multiqueue
    /// `VQ_PAIRS_SET`).
    ///
    /// # Errors
    /// The backend's refusal.
    fn set_enabled(&mut self, enabled: bool) -> io::Result<()> {
        let _ = enabled;
        Ok(())
    }
}

impl NetBackend for Tap {
    fn send(&mut self, frame: &[u8]) -> io::Result<()> {
        self.write_frame(frame)
    }

    fn send_slices(&mut self, head: &[u8], body: &[VolatileSlice<'_>]) -> io::Result<()> {
        self.write_frame_slices(head, body)
    }

    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_frame(buf)
    }

    fn rx_fd(&self) -> Option<RawFd> {
        Some(self.as_raw_fd())
    }

    fn configure(&mut self, acked: u64) -> io::Result<()> {
        self.set_offload(offload_flags(acked))
            .map_err(|e| io::Error::other(e.to_string()))
    }

    fn set_enabled(&mut self, enabled: bool) -> io::Result<()> {
        self.set_queue_enabled(enabled)
            .map_err(|e| io::Error::other(e.to_string()))
    }
}

/// A backend that discards what is sent and never receives: measures the device alone.
#[derive(Debug, Default)]
pub struct NullBackend {
    /// Frames sent.
    pub frames: u64,
    /// Bytes sent, headers included.
    pub bytes: u64,
}

impl NetBackend for NullBackend {
    fn send(&mut self, frame: &[u8]) -> io::Result<()> {
        self.frames += 1;
        self.bytes += frame.len() as u64;
        Ok(())
    }

    /// Counts the frame without gathering it: like a tap's `writev`, nothing is copied on
    /// the device's side, so a benchmark on this backend measures the device alone.
    fn send_slices(&mut self, head: &[u8], body: &[VolatileSlice<'_>]) -> io::Result<()> {
        self.frames += 1;
        self.bytes += (head.len() + body.iter().map(VolatileSlice::len).sum::<usize>()) as u64;
        Ok(())
    }

    fn recv(&mut self, _buf: &mut [u8]) -> io::Result<usize> {
        Err(io::ErrorKind::WouldBlock.into())
    }

    fn rx_fd(&self) -> Option<RawFd> {
        None
    }

    fn configure(&mut self, _acked: u64) -> io::Result<()> {
        Ok(())
    }
}

/// State shared between a [`MemBackend`] and its test-side handle.
#[derive(Debug, Default)]
pub struct MemState {
    /// Frames waiting to be received by the device (header first).
    pub rx: VecDeque<Vec<u8>>,
    /// Frames the device sent (header first).
    pub tx: Vec<Vec<u8>>,
    /// Features the device configured.
    pub acked: Option<u64>,
    /// Whether receive steering is enabled.
    pub enabled: bool,
}

/// An in-memory backend: frames pushed with [`MemBackend::inject`] are received; sent frames
/// are collected. Its eventfd is readable while frames wait.
#[derive(Clone, Debug)]
pub struct MemBackend {
    state: Arc<Mutex<MemState>>,
    event: Arc<EventFd>,
}

impl MemBackend {
    /// A new, empty backend.
    ///
    /// # Errors
    /// The eventfd cannot be created.
    pub fn new() -> io::Result<Self> {
        Ok(Self {
            state: Arc::new(Mutex::new(MemState {
                enabled: true,
                ..Default::default()
            })),
            event: Arc::new(EventFd::new(EFD_NONBLOCK)?),
        })
    }

    /// The shared state.
    pub fn state(&self) -> MutexGuard<'_, MemState> {
        // A poisoned lock means a test thread panicked; the data is still what it was.
        crate::metrics::lock(&self.state)
    }

    /// Queues a frame for the device to receive (header first) and signals the eventfd.
    pub fn inject(&self, frame: Vec<u8>) {
        self.state().rx.push_back(frame);
        // An eventfd write fails only when the counter would overflow: it is readable then.
        let _ = self.event.write(1);
    }

    /// Takes the frames the device sent.
    pub fn take_sent(&self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.state().tx)
    }
}

impl NetBackend for MemBackend {
    fn send(&mut self, frame: &[u8]) -> io::Result<()> {
        self.state().tx.push(frame.to_vec());
        Ok(())
    }

    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut st = self.state();
        let Some(frame) = st.rx.pop_front() else {
            // Drain the eventfd so a level-triggered poller sleeps.
            let _ = self.event.read();
            return Err(io::ErrorKind::WouldBlock.into());
        };
        // Like a tap read into a short buffer: the rest of the frame is lost.
        let n = frame.len().min(buf.len());
        buf[..n].copy_from_slice(&frame[..n]);
        Ok(n)
    }

    fn rx_fd(&self) -> Option<RawFd> {
        Some(self.event.as_raw_fd())
    }

    fn configure(&mut self, acked: u64) -> io::Result<()> {
        self.state().acked = Some(acked);
        Ok(())
    }

    fn set_enabled(&mut self, enabled: bool) -> io::Result<()> {
        self.state().enabled = enabled;
        Ok(())
    }
}
