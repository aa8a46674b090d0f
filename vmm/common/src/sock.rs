//! Unix sockets and private directories, created safely: the one place QMP, vhost-user and
//! statistics sockets are bound.
//!
//! * A path where a live process answers is never unlinked ([`SockError::InUse`]); a path
//!   that is not a socket is never touched; a stale socket file (nobody answers) is
//!   replaced.
//! * The socket gets its permission bits before it becomes reachable at its path: it is
//!   bound inside a fresh `0700` directory next to the final path, `chmod`ed, then renamed
//!   into place, so no client can connect during a window with wider permissions (and the
//!   process umask is not touched). The default mode is [`DEFAULT_SOCKET_MODE`] (0600),
//!   as for QEMU's own sockets under libvirt.
//! * Private directories ([`private_dir`]) come from `mkdtemp`: unpredictable names, mode
//!   0700, created atomically.

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// Mode of the sockets bouncevm and bouncevm-vhost create unless told otherwise.
pub const DEFAULT_SOCKET_MODE: u32 = 0o600;

/// Errors of socket creation; each displays as one line.
#[derive(Debug, thiserror::Error)]
pub enum SockError {
    /// A live process answers at the path.
    #[error("{0} is in use by a running process")]
    InUse(PathBuf),
    /// The path exists and is not a socket.
    #[error("{0} exists and is not a socket")]
    NotASocket(PathBuf),
    /// Binding (or placing) the socket failed.
    #[error("cannot listen on {path}: {source}")]
    Bind {
        /// The path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
}

/// Parses an octal mode such as `0600` or `660` (at most `0777`).
///
/// # Errors
/// A one-line reason.
pub fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("'{s}' is not an octal permission mode (e.g. 0600)"))
}

/// Creates a new private directory `<parent>/<prefix>XXXXXX` (mode 0700, random suffix).
///
/// # Errors
/// `mkdtemp`'s error.
pub fn private_dir_in(parent: &Path, prefix: &str) -> io::Result<PathBuf> {
    let mut template = parent
        .join(format!("{prefix}XXXXXX"))
        .into_os_string()
        .into_vec();
    template.push(0);
    let ptr = template.as_mut_ptr().cast::<libc::c_char>();
    // SAFETY: `template` is a writable NUL-terminated buffer ending in "XXXXXX"; mkdtemp
    // rewrites those six bytes in place and returns `ptr` or null.
    if unsafe { libc::mkdtemp(ptr) }.is_null() {
        return Err(io::Error::last_os_error());
    }
    template.pop();
    Ok(PathBuf::from(OsStr::from_bytes(&template)))
}

/// [`private_dir_in`] the system temporary directory.
///
/// # Errors
/// `mkdtemp`'s error.
pub fn private_dir(prefix: &str) -> io::Result<PathBuf> {
    private_dir_in(&std::env::temp_dir(), prefix)
}

/// Refuses a live socket or a non-socket at `path`; removes a stale socket file.
fn clear_stale(path: &Path) -> Result<(), SockError> {
    match std::fs::symlink_metadata(path) {
        Err(_) => Ok(()),
        Ok(m) if !m.file_type().is_socket() => Err(SockError::NotASocket(path.to_path_buf())),
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => Err(SockError::InUse(path.to_path_buf())),
            Err(_) => {
                tracing::info!("replacing stale socket {}", path.display());
                std::fs::remove_file(path).map_err(|source| SockError::Bind {
                    path: path.to_path_buf(),
                    source,
                })
            }
        },
    }
}

/// Binds a listening socket at `path` with permission bits `mode` (see the module
/// documentation).
///
/// # Errors
/// [`SockError::InUse`], [`SockError::NotASocket`], [`SockError::Bind`].
pub fn bind_unix(path: &Path, mode: u32) -> Result<UnixListener, SockError> {
    clear_stale(path)?;
    let bind_err = |source| SockError::Bind {
        path: path.to_path_buf(),
        source,
    };
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let dir = private_dir_in(&parent, ".bvm-sock.").map_err(bind_err)?;
    let tmp = dir.join("s");
    let result = (|| {
        let l = UnixListener::bind(&tmp)?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
        // Placed atomically; a socket bound meanwhile by another process at `path` would
        // be replaced, which is why the liveness check above runs first.
        std::fs::rename(&tmp, path)?;
        Ok(l)
    })();
    let _ = std::fs::remove_file(&tmp);
    let _ = std::fs::remove_dir(&dir);
    result.map_err(bind_err)
}

/// A bound socket that remembers which file it created, to remove only that file.
#[derive(Debug)]
pub struct BoundSocket {
    /// The listener.
    pub listener: UnixListener,
    path: PathBuf,
    id: (u64, u64),
}

impl BoundSocket {
    /// [`bind_unix`], remembering the file.
    ///
    /// # Errors
    /// As [`bind_unix`].
    pub fn bind(path: &Path, mode: u32) -> Result<Self, SockError> {
        let listener = bind_unix(path, mode)?;
        let m = std::fs::symlink_metadata(path).map_err(|source| SockError::Bind {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Self {
            listener,
            path: path.to_path_buf(),
            id: (m.dev(), m.ino()),
        })
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the socket file if it is still the one this bound.
    pub fn remove(&self) {
        if let Ok(m) = std::fs::symlink_metadata(&self.path) {
            if (m.dev(), m.ino()) == self.id {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockets_are_0600_live_ones_kept_stale_ones_replaced() {
        let dir = private_dir("bvm-sock-test.").unwrap();
        assert_eq!(
            std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
            0o700
        );
        let p = dir.join("q.sock");
        let s = BoundSocket::bind(&p, DEFAULT_SOCKET_MODE).unwrap();
        let mode = std::fs::symlink_metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(UnixStream::connect(&p).is_ok(), "reachable at its path");
        // A live server's socket is refused, not unlinked.
        assert!(matches!(bind_unix(&p, 0o600), Err(SockError::InUse(_))));
        assert!(p.exists());
        drop(s);
        // Now stale: replaced, with the asked mode.
        let s2 = BoundSocket::bind(&p, 0o660).unwrap();
        let mode = std::fs::symlink_metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o660);
        // Only our own file is removed.
        s2.remove();
        assert!(!p.exists());
        std::fs::write(&p, b"x").unwrap();
        assert!(matches!(
            bind_unix(&p, 0o600),
            Err(SockError::NotASocket(_))
        ));
        s2.remove();
        assert!(p.exists(), "a file someone else put there stays");
        // Two private directories never share a name.
        let a = private_dir("bvm-sock-test.").unwrap();
        assert_ne!(a, dir);
        let _ = std::fs::remove_dir(&a);
        let _ = std::fs::remove_file(&p);
        let _ = std::fs::remove_dir(&dir);
        assert_eq!(parse_mode("0660"), Ok(0o660));
        assert!(parse_mode("999").is_err());
        assert!(parse_mode("1777").is_err());
    }
}
