//! Regression tests of the drain finding: SIGTERM under load cut 15 of 2,394
//! accepted requests. Now: queued connections are taken, the listener
//! closes, /ready turns 503, every request on a connection the kernel
//! accepted gets its response (`Connection: close`),
//! then the process exits 0 within `--shutdown-timeout-secs`; a second
//! signal exits at once.

mod common;
#[path = "common/process.rs"]
mod process;

use process::{parse_response, request, Binary};
use serde_json::json;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CLIENTS: usize = 32;

#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    /// Sent on an open connection and never answered.
    cut: AtomicU64,
    /// Connect refused once the listener closed (never accepted).
    refused: AtomicU64,
    closes: AtomicU64,
}

/// Reads one response (head + Content-Length body) from `s`.
async fn read_response(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(u16, bool)> {
    buf.clear();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let r = parse_response(&buf[..end + 4])?;
            let len: usize = r.header("content-length")?.parse().ok()?;
            if buf.len() >= end + 4 + len {
                let close = r
                    .header("connection")
                    .is_some_and(|v| v.eq_ignore_ascii_case("close"));
                return Some((r.status, close));
            }
        }
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Keep-alive request loop until the server stops taking connections.
async fn client(addr: SocketAddr, req: Arc<Vec<u8>>, counts: Arc<Counts>, stop: Arc<AtomicBool>) {
    let mut buf = Vec::new();
    'connect: loop {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let Ok(mut s) = TcpStream::connect(addr).await else {
            counts.refused.fetch_add(1, Ordering::Relaxed);
            return;
        };
        loop {
            if s.write_all(&req).await.is_err() {
                // Closed before our request went out: not accepted.
                continue 'connect;
            }
            match read_response(&mut s, &mut buf).await {
                Some((_, close)) => {
                    counts.ok.fetch_add(1, Ordering::Relaxed);
                    if close {
                        counts.closes.fetch_add(1, Ordering::Relaxed);
                        continue 'connect;
                    }
                }
                None => {
                    counts.cut.fetch_add(1, Ordering::Relaxed);
                    continue 'connect;
                }
            }
        }
    }
}

fn select_request(tokens: usize) -> Vec<u8> {
    let body = serde_json::to_vec(&json!({
        "model_name": "m",
        "token_ids": (0..tokens as u32).collect::<Vec<_>>(),
    }))
    .unwrap();
    let mut r = format!(
        "POST /select HTTP/1.1\r\nHost: kvselect\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(&body);
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_cuts_no_accepted_request() {
    let mut server = Binary::start(&["--http-threads", "2", "--shutdown-timeout-secs", "10"]);
    let addr = server.addr;
    let kv = common::unused_endpoint();
    let r = request(
        addr,
        "POST",
        "/workers",
        &[("Content-Type", "application/json")],
        &serde_json::to_vec(
            &json!({"worker_id": 1, "model_name": "m", "endpoint": "http://w1",
            "block_size": 16, "kv_events_endpoints": {"0": kv}}),
        )
        .unwrap(),
    );
    assert_eq!(r.status, 201);
    let counts = Arc::new(Counts::default());
    let stop = Arc::new(AtomicBool::new(false));
    let req = Arc::new(select_request(4096));
    let mut tasks = Vec::new();
    for _ in 0..CLIENTS {
        tasks.push(tokio::spawn(client(
            addr,
            Arc::clone(&req),
            Arc::clone(&counts),
            Arc::clone(&stop),
        )));
    }
    // A /ready prober on its own keep-alive connection.
    let ready = tokio::spawn(async move {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let mut buf = Vec::new();
        let mut last = None;
        while let Some(r) = {
            if s.write_all(b"GET /ready HTTP/1.1\r\nHost: k\r\n\r\n")
                .await
                .is_err()
            {
                None
            } else {
                read_response(&mut s, &mut buf).await
            }
        } {
            last = Some(r);
            if r.1 {
                break;
            }
        }
        last
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = counts.ok.load(Ordering::Relaxed);
    let signalled = Instant::now();
    server.signal(libc::SIGTERM);
    let status = tokio::task::spawn_blocking(move || {
        let s = server.wait_exit(Duration::from_secs(15));
        (s, server)
    })
    .await
    .unwrap();
    let (status, server) = status;
    let exited = signalled.elapsed();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(10), t)
            .await
            .expect("client ends")
            .unwrap();
    }
    let last_ready = ready.await.unwrap();
    let c = &*counts;
    eprintln!(
        "answered {} ({} before SIGTERM), cut {}, refused after close {}, Connection: close seen {}, exit {:?} after {:?}",
        c.ok.load(Ordering::Relaxed),
        before,
        c.cut.load(Ordering::Relaxed),
        c.refused.load(Ordering::Relaxed),
        c.closes.load(Ordering::Relaxed),
        status,
        exited
    );
    let status = status.expect("exits within the deadline");
    assert!(status.success(), "{status:?}\n{}", server.log_text());
    assert!(before > 100, "load ran: {before}");
    assert_eq!(c.cut.load(Ordering::Relaxed), 0, "accepted requests cut");
    assert!(c.closes.load(Ordering::Relaxed) >= 1);
    assert_eq!(
        last_ready,
        Some((503, true)),
        "the last /ready answer is 503 with Connection: close"
    );
    let log = server.log_text();
    assert!(log.contains("draining"), "{log}");
    assert!(log.contains("all connections finished"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_deadline_bounds_a_stalled_request_and_a_second_signal_exits_at_once() {
    let stalled = b"POST /select HTTP/1.1\r\nHost: k\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{";
    // The deadline: a stalled upload holds the drain for 1 s, not its body timeout.
    let mut server = Binary::start(&[
        "--shutdown-timeout-secs",
        "1",
        "--body-read-timeout-secs",
        "60",
    ]);
    let mut c = TcpStream::connect(server.addr).await.unwrap();
    c.write_all(stalled).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t = Instant::now();
    server.signal(libc::SIGTERM);
    let status = server.wait_exit(Duration::from_secs(10)).expect("exits");
    let took = t.elapsed();
    assert!(status.success(), "{status:?}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(4),
        "{took:?}"
    );
    assert!(server.log_text().contains("shutdown deadline reached"));

    // A second signal does not wait for the 30 s deadline.
    let mut server = Binary::start(&[
        "--shutdown-timeout-secs",
        "30",
        "--body-read-timeout-secs",
        "60",
    ]);
    let mut c = TcpStream::connect(server.addr).await.unwrap();
    c.write_all(stalled).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    server.signal(libc::SIGTERM);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(server.child.try_wait().unwrap().is_none(), "still draining");
    let t = Instant::now();
    server.signal(libc::SIGINT);
    let status = server
        .wait_exit(Duration::from_secs(5))
        .expect("exits at once");
    assert_eq!(status.code(), Some(130));
    assert!(t.elapsed() < Duration::from_secs(2));
}
