//! The selection queue (`DYN_ROUTER_QUEUE_THRESHOLD`) over real sockets:
//! the behaviour observed on Dynamo 1.6.1 (busy above threshold x
//! max_num_batched_tokens, waiting selections admitted by frees and prefill
//! completions in priority order, `pending_count` in /loads, advisory and
//! explicit calls never wait, workers need max_num_batched_tokens) and
//! kvselect's bounds (429 past the wait bound or with the queue full).

mod common;

use common::*;
use kvselect::config::{Config, QueueLimits, RouterConfig};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

fn queue_config(max_wait: Duration, max_len: usize) -> Config {
    Config {
        router: RouterConfig {
            queue_threshold: Some(1.0),
            ..RouterConfig::default()
        },
        queue: QueueLimits { max_wait, max_len },
        ..test_config()
    }
}

async fn worker(s: &TestServer, id: u64, batched: Option<u64>) -> Value {
    let mut w = json!({
        "worker_id": id, "model_name": "m", "endpoint": format!("http://w{id}"),
        "block_size": 16, "kv_events_endpoints": {"0": unused_endpoint()},
    });
    if let Some(b) = batched {
        w["max_num_batched_tokens"] = json!(b);
    }
    let r = s.post("/workers", &w).await;
    assert_eq!(r.status, 201, "{}", r.text());
    r.json()
}

/// Books `n` tokens on worker `w` (pinned) as selection `id` (`tokens` is
/// inclusive).
async fn book(s: &TestServer, id: &str, w: u64, n: u32, base: u32) {
    let r = s
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m", "selection_id": id, "pinned_worker": [w, 0], "token_ids": tokens(base, base + n - 1)}),
        )
        .await;
    assert_eq!(r.status, 200, "{id}: {}", r.text());
}

