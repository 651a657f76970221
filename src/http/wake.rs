//! Fewer wake-ups per large request body: the socket's receive low-water
//! mark (`SO_RCVLOWAT`).
//!
//! A 100k-token prompt is about 630 KB of JSON. Over loopback it arrives in
//! 64 KB segments, and each one woke the worker thread: about ten parks in
//! `epoll_wait` per body, each a context switch (in the paced seed profile
//! the worker's parks were about 6% of the server's CPU, harness/README
//! "Where the CPU goes"). After each frame of a body with a declared
//! Content-Length, [`BodyWake::taken`] sets the mark to the bytes still to
//! come (at most [`MAX_MARK`]), so the kernel wakes the thread once they
//! are there, and hyper reads them in a few large reads without parking.
//! Linux also wakes it early when the receive buffer or the advertised
//! window runs short (`tcp_epollin_ready`), and raises the buffer to fit the
//! mark, so a mark never stalls the sender. A peer that closes wakes it too.
//!
//! The mark is never above what the socket will still receive: hyper hands
//! over everything it has buffered of the body with each frame and reads
//! the socket again only after the frame is taken, so once a frame is taken
//! the socket has at least Content-Length minus the bytes taken still to
//! come. That holds because the handler reads its body inside hyper's
//! connection task (hyper polls the service future inline), so nothing
//! reads the socket between taking a frame and setting the mark; a handler
//! that read its body from a spawned task would break it. A mark above that would leave the request waiting for its body
//! timeout, so the mark is set only where that count holds: HTTP/1 over
//! plain TCP (TLS reads ahead into its own buffers; HTTP/2 multiplexes
//! streams on one socket), never before the first frame, and it goes back
//! to 1 (the default) when the body is complete or the request ends any
//! other way ([`Drop`]), before hyper reads the next request.
//!
//! The cost is one `setsockopt` per frame that changes the mark (a frame
//! while more than [`MAX_MARK`] bytes are still to come keeps it). Where Linux grows the receive buffer for a mark it
//! also clamps the advertised window to the mark (256 KiB) until its
//! buffer autotuning raises both again: ample within a data centre (10
//! Gbit/s at 100 µs round trip is 125 KB in flight), a limit across a long,
//! fast link.

// setsockopt(SO_RCVLOWAT) on the connection's socket: one libc call with its
// SAFETY note.
#![allow(unsafe_code)]

use hyper::body::Incoming;
use hyper::{Request, Version};

/// Below this many bytes still to come, the mark is left at 1: one more
/// wake-up at most, not worth a system call.
pub const MIN_MARK: u64 = 64 * 1024;
/// The highest mark set: a larger body wakes the thread once per this many
/// bytes. Waiting for a whole 630 KB body cost latency (the parse no longer
/// overlaps the transfer: 768-837 against 947-971 requests/s, closed loop);
/// 256 KiB cost none and saved most of the wake-ups (harness/README
/// "Where the CPU goes"). The kernel grows the socket's receive buffer to
/// about twice the mark, so this also bounds that growth.
pub const MAX_MARK: u64 = 256 * 1024;

/// The connection's socket, in the extensions of each request that may use
/// a low-water mark (HTTP/1 over plain TCP).
#[derive(Clone, Copy, Debug)]
pub struct BodySocket(#[cfg(target_os = "linux")] pub std::os::fd::RawFd);

impl BodySocket {
    /// The socket of a plain-TCP connection.
    pub fn of(stream: &tokio::net::TcpStream) -> BodySocket {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            BodySocket(stream.as_raw_fd())
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = stream;
            BodySocket()
        }
    }

    /// Tags `req` with the connection's socket if the mark's count holds
    /// for it (the module doc): HTTP/1, and `socket` is `Some` only for
    /// plain TCP.
    pub fn tag(req: &mut Request<Incoming>, socket: Option<BodySocket>) {
        if let Some(s) = socket {
            if req.version() <= Version::HTTP_11 {
                req.extensions_mut().insert(s);
            }
        }
    }
}

/// The low-water mark of one request body's socket (see the module doc).
pub struct BodyWake {
    socket: Option<BodySocket>,
    declared: u64,
    /// The mark this body set last, or 1 (the default) while none is raised.
    mark: u64,
}

impl BodyWake {
    /// For the body of the request with head `req`, whose Content-Length is
    /// `declared`: active only for a tagged request with one.
    pub fn new(req: &hyper::http::request::Parts, declared: Option<u64>) -> BodyWake {
        let socket = req.extensions.get::<BodySocket>().copied();
        BodyWake {
            socket: socket.filter(|_| declared.is_some()),
            declared: declared.unwrap_or(0),
            mark: 1,
        }
    }

    /// After a frame: `taken` body bytes have been handed over so far.
    pub fn taken(&mut self, taken: usize) {
        let Some(socket) = self.socket else {
            return;
        };
        let rest = self.declared.saturating_sub(taken as u64);
        // While more than MAX_MARK is still to come the mark stays at
        // MAX_MARK: set once, not once per frame.
        let mark = if rest >= MIN_MARK {
            rest.min(MAX_MARK)
        } else {
            1
        };
        // A failed call leaves the mark as it was.
        if mark != self.mark && set_mark(socket, mark) {
            self.mark = mark;
        }
    }
}

impl Drop for BodyWake {
    fn drop(&mut self) {
        if let (true, Some(socket)) = (self.mark > 1, self.socket) {
            set_mark(socket, 1);
        }
    }
}

/// Sets `SO_RCVLOWAT`; whether it took.
#[cfg(target_os = "linux")]
fn set_mark(BodySocket(fd): BodySocket, bytes: u64) -> bool {
    let value = bytes.min(i32::MAX as u64) as libc::c_int;
    // SAFETY: `value` is a live c_int and the length passed is its size;
    // the kernel only reads it. `fd` is the socket of the connection whose
    // request is served: a mark is raised only just after a frame came in
    // through it, so it is open. The reset in `Drop` may come after hyper
    // closed the socket (a connection drops its socket before its request's
    // future): the call then fails, or, had the number been reused, sets
    // the default mark, 1, on that descriptor, which changes nothing a
    // reader relies on.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    r == 0
}

#[cfg(not(target_os = "linux"))]
fn set_mark(_: BodySocket, _: u64) -> bool {
    false
}
