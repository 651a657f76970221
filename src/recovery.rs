//! Start-up recovery (`--indexer-peers`): GET a peer's /dump and replay it
//! into the local index, partition by partition.

use crate::app::App;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::Request;
use hyper_util::rt::TokioIo;
use std::time::Duration;

/// Largest /dump body accepted from a peer.
pub const MAX_DUMP_BYTES: usize = 4 << 30;
/// Time allowed for one peer's whole answer.
pub const PEER_TIMEOUT: Duration = Duration::from_secs(60);

/// Fetches `peer`'s /dump and loads it; returns the number of stored events
/// applied.
pub async fn load_peer_dump(app: &App, peer: &str) -> Result<usize, String> {
    let body = tokio::time::timeout(PEER_TIMEOUT, fetch_dump(peer))
        .await
        .map_err(|_| format!("no answer within {PEER_TIMEOUT:?}"))??;
    app.load_dump(&body)
}

async fn fetch_dump(peer: &str) -> Result<Bytes, String> {
    let authority = peer
        .strip_prefix("http://")
        .ok_or_else(|| format!("peer `{peer}` must start with http://"))?
        .trim_end_matches('/');
    let stream = tokio::net::TcpStream::connect(authority)
        .await
        .map_err(|e| format!("connect {authority}: {e}"))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = Request::get("/dump")
        .header("host", authority)
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("GET /dump answered {}", resp.status()));
    }
    Limited::new(resp.into_body(), MAX_DUMP_BYTES)
        .collect()
        .await
        .map(|b| b.to_bytes())
        .map_err(|e| format!("reading /dump: {e}"))
}
