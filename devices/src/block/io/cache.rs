//! Cache and AIO modes, named and defined as QEMU's `-drive cache=` and `aio=`.
//!
//! QEMU's `cache=` is shorthand for three switches (`qemu(1)`, "-drive cache="):
//!
//! | mode           | `cache.writeback` | `cache.direct` (O_DIRECT) | `cache.no-flush` |
//! |----------------|-------------------|---------------------------|------------------|
//! | `writeback`    | on                | off                       | off              |
//! | `none`         | on                | on                        | off              |
//! | `writethrough` | off               | off                       | off              |
//! | `directsync`   | off               | on                        | off              |
//! | `unsafe`       | on                | off                       | on               |
//!
//! What each switch does here, as in QEMU:
//! - `cache.writeback` is the write cache the guest is told about (virtio-blk's `writeback`
//!   configuration field with `VIRTIO_BLK_F_CONFIG_WCE`). With it off, every write completes
//!   only after the data is on stable storage: the device flushes after each write (QEMU
//!   emulates FUA this way; it does not open with O_DSYNC).
//! - `cache.direct` opens the image with `O_DIRECT`, bypassing the host page cache; buffers
//!   that are not aligned for it go through an aligned bounce buffer of the engine's own.
//! - `cache.no-flush` makes FLUSH requests complete at once without syncing anything.

/// `cache=`: how the host caches the image.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CacheMode {
    /// O_DIRECT, write cache on (FLUSH syncs). QEMU's choice for benchmarks.
    None,
    /// Host page cache, write cache on (FLUSH syncs). QEMU's default.
    #[default]
    Writeback,
    /// Host page cache, write cache off: every write is synced before it completes.
    Writethrough,
    /// O_DIRECT and write cache off.
    DirectSync,
    /// Host page cache, write cache on, FLUSH ignored: data may be lost on a host crash.
    Unsafe,
}

// QEMU's names, in its documentation's order.
bounce::named_enum! {
    CacheMode, "cache mode", err: String = String::from;
    None => "none",
    Writeback => "writeback",
    Writethrough => "writethrough",
    DirectSync => "directsync",
    Unsafe => "unsafe",
}

impl CacheMode {
    /// `cache.direct`: open with O_DIRECT.
    pub fn direct(self) -> bool {
        matches!(self, Self::None | Self::DirectSync)
    }

    /// `cache.writeback`: the write cache the guest sees at start.
    pub fn write_cache(self) -> bool {
        !matches!(self, Self::Writethrough | Self::DirectSync)
    }

    /// `cache.no-flush`: FLUSH requests sync nothing.
    pub fn no_flush(self) -> bool {
        self == Self::Unsafe
    }
}

/// `aio=`: which engine does the host I/O.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AioMode {
    /// Linux io_uring: batched submission, completions in any order (raw images only).
    IoUring,
    /// A pool of threads doing blocking I/O (any image format).
    Threads,
    /// Blocking I/O inside the queue worker, one request at a time (for debugging).
    Sync,
}

// QEMU's names (`native` is not offered: Linux AIO is what io_uring replaces).
bounce::named_enum! {
    AioMode, "aio mode", err: String = String::from;
    IoUring => "io_uring",
    Threads => "threads",
    Sync => "sync",
}

/// `on-full=` (a bounce option): what a request does when the bounce pool is momentarily
/// full while the queue has other requests in flight.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum OnFull {
    /// Stay on the available ring (back-pressure) and be retried when in-flight requests
    /// release their slots, as a guest driver's request waits for a tag, for as long as
    /// others hold slots; IOERR only for a request larger than the pool, or when nothing
    /// else holds slots.
    #[default]
    Wait,
    /// Complete with IOERR at once (the Linux swiotlb behaviour for a full pool).
    Fail,
}

bounce::named_enum! {
    OnFull, "on-full action", err: String = String::from;
    Wait => "wait",
    Fail => "fail",
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_modes_follow_qemus_table() {
        // (mode, writeback, direct, no-flush), from qemu(1).
        let table = [
            ("writeback", true, false, false),
            ("none", true, true, false),
            ("writethrough", false, false, false),
            ("directsync", false, true, false),
            ("unsafe", true, false, true),
        ];
        for (name, wb, direct, no_flush) in table {
            let m: CacheMode = name.parse().unwrap();
            assert_eq!(m.name(), name);
            assert_eq!(
                (m.write_cache(), m.direct(), m.no_flush()),
                (wb, direct, no_flush),
                "{name}"
            );
        }
        assert!("off".parse::<CacheMode>().unwrap_err().contains("'off'"));
        assert_eq!(CacheMode::default(), CacheMode::Writeback);
    }

    #[test]
    fn aio_names() {
        for m in AioMode::ALL {
            assert_eq!(m.name().parse::<AioMode>().unwrap(), m);
        }
        assert!("native".parse::<AioMode>().is_err());
    }
}
