//! One thread per [`QueueWorker`]: epoll on the queues' notification eventfds, the worker's
//! own fds (edge-triggered, as the trait asks) and a stop eventfd.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use devices::virtio::dispatch::{Dispatcher, Outcome};
use devices::virtio::{QueueWorker, WorkerEvent};
use virtio_queue::Queue;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::msix::MsixInterrupts;

const STOP_TOKEN: u64 = u64::MAX;
const FD_TOKEN_FLAG: u64 = 1 << 32;

/// What a worker thread needs, handed over at activation.
pub(crate) struct WorkerSetup {
    /// Device id, for logs and the thread name.
    pub name: String,
    /// The worker.
    pub worker: Box<dyn QueueWorker<GuestMemoryMmap>>,
    /// Its queues, in `queue_indexes` order (the thread owns them until reset).
    pub queues: Vec<Queue>,
    /// The notification eventfd of each queue.
    pub kicks: Vec<Arc<EventFd>>,
    /// The MSI-X vector of each queue.
    pub vectors: Vec<u16>,
    /// Interrupt delivery.
    pub irq: Arc<MsixInterrupts>,
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// Set when the worker reports the device broken.
    pub needs_reset: Arc<AtomicBool>,
}

impl WorkerSetup {
    fn into_thread(self) -> ThreadState {
        ThreadState {
            name: self.name,
            worker: Dispatcher::new(self.worker),
            queues: self.queues,
            kicks: self.kicks,
            vectors: self.vectors,
            irq: self.irq,
            mem: self.mem,
            needs_reset: self.needs_reset,
        }
    }
}

/// What the thread owns: the setup, with the worker behind the shared dispatcher.
struct ThreadState {
    name: String,
    worker: Dispatcher<GuestMemoryMmap>,
    queues: Vec<Queue>,
    kicks: Vec<Arc<EventFd>>,
    vectors: Vec<u16>,
    irq: Arc<MsixInterrupts>,
    mem: GuestMemoryMmap,
    needs_reset: Arc<AtomicBool>,
}

/// A running worker thread.
#[derive(Debug)]
pub(crate) struct WorkerThread {
    stop: EventFd,
    handle: Option<JoinHandle<()>>,
}

impl WorkerThread {
    /// Spawns the thread.
    ///
    /// # Errors
    /// Creating the stop eventfd, the epoll set or the thread failed.
    pub fn spawn(setup: WorkerSetup) -> std::io::Result<Self> {
        let stop = EventFd::new(EFD_NONBLOCK)?;
        let epoll = Epoll::new()?;
        let state = setup.into_thread();
        epoll.ctl(
            ControlOperation::Add,
            stop.as_raw_fd(),
            EpollEvent::new(EventSet::IN, STOP_TOKEN),
        )?;
        for (i, k) in state.kicks.iter().enumerate() {
            epoll.ctl(
                ControlOperation::Add,
                k.as_raw_fd(),
                EpollEvent::new(EventSet::IN, i as u64),
            )?;
        }
        for (fd, token) in state.worker.extra_fds() {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(
                    EventSet::IN | EventSet::EDGE_TRIGGERED,
                    FD_TOKEN_FLAG | u64::from(token),
                ),
            )?;
        }
        let handle = std::thread::Builder::new()
            .name(format!("vq-{}", state.name))
            .spawn(move || run(state, epoll))?;
        Ok(WorkerThread {
            stop,
            handle: Some(handle),
        })
    }

    /// Stops the thread and joins it (an event being handled completes first).
    pub fn stop(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        let _ = self.stop.write(1);
        if let Some(h) = self.handle.take() {
            if h.join().is_err() {
                tracing::error!("virtio worker thread panicked");
            }
        }
    }
}

impl Drop for WorkerThread {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

fn run(mut s: ThreadState, epoll: Epoll) {
    let mut events = vec![EpollEvent::default(); 16];
    tracing::debug!(device = %s.name, queues = ?s.worker.queue_indexes(), "worker started");
    loop {
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::error!(device = %s.name, error = %e, "worker epoll failed");
                s.needs_reset.store(true, Ordering::SeqCst);
                s.irq.signal_config();
                return;
            }
        };
        for ev in &events[..n] {
            let token = ev.data();
            let event = if token == STOP_TOKEN {
                tracing::debug!(device = %s.name, "worker stopped");
                return;
            } else if token & FD_TOKEN_FLAG != 0 {
                WorkerEvent::Fd(token as u32)
            } else {
                let pos = token as usize;
                if let Some(k) = s.kicks.get(pos) {
                    // EAGAIN means another wakeup already consumed the count.
                    let _ = k.read();
                }
                WorkerEvent::Kick(pos)
            };
            let mut queues: Vec<&mut Queue> = s.queues.iter_mut().collect();
            // Workers run for enabled queues only (see the device's activation).
            match s.worker.dispatch(event, &s.mem, &mut queues, true) {
                Outcome::Served(signal) => {
                    for (pos, vector) in s.vectors.iter().enumerate() {
                        if signal.has(pos) {
                            s.irq.signal_queue(*vector);
                        }
                    }
                }
                Outcome::Broken(why) => {
                    // The dispatcher logged why (a bounded number of times per process).
                    tracing::debug!(device = %s.name, %why, "device broken: DEVICE_NEEDS_RESET");
                    s.needs_reset.store(true, Ordering::SeqCst);
                    s.irq.signal_config();
                    return;
                }
                Outcome::NotReady | Outcome::Parked | Outcome::Refused(_) => {
                    tracing::debug!(device = %s.name, ?event, "worker ignored an event");
                }
            }
        }
    }
}
