//! The harness HTTP client against a raw loopback socket: request framing,
//! keep-alive reuse, Content-Length and chunked bodies, `Connection: close`,
//! and the timeout.

use std::time::Duration;

use kvselect_harness::http::HttpConn;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Reads one request (head + Content-Length body) from `s`.
async fn read_request(
    s: &mut tokio::net::TcpStream,
    buf: &mut Vec<u8>,
) -> Option<(String, Vec<u8>)> {
    loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8(buf[..p].to_vec()).unwrap();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("Content-Length: "))
                .map(|v| v.trim().parse().unwrap())
                .unwrap_or(0);
            while buf.len() < p + 4 + len {
                let mut c = [0u8; 4096];
                let n = s.read(&mut c).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&c[..n]);
            }
            let body = buf[p + 4..p + 4 + len].to_vec();
            buf.drain(..p + 4 + len);
            return Some((head, body));
        }
        let mut c = [0u8; 4096];
        let n = s.read(&mut c).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&c[..n]);
    }
}

#[tokio::test]
async fn keep_alive_content_length_chunked_and_close() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let server = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = Vec::new();
        let mut seen = Vec::new();
        // 1: echo the body length with Content-Length.
        let (head, body) = read_request(&mut s, &mut buf).await.unwrap();
        seen.push(head);
        let reply = format!("{{\"len\":{}}}", body.len());
        s.write_all(
            format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{reply}",
                reply.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        // 2: chunked 201 on the same connection.
        let (head, _) = read_request(&mut s, &mut buf).await.unwrap();
        seen.push(head);
        s.write_all(b"HTTP/1.1 201 Created\r\ntransfer-encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\n\r\n")
            .await
            .unwrap();
        // 3: 404 asking to close.
        let (head, _) = read_request(&mut s, &mut buf).await.unwrap();
        seen.push(head);
        s.write_all(b"HTTP/1.1 404 Not Found\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}")
            .await
            .unwrap();
        seen
    });

    let mut c = HttpConn::connect(&addr).await.unwrap();
    let t = Duration::from_secs(5);
    let big = vec![b'7'; 100_000];
    assert_eq!(
        c.request("POST", "/select", Some(&big), t).await.unwrap(),
        200
    );
    assert_eq!(c.body(), b"{\"len\":100000}");
    assert!(c.reusable());
    assert_eq!(
        c.request("DELETE", "/reservations/x", None, t)
            .await
            .unwrap(),
        201
    );
    assert_eq!(c.body(), b"{\"a\":1}");
    assert_eq!(
        c.request("POST", "/reservations/x/output_block", Some(b"{}"), t)
            .await
            .unwrap(),
        404
    );
    assert!(!c.reusable(), "Connection: close is honoured");
    let seen = server.await.unwrap();
    assert!(seen[0].starts_with("POST /select HTTP/1.1\r\n"));
    assert!(seen[0].contains("Content-Type: application/json"));
    assert!(seen[1].starts_with("DELETE /reservations/x HTTP/1.1\r\n"));
    assert!(seen[1].contains("Content-Length: 0"));
    assert!(seen[2].contains("Content-Length: 2"));
}

#[tokio::test]
async fn a_silent_server_times_out() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let _hold = tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        drop(s);
    });
    let mut c = HttpConn::connect(&addr).await.unwrap();
    let e = c
        .request("GET", "/health", None, Duration::from_millis(200))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
    assert!(!c.reusable());
}
