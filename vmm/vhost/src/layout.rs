//! Which queues share an epoll thread.
//!
//! `vhost-user-backend` fixes its threads when a daemon is created (before features are
//! negotiated and before a device has workers), from a bit mask of queues per thread. The
//! layout must therefore be known up front: a [`QueueWorker`](devices::virtio::QueueWorker)
//! that serves several queues needs them all on one thread.

/// Most queues a layout can describe (`vhost-user-backend` uses 64-bit masks).
pub const MAX_QUEUES: usize = 64;

/// Errors of [`QueueLayout::new`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    /// A queue index is not below the queue count (or above [`MAX_QUEUES`]).
    #[error(
        "queue {queue} is out of range (the device has {num_queues} queues, at most {MAX_QUEUES})"
    )]
    OutOfRange {
        /// The queue.
        queue: u16,
        /// The device's queue count.
        num_queues: usize,
    },
    /// A queue is in two groups.
    #[error("queue {0} is in more than one group")]
    Duplicate(u16),
    /// A queue is in no group (it would never be served).
    #[error("queue {0} is in no group")]
    Missing(u16),
    /// A group is empty.
    #[error("group {0} is empty")]
    EmptyGroup(usize),
    /// The device has more queues than vhost-user-backend can serve.
    #[error("the device has {0} queues; vhost-user serves at most {MAX_QUEUES}")]
    TooManyQueues(usize),
}

/// Most net queue pairs over vhost-user: 2 queues per pair plus the control queue must fit in
/// [`MAX_QUEUES`] vrings.
pub const MAX_NET_QUEUE_PAIRS: u16 = ((MAX_QUEUES - 1) / 2) as u16;

/// Refuses a device whose queues do not all fit in a layout (`vhost-user-backend` describes
/// threads by 64-bit queue masks: queue 64 and above could never be served).
///
/// # Errors
/// [`LayoutError::TooManyQueues`].
pub fn check_queue_count(num_queues: usize) -> Result<(), LayoutError> {
    if num_queues > MAX_QUEUES {
        return Err(LayoutError::TooManyQueues(num_queues));
    }
    Ok(())
}

/// Queues grouped onto threads: thread `i` serves the queues whose bits are set in mask `i`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueLayout {
    masks: Vec<u64>,
}

impl QueueLayout {
    /// A layout from explicit groups of queue indexes covering `0..num_queues` once each.
    ///
    /// # Errors
    /// [`LayoutError`] for an index out of range, a queue in two groups or in none, or an
    /// empty group.
    pub fn new(num_queues: usize, groups: &[Vec<u16>]) -> Result<Self, LayoutError> {
        let mut seen = 0u64;
        let mut masks = Vec::with_capacity(groups.len());
        for (i, group) in groups.iter().enumerate() {
            if group.is_empty() {
                return Err(LayoutError::EmptyGroup(i));
            }
            let mut mask = 0u64;
            for &q in group {
                if usize::from(q) >= num_queues || usize::from(q) >= MAX_QUEUES {
                    return Err(LayoutError::OutOfRange {
                        queue: q,
                        num_queues,
                    });
                }
                let bit = 1u64 << q;
                if seen & bit != 0 {
                    return Err(LayoutError::Duplicate(q));
                }
                seen |= bit;
                mask |= bit;
            }
            masks.push(mask);
        }
        for q in 0..num_queues.min(MAX_QUEUES) {
            if seen & (1u64 << q) == 0 {
                // q < MAX_QUEUES = 64, so it fits in u16.
                return Err(LayoutError::Missing(q as u16));
            }
        }
        Ok(Self { masks })
    }

    /// One thread per queue (the layout of a device whose declared groups are unusable).
    pub fn one_per_queue(num_queues: usize) -> Self {
        let n = num_queues.clamp(1, MAX_QUEUES);
        Self {
            masks: (0..n).map(|q| 1u64 << q).collect(),
        }
    }

    /// Number of threads.
    pub fn threads(&self) -> usize {
        self.masks.len()
    }

    /// The masks, as `VhostUserBackend::queues_per_thread` returns them.
    pub fn masks(&self) -> Vec<u64> {
        self.masks.clone()
    }

    /// The thread that holds all of `queues`, with each queue's position in that thread's
    /// vring slice (vrings are handed to a thread in ascending queue order); `None` when no
    /// single thread holds them all.
    pub fn place(&self, queues: &[u16]) -> Option<(usize, Vec<usize>)> {
        let first = *queues.first()?;
        if usize::from(first) >= MAX_QUEUES {
            return None;
        }
        let thread = self.masks.iter().position(|m| m & (1u64 << first) != 0)?;
        let mask = self.masks[thread];
        let mut positions = Vec::with_capacity(queues.len());
        for &q in queues {
            if usize::from(q) >= MAX_QUEUES || mask & (1u64 << q) == 0 {
                return None;
            }
            let below = mask & ((1u64 << q) - 1);
            positions.push(below.count_ones() as usize);
        }
        Some((thread, positions))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_groups_pair_rx_tx_and_isolate_the_control_queue() {
        let l = QueueLayout::new(5, &[vec![0, 1], vec![2, 3], vec![4]]).unwrap();
        assert_eq!(l.masks(), vec![0b11, 0b1100, 0b10000]);
        assert_eq!(l.place(&[2, 3]), Some((1, vec![0, 1])));
        assert_eq!(l.place(&[3, 2]), Some((1, vec![1, 0])));
        assert_eq!(l.place(&[4]), Some((2, vec![0])));
        assert_eq!(l.place(&[1, 2]), None);
        assert_eq!(l.place(&[]), None);
        assert_eq!(l.place(&[200]), None);
        assert_eq!(QueueLayout::one_per_queue(3).masks(), vec![1, 2, 4]);
    }

    #[test]
    fn queue_counts_beyond_the_masks_are_refused() {
        // Regression: net with 32 pairs has 65 queues; the layout silently
        // dropped queue 64 (the control queue) and activation failed later.
        assert_eq!(check_queue_count(64), Ok(()));
        assert_eq!(
            check_queue_count(2 * 32 + 1),
            Err(LayoutError::TooManyQueues(65))
        );
        assert_eq!(2 * usize::from(MAX_NET_QUEUE_PAIRS) + 1, 63);
        assert!(check_queue_count(2 * usize::from(MAX_NET_QUEUE_PAIRS) + 1).is_ok());
    }

    #[test]
    fn explicit_layout_is_validated() {
        assert!(QueueLayout::new(3, &[vec![0, 2], vec![1]]).is_ok());
        assert_eq!(
            QueueLayout::new(3, &[vec![0, 2]]),
            Err(LayoutError::Missing(1))
        );
        assert_eq!(
            QueueLayout::new(2, &[vec![0, 1], vec![1]]),
            Err(LayoutError::Duplicate(1))
        );
        assert_eq!(
            QueueLayout::new(2, &[vec![0, 1], vec![]]),
            Err(LayoutError::EmptyGroup(1))
        );
        assert!(matches!(
            QueueLayout::new(2, &[vec![0, 5]]),
            Err(LayoutError::OutOfRange { queue: 5, .. })
        ));
        let l = QueueLayout::new(4, &[vec![0, 2], vec![1, 3]]).unwrap();
        assert_eq!(l.place(&[2, 0]), Some((0, vec![1, 0])));
    }
}
