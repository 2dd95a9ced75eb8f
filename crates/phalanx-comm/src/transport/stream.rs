//! One connection type for the transport: TCP between hosts, a Unix domain
//! stream socket (Linux abstract namespace) between ranks on one host.
//!
//! Frames, reader threads, heartbeats and failure handling are written once
//! against `Stream`; only the dial / listen step differs. Unix sockets skip
//! the TCP/IP stack (checksums, segmentation, ACK processing), which is most
//! of the kernel time of a large collective over loopback.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// Which kind of socket a peer connection uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// TCP (peers on other hosts, or `PHALANX_TRANSPORT=tcp`).
    Tcp,
    /// Unix domain stream socket (peers on this host).
    Unix,
    /// Shared memory for data, beside a Unix socket for control (peers on
    /// this host, see `transport::shm`).
    Shm,
    /// The system MPI library moves the data (`PHALANX_BACKEND=mpi`).
    Mpi,
}

impl Link {
    pub fn name(self) -> &'static str {
        match self {
            Link::Tcp => "tcp",
            Link::Unix => "unix",
            Link::Mpi => "mpi",
            Link::Shm => "shm",
        }
    }
}

/// A connected byte stream to a peer.
#[derive(Debug)]
pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

macro_rules! both {
    ($self:expr, $s:ident => $e:expr) => {
        match $self {
            Stream::Tcp($s) => $e,
            Stream::Unix($s) => $e,
        }
    };
}

impl Stream {
    pub fn link(&self) -> Link {
        match self {
            Stream::Tcp(_) => Link::Tcp,
            Stream::Unix(_) => Link::Unix,
        }
    }

    pub fn try_clone(&self) -> std::io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    pub fn shutdown(&self, how: Shutdown) -> std::io::Result<()> {
        both!(self, s => s.shutdown(how))
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        both!(self, s => s.set_read_timeout(t))
    }

    pub fn read_timeout(&self) -> std::io::Result<Option<Duration>> {
        both!(self, s => s.read_timeout())
    }

    pub fn set_write_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        both!(self, s => s.set_write_timeout(t))
    }

    pub fn set_nonblocking(&self, on: bool) -> std::io::Result<()> {
        both!(self, s => s.set_nonblocking(on))
    }

    /// TCP_NODELAY; Unix sockets have no Nagle algorithm.
    pub fn set_nodelay(&self, on: bool) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_nodelay(on),
            Stream::Unix(_) => Ok(()),
        }
    }

    /// SO_SNDBUF / SO_RCVBUF (best effort: the kernel caps them at
    /// net.core.wmem_max / rmem_max). For Unix stream sockets only the
    /// sender's SO_SNDBUF bounds the bytes in flight.
    pub fn set_buffers(&self, bytes: usize) {
        let size = bytes.min(i32::MAX as usize) as libc::c_int;
        for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
            // SAFETY: plain setsockopt on a socket we own, with a valid int pointer.
            unsafe {
                libc::setsockopt(
                    self.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    &size as *const _ as *const libc::c_void,
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                );
            }
        }
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        both!(self, s => s.as_raw_fd())
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        both!(self, s => s.read(buf))
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        both!(self, s => s.write(buf))
    }
    fn write_vectored(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        both!(self, s => s.write_vectored(bufs))
    }
    fn flush(&mut self) -> std::io::Result<()> {
        both!(self, s => s.flush())
    }
}

impl crate::wire::ReadTimeout for Stream {
    fn read_timeout(&self) -> std::io::Result<Option<Duration>> {
        Stream::read_timeout(self)
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        Stream::set_read_timeout(self, t)
    }
}

/// Where a rank can be reached over a Unix socket, and who may try: peers
/// with the same host identity.
pub(crate) mod local {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// This machine and network namespace, as far as abstract Unix sockets
    /// can tell: hostname, the kernel's boot id (two containers with one
    /// hostname on different machines differ here) and the network namespace
    /// (abstract socket names are scoped by it). `None` if any part is
    /// unknown, which disables Unix sockets.
    pub fn host_identity() -> Option<String> {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let netns = std::fs::read_link("/proc/self/ns/net").ok()?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        Some(format!(
            "{}|{}|{}",
            host.trim(),
            boot.trim(),
            netns.to_string_lossy()
        ))
    }

    /// Listen on a fresh abstract name: random bytes make it unique to this
    /// job and rank, and nothing is left on the file system.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    pub fn listen(rank: usize) -> std::io::Result<(UnixListener, String)> {
        #[cfg(target_os = "android")]
        use std::os::android::net::SocketAddrExt;
        #[cfg(target_os = "linux")]
        use std::os::linux::net::SocketAddrExt;
        let name = format!(
            "phalanx-{}-{}-r{rank}",
            std::process::id(),
            crate::wire::to_hex(&crate::wire::random_bytes(12))
        );
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        Ok((UnixListener::bind_addr(&addr)?, name))
    }

    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    pub fn listen(_rank: usize) -> std::io::Result<(UnixListener, String)> {
        Err(std::io::ErrorKind::Unsupported.into())
    }

    #[cfg(any(target_os = "linux", target_os = "android"))]
    pub fn dial(name: &str) -> std::io::Result<UnixStream> {
        #[cfg(target_os = "android")]
        use std::os::android::net::SocketAddrExt;
        #[cfg(target_os = "linux")]
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        UnixStream::connect_addr(&addr)
    }

    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    pub fn dial(_name: &str) -> std::io::Result<UnixStream> {
        Err(std::io::ErrorKind::Unsupported.into())
    }
}
