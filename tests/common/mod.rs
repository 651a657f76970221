//! Shared integration-test helpers: the real server on 127.0.0.1:0, a plain
//! HTTP/1.1 client, and a real ZMQ PUB publishing vLLM-format KV events.
#![allow(dead_code)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvselect::app::App;
use kvselect::config::Config;
use kvselect::http::Server;
use kvselect::ingest::decode::{tier_of_medium, Group, KvEvent, Removed, Stored};
use kvselect::ingest::encode::{encode_batch, EventForm};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct TestServer {
    pub addr: SocketAddr,
    pub app: Arc<App>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

pub struct Resp {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    pub fn error(&self) -> String {
        self.json()["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error key: {}", String::from_utf8_lossy(&self.body)))
            .to_string()
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub fn test_config() -> Config {
    Config {
        addr: "127.0.0.1:0".parse().unwrap(),
        threads: 2,
        ..Config::default()
    }
}

pub async fn start() -> TestServer {
    start_with(test_config()).await
}

pub async fn start_with(config: Config) -> TestServer {
    let listener = tokio::net::TcpListener::bind(config.addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Arc::new(App::new(config));
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = Server::from_config(Arc::clone(&app)).expect("server config");
    tokio::spawn(server.serve(listener, async move {
        let _ = rx.await;
    }));
    TestServer {
        addr,
        app,
        stop: Some(tx),
        client: Client::builder(TokioExecutor::new()).build_http(),
    }
}

impl TestServer {
    pub async fn raw(
        &self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: impl Into<Bytes>,
    ) -> Resp {
        let mut b = Request::builder()
            .method(method)
            .uri(format!("http://{}{}", self.addr, path));
        if let Some(ct) = content_type {
            b = b.header("content-type", ct);
        }
        let req = b.body(Full::new(body.into())).unwrap();
        let resp = self.client.request(req).await.expect("request");
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        Resp {
            status,
            headers,
            body,
        }
    }

    pub async fn get(&self, path: &str) -> Resp {
        self.raw("GET", path, None, Bytes::new()).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> Resp {
        self.raw(
            "POST",
            path,
            Some("application/json"),
            serde_json::to_vec(body).unwrap(),
        )
        .await
    }

    pub async fn post_str(&self, path: &str, body: &str) -> Resp {
        self.raw("POST", path, Some("application/json"), body.to_string())
            .await
    }

    pub async fn send(&self, method: &str, path: &str, body: &Value) -> Resp {
        self.raw(
            method,
            path,
            Some("application/json"),
            serde_json::to_vec(body).unwrap(),
        )
        .await
    }

    pub async fn delete(&self, path: &str) -> Resp {
        self.raw("DELETE", path, None, Bytes::new()).await
    }

    /// Registers a single-rank worker whose KV endpoint is `kv` (nothing has to
    /// listen there: SUB connects lazily).
    pub async fn worker(&self, id: u64, model: &str, bs: u32, kv: &str) -> Value {
        let r = self
            .post(
                "/workers",
                &json!({"worker_id": id, "model_name": model, "endpoint": format!("http://w{id}"),
                        "block_size": bs, "kv_events_endpoints": {"0": kv}}),
            )
            .await;
        assert_eq!(r.status, 201, "{}", r.text());
        let v = r.json();
        assert_eq!(v["lifecycle"], "schedulable", "{v}");
        v
    }

    /// The value of an unlabelled /metrics line.
    pub async fn metric(&self, name: &str) -> u64 {
        let r = self.get("/metrics").await;
        assert_eq!(r.status, 200);
        let text = r.text();
        let line = text
            .lines()
            .find(|l| l.split(' ').next() == Some(name))
            .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }

    /// The value of one labelled /metrics series, e.g.
    /// `metric_labelled("kvselect_http_timeouts_total", "kind=\"idle\"")`;
    /// 0 when absent.
    pub async fn metric_labelled(&self, name: &str, label: &str) -> u64 {
        let text = self.get("/metrics").await.text();
        let prefix = format!("{name}{{");
        text.lines()
            .filter(|l| l.starts_with(&prefix) && l.contains(label))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64)
            .sum()
    }

    pub async fn load_row(&self, model: &str, worker_id: u64, dp_rank: u32) -> Value {
        let r = self.get(&format!("/loads?model_name={model}")).await;
        assert_eq!(r.status, 200);
        let v = r.json();
        v[0]["loads"]
            .as_array()
            .unwrap()
            .iter()
            .find(|row| row["worker_id"] == worker_id && row["dp_rank"] == dp_rank)
            .cloned()
            .unwrap_or_else(|| panic!("no load row for {worker_id}/{dp_rank}: {v}"))
    }
}

pub fn tokens(a: u32, b: u32) -> Vec<u32> {
    (a..=b).collect()
}

/// A TCP endpoint on loopback that refuses connections for the rest of
/// the test process: a socket is bound to it without `SO_REUSEADDR` and
/// never listens, and is kept open. Linux often hands a just-closed port
/// out again within a few dozen binds, so a port taken from a listener
/// dropped at once could become a parallel test's publisher, and a server
/// subscribed here would index that test's events.
pub fn unused_endpoint() -> String {
    static HELD: std::sync::Mutex<Vec<socket2::Socket>> = std::sync::Mutex::new(Vec::new());
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    s.bind(&any.into()).unwrap();
    let addr = s.local_addr().unwrap().as_socket().unwrap();
    HELD.lock().unwrap().push(s);
    format!("tcp://{addr}")
}

// ----- a vLLM-format publisher over a real ZMQ XPUB socket -----

pub struct Publisher {
    pub socket: zmq::Socket,
    pub endpoint: String,
    pub seq: u64,
    _ctx: zmq::Context,
}

impl Publisher {
    /// An XPUB (a PUB that also reports each subscription, for
    /// [`Publisher::wait_subscriber`]) on a loopback port the OS picks.
    pub fn bind() -> Publisher {
        let ctx = zmq::Context::new();
        let socket = ctx.socket(zmq::XPUB).unwrap();
        // Every subscription, not only a topic's first.
        socket.set_xpub_verbose(true).unwrap();
        socket.set_linger(0).unwrap();
        socket.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = socket.get_last_endpoint().unwrap().unwrap();
        Publisher {
            socket,
            endpoint,
            seq: 0,
            _ctx: ctx,
        }
    }

    /// Waits (10 s at most) for a subscription, so that what is sent from
    /// now on reaches that subscriber (a PUB drops what it sends before a
    /// subscription arrives).
    pub fn wait_subscriber(&self) {
        self.socket.set_rcvtimeo(10_000).unwrap();
        // 1 then the topic: a subscription; 0: an unsubscription.
        while self
            .socket
            .recv_bytes(0)
            .expect("no subscriber within 10 s")
            .first()
            != Some(&1)
        {}
    }

    /// Sends one batch `[ts, events, dp_rank]` with the next seq, in vLLM
    /// 0.34's map form (the crate's own encoder, pinned to the spec's bytes by
    /// `tests/ingest_decode.rs`).
    pub fn send_events(&mut self, events: &[KvEvent], dp_rank: Option<u32>) {
        let mut payload = Vec::new();
        encode_batch(
            &mut payload,
            1_700_000_000.0,
            events,
            dp_rank,
            EventForm::Map,
        );
        let seq = self.seq.to_be_bytes();
        self.socket
            .send_multipart([&b""[..], &seq[..], &payload[..]], 0)
            .unwrap();
        self.seq += 1;
    }
}

fn tier(medium: &str) -> kvselect::index::Tier {
    tier_of_medium(Some(medium)).unwrap_or_else(|| panic!("unknown medium {medium}"))
}

/// A BlockStored event.
pub fn stored(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    bs: u32,
    medium: &str,
) -> KvEvent {
    KvEvent::Stored(Stored {
        block_hashes: hashes.to_vec(),
        parent_hash: parent,
        token_ids: tokens.to_vec(),
        eagle: false,
        block_size: bs,
        medium: tier(medium),
        lora_name: None,
        cache_salt: None,
        mm_hashes: None,
        group: Group::default(),
    })
}

/// A BlockRemoved event.
pub fn removed(hashes: &[u64], medium: &str) -> KvEvent {
    KvEvent::Removed(Removed {
        block_hashes: hashes.to_vec(),
        medium: tier(medium),
        group: Group::default(),
    })
}

pub fn cleared() -> KvEvent {
    KvEvent::Cleared
}

/// Polls `f` until it returns true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// Device blocks reported for `worker_id` by /overlap_scores of `tokens`.
pub async fn device_blocks(
    s: &TestServer,
    model: &str,
    tokens: &[u32],
    worker_id: u64,
) -> (u64, u64, u64) {
    let r = s
        .post(
            "/overlap_scores",
            &json!({"model_name": model, "token_ids": tokens}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let row = v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == worker_id)
        .cloned()
        .unwrap_or(json!({"device_blocks":0,"host_pinned_blocks":0,"disk_blocks":0}));
    (
        row["device_blocks"].as_u64().unwrap(),
        row["host_pinned_blocks"].as_u64().unwrap(),
        row["disk_blocks"].as_u64().unwrap(),
    )
}

/// Device blocks of one (worker, rank) for `tokens`, from /overlap_scores.
pub async fn rank_blocks(
    s: &TestServer,
    model: &str,
    tokens: &[u32],
    worker_id: u64,
    dp_rank: u32,
) -> u64 {
    let r = s
        .post(
            "/overlap_scores",
            &json!({"model_name": model, "token_ids": tokens}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == worker_id && w["dp_rank"] == dp_rank)
        .map_or(0, |w| w["device_blocks"].as_u64().unwrap())
}
