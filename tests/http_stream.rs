//! The streamed request path on the real binary: a prompt body written to
//! the socket in many small pieces (each usually its own hyper frame), with
//! Content-Length and with chunked transfer encoding, gets the same answer
//! as the same body written at once: the same values for a valid body, the
//! same status and error text (message, path, byte offset) for a bad one.

#[path = "common/process.rs"]
mod process;

use process::{parse_response, request, Binary, RawResponse};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

const JSON: (&str, &str) = ("Content-Type", "application/json");

/// `body` written `piece` bytes at a time with a short pause between
/// writes (so the server reads them as separate frames), chunked or with a
/// Content-Length.
fn trickle(addr: SocketAddr, path: &str, body: &[u8], piece: usize, chunked: bool) -> RawResponse {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let framing = if chunked {
        "Transfer-Encoding: chunked".to_string()
    } else {
        format!("Content-Length: {}", body.len())
    };
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: kvselect\r\nConnection: close\r\nContent-Type: application/json\r\n{framing}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).unwrap();
    for (k, p) in body.chunks(piece).enumerate() {
        if chunked {
            s.write_all(format!("{:x}\r\n", p.len()).as_bytes())
                .unwrap();
            s.write_all(p).unwrap();
            s.write_all(b"\r\n").unwrap();
        } else {
            s.write_all(p).unwrap();
        }
        if k % 4 == 0 {
            std::thread::sleep(Duration::from_micros(300));
        }
    }
    if chunked {
        s.write_all(b"0\r\n\r\n").unwrap();
    }
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read response");
    parse_response(&raw)
        .unwrap_or_else(|| panic!("bad response: {}", String::from_utf8_lossy(&raw)))
}

/// A prompt body of `n` tokens with `bad` in place of token `at`.
fn body(n: usize, at: usize, bad: &str) -> Vec<u8> {
    let mut s = String::from(r#"{"model_name":"m","selection_id":"s-1","token_ids":["#);
    for k in 0..n {
        if k > 0 {
            s.push_str(if k % 5 == 0 { ", " } else { "," });
        }
        if k == at {
            s.push_str(bad);
        } else {
            s.push_str(&((k as u64 * 2_654_435_761) % 200_000).to_string());
        }
    }
    s.push_str(r#"],"lora_name":null}"#);
    s.into_bytes()
}

fn text(r: &RawResponse) -> String {
    String::from_utf8_lossy(&r.body).into_owned()
}

#[test]
fn bodies_sent_in_small_pieces_get_the_whole_body_answers() {
    let b = Binary::start(&[]);
    // A KV-event endpoint nobody serves (port of this test's range): the
    // worker is schedulable, its cache stays empty.
    let worker = br#"{"worker_id":1,"model_name":"m","endpoint":"http://w1","block_size":16,
        "kv_events_endpoints":{"0":"tcp://127.0.0.1:19007"}}"#;
    assert_eq!(
        request(b.addr, "POST", "/workers", &[JSON], worker).status,
        201
    );

    // Valid: 100k tokens (~650 KB) and 3k tokens, on the pure-read routes.
    for (n, pieces) in [(100_000, &[4093usize, 65_536][..]), (3_000, &[61, 7][..])] {
        let valid = body(n, usize::MAX, "");
        for path in ["/potential_loads", "/overlap_scores"] {
            let whole = request(b.addr, "POST", path, &[JSON], &valid);
            assert_eq!(whole.status, 200, "{}", text(&whole));
            // The answers depend on the token count: the ids were read.
            let want = match path {
                "/potential_loads" => format!("\"potential_prefill_tokens\":{n}"),
                _ => format!("\"num_blocks\":{}", n / 16),
            };
            assert!(text(&whole).contains(&want), "{}", text(&whole));
            for &piece in pieces {
                for chunked in [false, true] {
                    let r = trickle(b.addr, path, &valid, piece, chunked);
                    assert_eq!(
                        (r.status, text(&r)),
                        (whole.status, text(&whole)),
                        "{path} n={n} piece={piece} chunked={chunked}"
                    );
                }
            }
        }
    }

    // Bad bodies: the error text, path and byte offset of the whole body.
    let n = 4_000;
    for (at, bad, status) in [
        (2_345, "007", 400),
        (3_999, "1.5", 422),
        (500, "4294967296", 422),
        (1_000, "-3", 422),
        (3, "]", 400),
    ] {
        let bad_body = body(n, at, bad);
        let whole = request(b.addr, "POST", "/select", &[JSON], &bad_body);
        assert_eq!(whole.status, status, "{bad}: {}", text(&whole));
        assert!(text(&whole).contains("byte "), "{}", text(&whole));
        for piece in [997, 64, 5] {
            for chunked in [false, true] {
                let r = trickle(b.addr, "/select", &bad_body, piece, chunked);
                assert_eq!(
                    (r.status, text(&r)),
                    (whole.status, text(&whole)),
                    "bad={bad} piece={piece} chunked={chunked}"
                );
            }
        }
    }
    // Truncated JSON, split inside a number.
    let cut = body(2000, usize::MAX, "");
    let cut = &cut[..cut.len() / 2];
    let whole = request(b.addr, "POST", "/select", &[JSON], cut);
    assert_eq!(whole.status, 400, "{}", text(&whole));
    assert!(text(&whole).contains("EOF"), "{}", text(&whole));
    for chunked in [false, true] {
        let r = trickle(b.addr, "/select", cut, 9, chunked);
        assert_eq!((r.status, text(&r)), (whole.status, text(&whole)));
    }
}

/// One response on a keep-alive connection: the head, then Content-Length
/// bytes of body.
#[cfg(target_os = "linux")]
fn read_response(s: &mut TcpStream) -> RawResponse {
    let mut raw = Vec::new();
    let mut byte = [0u8; 1];
    while !raw.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).expect("response head");
        raw.push(byte[0]);
    }
    let head = parse_response(&raw).expect("response head");
    let len: usize = head.header("content-length").unwrap().parse().unwrap();
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).expect("response body");
    RawResponse { body, ..head }
}

