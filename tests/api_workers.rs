//! The worker catalog against the spec's §10 rows 22–40, §3 and §4.3–4.6.

mod common;
use common::*;
use serde_json::json;

#[tokio::test]
async fn row22_to_24_shape_errors() {
    let s = start().await;
    let r = s.post("/workers", &json!({"model_name": "x"})).await;
    assert_eq!(r.status, 422);
    assert!(
        r.error().contains("missing field `worker_id`"),
        "{}",
        r.error()
    );
    let r = s.post_str("/workers", r#"{"worker_id": -1}"#).await;
    assert_eq!(r.status, 422);
    assert!(
        r.error()
            .contains("worker_id: invalid value: integer `-1`, expected u64"),
        "{}",
        r.error()
    );
    let r = s.post_str("/workers", r#"{"worker_id": "1"}"#).await;
    assert_eq!(r.status, 422);
    assert!(
        r.error()
            .contains("worker_id: invalid type: string \"1\", expected u64"),
        "{}",
        r.error()
    );
    let r = s
        .post_str("/workers", r#"{"worker_id": 18446744073709551615}"#)
        .await;
    assert_eq!(r.status, 201, "u64::MAX is a valid worker id");
}

#[tokio::test]
async fn row25_26_incomplete_then_schedulable() {
    let s = start().await;
    let r = s.post("/workers", &json!({"worker_id": 10})).await;
    assert_eq!(r.status, 201);
    let v = r.json();
    assert_eq!(v["lifecycle"], "incomplete");
    assert_eq!(
        v["not_schedulable_reasons"],
        json!([
            "endpoint is required",
            "block_size must be greater than 0",
            "kv_events endpoint is required for dp_rank 0"
        ])
    );
    assert_eq!(v["model_name"], "default");
    assert!(v.get("kv_events_endpoints").is_none(), "omitted when empty");
    assert_eq!(v["taints"], json!([]));
    assert_eq!(v["topology_domains"], json!({}));
    assert_eq!(
        v["data_parallel_size"],
        json!(null),
        "defaults are not materialised"
    );
    // Field order of §3.2.
    let text = r.text();
    let pos = |k: &str| {
        text.find(&format!("\"{k}\""))
            .unwrap_or_else(|| panic!("{k} missing"))
    };
    assert!(pos("worker_id") < pos("model_name") && pos("lifecycle") < pos("endpoint"));
    assert!(
        pos("replay_endpoint") < pos("block_size")
            && pos("kv_transfer_preferred_weight") < pos("not_schedulable_reasons")
    );

    let ep = unused_endpoint();
    let v = s.worker(11, "default", 16, &ep).await;
    assert!(v.get("not_schedulable_reasons").is_none());
    assert_eq!(v["kv_events_endpoints"], json!({"0": ep}));
    let r = s.get("/ready").await;
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["ready"], true);
    assert_eq!(v["schedulable_workers"], 1);
    assert_eq!(
        v["workers"].as_array().unwrap().len(),
        2,
        "all records, sorted by id"
    );
    assert_eq!(v["workers"][0]["worker_id"], 10);
}

#[tokio::test]
async fn row27_30_31_rank_and_endpoint_rules() {
    let s = start().await;
    let r = s
        .post(
            "/workers",
            &json!({"worker_id": 1, "endpoint": "http://w", "block_size": 16,
               "data_parallel_size": 2, "kv_events_endpoint": unused_endpoint()}),
        )
        .await;
    assert_eq!(
        r.json()["not_schedulable_reasons"],
        json!([
            "kv_events endpoint is required for dp_rank 0",
            "kv_events endpoint is required for dp_rank 1"
        ])
    );
    let r = s
        .post(
            "/workers",
            &json!({"worker_id": 2, "endpoint": "http://w", "block_size": 16,
               "data_parallel_size": 2, "replay_endpoint": unused_endpoint(),
               "kv_events_endpoints": {"0": unused_endpoint(), "1": unused_endpoint()}}),
        )
        .await;
    assert_eq!(
        r.json()["not_schedulable_reasons"],
        json!(["replay_endpoint is supported only for data_parallel_size 1"])
    );
    let r = s
        .post(
            "/workers",
            &json!({"worker_id": 602, "endpoint": "http://w", "block_size": 16,
               "kv_events_endpoints": {"0": "not-a-url"}}),
        )
        .await;
    assert_eq!(r.status, 201);
    assert_eq!(
        r.json()["not_schedulable_reasons"],
        json!(["reconciliation failed: invalid kv_events endpoint for worker 602 dp_rank 0: invalid ZMQ endpoint `not-a-url`: missing scheme"])
    );
    let r = s
        .post(
            "/workers",
            &json!({"worker_id": 3, "endpoint": "http://w", "block_size": 16,
               "data_parallel_size": 0, "kv_events_endpoints": {"0": unused_endpoint()}}),
        )
        .await;
    assert_eq!(
        r.json()["not_schedulable_reasons"][0],
        "data_parallel_size must be greater than 0"
    );
}

#[tokio::test]
async fn row28_non_numeric_rank_key_is_a_syntax_error() {
    let s = start().await;
    let r = s
        .post(
            "/workers",
            &json!({"worker_id": 1, "kv_events_endpoints": {"x": "tcp://127.0.0.1:1"}}),
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.error().contains("kv_events_endpoints"), "{}", r.error());
}

#[tokio::test]
async fn row29_32_33_partition_reconciliation_and_ranges() {
    let s = start().await;
    s.worker(12, "mA", 16, &unused_endpoint()).await;
    let r = s
        .post(
            "/workers",
            &json!({"worker_id": 13, "model_name": "mA", "endpoint": "http://w", "block_size": 32,
               "kv_events_endpoints": {"0": unused_endpoint()}}),
        )
        .await;
    assert_eq!(r.status, 201);
    assert_eq!(
        r.json()["not_schedulable_reasons"],
        json!(["reconciliation failed: block_size mismatch for model=mA routing_group=default: existing=16 requested=32"])
    );
    let r = s
        .post(
            "/workers",
            &json!({"worker_id": 14, "model_name": "mA", "endpoint": "http://w", "block_size": 16,
               "is_eagle": true, "kv_events_endpoints": {"0": unused_endpoint()}}),
        )
        .await;
    assert_eq!(
        r.json()["not_schedulable_reasons"],
        json!(["reconciliation failed: is_eagle mismatch for model=mA routing_group=default: existing=false requested=true"])
    );
    let r = s
        .post_str("/workers", r#"{"worker_id": 1, "block_size": 4294967296}"#)
        .await;
    assert_eq!(r.status, 422);
    assert!(r
        .error()
        .contains("block_size: invalid value: integer `4294967296`, expected u32"));
    let r = s
        .post_str(
            "/workers",
            r#"{"worker_id": 1, "kv_transfer_enforcement": "bogus"}"#,
        )
        .await;
    assert_eq!(r.status, 422);
    assert!(
        r.error()
            .contains("unknown variant `bogus`, expected `required` or `preferred`"),
        "{}",
        r.error()
    );
}

#[tokio::test]
async fn row34_to_40_patch_and_delete() {
    let s = start().await;
    let r = s.send("PATCH", "/workers/99", &json!({})).await;
    assert_eq!(
        (r.status, r.error()),
        (404, "worker 99 not found".to_string())
    );
    let r = s.post("/workers", &json!({"worker_id": 10})).await;
    assert_eq!(r.json()["lifecycle"], "incomplete");
    let ep = unused_endpoint();
    let r = s
        .send(
            "PATCH",
            "/workers/10",
            &json!({"model_name": "mA", "endpoint": "http://w10", "block_size": 16,
               "kv_events_endpoints": {"0": ep}}),
        )
        .await;
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["lifecycle"], "schedulable");
    assert_eq!(v["model_name"], "default", "PATCH cannot move partitions");
    let r = s
        .send(
            "PATCH",
            "/workers/10",
            &json!({"total_kv_blocks": 1000, "endpoint": null}),
        )
        .await;
    assert_eq!(
        r.json()["endpoint"],
        "http://w10",
        "null leaves a field unchanged"
    );
    assert_eq!(r.json()["total_kv_blocks"], 1000);
    let r = s
        .send("PATCH", "/workers/10", &json!({"block_size": 32}))
        .await;
    assert_eq!(r.json()["lifecycle"], "incomplete");
    let r = s.delete("/workers/10").await;
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["lifecycle"], "unschedulable");
    assert!(v.get("not_schedulable_reasons").is_none());
    let r = s.delete("/workers/10").await;
    assert_eq!(
        (r.status, r.error()),
        (404, "worker 10 not found".to_string())
    );
}

#[tokio::test]
async fn list_filters_are_exact_and_independent() {
    let s = start().await;
    s.worker(3, "a", 16, &unused_endpoint()).await;
    s.worker(1, "b", 16, &unused_endpoint()).await;
    s.post(
        "/workers",
        &json!({"worker_id": 2, "model_name": "a", "routing_group": "g"}),
    )
    .await;
    let ids = |v: serde_json::Value| -> Vec<u64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|w| w["worker_id"].as_u64().unwrap())
            .collect()
    };
    // The reference's order: model name, routing group, worker id.
    assert_eq!(ids(s.get("/workers").await.json()), vec![3, 2, 1]);
    assert_eq!(ids(s.get("/workers?model_name=a").await.json()), vec![3, 2]);
    assert_eq!(ids(s.get("/workers?routing_group=g").await.json()), vec![2]);
    assert_eq!(
        ids(s
            .get("/workers?model_name=a&routing_group=default&tenant_id=x")
            .await
            .json()),
        vec![3]
    );
    assert_eq!(
        ids(s.get("/workers?model_name=").await.json()),
        Vec::<u64>::new()
    );
}

