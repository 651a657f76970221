//! KV events over real ZMQ sockets reaching selection: vLLM wire-format
//! stores, removals and clears; the §7.3 tiered worked example; DP ranks;
//! endpoint changes; /dump and --indexer-peers recovery.

mod common;
use common::*;
use serde_json::json;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(10);

/// Publishes a probe block until the subscriber demonstrably receives it (ZMQ
/// slow joiner), then removes it again.
async fn connect(
    s: &TestServer,
    p: &mut Publisher,
    model: &str,
    worker_id: u64,
    dp_rank: Option<u32>,
) {
    let probe = tokens(900_000, 900_015);
    let ok = eventually(WAIT, || {
        p.send_events(&[stored(&[u64::MAX - 7], None, &probe, 16, "GPU")], dp_rank);
        async { rank_blocks(s, model, &probe, worker_id, dp_rank.unwrap_or(0)).await == 1 }
    })
    .await;
    assert!(ok, "subscriber for worker {worker_id} never connected");
    p.send_events(&[removed(&[u64::MAX - 7], "GPU")], dp_rank);
    assert!(
        eventually(WAIT, || async {
            rank_blocks(s, model, &probe, worker_id, dp_rank.unwrap_or(0)).await == 0
        })
        .await
    );
}

async fn kv_worker(s: &TestServer, id: u64, model: &str) -> Publisher {
    let mut p = Publisher::bind();
    s.worker(id, model, 16, &p.endpoint).await;
    connect(s, &mut p, model, id, None).await;
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_removals_and_clears_drive_overlap() {
    let s = start().await;
    let mut p = kvworker_pair(&s).await;
    let prompt = tokens(1, 64);
    p.send_events(
        &[stored(&[1001, 1002, 1003], None, &tokens(1, 48), 16, "GPU")],
        None,
    );
    assert!(
        eventually(WAIT, || async {
            device_blocks(&s, "m", &prompt, 200).await.0 == 3
        })
        .await
    );
    let r = s
        .post("/select", &json!({"model_name": "m", "token_ids": prompt}))
        .await
        .json();
    assert_eq!(r["worker_id"], 200, "the cached worker wins: {r}");
    assert_eq!(r["overlap"]["gpu"], 48);
    assert_eq!(r["effective_prefill_tokens"], 16);
    p.send_events(&[removed(&[1003], "GPU")], None);
    assert!(
        eventually(WAIT, || async {
            device_blocks(&s, "m", &prompt, 200).await.0 == 2
        })
        .await
    );
    p.send_events(&[cleared()], None);
    assert!(
        eventually(WAIT, || async {
            device_blocks(&s, "m", &prompt, 200).await.0 == 0
        })
        .await
    );
}

async fn kvworker_pair(s: &TestServer) -> Publisher {
    let p = kv_worker(s, 200, "m").await;
    s.worker(201, "m", 16, &unused_endpoint()).await;
    p
}

/// §7.3's first worked check and Appendix A's tiered select.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_overlap_worked_example() {
    let s = start().await;
    let mut a = kv_worker(&s, 300, "tier").await;
    let mut b = kv_worker(&s, 301, "tier").await;
    let mut c = kv_worker(&s, 302, "tier").await;
    s.worker(303, "tier", 16, &unused_endpoint()).await;
    let prompt = tokens(1, 128);
    let blocks = |n: u32| tokens(1, 16 * n);
    let hashes = |n: u64| (1..=n).map(|i| 5000 + i).collect::<Vec<_>>();
    a.send_events(&[stored(&hashes(2), None, &blocks(2), 16, "GPU")], None);
    b.send_events(
        &[
            stored(&hashes(1), None, &blocks(1), 16, "GPU"),
            stored(&hashes(4), None, &blocks(4), 16, "CPU"),
            stored(&hashes(6), None, &blocks(6), 16, "STORAGE"),
        ],
        None,
    );
    c.send_events(&[stored(&hashes(4), None, &blocks(4), 16, "CPU")], None);
    assert!(
        eventually(WAIT, || async {
            device_blocks(&s, "tier", &prompt, 301).await == (1, 4, 6)
                && device_blocks(&s, "tier", &prompt, 302).await == (0, 4, 4)
                && device_blocks(&s, "tier", &prompt, 300).await == (2, 2, 2)
        })
        .await
    );
    for _ in 0..5 {
        let r = s
            .post(
                "/select",
                &json!({"model_name": "tier", "token_ids": prompt}),
            )
            .await
            .json();
        assert_eq!(r["worker_id"], 301, "B (cost 12.25) wins every time: {r}");
        assert_eq!(
            r["overlap"],
            json!({"longest_matched":96,"gpu":16,"dp":{"0":16},"cpu":64,"disk":96})
        );
        assert_eq!(r["effective_prefill_tokens"], 68);
        assert_eq!(r["potential_decode_blocks"], 8);
    }
    let r = s
        .post(
            "/select",
            &json!({"model_name": "tier", "token_ids": prompt, "allowed_worker_ids": [302, 303]}),
        )
        .await
        .json();
    assert_eq!(r["worker_id"], 302);
    let pl = s
        .post(
            "/potential_loads",
            &json!({"model_name": "tier", "token_ids": prompt}),
        )
        .await
        .json();
    let mut got: Vec<(u64, u64)> = pl
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["worker_id"].as_u64().unwrap(),
                r["potential_prefill_tokens"].as_u64().unwrap(),
            )
        })
        .collect();
    got.sort();
    assert_eq!(got, vec![(300, 96), (301, 68), (302, 80), (303, 128)]);
    let scores = s
        .post(
            "/overlap_scores",
            &json!({"model_name": "tier", "token_ids": prompt}),
        )
        .await
        .json();
    assert_eq!(scores["num_blocks"], 8);
    assert_eq!(
        scores["workers"][1],
        json!({"worker_id":301,"dp_rank":0,"device_blocks":1,"host_pinned_blocks":4,"disk_blocks":6,
               "host_pinned_extension_blocks":3,"disk_extension_blocks":2,"shared_beyond_device_blocks":null})
    );
    assert_eq!(
        scores["shared_cache"],
        json!({"enabled":false,"total_hit_blocks":0,"ranges":[],"error":null})
    );

    // /dump reflects the index, and a peer started with --indexer-peers
    // rebuilds identical overlap answers once the workers are registered.
    let dump = s.get("/dump").await.json();
    let events = dump["tier:default"]["events"].as_array().unwrap();
    assert_eq!(dump["tier:default"]["block_size"], 16);
    assert!(events
        .iter()
        .any(|e| e["worker_id"] == 301 && e["storage_tier"] == "host_pinned"));
    let peer = start_with(kvselect::config::Config {
        indexer_peers: vec![format!("http://{}", s.addr)],
        ..test_config()
    })
    .await;
    let n = kvselect::recovery::load_peer_dump(&peer.app, &format!("http://{}", s.addr))
        .await
        .unwrap();
    assert!(n >= 5, "{n} events loaded");
    for id in 300..=303 {
        peer.worker(id, "tier", 16, &unused_endpoint()).await;
    }
    for id in 300..=302 {
        assert_eq!(
            device_blocks(&peer, "tier", &prompt, id).await,
            device_blocks(&s, "tier", &prompt, id).await,
            "worker {id}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_ranks_are_separate_candidates() {
    let s = start().await;
    let mut r0 = Publisher::bind();
    let mut r1 = Publisher::bind();
    let r = s
        .post("/workers", &json!({"worker_id": 500, "model_name": "dp", "endpoint": "http://w500", "block_size": 16,
               "data_parallel_size": 2, "kv_events_endpoints": {"0": r0.endpoint, "1": r1.endpoint}}))
        .await;
    assert_eq!(r.json()["lifecycle"], "schedulable");
    connect(&s, &mut r0, "dp", 500, Some(0)).await;
    connect(&s, &mut r1, "dp", 500, Some(1)).await;
    let prompt = tokens(1, 64);
    r0.send_events(&[stored(&[1], None, &tokens(1, 16), 16, "GPU")], Some(0));
    r1.send_events(&[stored(&[1, 2], None, &tokens(1, 32), 16, "GPU")], Some(1));
    assert!(
        eventually(WAIT, || async {
            let v = s
                .post("/select", &json!({"model_name": "dp", "token_ids": prompt}))
                .await
                .json();
            v["dp_rank"] == 1 && v["overlap"]["dp"] == json!({"0": 16, "1": 32})
        })
        .await
    );
    let v = s
        .post("/select", &json!({"model_name": "dp", "token_ids": prompt}))
        .await
        .json();
    assert_eq!(
        v["overlap"],
        json!({"longest_matched":32,"gpu":32,"dp":{"0":16,"1":32},"cpu":32,"disk":32})
    );
    assert_eq!(v["effective_prefill_tokens"], 32);
    // Clearing rank 1 leaves rank 0.
    r1.send_events(&[cleared()], Some(1));
    assert!(
        eventually(WAIT, || async {
            let v = s
                .post("/select", &json!({"model_name": "dp", "token_ids": prompt}))
                .await
                .json();
            v["overlap"]["dp"] == json!({"0": 16, "1": 0})
        })
        .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_change_clears_and_resubscribes_but_capacity_change_keeps_state() {
    let s = start().await;
    let mut p = kv_worker(&s, 200, "m").await;
    let prompt = tokens(1, 32);
    p.send_events(&[stored(&[1, 2], None, &prompt, 16, "GPU")], None);
    assert!(
        eventually(WAIT, || async {
            device_blocks(&s, "m", &prompt, 200).await.0 == 2
        })
        .await
    );
    // Capacity-only change: same listener, state kept.
    let r = s
        .send("PATCH", "/workers/200", &json!({"total_kv_blocks": 5000}))
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(device_blocks(&s, "m", &prompt, 200).await.0, 2);
    // New endpoint: old state cleared, new publisher heard.
    let mut q = Publisher::bind();
    let r = s
        .send(
            "PATCH",
            "/workers/200",
            &json!({"kv_events_endpoints": {"0": q.endpoint}}),
        )
        .await;
    assert_eq!(r.json()["lifecycle"], "schedulable");
    assert_eq!(device_blocks(&s, "m", &prompt, 200).await.0, 0);
    connect(&s, &mut q, "m", 200, None).await;
    q.send_events(&[stored(&[9], None, &tokens(1, 16), 16, "GPU")], None);
    assert!(
        eventually(WAIT, || async {
            device_blocks(&s, "m", &prompt, 200).await.0 == 1
        })
        .await
    );
    // The old publisher is no longer listened to.
    p.send_events(&[stored(&[1, 2], None, &prompt, 16, "GPU")], None);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(device_blocks(&s, "m", &prompt, 200).await.0, 1);
    // Deleting the worker drops its blocks (another worker keeps the
    // partition ready, so /overlap_scores still answers).
    s.worker(201, "m", 16, &unused_endpoint()).await;
    s.delete("/workers/200").await;
    let scores = s
        .post(
            "/overlap_scores",
            &json!({"model_name": "m", "token_ids": prompt}),
        )
        .await
        .json();
    assert!(
        scores["workers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|w| w["worker_id"] != 200),
        "{scores}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_dropped_and_the_stream_flows() {
    let s = start().await;
    let mut p = kv_worker(&s, 200, "m").await;
    p.socket
        .send_multipart([&b""[..], &p.seq.to_be_bytes()[..], &b"\xc1garbage"[..]], 0)
        .unwrap();
    p.seq += 1;
    p.socket
        .send_multipart([&b"only-one-frame"[..]], 0)
        .unwrap();
    let prompt = tokens(1, 16);
    p.send_events(&[stored(&[1], None, &prompt, 16, "GPU")], None);
    assert!(
        eventually(WAIT, || async {
            device_blocks(&s, "m", &prompt, 200).await.0 == 1
        })
        .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_applied_and_refused_events() {
    let s = start().await;
    let mut p = kv_worker(&s, 200, "m").await;
    // The probe's removal shows in the index before its counters move:
    // wait for the stream's last seq, written after them.
    let last = p.seq - 1;
    assert!(
        eventually(WAIT, || async {
            s.metric_labelled("kvselect_kv_stream_last_seq", "worker_id=\"200\"")
                .await
                == last
        })
        .await
    );
    let name = |n: &'static str| format!("kvselect_ingest_{n}_total");
    let stored0 = s.metric(&name("blocks_stored")).await;
    let removed0 = s.metric(&name("blocks_removed")).await;
    let orphan0 = s.metric(&name("stores_dropped_unknown_parent")).await;
    let malformed0 = s.metric(&name("malformed_dropped")).await;
    p.send_events(
        &[
            stored(&[11, 12, 13], None, &tokens(1, 48), 16, "GPU"),
            // Its parent was never stored: refused and counted.
            stored(&[21], Some(999_999), &tokens(100, 115), 16, "GPU"),
            removed(&[13], "GPU"),
        ],
        None,
    );
    p.socket
        .send_multipart([&b""[..], &p.seq.to_be_bytes()[..], &b"\xc1"[..]], 0)
        .unwrap();
    p.seq += 1;
    assert!(
        eventually(WAIT, || async {
            s.metric(&name("malformed_dropped")).await == malformed0 + 1
        })
        .await
    );
    assert_eq!(s.metric(&name("blocks_stored")).await, stored0 + 3);
    assert_eq!(s.metric(&name("blocks_removed")).await, removed0 + 1);
    assert_eq!(
        s.metric(&name("stores_dropped_unknown_parent")).await,
        orphan0 + 1
    );
    assert_eq!(device_blocks(&s, "m", &tokens(1, 48), 200).await.0, 2);
}
