//! End-to-end CPU cost of one /select of a long prompt, measured on the real
//! server binary: HTTP in, parse, hash, overlap query, cost, JSON out.
//!
//! It starts `target/release/kvselect` on a free loopback port, registers
//! `--workers` workers, each with a real ZMQ PUB publishing vLLM-format
//! BlockStored events (a shared `--prefix`-token prefix plus a private
//! suffix), waits until the index holds them, then sends `--requests`
//! /select calls of `--isl`-token prompts over one keep-alive connection.
//! Server CPU comes from utime+stime in /proc/<pid>/stat.
//!
//! With `--pause-us N`, each body is written in `--piece`-byte pieces
//! (default 64 KiB) with N µs between them, as a network link delivers it
//! (64 KiB per 50 µs is about 10 Gbit/s); the report then also counts the
//! server's worker parks (voluntary context switches) per request.
//!
//!     cargo build --release && cargo run --release --example select_cpu
//!
//! Last line: `select_cpu_ms_per_request=<n>`.

use kvselect::index::Tier;
use kvselect::ingest::decode::{Group, KvEvent, Stored};
use kvselect::ingest::encode::{encode_batch, EventForm};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BS: u32 = 16;

struct Args {
    bin: String,
    workers: usize,
    requests: usize,
    isl: usize,
    prefix: usize,
    suffix_blocks: usize,
    path: String,
    piece: usize,
    pause_us: u64,
}

fn args() -> Args {
    let mut a = Args {
        bin: "target/release/kvselect".into(),
        workers: 64,
        requests: 2000,
        isl: 100_000,
        prefix: 16_000,
        suffix_blocks: 256,
        path: "/select".into(),
        piece: 64 * 1024,
        pause_us: 0,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i + 1 < v.len() {
        let x = &v[i + 1];
        match v[i].as_str() {
            "--bin" => a.bin = x.clone(),
            "--workers" => a.workers = x.parse().expect("--workers"),
            "--requests" => a.requests = x.parse().expect("--requests"),
            "--isl" => a.isl = x.parse().expect("--isl"),
            "--prefix" => a.prefix = x.parse().expect("--prefix"),
            "--suffix-blocks" => a.suffix_blocks = x.parse().expect("--suffix-blocks"),
            "--path" => a.path = x.clone(),
            "--piece" => a.piece = x.parse().expect("--piece"),
            "--pause-us" => a.pause_us = x.parse().expect("--pause-us"),
            other => panic!("unknown flag {other}"),
        }
        i += 2;
    }
    a
}

struct Http {
    r: BufReader<TcpStream>,
    w: TcpStream,
    /// Bodies written in pieces of this many bytes, this long apart.
    piece: usize,
    pause: Duration,
}

impl Http {
    fn connect(port: u16) -> Http {
        let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.set_nodelay(true).unwrap();
        Http {
            r: BufReader::new(s.try_clone().unwrap()),
            w: s,
            piece: usize::MAX,
            pause: Duration::ZERO,
        }
    }

    fn call(&mut self, method: &str, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        self.w.write_all(head.as_bytes()).unwrap();
        for (k, piece) in body.chunks(self.piece).enumerate() {
            if k > 0 {
                // A spin: sleeping has a granularity of tens of µs.
                let t = Instant::now();
                while t.elapsed() < self.pause {
                    std::hint::spin_loop();
                }
            }
            self.w.write_all(piece).unwrap();
        }
        let mut line = String::new();
        self.r.read_line(&mut line).unwrap();
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("status");
        let mut len = 0usize;
        loop {
            line.clear();
            self.r.read_line(&mut line).unwrap();
            if line == "\r\n" {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().unwrap();
                }
            }
        }
        let mut buf = vec![0; len];
        self.r.read_exact(&mut buf).unwrap();
        (status, buf)
    }
}

