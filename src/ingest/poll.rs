//! One ingest OS thread: it owns its listeners and their sockets, polls
//! their descriptors with the hub's doorbell, runs their timers and obeys
//! the hub's commands.
//!
//! Owns: the poll loop (the one `unsafe` call of ingestion: `libc::poll` on
//! the sockets' `ZMQ_FD`s) and the command protocol. Does not: read a
//! message (`listener.rs`) or keep the registry (`hub.rs`).

// `libc::poll` over ZMQ_FD descriptors: the one FFI call of ingestion.
#![allow(unsafe_code)]

use super::listener::{Frames, Listener, Polled, Watch};
use super::spec::IngestConfig;
use super::stats::Counters;
use prometheus::local::LocalHistogram;
use std::os::fd::RawFd;
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest a poll sleeps with nothing scheduled (commands wake it anyway).
const IDLE_POLL: Duration = Duration::from_secs(1);

/// What the hub asks of a thread; each command carries its acknowledgement.
pub(super) enum Cmd {
    Add(Box<Listener>, SyncSender<()>),
    /// Stop a listener and clear the ranks it fed.
    Remove(u64, SyncSender<()>),
    Shutdown,
}

/// What every listener of a thread needs besides itself.
pub(super) struct Env {
    pub(super) ctx: super::zctx::Ctx,
    pub(super) counters: Arc<Counters>,
    /// This thread's copies of the hub's delay histograms, flushed once per
    /// round (`stats.rs`).
    pub(super) apply_delay: LocalHistogram,
    pub(super) engine_delay: LocalHistogram,
    pub(super) config: IngestConfig,
    /// Where this thread publishes whether it is caught up (`lag.rs`), and
    /// its slot there.
    pub(super) lag: Arc<super::lag::Lag>,
    pub(super) slot: usize,
}

/// One ingest OS thread and the listeners it owns.
pub(super) struct Thread {
    env: Env,
    rx: Receiver<Cmd>,
    doorbell: super::zctx::Socket,
    listeners: Vec<Listener>,
}

impl Thread {
    pub(super) fn new(env: Env, rx: Receiver<Cmd>, doorbell: super::zctx::Socket) -> Thread {
        Thread {
            env,
            rx,
            doorbell,
            listeners: Vec::new(),
        }
    }