async fn pending(s: &TestServer) -> (u64, u64) {
    let v = s.get("/loads").await.json();
    let p = &v[0];
    (
        p["pending_count"].as_u64().unwrap(),
        p["pending_isl_tokens"].as_u64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_need_max_num_batched_tokens_while_queueing() {
    let s = start_with(queue_config(Duration::from_secs(5), 16)).await;
    let w = worker(&s, 1, None).await;
    assert_eq!(w["lifecycle"], "incomplete");
    assert_eq!(
        w["not_schedulable_reasons"],
        json!(["max_num_batched_tokens is required while queueing is enabled"])
    );
    assert_eq!(worker(&s, 2, Some(256)).await["lifecycle"], "schedulable");
    // Without the variable the field stays optional.
    let plain = start().await;
    assert_eq!(worker(&plain, 1, None).await["lifecycle"], "schedulable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_workers_queue_selections_until_room_is_made() {
    let s = Arc::new(start_with(queue_config(Duration::from_secs(20), 16)).await);
    worker(&s, 1, Some(256)).await;
    worker(&s, 2, Some(256)).await;
    // Exactly at capacity is not busy: worker 1 at 256 still admits.
    book(&s, "a", 1, 128, 0).await;
    book(&s, "b", 1, 128, 1000).await;
    book(&s, "c2", 2, 120, 4000).await;
    book(&s, "c", 2, 300, 2000).await; // 420: busy (a pinned booking queues too)
    book(&s, "d", 1, 16, 3000).await; // 272 on worker 1 now: both busy
    assert_eq!(pending(&s).await, (0, 0));

    // Three selections of 150 tokens wait: plain, then one jumping 100 s
    // ahead, then one with a strict priority.
    let mut waiting = Vec::new();
    for (id, extra) in [
        ("plain", json!({})),
        ("jump", json!({"priority_jump": 100.0})),
        ("strict", json!({"strict_priority": 5})),
    ] {
        let s2 = Arc::clone(&s);
        let mut body =
            json!({"model_name": "m", "selection_id": id, "token_ids": tokens(9000, 9149)});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        waiting.push((
            id,
            tokio::spawn(async move { s2.post("/select_and_reserve", &body).await }),
        ));
        assert!(
            eventually(Duration::from_secs(2), || async {
                pending(&s).await.0 == waiting.len() as u64
            })
            .await
        );
    }
    assert_eq!(pending(&s).await, (3, 450));
    assert_eq!(s.metric("kvselect_queue_waiting").await, 3);

    // Never queued: advisory selects, explicit reservations, reports.
    let adv = s
        .post(
            "/select",
            &json!({"model_name": "m", "advisory": true, "token_ids": tokens(1, 50)}),
        )
        .await;
    assert_eq!(adv.status, 200, "{}", adv.text());
    assert_eq!(adv.json()["worker_load"]["prefill_token_capacity"], 256);
    let ex = s
        .post(
            "/reservations",
            &json!({"model_name": "m", "selection_id": "ex", "worker_id": 2, "token_ids": tokens(1, 50)}),
        )
        .await;
    assert_eq!(ex.status, 201, "{}", ex.text());
    assert_eq!(s.delete("/reservations/ex").await.status, 200);
    assert_eq!(
        s.post(
            "/potential_loads",
            &json!({"model_name": "m", "token_ids": [1]})
        )
        .await
        .status,
        200
    );

    // Each release makes room for exactly one (120 + 150 > 256), so the
    // order shows: strict first, then the jump, then the plain one.
    let mut handles: std::collections::HashMap<_, _> = waiting.into_iter().collect();
    let mut admit = |id: &'static str| {
        let h = handles.remove(id).unwrap();
        async move {
            let r = h.await.unwrap();
            assert_eq!(r.status, 200, "{id}: {}", r.text());
            assert_eq!(r.json()["worker_id"], 2, "{id}");
        }
    };
    assert_eq!(s.delete("/reservations/c").await.status, 200);
    admit("strict").await;
    assert_eq!(pending(&s).await, (2, 300));
    let done = |id: &str| format!("/reservations/{id}/prefill_complete");
    assert_eq!(s.post(&done("strict"), &json!({})).await.status, 200);
    admit("jump").await;
    assert_eq!(pending(&s).await, (1, 150));
    assert_eq!(s.post(&done("jump"), &json!({})).await.status, 200);
    admit("plain").await;
    assert_eq!(pending(&s).await, (0, 0));
    assert_eq!(
        s.metric("kvselect_queue_admitted_after_wait_total").await,
        3
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_answers_429_past_its_bounds() {
    // A wait bound the test's own polling and second request fit in, on
    // a loaded machine too.
    let s = Arc::new(start_with(queue_config(Duration::from_millis(1500), 1)).await);
    worker(&s, 1, Some(100)).await;
    book(&s, "full", 1, 200, 0).await;

    let s2 = Arc::clone(&s);
    let first = tokio::spawn(async move {
        s2.post(
            "/select",
            &json!({"model_name": "m", "token_ids": tokens(1, 20)}),
        )
        .await
    });
    assert!(
        eventually(Duration::from_secs(2), || async {
            pending(&s).await.0 == 1
        })
        .await
    );
    // The line holds one: the next is refused at once.
    let r = s
        .post("/select", &json!({"model_name": "m", "token_ids": [5]}))
        .await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(
        r.error(),
        "every worker is busy and the selection queue is full (1 waiting)"
    );
    assert_eq!(r.headers["retry-after"], "1");
    // The waiting one gives up at the wait bound.
    let r = first.await.unwrap();
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(
        r.error(),
        "every worker stayed busy for 1.5 s (the selection queue's wait bound)"
    );
    assert_eq!(pending(&s).await, (0, 0));
    assert_eq!(
        s.metric_labelled("kvselect_queue_rejected_total", "reason=\"full\"")
            .await,
        1
    );
    assert_eq!(
        s.metric_labelled("kvselect_queue_rejected_total", "reason=\"timeout\"")
            .await,
        1
    );
    // Nothing was booked by the refused ones, and room admits again.
    assert_eq!(
        s.get("/loads").await.json()[0]["loads"][0]["active_requests"],
        1
    );
    assert_eq!(s.delete("/reservations/full").await.status, 200);
    let r = s
        .post("/select", &json!({"model_name": "m", "token_ids": [5]}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A client that hangs up leaves the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_leaves_the_queue() {
    let s = Arc::new(start_with(queue_config(Duration::from_secs(20), 16)).await);
    worker(&s, 1, Some(100)).await;
    book(&s, "full", 1, 200, 0).await;
    let s2 = Arc::clone(&s);
    let h = tokio::spawn(async move {
        s2.post(
            "/select_and_reserve",
            &json!({"model_name": "m", "selection_id": "gone", "token_ids": tokens(1, 20)}),
        )
        .await
    });
    assert!(
        eventually(Duration::from_secs(2), || async {
            pending(&s).await.0 == 1
        })
        .await
    );
    h.abort();
    assert!(
        eventually(Duration::from_secs(2), || async {
            pending(&s).await.0 == 0
        })
        .await
    );
    assert_eq!(s.delete("/reservations/full").await.status, 200);
    // The aborted request was never booked.
    assert_eq!(s.delete("/reservations/gone").await.status, 404);
}
