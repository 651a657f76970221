//! Regression tests of the authentication finding: anyone who reached the
//! port could delete every worker or PATCH a worker's endpoint. With
//! `--auth-token-file`, every route but /health needs a bearer token; the
//! file holds several tokens and is re-read on SIGHUP. Also HTTPS.

mod common;
#[path = "common/process.rs"]
mod process;

use bytes::Bytes;
use common::{start_with, test_config};
use http_body_util::{BodyExt, Full};
use hyper::Request;
use process::{request, Binary};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let p = std::env::temp_dir().join(format!("kvselect-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Every (method, path) the server routes, plus paths it does not.
const ROUTES: &[(&str, &str)] = &[
    ("GET", "/ready"),
    ("GET", "/workers"),
    ("POST", "/workers"),
    ("PATCH", "/workers/1"),
    ("DELETE", "/workers/1"),
    ("POST", "/select"),
    ("POST", "/select_and_reserve"),
    ("POST", "/reservations"),
    ("DELETE", "/reservations/abc"),
    ("POST", "/reservations/abc/prefill_complete"),
    ("POST", "/reservations/abc/output_block"),
    ("GET", "/loads"),
    ("POST", "/potential_loads"),
    ("POST", "/overlap_scores"),
    ("GET", "/dump"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("GET", "/replica_sync/peers"),
    ("POST", "/replica_sync/register_peer"),
    ("POST", "/replica_sync/deregister_peer"),
    ("GET", "/no/such/route"),
    ("PUT", "/health/x"),
];

#[tokio::test]
async fn the_token_guards_every_route_but_health() {
    let dir = TempDir::new();
    let tokens = dir.0.join("tokens");
    std::fs::write(&tokens, "# current and next\nold-token\nnew-token\n").unwrap();
    let mut config = test_config();
    config.auth_token_file = Some(tokens.clone());
    let s = start_with(config).await;
    let addr = s.addr;
    let worker = br#"{"worker_id":1,"model_name":"m","endpoint":"http://w1","block_size":16}"#;
    tokio::task::spawn_blocking(move || {
        let json = ("Content-Type", "application/json");
        for &(method, path) in ROUTES {
            for auth in [
                None,
                Some("Bearer wrong"),
                Some("Basic b2xkLXRva2Vu"),
                Some("Bearer old-tokenx"),
            ] {
                let mut h = vec![json];
                if let Some(a) = auth {
                    h.push(("Authorization", a));
                }
                let r = request(addr, method, path, &h, b"{}");
                assert_eq!(r.status, 401, "{method} {path} with {auth:?}");
                let challenge = r.header("www-authenticate").expect("challenge");
                assert!(
                    challenge.starts_with("Bearer realm=\"kvselect\""),
                    "{challenge}"
                );
                assert_eq!(
                    auth == Some("Bearer wrong") || auth == Some("Bearer old-tokenx"),
                    challenge.contains("invalid_token")
                );
            }
            for token in ["Bearer old-token", "bearer new-token"] {
                let r = request(addr, method, path, &[json, ("Authorization", token)], b"{}");
                assert_ne!(r.status, 401, "{method} {path}");
            }
        }
        // /health needs nothing.
        assert_eq!(request(addr, "GET", "/health", &[], b"").status, 200);
        // A mutating call goes through only with a token.
        let r = request(addr, "POST", "/workers", &[json], worker);
        assert_eq!(r.status, 401);
        let r = request(
            addr,
            "POST",
            "/workers",
            &[json, ("Authorization", "Bearer new-token")],
            worker,
        );
        assert_eq!(r.status, 201);
        let r = request(addr, "DELETE", "/workers/1", &[], b"");
        assert_eq!(r.status, 401);
    })
    .await
    .unwrap();
    let metrics = tokio::task::spawn_blocking(move || {
        request(
            addr,
            "GET",
            "/metrics",
            &[("Authorization", "Bearer old-token")],
            b"",
        )
    })
    .await
    .unwrap();
    assert_eq!(metrics.status, 200);
    let text = String::from_utf8(metrics.body).unwrap();
    let refused: u64 = text
        .lines()
        .filter(|l| l.starts_with("kvselect_http_requests_total{") && l.contains("status=\"401\""))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert!(refused > 80, "{text}");
}

#[test]
fn the_token_file_is_re_read_on_sighup_and_a_bad_file_keeps_the_tokens() {
    let dir = TempDir::new();
    let tokens = dir.0.join("tokens");
    std::fs::write(&tokens, "first\n").unwrap();
    let server = Binary::start(&["--auth-token-file", tokens.to_str().unwrap()]);
    let get = |t: &str| {
        let h = format!("Bearer {t}");
        request(
            server.addr,
            "GET",
            "/workers",
            &[("Authorization", h.as_str())],
            b"",
        )
        .status
    };
    assert_eq!(get("first"), 200);
    assert_eq!(get("second"), 401);
    let reloaded = |n: usize| {
        process::Binary::log_text(&server)
            .matches("auth tokens reloaded")
            .count()
            == n
    };
    std::fs::write(&tokens, "first\nsecond\n").unwrap();
    server.signal(libc::SIGHUP);
    wait(|| reloaded(1));
    assert_eq!(get("first"), 200);
    assert_eq!(get("second"), 200);
    std::fs::write(&tokens, "\n# empty\n").unwrap();
    server.signal(libc::SIGHUP);
    wait(|| server.log_text().contains("auth token reload failed"));
    assert_eq!(get("second"), 200, "a bad file keeps the tokens in force");
    std::fs::write(&tokens, "second\n").unwrap();
    server.signal(libc::SIGHUP);
    wait(|| reloaded(2));
    assert_eq!(get("first"), 401);
    assert_eq!(get("second"), 200);
    assert!(
        !server.log_text().contains("first"),
        "tokens are never logged"
    );
}

fn wait(f: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(std::time::Instant::now() < deadline, "timed out");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_missing_or_empty_token_file_stops_start_up() {
    let dir = TempDir::new();
    let empty = dir.0.join("empty");
    std::fs::write(&empty, "# no tokens\n").unwrap();
    for path in [empty, dir.0.join("missing")] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvselect"))
            .args(["--port", "0", "--auth-token-file", path.to_str().unwrap()])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("auth token file"), "{err}");
    }
}

#[tokio::test]
async fn https_serves_http1_and_h2_with_the_token() {
    let dir = TempDir::new();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (cert_pem, key_pem) = (dir.0.join("cert.pem"), dir.0.join("key.pem"));
    std::fs::write(&cert_pem, cert.cert.pem()).unwrap();
    std::fs::write(&key_pem, cert.key_pair.serialize_pem()).unwrap();
    let tokens = dir.0.join("tokens");
    std::fs::write(&tokens, "t0k3n\n").unwrap();
    let mut config = test_config();
    config.tls = Some(kvselect::config::TlsFiles {
        cert: cert_pem,
        key: key_pem,
    });
    config.auth_token_file = Some(tokens);
    let s = start_with(config).await;

    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.cert.der().clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    for alpn in [&b"h2"[..], b"http/1.1"] {
        let mut tls = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots.clone())
            .with_no_client_auth();
        tls.alpn_protocols = vec![alpn.to_vec()];
        let connector = tokio_rustls::TlsConnector::from(Arc::new(tls));
        let tcp = tokio::net::TcpStream::connect(s.addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let stream = connector.connect(name, tcp).await.unwrap();
        let io = hyper_util::rt::TokioIo::new(stream);
        let get = |auth: Option<&str>| {
            let mut b = Request::builder().uri(format!("https://localhost/{}", "workers"));
            if let Some(a) = auth {
                b = b.header("authorization", a);
            }
            b.body(Full::new(Bytes::new())).unwrap()
        };
        let statuses = if alpn == b"h2" {
            let (mut send, conn) =
                hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
                    .await
                    .unwrap();
            tokio::spawn(conn);
            let a = send.send_request(get(None)).await.unwrap();
            let b = send.send_request(get(Some("Bearer t0k3n"))).await.unwrap();
            assert_eq!(b.version(), hyper::Version::HTTP_2);
            let body = b.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(&body[..], b"[]");
            (a.status().as_u16(), 200)
        } else {
            let (mut send, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
            tokio::spawn(conn);
            let a = send.send_request(get(None)).await.unwrap();
            let a_status = a.status().as_u16();
            a.into_body().collect().await.unwrap();
            let b = send.send_request(get(Some("Bearer t0k3n"))).await.unwrap();
            (a_status, b.status().as_u16())
        };
        assert_eq!(statuses, (401, 200), "{}", String::from_utf8_lossy(alpn));
    }
    // Plain HTTP on the TLS port gets no answer.
    let addr = s.addr;
    let plain = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut buf = Vec::new();
        let _ = c.read_to_end(&mut buf);
        buf
    })
    .await
    .unwrap();
    assert!(!plain.starts_with(b"HTTP/1.1 200"));
}
