//! Regression tests of the metrics finding: /metrics was served as
//! `application/json`, had no `# HELP` lines (`promtool check metrics`
//! failed) and carried no request, latency or per-stream metrics.

mod common;
#[path = "common/process.rs"]
mod process;

use common::{start, Publisher};
use process::promtool;
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_prometheus_text_that_promtool_accepts() {
    let s = start().await;
    let mut publisher = Publisher::bind();
    s.worker(7, "m", 16, &publisher.endpoint).await;
    let tokens = common::tokens(1, 64);
    // Events flow (ZMQ slow joiner: resend until seen); the stream is live.
    let stored = common::stored(&[1, 2, 3, 4], None, &tokens, 16, "GPU");
    let live = common::eventually(Duration::from_secs(10), || {
        publisher.send_events(std::slice::from_ref(&stored), None);
        let (s, t) = (&s, tokens.clone());
        async move { common::device_blocks(s, "m", &t, 7).await.0 == 4 }
    })
    .await;
    assert!(live, "KV events applied");
    let r = s
        .post("/select", &json!({"model_name": "m", "token_ids": tokens}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(s.post_str("/select", "{").await.status, 400);
    assert_eq!(s.get("/nope").await.status, 404);

    let r = s.get("/metrics").await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.headers["content-type"].to_str().unwrap(),
        "text/plain; version=0.0.4"
    );
    let text = r.text();
    for want in [
        "# HELP kvselect_http_requests_total ",
        "# TYPE kvselect_http_requests_total counter",
        "kvselect_http_requests_total{route=\"/select\",status=\"200\"} 1",
        "kvselect_http_requests_total{route=\"/select\",status=\"400\"} 1",
        "kvselect_http_requests_total{route=\"other\",status=\"404\"} 1",
        "# TYPE kvselect_http_request_duration_seconds histogram",
        "kvselect_http_request_duration_seconds_bucket{route=\"/select\",status=\"200\",le=\"+Inf\"} 1",
        "# TYPE kvselect_parse_duration_seconds histogram",
        "kvselect_parse_duration_seconds_count{body=\"select\"} 2",
        "kvselect_http_connections ",
        "kvselect_kv_stream_state{dp_rank=\"0\",state=\"live\",worker_id=\"7\"} 1",
        "kvselect_kv_stream_state{dp_rank=\"0\",state=\"replaying\",worker_id=\"7\"} 0",
        "kvselect_kv_stream_last_seq{dp_rank=\"0\",worker_id=\"7\"} ",
        "kvselect_ingest_gaps_total ",
        "kvselect_ingest_replays_started_total ",
        "kvselect_index_entries{model_name=\"m\",routing_group=\"default\"} 4",
        "kvselect_index_bytes{model_name=\"m\",routing_group=\"default\"} ",
        "kvselect_bookings 0",
        "kvselect_pending_selections ",
        "kvselect_workers{lifecycle=\"schedulable\"} 1",
        "kvselect_build_info{version=",
    ] {
        assert!(text.contains(want), "missing `{want}` in\n{text}");
    }
    for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
        let name = line.split_whitespace().nth(2).unwrap();
        assert!(
            text.contains(&format!("# HELP {name} ")),
            "{name} has no HELP"
        );
    }
    if let Some((ok, msg)) = promtool(&text) {
        assert!(ok, "promtool check metrics failed:\n{msg}\n{text}");
    }
    // HEAD gets the headers only; other methods 405.
    let head = s.raw("HEAD", "/metrics", None, "").await;
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty());
    assert_eq!(s.raw("POST", "/metrics", None, "").await.status, 405);
}
