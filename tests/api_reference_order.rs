//! Answers that were measured against the reference (Dynamo 1.6.1) with
//! `harness/interop/http_diff.py`, on the real server: the order of a
//! selection's checks, the routes with an empty id, and the cost of a prompt
//! whose prefill is not tracked.

mod common;

use common::*;
use serde_json::{json, Value};
use std::time::Duration;

const BS: u32 = 16;

fn sel(extra: Value) -> Value {
    let mut b = json!({"model_name": "m", "token_ids": tokens(1, 32)});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

#[tokio::test]
async fn selection_checks_run_in_the_reference_order() {
    let s = start().await;
    for id in [1, 2] {
        s.worker(id, "m", BS, &unused_endpoint()).await;
    }
    let r = s
        .post("/select_and_reserve", &sel(json!({"selection_id": "q"})))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let taken = (
        409,
        "selection q is already reserved or being reserved".to_string(),
    );
    // A booked id comes first: before the prompt's 400, the pinned worker's
    // 400 and the candidates' 503. Only an unknown partition comes earlier.
    for extra in [
        json!({"selection_id": "q"}),
        json!({"selection_id": "q", "token_ids": null, "block_hashes": [1]}),
        json!({"selection_id": "q", "allowed_worker_ids": [9]}),
        json!({"selection_id": "q", "pinned_worker": {"worker_id": 2, "dp_rank": 0}, "allowed_worker_ids": [1]}),
    ] {
        let r = s.post("/select_and_reserve", &sel(extra.clone())).await;
        assert_eq!((r.status, r.error()), taken, "{extra}");
    }
    let r = s
        .post(
            "/select_and_reserve",
            &sel(json!({"selection_id": "q", "model_name": "nomodel"})),
        )
        .await;
    assert_eq!(r.status, 503, "{}", r.text());
    // /select books nothing, so a booked id is no conflict there.
    let r = s
        .post(
            "/select",
            &sel(json!({"selection_id": "q", "allowed_worker_ids": [9]})),
        )
        .await;
    assert_eq!(
        (r.status, r.error()),
        (503, "no endpoints available to route work".to_string())
    );

    // A pinned worker outside the allowed set is the request's fault (400),
    // also with an empty set; the set is the affinity target's worker when
    // that target is a rank within it.
    let not_allowed = |w: u64| {
        (
            400,
            format!("pinned worker {w} is not in allowed worker set"),
        )
    };
    for (extra, want) in [
        (
            json!({"pinned_worker": {"worker_id": 2, "dp_rank": 0}, "allowed_worker_ids": [1]}),
            Some(not_allowed(2)),
        ),
        (
            json!({"pinned_worker": {"worker_id": 2, "dp_rank": 0}, "allowed_worker_ids": []}),
            Some(not_allowed(2)),
        ),
        (
            json!({"pinned_worker": {"worker_id": 9, "dp_rank": 0}, "allowed_worker_ids": [1]}),
            Some(not_allowed(9)),
        ),
        (
            json!({"pinned_worker": {"worker_id": 1, "dp_rank": 0}, "affinity_target": {"worker_id": 2}}),
            Some(not_allowed(1)),
        ),
        (
            json!({"pinned_worker": {"worker_id": 1, "dp_rank": 0}, "affinity_target": {"worker_id": 2},
                   "allowed_worker_ids": [1, 2]}),
            Some(not_allowed(1)),
        ),
        // The target is outside the allowed set, or no rank: no narrowing.
        (
            json!({"pinned_worker": {"worker_id": 1, "dp_rank": 0}, "affinity_target": {"worker_id": 2},
                   "allowed_worker_ids": [1]}),
            None,
        ),
        (
            json!({"pinned_worker": {"worker_id": 1, "dp_rank": 0}, "affinity_target": {"worker_id": 9}}),
            None,
        ),
        (
            json!({"pinned_worker": {"worker_id": 1, "dp_rank": 0}, "affinity_target": {"worker_id": 1}}),
            None,
        ),
    ] {
        let r = s.post("/select", &sel(extra.clone())).await;
        match want {
            Some(w) => assert_eq!((r.status, r.error()), w, "{extra}"),
            None => {
                assert_eq!(r.status, 200, "{extra}: {}", r.text());
                assert_eq!(r.json()["worker_id"], json!(1), "{extra}");
            }
        }
    }
    // The prompt's own 400 comes before the pinned worker's.
    let r = s
        .post(
            "/select",
            &sel(json!({"token_ids": null, "block_hashes": [1],
                        "pinned_worker": {"worker_id": 2, "dp_rank": 0}, "allowed_worker_ids": [1]})),
        )
        .await;
    assert_eq!(
        (r.status, r.error()),
        (
            400,
            "sequence_hashes is required without token_ids".to_string()
        )
    );
}

#[tokio::test]
async fn empty_ids_route_as_in_the_reference() {
    let s = start().await;
    s.worker(1, "m", BS, &unused_endpoint()).await;
    // The empty id is legal, and its lifecycle routes work.
    let r = s
        .post("/select_and_reserve", &sel(json!({"selection_id": ""})))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = s
        .post(
            "/reservations//output_block",
            &json!({"decay_fraction": 0.5}),
        )
        .await;
    assert_eq!(
        (r.status, r.text()),
        (200, r#"{"status":"ok"}"#.to_string())
    );
    let r = s.post_str("/reservations//prefill_complete", "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = s.get("/reservations//prefill_complete").await;
    assert_eq!(
        (r.status, r.error()),
        (405, "method not allowed".to_string())
    );
    // DELETE /reservations/ is no route: the empty id cannot be freed.
    let r = s.delete("/reservations/").await;
    assert_eq!((r.status, r.error()), (404, "route not found".to_string()));
    let r = s.post_str("/reservations//prefill_complete", "").await;
    assert_eq!(r.status, 200, "still booked: {}", r.text());
    // `/workers/` is no route either.
    for r in [
        s.delete("/workers/").await,
        s.get("/workers/").await,
        s.raw("PATCH", "/workers/", Some("application/json"), &b"{}"[..])
            .await,
    ] {
        assert_eq!((r.status, r.error()), (404, "route not found".to_string()));
    }
}

/// With prefill untracked the cache keeps its credit (unscaled), as the
/// reference has it: a worker holding the prompt's 5 blocks (credit 5)
/// beats an idle one while it has fewer than 5 more decode blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untracked_prefill_still_credits_the_cache() {
    let s = start().await;
    let prompt = tokens(1, 5 * BS);
    let hashes: Vec<u64> = (1..=5).collect();
    s.worker(1, "m", BS, &unused_endpoint()).await;
    let mut cached = Publisher::bind();
    s.worker(2, "m", BS, &cached.endpoint).await;
    // Sent once, after the server subscribed. (Resent in a loop with seq 0,
    // a late copy is a restart: it clears worker 2's blocks while a later
    // selection reads them.)
    cached.wait_subscriber();
    cached.send_events(&[stored(&hashes, None, &prompt, BS, "GPU")], None);
    let pinned2 = json!({"model_name": "m", "token_ids": prompt,
                         "pinned_worker": {"worker_id": 2, "dp_rank": 0}});
    let applied = eventually(Duration::from_secs(10), || async {
        let r = s.post("/select", &pinned2).await;
        r.status == 200 && r.json()["overlap"]["gpu"] == json!(5 * BS)
    })
    .await;
    assert!(applied, "the store never arrived");

    let untracked = json!({"model_name": "m", "token_ids": prompt,
                           "router_config_override": {"track_prefill_tokens": false}});
    // Bookings of blocks of their own (decode blocks count distinct ids).
    let book = |id: &str, from: u64, n: u64| {
        json!({"selection_id": id, "model_name": "m", "worker_id": 2,
               "sequence_hashes": (from..from + n).collect::<Vec<u64>>(), "isl_tokens": n * BS as u64})
    };
    // Idle: 5 new blocks. Worker 2: -5 + 4 + 5.
    assert_eq!(
        s.post("/reservations", &book("d4", 1000, 4)).await.status,
        201
    );
    for _ in 0..5 {
        let r = s.post("/select", &untracked).await;
        assert_eq!(r.json()["worker_id"], json!(2), "{}", r.text());
    }
    // Two more decode blocks: -5 + 6 + 5 > 5.
    assert_eq!(
        s.post("/reservations", &book("d2", 2000, 2)).await.status,
        201
    );
    for _ in 0..5 {
        let r = s.post("/select", &untracked).await;
        assert_eq!(r.json()["worker_id"], json!(1), "{}", r.text());
    }
}
