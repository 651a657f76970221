//! Findings of a side-by-side review against the reference (Dynamo 1.6.1),
//! each a request that kvselect answered differently, or that could act on
//! state it should not reach.

mod common;
use common::*;
use serde_json::json;

/// Percent escapes in a path id that decode to bytes which are not UTF-8
/// were decoded lossily, so `%FF` and `%FE` both named the booking whose id
/// is U+FFFD: a client could free another client's booking.
#[tokio::test]
async fn path_ids_that_are_not_utf8_are_a_400_and_touch_no_booking() {
    let s = start().await;
    s.worker(1, "m", 16, &unused_endpoint()).await;
    let body = json!({"model_name": "m", "token_ids": [1], "selection_id": "\u{FFFD}"});
    assert_eq!(s.post("/select_and_reserve", &body).await.status, 200);
    for (method, path) in [
        ("DELETE", "/reservations/%FF"),
        ("POST", "/reservations/%C3%28/prefill_complete"),
        ("POST", "/reservations/x%EF%BF/output_block"),
    ] {
        let r = s.raw(method, path, Some("application/json"), "{}").await;
        assert_eq!(
            (r.status, r.error()),
            (
                400,
                "Invalid URL: Invalid UTF-8 in `selection_id`".to_string()
            ),
            "{method} {path}"
        );
    }
    let r = s.raw("DELETE", "/workers/%FF", None, "").await;
    assert_eq!(
        (r.status, r.error()),
        (400, "Invalid URL: Invalid UTF-8 in `worker_id`".to_string())
    );
    // The U+FFFD booking is still there, and its own id, escaped, frees it.
    assert_eq!(
        s.get("/loads").await.json()[0]["loads"][0]["active_requests"],
        1
    );
    assert_eq!(s.delete("/reservations/%EF%BF%BD").await.status, 200);
    assert_eq!(s.get("/workers").await.json()[0]["worker_id"], 1);
}

#[tokio::test]
async fn a_query_field_given_twice_is_a_400() {
    let s = start().await;
    for path in [
        "/workers?model_name=x&model_name=m",
        "/loads?routing_group=a&routing_group=b",
    ] {
        let r = s.get(path).await;
        let field = if path.contains("model_name") {
            "model_name"
        } else {
            "routing_group"
        };
        assert_eq!(
            (r.status, r.error()),
            (
                400,
                format!("Failed to deserialize query string: duplicate field `{field}`")
            ),
            "{path}"
        );
    }
    // Other keys are ignored, given twice or not.
    assert_eq!(s.get("/workers?x=1&x=2").await.status, 200);
}

#[tokio::test]
async fn a_second_leading_slash_is_no_route() {
    let s = start().await;
    for path in ["//health", "//workers", "///select"] {
        let r = s.get(path).await;
        assert_eq!(
            (r.status, r.error()),
            (404, "route not found".to_string()),
            "{path}"
        );
    }
}

/// Fields that default when absent but are not `Option`s in the reference:
/// `null` is a 422 there (a worker patch's `null` still leaves a field as
/// it is).
#[tokio::test]
async fn null_where_the_reference_has_no_option_is_a_422() {
    let s = start().await;
    s.worker(1, "m", 16, &unused_endpoint()).await;
    let r = s
        .post(
            "/select",
            &json!({"model_name": "m", "token_ids": [1], "advisory": null}),
        )
        .await;
    assert_eq!(r.status, 422, "{}", r.text());
    assert!(
        r.error()
            .contains("advisory: invalid type: null, expected a boolean"),
        "{}",
        r.error()
    );
    // /select_and_reserve has no `advisory`: ignored, as any unknown field.
    let r = s
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m", "token_ids": [1], "advisory": null}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    for (field, expected) in [
        ("taints", "a sequence"),
        ("topology_domains", "a map"),
        ("kv_events_endpoints", "a map"),
    ] {
        let mut w = json!({"worker_id": 2, "endpoint": "http://w2", "block_size": 16,
                           "kv_events_endpoint": unused_endpoint()});
        w[field] = json!(null);
        let r = s.post("/workers", &w).await;
        assert_eq!(r.status, 422, "{field}: {}", r.text());
        assert!(
            r.error()
                .contains(&format!("{field}: invalid type: null, expected {expected}")),
            "{}",
            r.error()
        );
        let r = s
            .raw(
                "PATCH",
                "/workers/1",
                Some("application/json"),
                json!({field: null}).to_string(),
            )
            .await;
        assert_eq!(r.status, 200, "PATCH {field}: {}", r.text());
    }
    assert_eq!(s.get("/workers").await.json().as_array().unwrap().len(), 1);
}