fn cpu_ticks(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &s[s.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

fn clk_tck() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
    KvEvent::Stored(Stored {
        block_hashes: hashes.to_vec(),
        parent_hash: parent,
        token_ids: tokens.to_vec(),
        eagle: false,
        block_size: BS,
        medium: Tier::Device,
        lora_name: None,
        cache_salt: None,
        mm_hashes: None,
        group: Group::default(),
    })
}

fn batch(events: &[KvEvent]) -> Vec<u8> {
    let mut p = Vec::new();
    encode_batch(&mut p, 0.0, events, None, EventForm::Map);
    p
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn main() {
    let a = args();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = Command::new(&a.bin)
        .args(["--port", &port.to_string(), "--http-threads", "1"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start {}: {e} (run `cargo build --release` first)",
                a.bin
            )
        });
    let pid = child.id();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut http = loop {
        if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
            drop(s);
            break Http::connect(port);
        }
        assert!(Instant::now() < deadline, "server did not start");
        std::thread::sleep(Duration::from_millis(20));
    };

    // Workers with real PUB sockets.
    let ctx = zmq::Context::new();
    let mut pubs = Vec::new();
    for w in 0..a.workers {
        let s = ctx.socket(zmq::PUB).unwrap();
        s.set_sndhwm(0).unwrap();
        s.bind("tcp://127.0.0.1:*").unwrap();
        let ep = s.get_last_endpoint().unwrap().unwrap();
        let body = format!(
            r#"{{"worker_id":{w},"model_name":"bench","endpoint":"http://w{w}","block_size":{BS},"kv_events_endpoints":{{"0":"{ep}"}}}}"#
        );
        let (st, resp) = http.call("POST", "/workers", body.as_bytes());
        assert_eq!(st, 201, "{}", String::from_utf8_lossy(&resp));
        pubs.push(s);
    }
    let prefix_tokens: Vec<u32> = (0..a.prefix as u32).map(|i| (i * 7919) % 151_936).collect();
    let prefix_blocks = a.prefix / BS as usize;
    // Publish until the index demonstrably holds every worker's prefix (ZMQ
    // subscribers connect asynchronously; stores are idempotent).
    let probe = format!(
        r#"{{"model_name":"bench","token_ids":{}}}"#,
        serde_json::to_string(&prefix_tokens).unwrap()
    );
    let t0 = Instant::now();
    let mut seq = vec![0u64; a.workers];
    loop {
        for (w, s) in pubs.iter().enumerate() {
            let hashes: Vec<u64> = (0..prefix_blocks as u64).map(|i| 1 + i).collect();
            let mut events = vec![stored(
                &hashes,
                None,
                &prefix_tokens[..prefix_blocks * BS as usize],
            )];
            let suffix: Vec<u32> = (0..(a.suffix_blocks * BS as usize) as u32)
                .map(|i| 200_000 + w as u32 * 10_000 + i)
                .collect();
            let shash: Vec<u64> = (0..a.suffix_blocks as u64).map(|i| 1_000_000 + i).collect();
            events.push(stored(&shash, Some(prefix_blocks as u64), &suffix));
            s.send_multipart(
                [&b""[..], &seq[w].to_be_bytes()[..], &batch(&events)[..]],
                0,
            )
            .unwrap();
            seq[w] += 1;
        }
        std::thread::sleep(Duration::from_millis(300));
        let (_, resp) = http.call("POST", "/overlap_scores", probe.as_bytes());
        let v: serde_json::Value = serde_json::from_slice(&resp).unwrap();
        let full = v["workers"]
            .as_array()
            .map(|ws| {
                ws.iter()
                    .filter(|w| w["device_blocks"] == prefix_blocks)
                    .count()
            })
            .unwrap_or(0);
        if full == a.workers {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "index never filled: {full}/{} workers",
            a.workers
        );
    }

    // Request bodies: the shared prefix plus a distinct tail, realistic ids.
    let bodies: Vec<Vec<u8>> = (0..8u32)
        .map(|k| {
            let mut t = prefix_tokens.clone();
            t.extend((0..(a.isl - a.prefix) as u32).map(|i| (i * 31 + k * 104_729) % 151_936));
            format!(
                r#"{{"model_name":"bench","token_ids":{}}}"#,
                serde_json::to_string(&t).unwrap()
            )
            .into_bytes()
        })
        .collect();
    for b in &bodies {
        let (st, resp) = http.call("POST", &a.path, b);
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&resp));
    }
    if a.pause_us > 0 {
        http.piece = a.piece;
        http.pause = Duration::from_micros(a.pause_us);
    }
    let parks0 = kvselect::runtime::worker_parks(pid);
    let ticks0 = cpu_ticks(pid);
    let wall0 = Instant::now();
    let mut lat = Vec::with_capacity(a.requests);
    for i in 0..a.requests {
        let t = Instant::now();
        let (st, _) = http.call("POST", &a.path, &bodies[i % bodies.len()]);
        lat.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!(st, 200);
    }
    let wall = wall0.elapsed().as_secs_f64();
    let cpu_s = (cpu_ticks(pid) - ticks0) as f64 / clk_tck();
    let parks = kvselect::runtime::worker_parks(pid) - parks0;
    let _ = child.kill();
    let _ = child.wait();
    lat.sort_by(|x, y| x.partial_cmp(y).unwrap());
    let body_mb = bodies[0].len() as f64 / 1e6;
    println!(
        "workers={} isl={} prefix={} body={:.2}MB requests={} wall={:.2}s",
        a.workers, a.isl, a.prefix, body_mb, a.requests, wall
    );
    println!(
        "latency_ms p50={:.3} p99={:.3} p999={:.3}",
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        percentile(&lat, 0.999)
    );
    println!(
        "server_cpu_s={cpu_s:.3} req_per_s={:.0} worker_parks_per_request={:.1} body_pieces={} pause_us={}",
        a.requests as f64 / wall,
        parks as f64 / a.requests as f64,
        if a.pause_us > 0 {
            bodies[0].len().div_ceil(a.piece)
        } else {
            1
        },
        a.pause_us
    );
    println!(
        "select_cpu_ms_per_request={:.3}",
        cpu_s * 1e3 / a.requests as f64
    );
}