#[cfg(target_os = "linux")]
fn keep_alive_head(path: &str, len: usize) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: kvselect\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
    )
}

/// A large body sent in 64 KiB pieces with pauses between them wakes the
/// server's worker once per 256 KiB or at its end, not once per piece (the
/// receive low-water mark, `src/http/wake.rs`). The mark goes back to
/// 1 after each body: a small request on the same keep-alive connection is
/// answered at once, and so is one written straight after a large body.
#[cfg(target_os = "linux")]
#[test]
fn a_large_body_wakes_the_server_when_it_is_all_there() {
    let b = Binary::start(&["--http-threads", "1"]);
    let worker = br#"{"worker_id":1,"model_name":"m","endpoint":"http://w1","block_size":16,
        "kv_events_endpoints":{"0":"tcp://127.0.0.1:19008"}}"#;
    assert_eq!(
        request(b.addr, "POST", "/workers", &[JSON], worker).status,
        201
    );
    let valid = body(100_000, usize::MAX, "");
    let small = body(40, usize::MAX, "");
    let whole = request(b.addr, "POST", "/potential_loads", &[JSON], &valid);
    assert_eq!(whole.status, 200, "{}", text(&whole));
    let small_whole = request(b.addr, "POST", "/potential_loads", &[JSON], &small);
    assert_eq!(small_whole.status, 200, "{}", text(&small_whole));

    let mut s = TcpStream::connect(b.addr).expect("connect");
    s.set_nodelay(true).unwrap();
    // A mark left raised would hold the small request until this fails.
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let pieces = valid.len().div_ceil(65_536);
    assert!(pieces >= 10, "{pieces}");
    let mut parks = Vec::new();
    for _ in 0..3 {
        let before = kvselect::runtime::worker_parks(b.pid() as u32);
        s.write_all(keep_alive_head("/potential_loads", valid.len()).as_bytes())
            .unwrap();
        for piece in valid.chunks(65_536) {
            s.write_all(piece).unwrap();
            std::thread::sleep(Duration::from_millis(5));
        }
        let r = read_response(&mut s);
        parks.push(kvselect::runtime::worker_parks(b.pid() as u32) - before);
        assert_eq!((r.status, text(&r)), (whole.status, text(&whole)));
        s.write_all(keep_alive_head("/potential_loads", small.len()).as_bytes())
            .unwrap();
        s.write_all(&small).unwrap();
        let r = read_response(&mut s);
        assert_eq!(
            (r.status, text(&r)),
            (small_whole.status, text(&small_whole))
        );
    }
    // Without the mark every piece is a wake-up (11-12 for 11 pieces);
    // with it, the head and first piece, then one per 256 KiB: 3 or 4.
    parks.sort();
    eprintln!("worker parks per body: {parks:?}, {pieces} pieces");
    assert!(
        parks[1] <= 6,
        "worker parks per body: {parks:?}, {pieces} pieces"
    );

    // A large body and a small request in one write: both answered.
    let mut both = keep_alive_head("/potential_loads", valid.len()).into_bytes();
    both.extend_from_slice(&valid);
    both.extend_from_slice(keep_alive_head("/potential_loads", small.len()).as_bytes());
    both.extend_from_slice(&small);
    s.write_all(&both).unwrap();
    let r = read_response(&mut s);
    assert_eq!((r.status, text(&r)), (whole.status, text(&whole)));
    let r = read_response(&mut s);
    assert_eq!(
        (r.status, text(&r)),
        (small_whole.status, text(&small_whole))
    );
}
