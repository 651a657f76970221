//! One ingest OS thread: it owns its listeners and their sockets, waits on
//! their descriptors and the hub's doorbell, runs their timers and obeys the
//! hub's commands.
//!
//! Owns: the wait loop over an epoll set of the sockets' `ZMQ_FD`s (the FFI
//! of ingestion: `epoll_create1`, `epoll_ctl`, `epoll_wait`) and the command
//! protocol. Does not: read a message (`listener.rs`) or keep the registry
//! (`hub.rs`).
//!
//! A round: run the listeners' timers; bring the epoll set in step with the
//! socket each listener watches (its SUB, or its DEALER while a replay runs);
//! wait for a descriptor, the next timer or the idle limit (not at all when a
//! listener is `hot`); read every listener that fired or is hot, within the
//! round's byte budget and starting one listener further each round; apply
//! what was read; drain the doorbell; take the hub's commands.
//!
//! Sockets are waited on through their descriptors, not with `zmq::poll`,
//! which asks every socket for ZMQ_EVENTS after every wake-up (one syscall
//! each). A ZMQ_FD signals new commands, not readable messages, so a socket
//! whose descriptor fired is asked for its events once (which processes the
//! commands and quiets the descriptor) and read until empty; a socket left
//! unemptied (the per-round caps, a SUB parked behind a replay) or newly
//! watched is `hot` and checked next round without waiting. Once per
//! [`IDLE_POLL`], busy or not, every socket and the doorbell are checked, so
//! a missed signal never stalls a listener for longer than that.
//!
//! The set lives across rounds (level-triggered EPOLLIN), so a wake-up costs
//! the ready descriptors, not all of them: `poll(2)` over the ~32 descriptors
//! of a thread adds and removes a wait-queue entry for each on every call
//! (`benches/ingest_wakeup.rs` measures both ways). A listener's descriptor
//! is asked for (a getsockopt) only when its watched socket changes, which
//! the listener tells by a serial number per socket (`listener.rs`). Each
//! event carries its listener's id, not a position in the list: listeners
//! are swap-removed.
//!
//! Descriptor numbers are reused. A ZMQ_FD closes with its socket (libzmq's
//! reaper thread closes it, possibly a little later), the kernel drops a
//! closed descriptor from the set by itself, and the number may come back
//! for another listener's new socket. So the thread keeps its own map of
//! what it registered (descriptor -> owner) and never trusts the kernel's
//! set to match: it deletes a registration only when the map says the
//! listener deleting it owns that number, takes ENOENT and EBADF on delete
//! as already gone, turns an add that meets EEXIST into a modify (and a
//! modify that meets ENOENT into an add), and takes a listener out of the
//! set before its sockets close. Linux only.

// epoll_create1 / epoll_ctl / epoll_wait on the thread's epoll descriptor:
// the FFI of ingestion; each call has its SAFETY note.
#![allow(unsafe_code)]

use super::listener::{Frames, Listener, Polled, Watch};
use super::spec::IngestConfig;
use super::stats::Counters;
use prometheus::local::LocalHistogram;
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest a wait sleeps with nothing scheduled (commands wake it anyway).
const IDLE_POLL: Duration = Duration::from_secs(1);

/// Pause after an `epoll_wait` failure other than EINTR.
const WAIT_FAILED_PAUSE: Duration = Duration::from_millis(10);

/// The epoll owner id of the doorbell; listener ids count up from 0.
const DOORBELL: u64 = u64::MAX;

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
    /// Listener id -> its position in `listeners`, to map ready events back.
    at: HashMap<u64, usize>,
    epoll: Epoll,
}