    pub(super) fn run(&mut self) {
        let mut frames = Frames::default();
        let mut fds: Vec<libc::pollfd> = Vec::new();
        // The doorbell's descriptor is the same for the thread's life.
        let doorbell = self.doorbell.get_fd().ok();
        let mut last_sweep = Instant::now();
        let mut start = 0usize;
        loop {
            let now = Instant::now();
            let mut timeout = IDLE_POLL;
            for l in &mut self.listeners {
                if let Some(at) = l.tick(now, &self.env) {
                    timeout = timeout.min(at.saturating_duration_since(now));
                }
            }
            // Sockets are polled through their descriptors (ZMQ_FD), not
            // with `zmq::poll` on the sockets: that asks every socket for
            // ZMQ_EVENTS after every wake-up, one syscall each, so one
            // message cost ~70 syscalls with 32 listeners per thread. A
            // ZMQ_FD is edge-triggered: it signals new commands, not
            // readable messages. So a socket whose descriptor fired is asked
            // for its events once (which processes its commands) and read
            // until empty; a socket left unemptied (the per-round cap, a
            // parked SUB) or new to the poll set is `hot` and checked next
            // round without waiting. A listener's descriptor is asked for
            // (a getsockopt) only when its watched socket changes, which its
            // serial number per socket tells (`listener.rs`).
            fds.clear();
            fds.push(pollfd(doorbell));
            for l in &mut self.listeners {
                let (watch, serial) = l.watching();
                if (watch, serial) != (l.polled.watch, l.polled.serial) {
                    let fd = l.watched(watch).and_then(|s| s.get_fd().ok());
                    l.polled = Polled { watch, serial, fd };
                    l.hot = true;
                }
                fds.push(pollfd(l.polled.fd));
            }
            let any_hot = self
                .listeners
                .iter()
                .any(|l| (l.hot && l.polled.watch != Watch::None) || l.ready());
            // Round up so a 0.4 ms deadline does not spin at 0 ms.
            let ms = if any_hot {
                0
            } else {
                timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
            };
            // SAFETY: `fds` is a live, exclusively borrowed array of
            // `fds.len()` pollfd structs for the duration of the call.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            if rc < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::warn!(error = %e, "poll failed");
                }
            }
            // Once per IDLE_POLL, busy or not, every socket is checked, so
            // a missed edge could never stall a listener (or the doorbell)
            // for longer than that.
            let after = Instant::now();
            let sweep = after.duration_since(last_sweep) >= IDLE_POLL;
            if sweep {
                last_sweep = after;
                for l in &mut self.listeners {
                    l.hot = true;
                }
            }
            let fired = |i: usize| fds[i].revents != 0;
            if any_hot || (1..fds.len()).any(fired) {
                self.env.lag.behind(self.env.slot, after);
            }
            // Reading starts one listener further each round, so a spent
            // byte budget leaves a different one for the next round.
            let mut budget = self.env.config.max_bytes_per_round;
            let n = self.listeners.len();
            start = if n == 0 { 0 } else { (start + 1) % n };
            for k in 0..n {
                let i = (start + k) % n;
                let l = &mut self.listeners[i];
                let w = l.polled.watch;
                if w == Watch::None || !(l.hot || fired(i + 1)) {
                    continue;
                }
                if budget == 0 {
                    l.hot = true;
                    continue;
                }
                let readable = l
                    .watched(w)
                    .and_then(|s| s.get_events().ok())
                    .is_some_and(|ev| ev.contains(zmq::POLLIN));
                l.hot = readable
                    && !match w {
                        Watch::Sub => l.fill_sub(&mut frames, &self.env, &mut budget),
                        _ => l.drain_dealer(&mut frames, &self.env),
                    };
            }
            // Every stream of the thread is read before any is applied, so
            // the receipt-to-application delay counts the wait for the
            // thread's other streams (`listener.rs`).
            for l in &mut self.listeners {
                if l.ready() {
                    l.apply_inbox(&self.env);
                }
            }
            self.env.apply_delay.flush();
            self.env.engine_delay.flush();
            let behind = self
                .listeners
                .iter()
                .any(|l| (l.hot && l.polled.watch != Watch::None) || l.ready());
            if !behind {
                self.env.lag.caught_up(self.env.slot);
            }
            if fired(0) || sweep {
                let _ = self.doorbell.get_events();
                while self.doorbell.recv_bytes(zmq::DONTWAIT).is_ok() {}
            }
            // Commands are checked every round, not only on a doorbell: the
            // doorbell is only a wake-up.
            loop {
                match self.rx.try_recv() {
                    Ok(Cmd::Add(l, ack)) => {
                        let mut l = *l;
                        l.tick(Instant::now(), &self.env);
                        self.listeners.push(l);
                        let _ = ack.send(());
                    }
                    Ok(Cmd::Remove(id, ack)) => {
                        if let Some(pos) = self.listeners.iter().position(|l| l.id == id) {
                            let mut l = self.listeners.swap_remove(pos);
                            l.close();
                            l.clear_ranks();
                        }
                        let _ = ack.send(());
                    }
                    Ok(Cmd::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => {
                        for l in &mut self.listeners {
                            l.close();
                        }
                        return;
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
        }
    }
}

/// A poll entry for readability of `fd`; a negative fd (no socket) is
/// ignored by `poll`.
fn pollfd(fd: Option<RawFd>) -> libc::pollfd {
    libc::pollfd {
        fd: fd.unwrap_or(-1),
        events: libc::POLLIN,
        revents: 0,
    }
}
