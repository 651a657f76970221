//! Stale streams count less (issue #17 item 4), on the real server with
//! real ZMQ publishers: a rank whose KV stream is replaying a gap has its
//! overlap counted half, and the reply names why in
//! `x-kvselect-worker-stale`.

mod common;

use common::*;
use serde_json::json;
use std::time::Duration;

const BS: u32 = 16;

/// A replay endpoint that takes requests and never answers, so a replay
/// against it runs until the replay timeout.
fn silent_replay_endpoint() -> (zmq::Context, zmq::Socket, String) {
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::ROUTER).unwrap();
    s.set_linger(0).unwrap();
    s.bind("tcp://127.0.0.1:*").unwrap();
    let ep = s.get_last_endpoint().unwrap().unwrap();
    (ctx, s, ep)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaying_stream_counts_half_and_the_reply_says_so() {
    let s = start().await;
    let prompt = tokens(1, 10 * BS);
    let hashes: Vec<u64> = (1..=10).collect();

    // Worker 1 holds 6 of the prompt's 10 blocks; worker 2 holds all 10
    // and has a replay endpoint that never answers.
    let mut a = Publisher::bind();
    s.worker(1, "m", BS, &a.endpoint).await;
    let mut b = Publisher::bind();
    let (_ctx, _router, replay) = silent_replay_endpoint();
    let r = s
        .post(
            "/workers",
            &json!({"worker_id": 2, "model_name": "m", "endpoint": "http://w2", "block_size": BS,
                    "kv_events_endpoints": {"0": b.endpoint}, "replay_endpoint": replay}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());

    let select = || async {
        s.post("/select", &json!({"model_name": "m", "token_ids": prompt}))
            .await
    };
    // Each store is sent once, after the server subscribed: a PUB drops
    // what it sends before the subscription arrives, and a resent seq 0 is
    // a restart that clears the worker's blocks while later checks read
    // them.
    a.wait_subscriber();
    b.wait_subscriber();
    a.send_events(
        &[stored(
            &hashes[..6],
            None,
            &prompt[..6 * BS as usize],
            BS,
            "GPU",
        )],
        None,
    );
    b.send_events(&[stored(&hashes, None, &prompt, BS, "GPU")], None);
    let on_1 = || async {
        s.post(
            "/select",
            &json!({"model_name": "m", "token_ids": prompt, "pinned_worker": {"worker_id": 1, "dp_rank": 0}}),
        )
        .await
    };
    let applied = eventually(Duration::from_secs(10), || async {
        let r = select().await;
        r.status == 200
            && r.json()["overlap"]["longest_matched"] == json!(10 * BS)
            && on_1().await.json()["overlap"]["longest_matched"] == json!(6 * BS)
    })
    .await;
    assert!(applied, "the stores never arrived");

    // Fresh, the fuller cache wins, unflagged.
    for _ in 0..5 {
        let r = select().await;
        assert_eq!(r.json()["worker_id"], json!(2), "{}", r.text());
        assert!(r.headers.get("x-kvselect-worker-stale").is_none());
    }
    assert_eq!(s.metric("kvselect_stale_overlap_discounts_total").await, 0);

    // A gap on worker 2 (seq 1 never sent): its listener asks the silent
    // endpoint to replay, and waits.
    b.seq = 2;
    b.send_events(
        &[stored(
            &[11],
            Some(10),
            &tokens(1000, 1000 + BS - 1),
            BS,
            "GPU",
        )],
        None,
    );
    let replaying = eventually(Duration::from_secs(5), || async {
        s.get("/workers").await.json()[1]["kv_streams"][0]["state"] == json!("replaying")
    })
    .await;
    assert!(replaying, "{}", s.get("/workers").await.text());

    // Replaying, worker 2's 10 blocks count as 5, below worker 1's 6. The
    // reported overlap stays what the index holds.
    let r = select().await;
    assert_eq!(r.json()["worker_id"], json!(1), "{}", r.text());
    assert!(r.headers.get("x-kvselect-worker-stale").is_none());
    let pinned = s
        .post(
            "/select",
            &json!({"model_name": "m", "token_ids": prompt, "pinned_worker": {"worker_id": 2, "dp_rank": 0}}),
        )
        .await;
    assert_eq!(pinned.status, 200);
    assert_eq!(
        pinned.headers["x-kvselect-worker-stale"],
        "replaying",
        "{}",
        pinned.text()
    );
    assert_eq!(pinned.json()["overlap"]["longest_matched"], json!(10 * BS));
    assert!(s.metric("kvselect_stale_overlap_discounts_total").await >= 2);
}

#[test]
fn the_staleness_rule() {
    use kvselect::ingest::{stale_by, ListenerState, Stale, SILENCE};
    let quiet = SILENCE + Duration::from_secs(1);
    assert_eq!(stale_by(ListenerState::Live, Duration::ZERO, 3), None);
    // Silence counts only while bookings are active.
    assert_eq!(stale_by(ListenerState::Live, quiet, 0), None);
    assert_eq!(stale_by(ListenerState::Live, quiet, 1), Some(Stale::Silent));
    assert_eq!(
        stale_by(ListenerState::Replaying, Duration::ZERO, 0),
        Some(Stale::Replaying)
    );
    assert_eq!(
        stale_by(ListenerState::Failed, Duration::ZERO, 0),
        Some(Stale::NotConnected)
    );
    assert_eq!(
        stale_by(ListenerState::Connecting, Duration::ZERO, 0),
        Some(Stale::NotConnected)
    );
}