impl Thread {
    /// # Panics
    /// If the OS refuses an epoll descriptor (the thread cannot wait
    /// without one).
    pub(super) fn new(env: Env, rx: Receiver<Cmd>, doorbell: super::zctx::Socket) -> Thread {
        let mut epoll = Epoll::new().expect("epoll descriptor for an ingest thread");
        match doorbell.get_fd() {
            Ok(fd) => epoll.add(fd, DOORBELL),
            // Commands are still taken every round, at the latest after
            // IDLE_POLL.
            Err(e) => tracing::warn!(error = %e, "ingest doorbell has no descriptor"),
        }
        Thread {
            env,
            rx,
            doorbell,
            listeners: Vec::new(),
            at: HashMap::new(),
            epoll,
        }
    }

    pub(super) fn run(&mut self) {
        let mut frames = Frames::default();
        // Per listener position: its descriptor fired this round.
        let mut fired: Vec<bool> = Vec::new();
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
            // The set follows each listener's watched socket; the old
            // registration goes first, as the new socket may have the old
            // one's number (module docs).
            for l in &mut self.listeners {
                let (watch, serial) = l.watching();
                if (watch, serial) == (l.polled.watch, l.polled.serial) {
                    continue;
                }
                let fd = l.watched(watch).and_then(|s| s.get_fd().ok());
                if let Some(old) = l.polled.fd {
                    self.epoll.remove(old, l.id);
                }
                if let Some(new) = fd {
                    self.epoll.add(new, l.id);
                }
                l.polled = Polled { watch, serial, fd };
                l.hot = true;
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
            let n = self.listeners.len();
            fired.clear();
            fired.resize(n, false);
            let mut doorbell = false;
            let mut any_fired = false;
            for ev in self.epoll.wait(n + 1, ms) {
                let id = ev.u64;
                if id == DOORBELL {
                    doorbell = true;
                } else if let Some(&i) = self.at.get(&id) {
                    fired[i] = true;
                    any_fired = true;
                }
            }
            // Once per IDLE_POLL, busy or not, every socket is checked, so
            // a missed signal could never stall a listener (or the doorbell)
            // for longer than that.
            let after = Instant::now();
            let sweep = after.duration_since(last_sweep) >= IDLE_POLL;
            if sweep {
                last_sweep = after;
                for l in &mut self.listeners {
                    l.hot = true;
                }
            }
            if any_hot || any_fired {
                self.env.lag.behind(self.env.slot, after);
            }
            // Reading starts one listener further each round, so a spent
            // byte budget leaves a different one for the next round.
            let mut budget = self.env.config.max_bytes_per_round;
            start = if n == 0 { 0 } else { (start + 1) % n };
            for k in 0..n {
                let i = (start + k) % n;
                let l = &mut self.listeners[i];
                let w = l.polled.watch;
                if w == Watch::None || !(l.hot || fired[i]) {
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
            if doorbell || sweep {
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
                        self.at.insert(l.id, self.listeners.len());
                        self.listeners.push(l);
                        let _ = ack.send(());
                    }
                    Ok(Cmd::Remove(id, ack)) => {
                        if let Some(pos) = self.at.remove(&id) {
                            let mut l = self.listeners.swap_remove(pos);
                            if let Some(moved) = self.listeners.get(pos) {
                                self.at.insert(moved.id, pos);
                            }
                            // Out of the set while the descriptor is still
                            // this socket's: once closed, its number may be
                            // handed out again.
                            if let Some(fd) = l.polled.fd {
                                self.epoll.remove(fd, l.id);
                            }
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

/// The thread's epoll set: level-triggered EPOLLIN on the doorbell and on
/// each listener's watched descriptor, each event carrying its owner's id
/// (a listener id, or [`DOORBELL`]). Closed with the thread.
struct Epoll {
    fd: OwnedFd,
    /// What this thread registered: descriptor -> owner. The kernel's set
    /// may hold less (a closed descriptor leaves it by itself); this map
    /// decides who may delete a number (module docs).
    owners: HashMap<RawFd, u64>,
    /// `epoll_wait`'s output buffer.
    events: Vec<libc::epoll_event>,
}

impl Epoll {
    fn new() -> io::Result<Epoll> {
        // SAFETY: no pointer argument; a negative result is checked below.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Epoll {
            // SAFETY: `fd` was just returned by epoll_create1, is open, and
            // nothing else owns it; the OwnedFd closes it once.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            owners: HashMap::new(),
            events: Vec::new(),
        })
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, owner: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: owner,
        };
        // SAFETY: `self.fd` is an open epoll descriptor (owned by `self`);
        // `ev` is a valid epoll_event that outlives the call (the kernel
        // copies it, and ignores it for EPOLL_CTL_DEL). `fd` is only a
        // number to the kernel: a closed or foreign one yields an error.
        let rc = unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), op, fd, &mut ev) };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// Watches `fd` for `owner`, whatever was registered under that number
    /// before: a registration of this very descriptor is modified to carry
    /// `owner`.
    fn add(&mut self, fd: RawFd, owner: u64) {
        let r = match self.ctl(libc::EPOLL_CTL_ADD, fd, owner) {
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                match self.ctl(libc::EPOLL_CTL_MOD, fd, owner) {
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                        self.ctl(libc::EPOLL_CTL_ADD, fd, owner)
                    }
                    r => r,
                }
            }
            r => r,
        };
        match r {
            Ok(()) => {
                self.owners.insert(fd, owner);
            }
            Err(e) => {
                // Whatever the map said of this number is stale now. The
                // socket is still read on every IDLE_POLL sweep.
                self.owners.remove(&fd);
                tracing::warn!(error = %e, fd, "epoll_ctl failed; the socket is checked once a second only");
            }
        }
    }

