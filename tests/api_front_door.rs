//! The front door against the spec's §10 table, rows 1–21 and 73–79: routes,
//! methods, Content-Type, body limit, and the 400/422 split.

mod common;
use common::*;
use serde_json::json;

#[tokio::test]
async fn row01_to_04_fresh_process() {
    let s = start().await;
    let r = s.get("/health").await;
    assert_eq!(
        (r.status, r.text()),
        (200, r#"{"status":"ok"}"#.to_string())
    );
    assert_eq!(r.headers["content-type"], "application/json");
    let r = s.get("/ready").await;
    assert_eq!(r.status, 503);
    assert_eq!(
        r.json(),
        json!({"ready":false,"schedulable_workers":0,"workers":[]})
    );
    assert_eq!(s.get("/loads").await.json(), json!([]));
    assert_eq!(s.get("/workers").await.json(), json!([]));
    let r = s.get("/dump").await;
    assert_eq!((r.status, r.json()), (200, json!({})));
    let r = s.raw("HEAD", "/health", None, "").await;
    assert_eq!(r.status, 200);
    assert!(r.body.is_empty());
}

#[tokio::test]
async fn row05_no_workers_is_503_everywhere() {
    let s = start().await;
    let body = json!({"token_ids": tokens(1, 64)});
    for path in [
        "/select",
        "/select_and_reserve",
        "/potential_loads",
        "/overlap_scores",
    ] {
        let r = s.post(path, &body).await;
        assert_eq!(r.status, 503, "{path}");
        assert_eq!(r.error(), "no schedulable workers are available", "{path}");
    }
}

#[tokio::test]
async fn row06_07_unknown_route_and_wrong_method() {
    let s = start().await;
    let r = s.get("/nope").await;
    assert_eq!((r.status, r.error()), (404, "route not found".to_string()));
    assert_eq!(
        s.get("/dump/").await.status,
        404,
        "no trailing-slash normalisation"
    );
    let r = s.delete("/reservations/").await;
    assert_eq!(
        (r.status, r.error()),
        (404, "route not found".to_string()),
        "row 73"
    );
    for (method, path, allow) in [
        ("GET", "/select", "POST"),
        ("PUT", "/workers", "GET,HEAD,POST"),
        ("GET", "/workers/1", "PATCH,DELETE"),
        ("OPTIONS", "/select", "POST"),
        ("POST", "/health", "GET,HEAD"),
    ] {
        let r = s.raw(method, path, None, "").await;
        assert_eq!(r.status, 405, "{method} {path}");
        assert_eq!(r.error(), "method not allowed");
        assert_eq!(r.headers["allow"], allow, "{method} {path}");
    }
}

#[tokio::test]
async fn row08_content_type_checked_first() {
    let s = start().await;
    let body = r#"{"token_ids":[1]}"#;
    for ct in [None, Some("text/plain"), Some("application/xml")] {
        let r = s.raw("POST", "/select", ct, body).await;
        assert_eq!(r.status, 415, "{ct:?}");
        assert_eq!(
            r.error(),
            "Expected request with `Content-Type: application/json`"
        );
    }
    for ct in ["application/json; charset=utf-8", "application/vnd.kv+json"] {
        let r = s.raw("POST", "/select", Some(ct), body).await;
        assert_eq!(r.status, 503, "{ct} is accepted and reaches the handler");
    }
    let r = s
        .raw("POST", "/reservations/x/output_block", None, "")
        .await;
    assert_eq!(r.status, 415, "row 70: output_block needs a JSON body");
}

#[tokio::test]
async fn row09_to_18_json_errors_400_vs_422() {
    let s = start().await;
    let cases: &[(&str, u16, &str)] = &[
        (
            r#"{"token_ids":[1"#,
            400,
            "Failed to parse the request body as JSON: ",
        ),
        ("", 400, "Failed to parse the request body as JSON: "),
        (
            r#"{"token_ids":[1,]}"#,
            400,
            "Failed to parse the request body as JSON: ",
        ),
        (
            r#"{"token_ids":[Infinity]}"#,
            400,
            "Failed to parse the request body as JSON: ",
        ),
        (
            r#"{"token_ids":[1]} x"#,
            400,
            "Failed to parse the request body as JSON: ",
        ),
        (
            "[]",
            422,
            "Failed to deserialize the JSON body into the target type: ",
        ),
        (
            "null",
            422,
            "Failed to deserialize the JSON body into the target type: ",
        ),
        (
            r#"{"token_ids": [-1]}"#,
            422,
            "invalid value: integer `-1`, expected u32",
        ),
        (
            r#"{"token_ids": [4294967296]}"#,
            422,
            "invalid value: integer `4294967296`, expected u32",
        ),
        (
            r#"{"token_ids": [1.5]}"#,
            422,
            "invalid type: floating point `1.5`, expected u32",
        ),
        (
            r#"{"token_ids": "abc"}"#,
            422,
            "invalid type: string \"abc\", expected a sequence",
        ),
        (
            r#"{"token_ids": [1], "is_eagle": "yes"}"#,
            422,
            "expected a boolean",
        ),
        (
            r#"{"token_ids": [1], "is_eagle": "false"}"#,
            422,
            "expected a boolean",
        ),
        (
            r#"{"token_ids": [1], "model_name": 5}"#,
            422,
            "model_name: invalid type: integer `5`, expected a string",
        ),
        (
            r#"{"model_name":"m","model_name":"m","token_ids":[1]}"#,
            422,
            "duplicate field `model_name`",
        ),
    ];
    for (body, status, needle) in cases {
        let r = s.post_str("/select", body).await;
        assert_eq!(r.status, *status, "{body}: {}", r.text());
        let e = r.error();
        assert!(e.contains(needle), "{body}: `{e}` lacks `{needle}`");
        if *status == 422 || *status == 400 {
            assert!(e.contains(" at line "), "{body}: `{e}` carries a position");
        }
    }
}

#[tokio::test]
async fn row19_to_21_body_limit() {
    let s = start().await;
    let limit = 8 * 1024 * 1024;
    let mut exact = br#"{"token_ids":[1],"pad":""#.to_vec();
    exact.resize(limit - 2, b'a');
    exact.extend_from_slice(br#""}"#);
    assert_eq!(exact.len(), limit);
    let r = s
        .raw("POST", "/select", Some("application/json"), exact.clone())
        .await;
    assert_eq!(
        r.status,
        503,
        "exactly 8 MiB passes the limit: {}",
        r.text()
    );
    let mut over = exact.clone();
    over.insert(over.len() - 2, b'a');
    let r = s
        .raw("POST", "/select", Some("application/json"), over.clone())
        .await;
    assert_eq!(r.status, 413);
    assert_eq!(
        r.error(),
        "Failed to buffer the request body: length limit exceeded"
    );
    let r = s.raw("POST", "/select", None, over).await;
    assert_eq!(r.status, 415, "Content-Type wins over size");
}

#[tokio::test]
async fn body_limit_is_configurable() {
    let s = start_with(kvselect::config::Config {
        body_limit_bytes: 64,
        ..test_config()
    })
    .await;
    let r = s
        .post("/select", &json!({"token_ids": tokens(1, 64)}))
        .await;
    assert_eq!(r.status, 413);
}

#[tokio::test]
async fn path_parameters_that_do_not_parse() {
    let s = start().await;
    let r = s.send("PATCH", "/workers/abc", &json!({})).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.error(), "Invalid URL: Cannot parse `abc` to a `u64`");
    let r = s.delete("/workers/-1").await;
    assert_eq!(
        (r.status, r.error()),
        (400, "Invalid URL: Cannot parse `-1` to a `u64`".to_string())
    );
}

#[tokio::test]
async fn row76_replica_sync_is_disabled() {
    let s = start().await;
    let r = s.get("/replica_sync/peers").await;
    assert_eq!((r.status, r.json()), (200, json!([])));
    let r = s
        .post(
            "/replica_sync/register_peer",
            &json!({"endpoint": "tcp://127.0.0.1:1"}),
        )
        .await;
    assert_eq!(
        (r.status, r.error()),
        (409, "replica sync is disabled".to_string())
    );
    let r = s.post("/replica_sync/register_peer", &json!({})).await;
    assert_eq!(r.status, 422);
    assert!(r.error().contains("missing field `endpoint`"));
}

#[tokio::test]
async fn http2_prior_knowledge_is_served() {
    let s = start().await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let resp = client
        .get(format!("http://{}/health", s.addr).parse().unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), hyper::Version::HTTP_2);
}