#[tokio::test]
async fn moving_partition_drops_old_load_and_creates_new_partition() {
    let s = start().await;
    s.worker(7, "m16", 16, &unused_endpoint()).await;
    let r = s
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m16", "token_ids": tokens(1, 64), "selection_id": "r"}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    s.worker(7, "m8", 8, &unused_endpoint()).await;
    let loads = s.get("/loads").await.json();
    assert_eq!(loads[0]["model_name"], "m16");
    assert_eq!(
        loads[0]["loads"],
        json!([]),
        "worker left the old partition"
    );
    assert_eq!(loads[1]["model_name"], "m8");
    assert_eq!(loads[1]["loads"][0]["active_requests"], 0);
    let r = s.delete("/reservations/r").await;
    assert_eq!(r.status, 404, "its bookings went with it");
}

#[tokio::test]
async fn workers_are_listed_by_model_group_then_id() {
    let s = start().await;
    for (id, model, group) in [(10, "b", "g"), (3, "a", "z"), (1, "b", "g"), (7, "a", "y")] {
        let r = s
            .post(
                "/workers",
                &json!({"worker_id": id, "model_name": model, "routing_group": group}),
            )
            .await;
        assert_eq!(r.status, 201);
    }
    let ids: Vec<u64> = s
        .get("/workers")
        .await
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["worker_id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids, [7, 3, 1, 10]);
    let ready = s.get("/ready").await.json();
    let ids: Vec<u64> = ready["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["worker_id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids, [7, 3, 1, 10]);
}

#[tokio::test]
async fn taints_are_a_set_and_names_are_never_null() {
    let s = start().await;
    let r = s
        .post(
            "/workers",
            &json!({"worker_id": 3, "taints": ["b", "a", "b", "c"]}),
        )
        .await;
    assert_eq!(r.status, 201);
    assert_eq!(r.json()["taints"], json!(["a", "b", "c"]));
    let r = s
        .send("PATCH", "/workers/3", &json!({"taints": ["z", "z"]}))
        .await;
    assert_eq!(r.json()["taints"], json!(["z"]));
    for field in ["model_name", "routing_group"] {
        let r = s
            .post("/workers", &json!({"worker_id": 4, field: null}))
            .await;
        assert_eq!(r.status, 422, "{field}");
        assert!(
            r.error()
                .contains(&format!("{field}: invalid type: null, expected a string")),
            "{}",
            r.error()
        );
        let r = s
            .post("/select", &json!({"token_ids": [1], field: null}))
            .await;
        assert_eq!(r.status, 422, "{field}");
    }
}

/// Issue #15 item 3: KV-event and replay endpoints must be tcp://host:port
/// with a real host and port; ipc:// only with --allow-ipc-endpoints;
/// inproc:// never. A refused endpoint keeps the worker incomplete with a
/// reason naming it, and opens no stream.
#[tokio::test]
async fn kv_endpoint_validation_keeps_bad_endpoints_incomplete() {
    let worker = |id: u64, kv: &str, replay: Option<&str>| {
        let mut w = json!({"worker_id": id, "endpoint": "http://w", "block_size": 16,
            "kv_events_endpoint": kv});
        if let Some(r) = replay {
            w["replay_endpoint"] = json!(r);
        }
        w
    };
    let s = start().await;
    let r = s
        .post("/workers", &worker(1, "tcp://127.0.0.1:19150", None))
        .await;
    assert_eq!(r.json()["lifecycle"], "schedulable");
    for (id, kv, replay, why) in [
        (2, "tcp://256.1.1.1:1", None, "invalid host `256.1.1.1`"),
        (3, "tcp://127.0.0.1:0", None, "invalid port `0`"),
        (4, "tcp://127.0.0.1:70000", None, "invalid port `70000`"),
        (5, "inproc://x", None, "inproc endpoints are refused"),
        (
            6,
            "ipc:///etc/passwd",
            None,
            "refused without --allow-ipc-endpoints",
        ),
        (
            7,
            "tcp://127.0.0.1:19151",
            Some("tcp://127.0.0.1:0"),
            "invalid replay endpoint for worker 7",
        ),
    ] {
        let r = s.post("/workers", &worker(id, kv, replay)).await;
        assert_eq!(r.status, 201);
        let v = r.json();
        assert_eq!(v["lifecycle"], "incomplete", "{kv}");
        let reasons = v["not_schedulable_reasons"].to_string();
        assert!(reasons.contains(why), "{kv}: {reasons}");
    }
    // No listener was started for a refused endpoint.
    let started = s.app.catalog.hub().stats().listeners.len();
    assert_eq!(started, 1);
    // A PATCH to a good endpoint makes a refused worker schedulable.
    let r = s
        .send(
            "PATCH",
            "/workers/3",
            &json!({"kv_events_endpoint": "tcp://127.0.0.1:19152"}),
        )
        .await;
    assert_eq!(r.json()["lifecycle"], "schedulable");

    let mut config = test_config();
    config.allow_ipc_endpoints = true;
    let s = start_with(config).await;
    let r = s
        .post(
            "/workers",
            &worker(1, "ipc:///tmp/kvselect-test.sock", None),
        )
        .await;
    assert_eq!(r.json()["lifecycle"], "schedulable");
    let r = s.post("/workers", &worker(2, "inproc://x", None)).await;
    assert_eq!(
        r.json()["lifecycle"],
        "incomplete",
        "inproc even with the flag"
    );
}