    /// Stops watching `fd` for `owner`, if `owner` is who registered that
    /// number: after a close, the number may belong to someone else's
    /// socket. A descriptor that already left the set (closed) is no error.
    fn remove(&mut self, fd: RawFd, owner: u64) {
        if self.owners.get(&fd) != Some(&owner) {
            return;
        }
        self.owners.remove(&fd);
        match self.ctl(libc::EPOLL_CTL_DEL, fd, owner) {
            Ok(()) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EBADF)) => {}
            Err(e) => tracing::warn!(error = %e, fd, "epoll_ctl delete failed"),
        }
    }

    /// Waits up to `ms` (0: not at all, -1: without limit) for at most
    /// `max` ready descriptors; returns their events (none on an error,
    /// which is logged unless it is EINTR).
    fn wait(&mut self, max: usize, ms: i32) -> &[libc::epoll_event] {
        let max = max.clamp(1, i32::MAX as usize);
        if self.events.len() < max {
            self.events
                .resize(max, libc::epoll_event { events: 0, u64: 0 });
        }
        // SAFETY: `self.fd` is an open epoll descriptor; `self.events` is a
        // live, exclusively borrowed buffer of at least `max` epoll_event
        // structs, and the kernel writes at most `max` of them.
        let rc = unsafe {
            libc::epoll_wait(
                self.fd.as_raw_fd(),
                self.events.as_mut_ptr(),
                max as libc::c_int,
                ms,
            )
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                tracing::warn!(error = %e, "epoll_wait failed");
                // A failure that persists must not turn the loop into a
                // spin that floods the log; the round still runs (the sweep
                // reads every socket).
                std::thread::sleep(WAIT_FAILED_PAUSE);
            }
            return &[];
        }
        &self.events[..rc as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::Epoll;
    use std::io::Write;
    use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
    use std::os::unix::net::UnixStream;

    /// The owners of the ready descriptors, without waiting.
    fn ready(ep: &mut Epoll) -> Vec<u64> {
        let mut ids: Vec<u64> = ep.wait(16, 0).iter().map(|e| e.u64).collect();
        ids.sort_unstable();
        ids
    }

    /// A readable pair: the read end's descriptor and the write end.
    fn pair() -> (UnixStream, UnixStream) {
        UnixStream::pair().unwrap()
    }

    /// Closes `old` and opens another file under the same number, as a
    /// socket closed by one listener and opened by another can get it.
    fn reuse(old: RawFd, file: &UnixStream) -> OwnedFd {
        // SAFETY: `old` is an open descriptor this test owns (from
        // `into_raw_fd`) and `file` is open; dup2 closes `old`'s file and
        // makes `old` a copy of `file`, which the returned OwnedFd owns.
        let rc = unsafe { libc::dup2(file.as_raw_fd(), old) };
        assert_eq!(rc, old, "{}", std::io::Error::last_os_error());
        // SAFETY: `old` is open (dup2 succeeded) and owned by nobody else.
        unsafe { OwnedFd::from_raw_fd(old) }
    }

    #[test]
    fn level_triggered_until_drained_and_deleted() {
        let mut ep = Epoll::new().unwrap();
        let (r, mut w) = pair();
        ep.add(r.as_raw_fd(), 7);
        assert!(ready(&mut ep).is_empty());
        w.write_all(b"x").unwrap();
        assert_eq!(ready(&mut ep), [7]);
        assert_eq!(ready(&mut ep), [7], "still readable, still reported");
        ep.remove(r.as_raw_fd(), 7);
        assert!(ready(&mut ep).is_empty());
        assert!(ep.owners.is_empty());
    }

    #[test]
    fn adding_a_registered_descriptor_again_changes_its_owner() {
        let mut ep = Epoll::new().unwrap();
        let (r, mut w) = pair();
        ep.add(r.as_raw_fd(), 1);
        ep.add(r.as_raw_fd(), 2);
        w.write_all(b"x").unwrap();
        assert_eq!(ready(&mut ep), [2]);
        // The old owner no longer owns the number: its delete is a no-op.
        ep.remove(r.as_raw_fd(), 1);
        assert_eq!(ready(&mut ep), [2]);
    }

    /// Listener 1's socket closes, listener 2's new socket gets the same
    /// descriptor number and registers it, then listener 1 catches up on
    /// its change: its delete must not take listener 2's registration.
    #[test]
    fn a_reused_number_stays_with_its_new_owner() {
        let mut ep = Epoll::new().unwrap();
        let (r1, _w1) = pair();
        let n = r1.into_raw_fd();
        ep.add(n, 1);
        let (r2, mut w2) = pair();
        let reused = reuse(n, &r2);
        ep.add(n, 2);
        ep.remove(n, 1);
        w2.write_all(b"x").unwrap();
        assert_eq!(ready(&mut ep), [2]);
        assert_eq!(ep.owners.get(&n), Some(&2));
        // Its own delete works, and a second one is a no-op.
        ep.remove(n, 2);
        ep.remove(n, 2);
        assert!(ready(&mut ep).is_empty());
        drop(reused);
    }

    /// The same, with listener 1's delete first: it meets a number that is
    /// no longer in the set (ENOENT), and listener 2's add still registers
    /// although the map knew the number.
    #[test]
    fn a_reused_number_is_registered_after_a_stale_delete() {
        let mut ep = Epoll::new().unwrap();
        let (r1, _w1) = pair();
        let n = r1.into_raw_fd();
        ep.add(n, 1);
        let (r2, mut w2) = pair();
        let _reused = reuse(n, &r2);
        ep.remove(n, 1);
        ep.add(n, 2);
        w2.write_all(b"x").unwrap();
        assert_eq!(ready(&mut ep), [2]);
    }

    /// A descriptor closed and not reused left the set by itself: deleting
    /// it (EBADF) is no error and forgets it.
    #[test]
    fn deleting_a_closed_descriptor_forgets_it() {
        let mut ep = Epoll::new().unwrap();
        let (r, w) = pair();
        let n = r.as_raw_fd();
        ep.add(n, 3);
        drop((r, w));
        ep.remove(n, 3);
        assert!(ep.owners.is_empty());
        assert!(ready(&mut ep).is_empty());
    }
}
