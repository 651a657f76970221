//! Reservations and load accounting: §10 rows 54–72, the §6.4 lifecycle
//! table, pending-selection rules of §6.2, and exactness under concurrency.

mod common;
use common::*;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

#[tokio::test]
async fn row54_55_duplicate_ids() {
    let s = start().await;
    s.worker(1, "m", 16, &unused_endpoint()).await;
    for id in ["c1", ""] {
        let body = json!({"model_name": "m", "token_ids": [1, 2], "selection_id": id});
        assert_eq!(s.post("/select_and_reserve", &body).await.status, 200);
        let r = s.post("/select_and_reserve", &body).await;
        assert_eq!(
            (r.status, r.error()),
            (
                409,
                format!("selection {id} is already reserved or being reserved")
            )
        );
    }
    let r = s
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m", "token_ids": [1], "selection_id": null}),
        )
        .await;
    let id = r.json()["selection_id"].as_str().unwrap().to_string();
    assert_eq!(id.len(), 36, "a UUID v4 is generated: {id}");
}

#[tokio::test]
async fn row56_to_60_replay_form() {
    let s = start().await;
    s.worker(400, "rv", 16, &unused_endpoint()).await;
    let r = s.post("/reservations", &json!({"model_name": "x"})).await;
    assert_eq!(r.status, 422);
    assert!(r.error().contains("missing field `selection_id`"));
    let r = s
        .post("/reservations", &json!({"selection_id": "nope"}))
        .await;
    assert_eq!(
        (r.status, r.error()),
        (404, "no pending selection nope for model=default routing_group=default (expired, already used, or never selected)".to_string())
    );
    let sel = s
        .post(
            "/select",
            &json!({"model_name": "rv", "token_ids": tokens(1, 64), "selection_id": "c1"}),
        )
        .await;
    assert_eq!(sel.status, 200);
    let r = s
        .post(
            "/reservations",
            &json!({"selection_id": "c1", "token_ids": [9, 9, 9]}),
        )
        .await;
    assert_eq!(r.status, 404, "wrong partition");
    assert!(r.error().contains("model=default routing_group=default"));
    let r = s
        .post(
            "/reservations",
            &json!({"selection_id": "c1", "model_name": "rv", "token_ids": [9, 9, 9]}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(
        r.json(),
        json!({"selection_id":"c1","model_name":"rv","routing_group":"default","worker_id":400,"dp_rank":0,"endpoint":"http://w400"})
    );
    let row = s.load_row("rv", 400, 0).await;
    assert_eq!(
        row["potential_decode_blocks"], 4,
        "the cached selection was booked, not the body's tokens"
    );
    assert_eq!(row["potential_prefill_tokens"], 64);
    let r = s
        .post(
            "/reservations",
            &json!({"selection_id": "c1", "model_name": "rv"}),
        )
        .await;
    assert_eq!(r.status, 404, "single use");

    // Row 60: replay while the id is booked -> 409, and the entry survives.
    s.post(
        "/select",
        &json!({"model_name": "rv", "token_ids": [1], "selection_id": "c1"}),
    )
    .await;
    let r = s
        .post(
            "/reservations",
            &json!({"selection_id": "c1", "model_name": "rv"}),
        )
        .await;
    assert_eq!(r.status, 409);
    assert_eq!(s.delete("/reservations/c1").await.status, 200);
    let r = s
        .post(
            "/reservations",
            &json!({"selection_id": "c1", "model_name": "rv"}),
        )
        .await;
    assert_eq!(r.status, 201, "retry after the booking was freed");
}

#[tokio::test]
async fn row61_to_68_explicit_form() {
    let s = start().await;
    s.worker(400, "rv", 16, &unused_endpoint()).await;
    let base = json!({"selection_id": "e", "model_name": "rv", "worker_id": 400});
    let with = |extra: serde_json::Value| {
        let mut b = base.clone();
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let cases = [
        (
            with(json!({"sequence_hashes": [1], "isl_tokens": 40, "effective_prefill_tokens": 41})),
            400,
            "effective_prefill_tokens (41) must not exceed isl_tokens (40)",
        ),
        (
            with(json!({})),
            400,
            "sequence_hashes is required without token_ids",
        ),
        (
            with(json!({"sequence_hashes": [1]})),
            400,
            "isl_tokens is required without token_ids",
        ),
        (
            with(json!({"worker_id": 999, "token_ids": [1]})),
            404,
            "schedulable worker 999 not found for model=rv routing_group=default",
        ),
        (
            with(json!({"dp_rank": 5, "token_ids": [1]})),
            404,
            "Worker WorkerWithDpRank { worker_id: 400, dp_rank: 5 } not found",
        ),
        (
            with(json!({"model_name": "nomodel", "token_ids": [1]})),
            503,
            "no schedulable workers for model=nomodel routing_group=default",
        ),
    ];
    for (body, status, msg) in cases {
        let r = s.post("/reservations", &body).await;
        assert_eq!((r.status, r.error()), (status, msg.to_string()), "{body}");
    }
    let r = s
        .post(
            "/reservations",
            &with(json!({"sequence_hashes": [7], "isl_tokens": 0})),
        )
        .await;
    assert_eq!(r.status, 201, "row 67: isl 0 is fine in the explicit form");
    let r = s
        .post("/reservations", &with(json!({"token_ids": [1]})))
        .await;
    assert_eq!(r.status, 409);

    // Prefill accounting: raw tokens without effective_prefill_tokens book none.
    let r = s
        .post(
            "/reservations",
            &with(json!({"selection_id": "p0", "token_ids": tokens(1, 64)})),
        )
        .await;
    assert_eq!(r.status, 201);
    assert_eq!(
        s.load_row("rv", 400, 0).await["potential_prefill_tokens"],
        0
    );
    let r = s
        .post("/reservations", &with(json!({"selection_id": "p1", "token_ids": tokens(1, 64), "effective_prefill_tokens": 24})))
        .await;
    assert_eq!(r.status, 201);
    assert_eq!(
        s.load_row("rv", 400, 0).await["potential_prefill_tokens"],
        24
    );
    let r = s
        .post(
            "/reservations",
            &with(json!({"selection_id": "p2", "token_ids": tokens(1, 64),
               "effective_prefill_tokens": 24, "track_prefill_tokens": false})),
        )
        .await;
    assert_eq!(r.status, 201);
    assert_eq!(
        s.load_row("rv", 400, 0).await["potential_prefill_tokens"],
        24
    );

    // An explicit booking discards a cached selection of the same id.
    s.post(
        "/select",
        &json!({"model_name": "rv", "token_ids": [1], "selection_id": "d"}),
    )
    .await;
    s.post(
        "/reservations",
        &with(json!({"selection_id": "d", "token_ids": [1]})),
    )
    .await;
    s.delete("/reservations/d").await;
    let r = s
        .post(
            "/reservations",
            &json!({"selection_id": "d", "model_name": "rv"}),
        )
        .await;
    assert_eq!(r.status, 404);
}

#[tokio::test]
async fn row68_replay_when_partition_lost_workers() {
    let s = start().await;
    let ep = unused_endpoint();
    s.worker(400, "rv", 16, &ep).await;
    s.worker(401, "other", 16, &unused_endpoint()).await;
    s.post(
        "/select",
        &json!({"model_name": "rv", "token_ids": [1], "selection_id": "c"}),
    )
    .await;
    s.delete("/workers/400").await;
    let r = s
        .post(
            "/reservations",
            &json!({"selection_id": "c", "model_name": "rv"}),
        )
        .await;
    assert_eq!(
        (r.status, r.error()),
        (
            503,
            "no schedulable workers for model=rv routing_group=default".to_string()
        )
    );
    s.worker(400, "rv", 16, &ep).await;
    let r = s
        .post(
            "/reservations",
            &json!({"selection_id": "c", "model_name": "rv"}),
        )
        .await;
    assert_eq!(r.status, 201, "the entry survived the 503");
}

#[tokio::test]
async fn row69_to_72_lifecycle_errors() {
    let s = start().await;
    s.worker(1, "m", 16, &unused_endpoint()).await;
    let nf = "reservation nope not found".to_string();
    let r = s
        .post("/reservations/nope/prefill_complete", &json!({}))
        .await;
    assert_eq!((r.status, r.error()), (404, nf.clone()));
    let r = s
        .raw("POST", "/reservations/nope/prefill_complete", None, "")
        .await;
    assert_eq!(r.status, 404, "no body needed");
    let r = s.delete("/reservations/nope").await;
    assert_eq!((r.status, r.error()), (404, nf.clone()));
    let r = s.post("/reservations/nope/output_block", &json!({})).await;
    assert_eq!((r.status, r.error()), (404, nf));
    let r = s.post_str("/reservations/nope/output_block", "null").await;
    assert_eq!(r.status, 422);
    let r = s
        .post(
            "/reservations/nope/output_block",
            &json!({"decay_fraction": 1.5}),
        )
        .await;
    assert_eq!(
        (r.status, r.error()),
        (
            400,
            "decay_fraction must be between 0.0 and 1.0".to_string()
        )
    );
    let r = s
        .post(
            "/reservations/x/output_block",
            &json!({"decay_fraction": "a"}),
        )
        .await;
    assert_eq!(r.status, 422);
    assert!(
        r.error()
            .contains("decay_fraction: invalid type: string \"a\", expected f64"),
        "{}",
        r.error()
    );
}

/// §6.4, step by step (worker 200 idle here, so prefill is the whole prompt).
#[tokio::test]
async fn lifecycle_load_accounting_table() {
    let s = start().await;
    s.worker(200, "ov", 16, &unused_endpoint()).await;
    let row = |v: serde_json::Value| {
        (
            v["potential_prefill_tokens"].as_u64().unwrap(),
            v["potential_decode_blocks"].as_u64().unwrap(),
            v["active_requests"].as_u64().unwrap(),
        )
    };
    assert_eq!(row(s.load_row("ov", 200, 0).await), (0, 0, 0));
    let r = s
        .post(
            "/select_and_reserve",
            &json!({"model_name": "ov", "token_ids": tokens(1, 64), "selection_id": "r1"}),
        )
        .await;
    assert_eq!(r.json()["effective_prefill_tokens"], 64);
    assert_eq!(row(s.load_row("ov", 200, 0).await), (64, 4, 1));
    let pl = s
        .post(
            "/potential_loads",
            &json!({"model_name": "ov", "token_ids": tokens(1, 64)}),
        )
        .await
        .json();
    assert_eq!(
        row(pl[0].clone()),
        (128, 4, 1),
        "shared hashes are not new blocks"
    );
    assert_eq!(
        s.post("/reservations/r1/prefill_complete", &json!({}))
            .await
            .status,
        200
    );
    assert_eq!(row(s.load_row("ov", 200, 0).await), (0, 4, 1));
    assert_eq!(
        s.post("/reservations/r1/prefill_complete", &json!({}))
            .await
            .status,
        200
    );
    assert_eq!(
        s.post("/reservations/r1/output_block", &json!({}))
            .await
            .status,
        200
    );
    assert_eq!(row(s.load_row("ov", 200, 0).await), (0, 5, 1));
    assert_eq!(
        s.post(
            "/reservations/r1/output_block",
            &json!({"decay_fraction": 0.5})
        )
        .await
        .status,
        200
    );
    assert_eq!(row(s.load_row("ov", 200, 0).await), (0, 3, 1));
    assert_eq!(s.delete("/reservations/r1").await.status, 200);
    assert_eq!(row(s.load_row("ov", 200, 0).await), (0, 0, 0));
    assert_eq!(s.delete("/reservations/r1").await.status, 404);

    // Two identical prompts share decode blocks but not prefill.
    for id in ["a", "b"] {
        s.post(
            "/select_and_reserve",
            &json!({"model_name": "ov", "token_ids": tokens(1, 64), "selection_id": id}),
        )
        .await;
    }
    assert_eq!(row(s.load_row("ov", 200, 0).await), (128, 4, 2));
}

/// Token prompts book chained identities (the ledger's per-rank prefix
/// path); hashes a client sends are arbitrary and move the rank into the
/// identity table. The load is the same either way.
#[tokio::test]
async fn chained_and_given_identities_count_the_same_load() {
    let s = start().await;
    s.worker(200, "ov", 16, &unused_endpoint()).await;
    let decode = |v: serde_json::Value| v["potential_decode_blocks"].as_u64().unwrap();
    let a = s
        .post(
            "/select_and_reserve",
            &json!({"model_name": "ov", "token_ids": tokens(1, 64), "selection_id": "a"}),
        )
        .await
        .json();
    // Blocks 1-4 shared with "a", 5 and 6 new.
    s.post(
        "/select_and_reserve",
        &json!({"model_name": "ov", "token_ids": tokens(1, 96), "selection_id": "b"}),
    )
    .await;
    assert_eq!(decode(s.load_row("ov", 200, 0).await), 6);
    assert_eq!(s.metric("kvselect_active_chained_identities").await, 6);
    assert_eq!(s.metric("kvselect_active_identities").await, 0);
    let pl = s
        .post(
            "/potential_loads",
            &json!({"model_name": "ov", "token_ids": tokens(1, 80)}),
        )
        .await
        .json();
    assert_eq!(decode(pl[0].clone()), 6, "all 5 blocks are active already");
    // "a"'s hashes sent back as given: the same identities, now arbitrary.
    let r = s
        .post(
            "/reservations",
            &json!({"selection_id": "c", "model_name": "ov", "worker_id": 200,
                    "sequence_hashes": a["sequence_hashes"], "isl_tokens": 64}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(decode(s.load_row("ov", 200, 0).await), 6);
    assert_eq!(s.metric("kvselect_active_chained_identities").await, 0);
    assert_eq!(s.metric("kvselect_active_identities").await, 6);
    for id in ["a", "b", "c"] {
        assert_eq!(s.delete(&format!("/reservations/{id}")).await.status, 200);
    }
    assert_eq!(decode(s.load_row("ov", 200, 0).await), 0);
    assert_eq!(s.metric("kvselect_active_identities").await, 0);
}

#[tokio::test]
async fn pending_selections_expire() {
    let s = start_with(kvselect::config::Config {
        selection_cache_ttl: Duration::from_millis(300),
        ..test_config()
    })
    .await;
    s.worker(1, "m", 16, &unused_endpoint()).await;
    s.post(
        "/select",
        &json!({"model_name": "m", "token_ids": [1], "selection_id": "t"}),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r = s
        .post(
            "/reservations",
            &json!({"selection_id": "t", "model_name": "m"}),
        )
        .await;
    assert_eq!(r.status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_reserve_free_cycles_return_to_zero() {
    let s = Arc::new(start().await);
    for id in 1..=3 {
        s.worker(id, "c", 16, &unused_endpoint()).await;
    }
    let mut tasks = Vec::new();
    for t in 0..8 {
        let s = Arc::clone(&s);
        tasks.push(tokio::spawn(async move {
            for i in 0..25 {
                let id = format!("t{t}-{i}");
                let prompt = tokens(1 + (i % 3) * 100, 64 + (i % 3) * 100 + t);
                let r = s
                    .post(
                        "/select_and_reserve",
                        &json!({"model_name": "c", "token_ids": prompt, "selection_id": id}),
                    )
                    .await;
                assert_eq!(r.status, 200, "{}", r.text());
                if i % 2 == 0 {
                    s.post(&format!("/reservations/{id}/prefill_complete"), &json!({}))
                        .await;
                }
                s.post(
                    &format!("/reservations/{id}/output_block"),
                    &json!({"decay_fraction": 0.5}),
                )
                .await;
                assert_eq!(s.delete(&format!("/reservations/{id}")).await.status, 200);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let loads = s.get("/loads?model_name=c").await.json();
    for row in loads[0]["loads"].as_array().unwrap() {
        assert_eq!(row["potential_prefill_tokens"], 0, "{row}");
        assert_eq!(row["potential_decode_blocks"], 0, "{row}");
        assert_eq!(row["active_requests"], 0, "{row}");
    }
}
