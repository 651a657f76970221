//! The hub's ZeroMQ context, sized for a fleet.
//!
//! libzmq caps a context at `ZMQ_MAX_SOCKETS` sockets (1,023 by default),
//! and the `zmq` crate offers no setter for it; past the cap `zmq_socket`
//! fails with EMFILE, which is how fleets past ~1,019 worker-ranks went
//! blind. This module owns a context created with `zmq_ctx_new`, sets
//! `ZMQ_MAX_SOCKETS` before its first socket, and hands out ordinary
//! [`zmq::Socket`]s wrapped so each keeps the context alive: the context is
//! terminated only after its last socket closed (terminating earlier would
//! block in `zmq_ctx_term`).
//!
//! Owns: the raw context's lifetime (the only raw ZMQ calls of ingestion).

// zmq_ctx_new / zmq_ctx_set / zmq_socket / zmq_ctx_term on a context the
// `zmq` crate does not expose; each call has its SAFETY note.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::sync::Arc;

struct Raw(*mut c_void);

// SAFETY: a ZMQ context is thread-safe (zmq_ctx_*(3)); only the pointer
// is shared, sockets stay on the thread that uses them.
unsafe impl Send for Raw {}
// SAFETY: as above.
unsafe impl Sync for Raw {}

impl Drop for Raw {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from zmq_ctx_new and every socket made from
        // it holds an `Arc<Raw>`, so none is open now; EINTR is retried.
        while unsafe { zmq_sys::zmq_ctx_term(self.0) } == -1 {
            // SAFETY: zmq_errno reads this thread's errno; no arguments.
            let errno = unsafe { zmq_sys::zmq_errno() };
            if zmq::Error::from_raw(errno) != zmq::Error::EINTR {
                break;
            }
        }
    }
}

/// A context whose sockets keep it alive. Cheap to clone.
#[derive(Clone)]
pub(super) struct Ctx(Arc<Raw>);

/// A socket of a [`Ctx`]; derefs to [`zmq::Socket`]. The socket field is
/// dropped (closed) before the context reference.
pub(super) struct Socket {
    sock: zmq::Socket,
    _ctx: Arc<Raw>,
}

impl std::ops::Deref for Socket {
    type Target = zmq::Socket;
    fn deref(&self) -> &zmq::Socket {
        &self.sock
    }
}

impl Ctx {
    /// A new context allowing `max_sockets` sockets (clipped by libzmq to
    /// its `ZMQ_SOCKET_LIMIT`). Returns the context and the cap in force.
    pub(super) fn new(max_sockets: i32) -> (Ctx, i32) {
        // SAFETY: no argument; a null result is handled below.
        let raw = unsafe { zmq_sys::zmq_ctx_new() };
        assert!(!raw.is_null(), "zmq_ctx_new failed");
        let raw = Raw(raw);
        // SAFETY: `raw.0` is a live context with no socket yet, which is
        // when ZMQ_MAX_SOCKETS may be set. Both calls only read or set ints.
        let cap = unsafe {
            let limit = zmq_sys::zmq_ctx_get(raw.0, zmq_sys::ZMQ_SOCKET_LIMIT as _);
            let want = if limit > 0 {
                max_sockets.min(limit)
            } else {
                max_sockets
            };
            if zmq_sys::zmq_ctx_set(raw.0, zmq_sys::ZMQ_MAX_SOCKETS as _, want.max(1)) == 0 {
                want.max(1)
            } else {
                zmq_sys::zmq_ctx_get(raw.0, zmq_sys::ZMQ_MAX_SOCKETS as _)
            }
        };
        (Ctx(Arc::new(raw)), cap)
    }

    pub(super) fn socket(&self, kind: zmq::SocketType) -> Result<Socket, zmq::Error> {
        let raw_kind = match kind {
            zmq::SUB => zmq_sys::ZMQ_SUB,
            zmq::DEALER => zmq_sys::ZMQ_DEALER,
            zmq::PUSH => zmq_sys::ZMQ_PUSH,
            zmq::PULL => zmq_sys::ZMQ_PULL,
            zmq::PUB => zmq_sys::ZMQ_PUB,
            zmq::ROUTER => zmq_sys::ZMQ_ROUTER,
            _ => return Err(zmq::Error::EINVAL),
        };
        // SAFETY: `self.0 .0` is a live context (this `Ctx` holds it).
        let s = unsafe { zmq_sys::zmq_socket(self.0 .0, raw_kind as _) };
        if s.is_null() {
            // SAFETY: reads the calling thread's errno.
            return Err(zmq::Error::from_raw(unsafe { zmq_sys::zmq_errno() }));
        }
        Ok(Socket {
            // SAFETY: `s` is a new socket that nothing else owns; the
            // returned value closes it on drop, before `_ctx` is released.
            sock: unsafe { zmq::Socket::from_raw(s) },
            _ctx: Arc::clone(&self.0),
        })
    }
}
