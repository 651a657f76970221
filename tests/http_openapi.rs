//! /openapi.json against the real routes: every path and method it lists is
//! served (and no other method), every status it lists is produced by some
//! request, and a property-based client that builds bodies from its schemas
//! gets only statuses the document lists, never a 5xx it does not.

mod common;
#[path = "common/process.rs"]
mod process;

use common::{start_with, test_config, TestServer};
use process::{parse_response, request, RawResponse};
use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestRunner};
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

const BODY_LIMIT: usize = 64 * 1024;
const METHODS: &[&str] = &["get", "post", "patch", "delete", "put"];

type Op = (String, String); // (path template, METHOD)

struct Doc {
    doc: Value,
    /// Documented statuses per operation.
    ops: BTreeMap<Op, BTreeSet<u16>>,
}

impl Doc {
    fn load(text: &str) -> Doc {
        let doc: Value = serde_json::from_str(text).expect("openapi.json is JSON");
        assert_eq!(doc["openapi"], "3.0.3");
        let mut ops = BTreeMap::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for m in METHODS {
                if let Some(op) = item.get(*m) {
                    let statuses = op["responses"]
                        .as_object()
                        .unwrap()
                        .keys()
                        .map(|k| k.parse::<u16>().expect("numeric status"))
                        .collect();
                    ops.insert((path.clone(), m.to_uppercase()), statuses);
                }
            }
        }
        Doc { doc, ops }
    }

    fn op(&self, op: &Op) -> &Value {
        &self.doc["paths"][&op.0][op.1.to_lowercase()]
    }

    fn resolve<'a>(&'a self, schema: &'a Value) -> &'a Value {
        match schema.get("$ref").and_then(Value::as_str) {
            Some(r) => {
                let name = r.rsplit('/').next().unwrap();
                &self.doc["components"]["schemas"][name]
            }
            None => schema,
        }
    }

    fn body_schema(&self, op: &Op) -> Option<&Value> {
        self.op(op)
            .get("requestBody")
            .map(|b| self.resolve(&b["content"]["application/json"]["schema"]))
    }

    fn example(&self, op: &Op) -> Option<&Value> {
        self.op(op)
            .get("requestBody")
            .map(|b| &b["content"]["application/json"]["example"])
    }
}

fn fill(template: &str, id: &str) -> String {
    template
        .replace("{worker_id}", id)
        .replace("{selection_id}", id)
}

/// Records every answer and checks it is documented.
struct Client<'a> {
    addr: SocketAddr,
    doc: &'a Doc,
    seen: BTreeMap<Op, BTreeSet<u16>>,
    auth: Option<String>,
}

impl Client<'_> {
    fn send(&mut self, op: &Op, id: &str, body: Option<&[u8]>, ct: Option<&str>) -> RawResponse {
        let path = fill(&op.0, id);
        let mut headers = Vec::new();
        if let Some(ct) = ct {
            headers.push(("Content-Type", ct));
        }
        let auth;
        if let Some(t) = &self.auth {
            auth = format!("Bearer {t}");
            headers.push(("Authorization", auth.as_str()));
        }
        let r = request(self.addr, &op.1, &path, &headers, body.unwrap_or(b""));
        self.record(op, r.status, &path, body);
        r
    }

    fn json(&mut self, op: &Op, id: &str, body: &Value) -> RawResponse {
        let b = serde_json::to_vec(body).unwrap();
        self.send(op, id, Some(&b), Some("application/json"))
    }

    fn record(&mut self, op: &Op, status: u16, path: &str, body: Option<&[u8]>) {
        let documented = &self.doc.ops[op];
        assert!(
            documented.contains(&status),
            "{} {path} answered {status}, not documented ({documented:?}); body {}",
            op.1,
            String::from_utf8_lossy(body.unwrap_or(b""))
        );
        self.seen.entry(op.clone()).or_default().insert(status);
    }
}

fn op(path: &str, method: &str) -> Op {
    (path.to_string(), method.to_string())
}

