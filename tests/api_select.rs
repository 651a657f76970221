//! Selection against the spec: §10 rows 41–53, the §5.4 hash vectors through
//! /select_and_reserve, and §4.8's response fields.

mod common;
use common::*;
use serde_json::{json, Value};

async fn ready_partition(s: &TestServer, model: &str, bs: u32) {
    s.worker(1, model, bs, &unused_endpoint()).await;
}

fn seqs(v: &Value) -> Vec<i64> {
    v["sequence_hashes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

const V1: [i64; 4] = [
    -1583300653928780152,
    -5980354406663771828,
    960926348267535642,
    4923844688253642376,
];

#[tokio::test]
async fn hash_vectors_through_select_and_reserve() {
    let s = start().await;
    ready_partition(&s, "hb16", 16).await;
    let mut n = 0;
    let mut check = |body: Value| {
        n += 1;
        let mut body = body;
        body["model_name"] = json!("hb16");
        body["selection_id"] = json!(format!("v{n}"));
        body
    };
    let cases: Vec<(Value, Vec<i64>, u64)> = vec![
        (json!({"token_ids": tokens(1, 64)}), V1.to_vec(), 64),
        (json!({"token_ids": tokens(1, 70)}), V1.to_vec(), 70),
        (json!({"token_ids": tokens(1, 15)}), vec![], 15),
        (json!({"token_ids": []}), vec![], 0),
        (
            json!({"token_ids": tokens(1, 65), "is_eagle": true}),
            vec![
                6752489653130089168,
                9179783426037465070,
                -1110493754701239145,
                5272114047328302112,
            ],
            65,
        ),
        (
            json!({"token_ids": tokens(1, 64), "lora_name": "adapter-a"}),
            vec![
                4377081107200288488,
                7377467575642017039,
                -46267199052646533,
                1112326616743196530,
            ],
            64,
        ),
        (
            json!({"token_ids": tokens(1, 64), "lora_name": "adapter-a", "cache_salt": "tenant-a"}),
            vec![
                6479329714943191495,
                1048832103984355278,
                -7557696592854020439,
                8012940166391839893,
            ],
            64,
        ),
        (
            json!({"token_ids": tokens(1, 64), "lora_name": "", "cache_salt": ""}),
            V1.to_vec(),
            64,
        ),
        (
            json!({"token_ids": tokens(0, 39),
                   "block_mm_infos": [{"mm_objects": [{"mm_hash": 42, "offsets": [[0, 2]]}]}, null]}),
            vec![-1150668130253449645, 8017126656147137792],
            40,
        ),
        (
            json!({"block_hashes": [1, 2], "sequence_hashes": [-3, 4], "isl_tokens": 40}),
            vec![-3, 4],
            40,
        ),
        (
            json!({"mm_routing_info": {"routing_token_ids": tokens(1, 64)}, "token_ids": [9, 9]}),
            V1.to_vec(),
            64,
        ),
    ];
    for (body, want, isl) in cases {
        let body = check(body);
        let r = s.post("/select_and_reserve", &body).await;
        assert_eq!(r.status, 200, "{body}: {}", r.text());
        let v = r.json();
        assert_eq!(seqs(&v), want, "{body}");
        assert_eq!(v["isl_tokens"], isl, "{body}");
        assert_eq!(v["track_prefill_tokens"], true);
    }
}

#[tokio::test]
async fn select_response_shape_and_no_booking() {
    let s = start().await;
    ready_partition(&s, "m", 16).await;
    let r = s
        .post(
            "/select",
            &json!({"model_name": "m", "token_ids": tokens(1, 64)}),
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.json(),
        json!({"model_name":"m","routing_group":"default","worker_id":1,"dp_rank":0,"endpoint":"http://w1",
               "block_size":16,"overlap":{"longest_matched":0,"gpu":0,"dp":{"0":0},"cpu":0,"disk":0},
               "effective_prefill_tokens":64,"potential_decode_blocks":4})
    );
    let text = r.text();
    assert!(
        text.starts_with(r#"{"model_name":"m","routing_group":"default","worker_id":1"#),
        "{text}"
    );
    let row = s.load_row("m", 1, 0).await;
    assert_eq!(row["active_requests"], 0, "/select never books");
    let r = s
        .post(
            "/select",
            &json!({"model_name": "m", "token_ids": [1], "selection_id": "s1"}),
        )
        .await;
    assert_eq!(r.json()["selection_id"], "s1");
    assert!(r.text().starts_with(r#"{"selection_id":"s1","model_name""#));
}

#[tokio::test]
async fn row41_to_47_precomputed_prompt_rules() {
    let s = start().await;
    ready_partition(&s, "hb16", 16).await;
    let cases: &[(&str, u16, &str)] = &[
        (
            r#"{"model_name":"hb16"}"#,
            400,
            "block_hashes is required without token_ids",
        ),
        (
            r#"{"model_name":"hb16","block_hashes":[1,2]}"#,
            400,
            "sequence_hashes is required without token_ids",
        ),
        (
            r#"{"model_name":"hb16","block_hashes":[1,2],"sequence_hashes":[3,4]}"#,
            400,
            "isl_tokens is required without token_ids",
        ),
        (
            r#"{"model_name":"hb16","block_hashes":[1,2],"sequence_hashes":[3],"isl_tokens":32}"#,
            400,
            "block_hashes length 2 must match sequence_hashes length 1",
        ),
        (
            r#"{"model_name":"hb16","block_hashes":[1,2],"sequence_hashes":[3,4],"isl_tokens":0}"#,
            400,
            "isl_tokens must be greater than 0",
        ),
    ];
    for (body, status, msg) in cases {
        let r = s.post_str("/select", body).await;
        assert_eq!((r.status, r.error()), (*status, msg.to_string()), "{body}");
    }
    let r = s
        .post_str(
            "/select",
            r#"{"model_name":"hb16","block_hashes":[],"sequence_hashes":[],"isl_tokens":5}"#,
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["effective_prefill_tokens"], 5);
    assert_eq!(
        r.json()["potential_decode_blocks"],
        1,
        "row 46: partial block counts"
    );
    let r = s
        .post_str(
            "/select",
            r#"{"model_name":"hb16","block_hashes":[1,2],"sequence_hashes":[3,4],"isl_tokens":40}"#,
        )
        .await;
    assert_eq!(r.json()["potential_decode_blocks"], 3);
    let r = s
        .post_str("/select", r#"{"model_name":"hb16","block_hashes":[18446744073709551615],"sequence_hashes":[1],"isl_tokens":1}"#)
        .await;
    assert_eq!(r.status, 422, "row 47");
    assert!(r.error().contains("expected i64"), "{}", r.error());
}

#[tokio::test]
async fn row48_to_53_partitions_filters_and_advisory() {
    let s = start().await;
    let ep = unused_endpoint();
    let r = s
        .post("/workers", &json!({"worker_id": 15, "model_name": "hb16", "endpoint": "http://w15", "block_size": 16,
               "kv_events_endpoints": {"0": ep}, "max_num_batched_tokens": 8192, "total_kv_blocks": 1000,
               "taints": ["gpu-a"]}))
        .await;
    assert_eq!(r.json()["lifecycle"], "schedulable");
    let base = json!({"model_name": "hb16", "token_ids": tokens(1, 32)});
    let with = |k: &str, v: Value| {
        let mut b = base.clone();
        b[k] = v;
        b
    };
    let r = s
        .post("/select", &with("routing_group", json!("nope")))
        .await;
    assert_eq!(
        (r.status, r.error()),
        (
            503,
            "no schedulable workers for model=hb16 routing_group=nope".to_string()
        )
    );
    for (k, v) in [
        ("allowed_worker_ids", json!([999])),
        ("pinned_worker", json!({"worker_id": 999, "dp_rank": 0})),
        ("pinned_worker", json!({"worker_id": 15, "dp_rank": 1})),
        ("routing_constraints", json!({"required_taints": ["gpu-x"]})),
    ] {
        let r = s.post("/select", &with(k, v.clone())).await;
        assert_eq!(
            (r.status, r.error()),
            (503, "no endpoints available to route work".to_string()),
            "{k}={v}"
        );
    }
    let r = s
        .post(
            "/select",
            &with("routing_constraints", json!({"required_taints": ["gpu-a"]})),
        )
        .await;
    assert_eq!(r.status, 200);
    let r = s
        .post("/select", &with("pinned_worker", json!({"worker_id": 15})))
        .await;
    assert_eq!(r.status, 422);
    assert!(
        r.error().contains("pinned_worker: missing field `dp_rank`"),
        "{}",
        r.error()
    );
    let r = s
        .post(
            "/select",
            &with(
                "router_config_override",
                json!({"overlap_score_credit": -1}),
            ),
        )
        .await;
    assert_eq!(r.status, 422);
    assert!(
        r.error().contains(
            "router_config_override: overlap_score_credit must be a finite, non-negative number"
        ),
        "{}",
        r.error()
    );
    let r = s.post("/select", &with("advisory", json!(true))).await;
    assert_eq!(
        r.json()["worker_load"],
        json!({"active_prefill_tokens": 0, "prefill_token_capacity": 8192, "total_kv_blocks": 1000})
    );
    let r = s
        .post(
            "/select",
            &with("session_context", json!({"parent_session_id": "p"})),
        )
        .await;
    assert_eq!(r.status, 422, "row 80");
    assert!(
        r.error()
            .contains("session_context: missing field `session_id`"),
        "{}",
        r.error()
    );
}

#[tokio::test]
async fn ties_are_broken_at_random() {
    let s = start().await;
    for id in 1..=3 {
        s.worker(id, "t", 16, &unused_endpoint()).await;
    }
    let mut counts = [0u32; 4];
    for _ in 0..60 {
        let r = s
            .post(
                "/select",
                &json!({"model_name": "t", "token_ids": tokens(1, 64)}),
            )
            .await;
        counts[r.json()["worker_id"].as_u64().unwrap() as usize] += 1;
    }
    assert!(
        counts[1..].iter().all(|&c| c >= 5),
        "idle workers share the load: {counts:?}"
    );
}

#[tokio::test]
async fn load_steers_selection_away() {
    let s = start().await;
    s.worker(1, "l", 16, &unused_endpoint()).await;
    s.worker(2, "l", 16, &unused_endpoint()).await;
    let first = s
        .post(
            "/select_and_reserve",
            &json!({"model_name": "l", "token_ids": tokens(1000, 1255)}),
        )
        .await
        .json();
    let busy = first["worker_id"].as_u64().unwrap();
    for _ in 0..10 {
        let r = s
            .post(
                "/select",
                &json!({"model_name": "l", "token_ids": tokens(1, 64)}),
            )
            .await;
        assert_ne!(
            r.json()["worker_id"].as_u64().unwrap(),
            busy,
            "the idle worker is cheaper"
        );
    }
    // The weight override really applies: with prefill scale 0 and credit 0,
    // only decode load counts, which still favours the idle worker; with the
    // busy worker pinned, we get it regardless.
    let r = s
        .post(
            "/select",
            &json!({"model_name": "l", "token_ids": tokens(1, 64),
               "pinned_worker": {"worker_id": busy, "dp_rank": 0}}),
        )
        .await;
    assert_eq!(r.json()["worker_id"].as_u64().unwrap(), busy);
}

#[tokio::test]
async fn assume_kv_reuse_override_books_random_identities() {
    let s = start().await;
    ready_partition(&s, "r", 16).await;
    let r = s
        .post("/select_and_reserve", &json!({"model_name": "r", "token_ids": tokens(1, 64),
               "router_config_override": {"assume_kv_reuse": false, "track_prefill_tokens": false}}))
        .await;
    let v = r.json();
    assert_eq!(seqs(&v).len(), 4);
    assert_ne!(seqs(&v), V1.to_vec());
    assert_eq!(v["track_prefill_tokens"], false);
    let row = s.load_row("r", 1, 0).await;
    assert_eq!(
        (
            row["potential_prefill_tokens"].as_u64(),
            row["potential_decode_blocks"].as_u64()
        ),
        (Some(0), Some(4))
    );
    // Given sequence hashes are booked as given (measured on Dynamo 1.6.1:
    // echoed, and shared with a booking of the same hashes).
    for id in ["g1", "g2"] {
        let r = s
            .post("/select_and_reserve", &json!({"model_name": "r", "selection_id": id,
                   "pinned_worker": {"worker_id": 1, "dp_rank": 0},
                   "block_hashes": [11, 12], "sequence_hashes": [1, 2], "isl_tokens": 32,
                   "router_config_override": {"assume_kv_reuse": false, "track_prefill_tokens": false}}))
            .await;
        assert_eq!(seqs(&r.json()), vec![1, 2]);
    }
    let row = s.load_row("r", 1, 0).await;
    assert_eq!(
        row["potential_decode_blocks"].as_u64(),
        Some(6),
        "4 + the 2 shared"
    );
}

/// §5.5: keyed-xxh3-v1 changes only the booked identities.
#[tokio::test]
async fn keyed_tracking_vector() {
    let s = start_with(kvselect::config::Config {
        tracking_key: Some(kvselect::hash::TrackingKey {
            key: [0x5a; 32],
            key_id: "2026-01".into(),
        }),
        ..test_config()
    })
    .await;
    let r = s
        .post(
            "/workers",
            &json!({"worker_id": 1, "model_name": "model-a", "routing_group": "tenant-a",
                    "endpoint": "http://w1", "block_size": 4,
                    "kv_events_endpoints": {"0": unused_endpoint()}}),
        )
        .await;
    assert_eq!(r.json()["lifecycle"], "schedulable");
    let body = |extra: Value| {
        let mut b = json!({"model_name": "model-a", "routing_group": "tenant-a", "token_ids": tokens(0, 11)});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let r = s
        .post(
            "/select_and_reserve",
            &body(json!({"cache_salt": "cache-a", "lora_name": "adapter-a"})),
        )
        .await;
    assert_eq!(
        seqs(&r.json()),
        vec![
            4363769719052127296,
            -3448220111546932189,
            -4525829865824556860
        ]
    );
    let r = s.post("/select_and_reserve", &body(json!({}))).await;
    assert_eq!(
        seqs(&r.json()),
        vec![
            9128120665308694112,
            3464444111544908762,
            -3717274867117557559
        ]
    );
    // Precomputed sequence hashes pass through untouched.
    let r = s
        .post(
            "/select_and_reserve",
            &json!({"model_name": "model-a", "routing_group": "tenant-a",
                    "block_hashes": [1], "sequence_hashes": [-5], "isl_tokens": 4}),
        )
        .await;
    assert_eq!(seqs(&r.json()), vec![-5]);
}

/// Nested structs given as arrays (serde's positional form), over HTTP:
/// accepted and honoured, with the reference's statuses and texts when the
/// length is wrong.
#[tokio::test]
async fn nested_structs_as_arrays() {
    let s = start().await;
    let ep = unused_endpoint();
    let r = s
        .post("/workers", &json!({"worker_id": 15, "model_name": "arr", "endpoint": "http://w15", "block_size": 16,
               "kv_events_endpoints": {"0": ep}, "taints": ["gpu-a"]}))
        .await;
    assert_eq!(r.json()["lifecycle"], "schedulable");
    s.worker(16, "arr", 16, &unused_endpoint()).await;
    let r = s
        .post_str(
            "/select",
            r#"{"model_name":"arr","token_ids":[1,2],"pinned_worker":[16,0]}"#,
        )
        .await;
    assert_eq!((r.status, r.json()["worker_id"].clone()), (200, json!(16)));
    let r = s
        .post_str(
            "/select",
            r#"{"model_name":"arr","token_ids":[1,2],"pinned_worker":[15,1]}"#,
        )
        .await;
    assert_eq!(r.status, 503, "{}", r.error());
    let r = s
        .post_str(
            "/select",
            r#"{"model_name":"arr","token_ids":[1],"routing_constraints":[["gpu-a"]]}"#,
        )
        .await;
    assert_eq!((r.status, r.json()["worker_id"].clone()), (200, json!(15)));
    let r = s
        .post_str(
            "/select",
            r#"{"model_name":"arr","token_ids":[1],"routing_constraints":[]}"#,
        )
        .await;
    assert_eq!(r.status, 200);
    let r = s
        .post_str(
            "/select_and_reserve",
            r#"{"model_name":"arr","token_ids":[1,2],"router_config_override":[null,null,null,null,null,false,null]}"#,
        )
        .await;
    assert_eq!(
        (r.status, r.json()["track_prefill_tokens"].clone()),
        (200, json!(false))
    );
    let r = s
        .post_str(
            "/select",
            r#"{"model_name":"arr","token_ids":[1],"pinned_worker":[3]}"#,
        )
        .await;
    assert_eq!(r.status, 422);
    assert_eq!(
        r.error(),
        "Failed to deserialize the JSON body into the target type: pinned_worker: invalid length 1, \
         expected struct WorkerWithDpRank with 2 elements at line 1 column 55 (byte 55)"
    );
    let r = s
        .post_str(
            "/select",
            r#"{"model_name":"arr","token_ids":[1],"pinned_worker":[3,0,1]}"#,
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(
        r.error().contains("pinned_worker: trailing characters"),
        "{}",
        r.error()
    );
    let r = s.post_str("/overlap_scores", "[1]").await;
    assert_eq!(r.status, 422);
    assert!(
        r.error().contains("expected struct OverlapScoresRequest"),
        "{}",
        r.error()
    );
}