/// An `isl_tokens` near 2^64 wrapped the rank's prefill sum, so a loaded
/// worker looked idle (the reference wraps it too, then panics on its
/// prefill_complete).
#[tokio::test]
async fn isl_tokens_beyond_u32_are_a_400_and_book_nothing() {
    let s = start().await;
    s.worker(1, "m", 16, &unused_endpoint()).await;
    let huge = u64::MAX;
    for (path, body) in [
        (
            "/reservations",
            json!({"model_name": "m", "selection_id": "r1", "worker_id": 1,
                   "sequence_hashes": [5], "isl_tokens": huge, "effective_prefill_tokens": huge}),
        ),
        (
            "/select_and_reserve",
            json!({"model_name": "m", "selection_id": "r2", "block_hashes": [5],
                   "sequence_hashes": [5], "isl_tokens": 1u64 << 32}),
        ),
    ] {
        let r = s.post(path, &body).await;
        assert_eq!(
            (r.status, r.error()),
            (400, "isl_tokens must be at most 4294967295".to_string()),
            "{path}"
        );
    }
    let row = &s.get("/loads").await.json()[0]["loads"][0];
    assert_eq!(row["active_requests"], 0, "{row}");
    assert_eq!(row["potential_prefill_tokens"], 0, "{row}");
    // The bound itself is accepted.
    let r = s
        .post(
            "/select_and_reserve",
            &json!({"model_name": "m", "selection_id": "r3", "block_hashes": [5],
                    "sequence_hashes": [5], "isl_tokens": u32::MAX}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A rank range past u32::MAX was cut to nothing: the worker was
/// schedulable, counted by /ready, and had no rank to select.
#[tokio::test]
async fn a_rank_range_past_u32_is_not_schedulable() {
    let s = start().await;
    let r = s
        .post(
            "/workers",
            &json!({"worker_id": 31, "endpoint": "http://w31", "block_size": 16,
                    "data_parallel_start_rank": u32::MAX, "data_parallel_size": 2,
                    "kv_events_endpoints": {"4294967295": unused_endpoint()}}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let v = r.json();
    assert_ne!(v["lifecycle"], "schedulable", "{v}");
    assert_eq!(
        v["not_schedulable_reasons"],
        json!(["data_parallel_start_rank + data_parallel_size must not exceed 4294967295"])
    );
    assert_eq!(s.get("/ready").await.status, 503);
    // The highest range that fits: one rank, u32::MAX - 1, that selects.
    let r = s
        .post(
            "/workers",
            &json!({"worker_id": 32, "endpoint": "http://w32", "block_size": 16,
                    "data_parallel_start_rank": u32::MAX - 1, "data_parallel_size": 1,
                    "kv_events_endpoints": {"4294967294": unused_endpoint()}}),
        )
        .await;
    assert_eq!(r.json()["lifecycle"], "schedulable", "{}", r.text());
    let r = s.post("/select", &json!({"token_ids": [1]})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        (r.json()["worker_id"].as_u64(), r.json()["dp_rank"].as_u64()),
        (Some(32), Some(u64::from(u32::MAX - 1)))
    );
}