/// A body that stalls: 408 after the server's body timeout.
fn stalled(addr: SocketAddr, method: &str, path: &str) -> u16 {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: k\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"
    )
    .unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    parse_response(&raw).map_or(0, |r| r.status)
}

/// JSON values for `schema`: mostly valid, sometimes of the wrong type or
/// null, with the registered model name most of the time.
fn strategy(doc: &Doc, schema: &Value, depth: u32) -> BoxedStrategy<Value> {
    let schema = doc.resolve(schema).clone();
    let wrong = prop_oneof![
        Just(Value::Null),
        Just(json!("x")),
        Just(json!(-1)),
        Just(json!(1.5)),
        Just(json!([])),
        Just(json!({})),
    ];
    let valid: BoxedStrategy<Value> = if let Some(e) = schema.get("enum") {
        let mut v: Vec<Value> = e.as_array().unwrap().clone();
        v.push(json!("bogus"));
        proptest::sample::select(v).boxed()
    } else {
        match schema
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("object")
        {
            "integer" => {
                let max = schema
                    .get("maximum")
                    .and_then(Value::as_u64)
                    .unwrap_or(u64::MAX);
                prop_oneof![
                    4 => (0u64..8).prop_map(|n| json!(n)),
                    1 => (0u64..=max.min(1 << 40)).prop_map(|n| json!(n)),
                    1 => Just(json!(u64::MAX)),
                    1 => any::<i64>().prop_map(|n| json!(n)),
                ]
                .boxed()
            }
            "number" => prop_oneof![
                (0.0f64..1.0).prop_map(|x| json!(x)),
                (-1e6f64..1e6).prop_map(|x| json!(x)),
            ]
            .boxed(),
            "boolean" => any::<bool>().prop_map(Value::Bool).boxed(),
            "string" => prop_oneof![
                3 => Just(json!("m")),
                1 => Just(json!("default")),
                1 => Just(json!("tcp://127.0.0.1:5600")),
                1 => Just(json!("http://w1:8000")),
                1 => "[a-z0-9 ]{0,6}".prop_map(Value::String),
            ]
            .boxed(),
            "array" if depth < 3 => {
                proptest::collection::vec(strategy(doc, &schema["items"], depth + 1), 0..70)
                    .prop_map(Value::Array)
                    .boxed()
            }
            "object" if depth < 3 => {
                let required: BTreeSet<String> = schema
                    .get("required")
                    .and_then(Value::as_array)
                    .map(|r| r.iter().map(|v| v.as_str().unwrap().to_string()).collect())
                    .unwrap_or_default();
                let props: Vec<(String, BoxedStrategy<Option<Value>>)> = schema
                    .get("properties")
                    .and_then(Value::as_object)
                    .map(|p| {
                        p.iter()
                            .map(|(k, v)| {
                                let s = strategy(doc, v, depth + 1);
                                let w = if required.contains(k) { 19 } else { 3 };
                                let opt = prop_oneof![
                                    w => s.prop_map(Some),
                                    (20 - w) => Just(None),
                                ]
                                .boxed();
                                (k.clone(), opt)
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                let (keys, strats): (Vec<String>, Vec<_>) = props.into_iter().unzip();
                strats
                    .prop_map(move |vals| {
                        let mut m = Map::new();
                        for (k, v) in keys.iter().zip(vals) {
                            if let Some(v) = v {
                                m.insert(k.clone(), v);
                            }
                        }
                        Value::Object(m)
                    })
                    .boxed()
            }
            _ => Just(json!({})).boxed(),
        }
    };
    prop_oneof![12 => valid, 1 => wrong].boxed()
}

fn server(config: kvselect::config::Config) -> (tokio::runtime::Runtime, TestServer) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let s = rt.block_on(start_with(config));
    (rt, s)
}

#[test]
fn openapi_lists_exactly_the_routes_and_statuses_the_server_has() {
    let mut config = test_config();
    config.body_limit_bytes = BODY_LIMIT;
    config.limits.body_read_timeout = Duration::from_millis(300);
    let (_rt, s) = server(config);
    let served = request(s.addr, "GET", "/openapi.json", &[], b"");
    assert_eq!(served.status, 200);
    assert_eq!(
        served.header("content-type").as_deref(),
        Some("application/json")
    );
    let doc = Doc::load(std::str::from_utf8(&served.body).unwrap());
    assert_eq!(
        serde_json::from_str::<Value>(kvselect::http::OPENAPI).unwrap(),
        doc.doc
    );
    let mut c = Client {
        addr: s.addr,
        doc: &doc,
        seen: BTreeMap::new(),
        auth: None,
    };

    // Every documented path serves exactly its documented methods.
    for path in doc.doc["paths"].as_object().unwrap().keys() {
        let documented: BTreeSet<String> = doc
            .ops
            .keys()
            .filter(|(p, _)| p == path)
            .map(|(_, m)| m.clone())
            .collect();
        let r = request(s.addr, "PUT", &fill(path, "x1"), &[], b"");
        assert_eq!(r.status, 405, "PUT {path}");
        let mut allow: BTreeSet<String> = r
            .header("allow")
            .unwrap()
            .split(',')
            .map(|m| m.trim().to_string())
            .collect();
        allow.remove("HEAD");
        assert_eq!(allow, documented, "Allow of {path}");
    }

    // Before any worker: the 503s.
    let ready = op("/ready", "GET");
    assert_eq!(c.send(&ready, "", None, None).status, 503);
    for (path, method) in doc.ops.keys().cloned().collect::<Vec<_>>() {
        let o = (path.clone(), method.clone());
        if doc.ops[&o].contains(&503) && path != "/ready" {
            let ex = doc.example(&o).unwrap().clone();
            assert_eq!(c.json(&o, "", &ex).status, 503, "{method} {path}");
        }
    }

    // The walkthrough: 200/201, 404, 409.
    let kv = common::unused_endpoint();
    let workers = op("/workers", "POST");
    let r = c.json(
        &workers,
        "",
        &json!({"worker_id": 1, "model_name": "m", "endpoint": "http://w1:8000",
        "block_size": 16, "kv_events_endpoints": {"0": kv}}),
    );
    assert_eq!(r.status, 201);
    let toks: Vec<u32> = (1..=64).collect();
    for (p, m) in [
        ("/health", "GET"),
        ("/ready", "GET"),
        ("/workers", "GET"),
        ("/loads", "GET"),
        ("/dump", "GET"),
        ("/metrics", "GET"),
        ("/openapi.json", "GET"),
        ("/replica_sync/peers", "GET"),
    ] {
        assert_eq!(c.send(&op(p, m), "", None, None).status, 200, "{m} {p}");
    }
    let prompt = json!({"model_name": "m", "token_ids": toks});
    for p in ["/select", "/potential_loads", "/overlap_scores"] {
        assert_eq!(c.json(&op(p, "POST"), "", &prompt).status, 200, "{p}");
    }
    let sr = op("/select_and_reserve", "POST");
    let booked = json!({"model_name": "m", "token_ids": toks, "selection_id": "s1"});
    assert_eq!(c.json(&sr, "", &booked).status, 200);
    assert_eq!(c.json(&sr, "", &booked).status, 409);
    let res = op("/reservations", "POST");
    let explicit = |id: &str| json!({"selection_id": id, "model_name": "m", "worker_id": 1, "token_ids": toks});
    assert_eq!(c.json(&res, "", &explicit("s1")).status, 409);
    assert_eq!(c.json(&res, "", &explicit("s2")).status, 201);
    assert_eq!(
        c.json(
            &res,
            "",
            &json!({"selection_id": "never", "model_name": "m"})
        )
        .status,
        404
    );
    let (pc, ob, free) = (
        op("/reservations/{selection_id}/prefill_complete", "POST"),
        op("/reservations/{selection_id}/output_block", "POST"),
        op("/reservations/{selection_id}", "DELETE"),
    );
    assert_eq!(c.send(&pc, "s1", None, None).status, 200);
    assert_eq!(c.json(&ob, "s1", &json!({})).status, 200);
    assert_eq!(c.send(&free, "s1", None, None).status, 200);
    assert_eq!(c.send(&free, "s1", None, None).status, 404);
    assert_eq!(c.send(&pc, "s1", None, None).status, 404);
    assert_eq!(c.json(&ob, "s1", &json!({})).status, 404);
    for p in [
        "/replica_sync/register_peer",
        "/replica_sync/deregister_peer",
    ] {
        let r = c.json(
            &op(p, "POST"),
            "",
            &json!({"endpoint": "tcp://127.0.0.1:5600"}),
        );
        assert_eq!(r.status, 409, "{p}");
    }
    let (patch, delete) = (
        op("/workers/{worker_id}", "PATCH"),
        op("/workers/{worker_id}", "DELETE"),
    );
    assert_eq!(
        c.json(&patch, "1", &json!({"total_kv_blocks": 50000}))
            .status,
        200
    );
    assert_eq!(c.json(&patch, "99", &json!({})).status, 404);
    assert_eq!(c.send(&delete, "abc", None, None).status, 400);
    assert_eq!(c.send(&delete, "99", None, None).status, 404);
    // The 400s of the routes without a body: a query field given twice, a
    // selection id whose escapes are not UTF-8.
    for (p, m, path) in [
        ("/workers", "GET", "/workers?model_name=a&model_name=b"),
        ("/loads", "GET", "/loads?routing_group=a&routing_group=b"),
        (
            "/reservations/{selection_id}",
            "DELETE",
            "/reservations/%FF",
        ),
        (
            "/reservations/{selection_id}/prefill_complete",
            "POST",
            "/reservations/%FF/prefill_complete",
        ),
    ] {
        let r = request(s.addr, m, path, &[], b"");
        assert_eq!(r.status, 400, "{m} {path}");
        c.record(&op(p, m), r.status, path, None);
    }

    // The front door's statuses on every body route: 400, 413, 415, 422, 408.
    let body_ops: Vec<Op> = doc
        .ops
        .keys()
        .filter(|o| doc.body_schema(o).is_some())
        .cloned()
        .collect();
    for o in &body_ops {
        let id = "1";
        assert_eq!(
            c.send(o, id, Some(b"{"), Some("application/json")).status,
            400,
            "{o:?}"
        );
        assert_eq!(
            c.send(o, id, Some(b"[]"), Some("application/json")).status,
            422,
            "{o:?}"
        );
        assert_eq!(
            c.send(o, id, Some(b"{}"), Some("text/plain")).status,
            415,
            "{o:?}"
        );
        let big = vec![b' '; BODY_LIMIT + 1];
        assert_eq!(
            c.send(o, id, Some(&big), Some("application/json")).status,
            413,
            "{o:?}"
        );
        let status = stalled(s.addr, &o.1, &fill(&o.0, id));
        assert_eq!(status, 408, "{o:?}");
        c.record(o, status, &o.0, None);
    }

    // Property-based client: bodies from the schemas, ids and filters at random.
    let body_seed = json!({"worker_id": 1, "model_name": "m", "endpoint": "http://w1:8000",
        "block_size": 16, "kv_events_endpoints": {"0": kv}});
    c.json(&workers, "", &body_seed);
    let mut runner = TestRunner::new(PropConfig {
        cases: 48,
        failure_persistence: None,
        ..PropConfig::default()
    });
    for o in doc.ops.keys().cloned().collect::<Vec<_>>() {
        let body = match doc.body_schema(&o) {
            Some(schema) => strategy(&doc, schema, 0).prop_map(Some).boxed(),
            None => Just(None).boxed(),
        };
        let ids = prop_oneof![
            Just("1".to_string()),
            Just("s2".to_string()),
            "[a-z0-9]{1,6}"
        ];
        let query = prop_oneof![
            Just(""),
            Just("?model_name=m"),
            Just("?routing_group=x&model_name=")
        ];
        let cell = std::cell::RefCell::new(&mut c);
        runner
            .run(&(body, ids, query), |(body, id, query)| {
                let mut c = cell.borrow_mut();
                let mut o2 = o.clone();
                if o.1 == "GET" && doc.op(&o).get("parameters").is_some() {
                    o2.0.push_str(query);
                }
                let path = fill(&o2.0, &id);
                let r = match &body {
                    Some(b) => {
                        let bytes = serde_json::to_vec(b).unwrap();
                        request(
                            c.addr,
                            &o.1,
                            &path,
                            &[("Content-Type", "application/json")],
                            &bytes,
                        )
                    }
                    None => request(c.addr, &o.1, &path, &[], b""),
                };
                prop_assert!(
                    r.status < 500 || r.status == 503,
                    "{} {path}: {}",
                    o.1,
                    r.status
                );
                c.record(
                    &o,
                    r.status,
                    &path,
                    body.as_ref()
                        .map(|b| b.to_string())
                        .as_deref()
                        .map(str::as_bytes),
                );
                Ok(())
            })
            .unwrap_or_else(|e| panic!("{o:?}: {e}"));
    }

    c.json(&workers, "", &body_seed);
    assert_eq!(c.send(&delete, "1", None, None).status, 200);

    // 401 is documented everywhere but /health; with a token file it is real.
    let dir = std::env::temp_dir().join(format!("kvselect-oa-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("t"), "tok\n").unwrap();
    let mut config = test_config();
    config.auth_token_file = Some(dir.join("t"));
    let (_rt2, authed) = server(config);
    let mut a = Client {
        addr: authed.addr,
        doc: &doc,
        seen: BTreeMap::new(),
        auth: None,
    };
    for o in doc.ops.keys().cloned().collect::<Vec<_>>() {
        let r = a.send(&o, "1", Some(b"{}"), Some("application/json"));
        if o.0 == "/health" {
            assert_eq!(r.status, 200);
        } else {
            assert_eq!(r.status, 401, "{o:?}");
            c.seen.entry(o).or_default().insert(401);
        }
    }
    a.auth = Some("tok".into());
    assert_eq!(a.send(&op("/workers", "GET"), "", None, None).status, 200);
    let _ = std::fs::remove_dir_all(&dir);

    // 429 comes from the selection queue: a server with
    // DYN_ROUTER_QUEUE_THRESHOLD, its only worker busy, a 50 ms wait bound.
    let mut config = test_config();
    config.router.queue_threshold = Some(1.0);
    config.queue.max_wait = Duration::from_millis(50);
    let (_rt3, queued) = server(config);
    let mut q = Client {
        addr: queued.addr,
        doc: &doc,
        seen: BTreeMap::new(),
        auth: None,
    };
    let mut busy = body_seed.clone();
    busy["max_num_batched_tokens"] = json!(16);
    assert_eq!(q.json(&workers, "", &busy).status, 201);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        q.json(
            &sr,
            "",
            &json!({"model_name": "m", "selection_id": "big", "token_ids": vec![1; 64]})
        )
        .status,
        200
    );
    for p in ["/select", "/select_and_reserve"] {
        let o = op(p, "POST");
        assert_eq!(
            q.json(&o, "", &json!({"model_name": "m", "token_ids": [1, 2]}))
                .status,
            429,
            "{p}"
        );
        c.seen.entry(o).or_default().insert(429);
    }

    // Every documented status was produced.
    for (o, documented) in &doc.ops {
        let seen = c.seen.get(o).cloned().unwrap_or_default();
        let missing: Vec<_> = documented.difference(&seen).collect();
        assert!(
            missing.is_empty(),
            "{o:?}: documented but never produced: {missing:?}"
        );
    }
}
