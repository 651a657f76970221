//! The cost of one wake-up of an ingest thread with one ready stream among N
//! idle ones, for the two ways of waiting on the sockets' descriptors:
//!
//! - `poll`: rebuild the `pollfd` array each round, asking every socket for
//!   its ZMQ_FD (a getsockopt), then `poll(2)` and a scan of the results;
//! - `poll_cached_fds`: the same without the getsockopts (the array is kept,
//!   only `revents` reset), to tell the two costs apart;
//! - `epoll`: as the ingest thread waits (`src/ingest/poll.rs`): `epoll_wait`
//!   on a set kept across rounds, and each ready event's id looked up.
//!
//! The descriptors are a doorbell and N idle listeners, the ZMQ_FDs of real
//! ZMQ sockets that nobody sends to, plus one ready stream in the middle of
//! the array: a Unix socket holding one unread byte, so it stays readable
//! (level-triggered) for every iteration. The wait's timeout is 1 s, as an
//! idle thread's: `poll(2)` with a zero timeout would skip the wait-queue
//! entries that are its main cost, and the ready descriptor makes both calls
//! return at once. One iteration is one wake-up.
//!
//! Run: `nice -n 5 cargo bench --bench ingest_wakeup`

// poll / epoll_create1 / epoll_ctl / epoll_wait on descriptors this bench
// owns; each call has its SAFETY note.
#![allow(unsafe_code)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use std::collections::HashMap;
use std::hint::black_box;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// The thread's idle wait.
const TIMEOUT_MS: i32 = 1000;

/// A doorbell, `n` idle listener sockets and one ready stream.
struct Setup {
    _ctx: zmq::Context,
    doorbell: zmq::Socket,
    idle: Vec<zmq::Socket>,
    /// The ready stream's read end, and its writer (kept open).
    ready: (UnixStream, UnixStream),
}

impl Setup {
    fn new(n: usize) -> Setup {
        let ctx = zmq::Context::new();
        let sock = || {
            let s = ctx.socket(zmq::PULL).unwrap();
            // Process the commands a new socket has, so its ZMQ_FD is quiet.
            s.get_events().unwrap();
            s
        };
        let doorbell = sock();
        let idle: Vec<zmq::Socket> = (0..n).map(|_| sock()).collect();
        let (r, mut w) = UnixStream::pair().unwrap();
        w.write_all(b"x").unwrap();
        Setup {
            doorbell,
            idle,
            ready: (r, w),
            _ctx: ctx,
        }
    }

    /// The thread's pollfd array: the doorbell, then the listeners, the
    /// ready stream in the middle.
    fn pollfds(&self) -> Vec<libc::pollfd> {
        let mut fds = Vec::with_capacity(self.idle.len() + 2);
        self.fill(&mut fds);
        fds
    }

    fn fill(&self, fds: &mut Vec<libc::pollfd>) {
        let pfd = |fd: RawFd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        fds.clear();
        fds.push(pfd(self.doorbell.get_fd().unwrap()));
        let mid = self.idle.len() / 2;
        for (i, s) in self.idle.iter().enumerate() {
            if i == mid {
                fds.push(pfd(self.ready.0.as_raw_fd()));
            }
            fds.push(pfd(s.get_fd().unwrap()));
        }
    }
}

/// `poll(2)` over `fds`; the number of entries with events.
fn poll(fds: &mut [libc::pollfd]) -> usize {
    // SAFETY: `fds` is a live, exclusively borrowed array of `fds.len()`
    // pollfd structs for the duration of the call.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, TIMEOUT_MS) };
    assert!(rc >= 0, "{}", std::io::Error::last_os_error());
    fds.iter().filter(|p| p.revents != 0).count()
}

/// An epoll set of the same descriptors, each event carrying an id.
struct Epoll {
    fd: OwnedFd,
    events: Vec<libc::epoll_event>,
    /// Id -> position, as the thread maps ids back to listeners.
    at: HashMap<u64, usize>,
}

impl Epoll {
    fn new(fds: &[libc::pollfd]) -> Epoll {
        // SAFETY: no pointer argument; the result is checked.
        let raw = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        assert!(raw >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: `raw` is a new, open descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        for (i, p) in fds.iter().enumerate() {
            let mut ev = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: i as u64,
            };
            // SAFETY: `fd` is an open epoll descriptor, `p.fd` an open
            // descriptor of the setup, `ev` a valid event for the call.
            let rc = unsafe { libc::epoll_ctl(fd.as_raw_fd(), libc::EPOLL_CTL_ADD, p.fd, &mut ev) };
            assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        }
        Epoll {
            fd,
            events: vec![libc::epoll_event { events: 0, u64: 0 }; fds.len()],
            at: (0..fds.len()).map(|i| (i as u64, i)).collect(),
        }
    }

    /// One wait; the sum of the ready positions (so nothing is optimized
    /// away).
    fn wait(&mut self) -> usize {
        // SAFETY: `self.fd` is an open epoll descriptor; `self.events` is an
        // exclusively borrowed buffer of `self.events.len()` events, the
        // most the kernel writes.
        let rc = unsafe {
            libc::epoll_wait(
                self.fd.as_raw_fd(),
                self.events.as_mut_ptr(),
                self.events.len() as libc::c_int,
                TIMEOUT_MS,
            )
        };
        assert!(rc >= 0, "{}", std::io::Error::last_os_error());
        self.events[..rc as usize]
            .iter()
            .map(|e| {
                let id = e.u64;
                self.at[&id]
            })
            .sum()
    }
}

fn wakeup(c: &mut Criterion) {
    let mut g = c.benchmark_group("ingest_wakeup");
    for n in [32usize, 256] {
        let setup = Setup::new(n);
        let mut fds = setup.pollfds();
        assert_eq!(poll(&mut fds), 1, "exactly the ready stream is readable");
        g.bench_with_input(BenchmarkId::new("poll", n), &n, |b, _| {
            let mut fds = Vec::new();
            b.iter(|| {
                setup.fill(&mut fds);
                black_box(poll(&mut fds))
            })
        });
        g.bench_with_input(BenchmarkId::new("poll_cached_fds", n), &n, |b, _| {
            let mut fds = setup.pollfds();
            b.iter(|| {
                for p in &mut fds {
                    p.revents = 0;
                }
                black_box(poll(&mut fds))
            })
        });
        let mut ep = Epoll::new(&fds);
        assert_eq!(ep.wait(), n / 2 + 1, "only the ready stream fires");
        g.bench_with_input(BenchmarkId::new("epoll", n), &n, |b, _| {
            b.iter(|| black_box(ep.wait()))
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = wakeup
}
criterion_main!(benches);
