//! The HTTP front door: accept loop, routing, Content-Type (415) and body-limit
//! (413) checks, then hand-off to [`App`]. Plain hyper 1.x; HTTP/1.1 with
//! keep-alive and HTTP/2 (prior knowledge) on the same port.
//!
//! Checks run in the reference's order: route (404/405) -> Content-Type (415,
//! before any body byte is read) -> body limit (413, enforced while
//! streaming; a declared Content-Length over the limit fails at once) ->
//! parse (400/422) -> handler.

pub mod error;

use crate::app::{App, Selection};
use crate::parse::SelectKind;
use crate::pool::{Pool, Pooled};
use bytes::Bytes;
use error::{error_body, HttpError};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde::Serialize;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use tokio::net::TcpListener;

/// Idle body buffers kept per server; each may keep up to the body limit.
const BODY_POOL_BUFFERS: usize = 16;

pub struct Server {
    app: Arc<App>,
    bodies: Pool<u8>,
}

type Resp = Response<Full<Bytes>>;

impl Server {
    pub fn new(app: Arc<App>) -> Arc<Server> {
        let bodies = Pool::new(BODY_POOL_BUFFERS, app.config.body_limit_bytes);
        Arc::new(Server { app, bodies })
    }

    pub fn app(&self) -> &Arc<App> {
        &self.app
    }

    /// Serves connections from `listener` until `shutdown` resolves.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        loop {
            let (stream, peer) = tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // EMFILE and friends: back off briefly instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let _ = stream.set_nodelay(true);
            let server = Arc::clone(&self);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let server = Arc::clone(&server);
                    async move { Ok::<_, Infallible>(server.handle(req).await) }
                });
                if let Err(e) = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                {
                    tracing::debug!(%peer, error = %e, "connection ended with error");
                }
            });
        }
        self.app.begin_shutdown();
    }

    async fn handle(&self, req: Request<Incoming>) -> Resp {
        let head_only = req.method() == Method::HEAD;
        let mut resp = match self.route(req).await {
            Ok((status, body)) => json(status, body),
            Err(e) => {
                let (status, msg) = e.status_and_message();
                let mut r = json(status, error_body(&msg));
                if let HttpError::MethodNotAllowed { allow } = e {
                    r.headers_mut()
                        .insert(ALLOW, HeaderValue::from_static(allow));
                }
                r
            }
        };
        if head_only {
            *resp.body_mut() = Full::new(Bytes::new());
        }
        resp
    }

    async fn route(&self, req: Request<Incoming>) -> Routed {
        let app = &self.app;
        let path = req.uri().path().to_string();
        let query = req.uri().query().map(str::to_string);
        let method = req.method().clone();
        let get = method == Method::GET || method == Method::HEAD;
        let post = method == Method::POST;
        let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let not_allowed = |allow| Err(HttpError::MethodNotAllowed { allow });
        const GET_HEAD: &str = "GET,HEAD";
        match segments.as_slice() {
            ["health"] if get => Ok((StatusCode::OK, br#"{"status":"ok"}"#.to_vec())),
            ["health"] => not_allowed(GET_HEAD),
            ["ready"] if get => {
                let r = app.readiness();
                let status = if r.ready {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                Ok((status, to_json(&r, 1024)))
            }
            ["ready"] => not_allowed(GET_HEAD),
            ["workers"] if get => {
                let q = Query::parse(query.as_deref());
                ok(&app.list_workers(q.get("model_name"), q.get("routing_group")))
            }
            ["workers"] if post => {
                let body = self.body(req).await?;
                created(&app.upsert_worker(app.parser.worker_upsert(&body)?))
            }
            ["workers"] => not_allowed("GET,HEAD,POST"),
            ["workers", id] if method == Method::PATCH => {
                let id = parse_u64(id)?;
                let body = self.body(req).await?;
                ok(&app.patch_worker(id, app.parser.worker_patch(&body)?)?)
            }
            ["workers", id] if method == Method::DELETE => ok(&app.delete_worker(parse_u64(id)?)?),
            ["workers", _] => not_allowed("PATCH,DELETE"),
            ["select"] if post => {
                let body = self.body(req).await?;
                let kind = SelectKind::Select;
                let sel = app.select(&app.parser.select(&body, kind)?, kind)?;
                Ok((StatusCode::OK, selection_json(&sel)))
            }
            ["select"] => not_allowed("POST"),
            ["select_and_reserve"] if post => {
                let body = self.body(req).await?;
                let kind = SelectKind::SelectAndReserve;
                let sel = app.select(&app.parser.select(&body, kind)?, kind)?;
                Ok((StatusCode::OK, selection_json(&sel)))
            }
            ["select_and_reserve"] => not_allowed("POST"),
            ["reservations"] if post => {
                let body = self.body(req).await?;
                created(&app.create_reservation(&app.parser.reservation(&body)?)?)
            }
            ["reservations"] => not_allowed("POST"),
            ["reservations", id] if !id.is_empty() => {
                if method != Method::DELETE {
                    return not_allowed("DELETE");
                }
                app.free_reservation(&percent_decode(id))?;
                status_ok()
            }
            ["reservations", id, "prefill_complete"] if !id.is_empty() => {
                if !post {
                    return not_allowed("POST");
                }
                app.prefill_complete(&percent_decode(id))?;
                status_ok()
            }
            ["reservations", id, "output_block"] if !id.is_empty() => {
                if !post {
                    return not_allowed("POST");
                }
                let body = self.body(req).await?;
                let decay = app.parser.output_block(&body)?.decay_fraction;
                app.output_block(&percent_decode(id), decay)?;
                status_ok()
            }
            ["loads"] if get => {
                let q = Query::parse(query.as_deref());
                ok(&app.loads(q.get("model_name"), q.get("routing_group")))
            }
            ["loads"] => not_allowed(GET_HEAD),
            ["potential_loads"] if post => {
                let body = self.body(req).await?;
                ok(&app.potential_loads(&app.parser.prompt_query(&body)?)?)
            }
            ["potential_loads"] => not_allowed("POST"),
            ["overlap_scores"] if post => {
                let body = self.body(req).await?;
                ok(&app.overlap_scores(&app.parser.prompt_query(&body)?)?)
            }
            ["overlap_scores"] => not_allowed("POST"),
            ["dump"] if get => Ok((StatusCode::OK, app.dump().into_bytes())),
            ["dump"] => not_allowed(GET_HEAD),
            ["metrics"] if get => Ok((StatusCode::OK, crate::metrics::render(app).into_bytes())),
            ["metrics"] => not_allowed(GET_HEAD),
            ["replica_sync", "peers"] if get => ok(&app.replica_peers()),
            ["replica_sync", "peers"] => not_allowed(GET_HEAD),
            ["replica_sync", "register_peer"] if post => {
                let body = self.body(req).await?;
                let endpoint = app.parser.peer_endpoint(&body)?;
                let status = if app.register_replica_peer(&endpoint)? {
                    StatusCode::CREATED
                } else {
                    StatusCode::OK
                };
                Ok((status, br#"{"status":"ok"}"#.to_vec()))
            }
            ["replica_sync", "deregister_peer"] if post => {
                let body = self.body(req).await?;
                let endpoint = app.parser.peer_endpoint(&body)?;
                app.deregister_replica_peer(&endpoint)?;
                status_ok()
            }
            ["replica_sync", "register_peer" | "deregister_peer"] => not_allowed("POST"),
            // kvselect's repair source: this replica's live bookings.
            ["replica_sync", "bookings"] if get => ok(&app.replica_bookings()?),
            ["replica_sync", "bookings"] => not_allowed(GET_HEAD),
            _ => Err(HttpError::RouteNotFound),
        }
    }

    /// Checks Content-Type, then reads the body within the limit.
    async fn body(&self, req: Request<Incoming>) -> Result<Pooled<u8>, HttpError> {
        if !is_json(req.headers().get(CONTENT_TYPE)) {
            return Err(HttpError::UnsupportedMediaType);
        }
        let limit = self.app.config.body_limit_bytes;
        let declared = req
            .headers()
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(HttpError::PayloadTooLarge);
        }
        let mut buf = self.bodies.take();
        if let Some(n) = declared {
            buf.reserve(n as usize);
        }
        let mut body = req.into_body();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| HttpError::BodyRead(e.to_string()))?;
            if let Ok(data) = frame.into_data() {
                if buf.len() + data.len() > limit {
                    return Err(HttpError::PayloadTooLarge);
                }
                buf.extend_from_slice(&data);
            }
        }
        Ok(buf)
    }
}

type Routed = Result<(StatusCode, Vec<u8>), HttpError>;

/// `v` as JSON into a buffer of `capacity` bytes to start with.
fn to_json(v: &impl Serialize, capacity: usize) -> Vec<u8> {
    let mut body = Vec::with_capacity(capacity);
    serde_json::to_writer(&mut body, v).expect("reply types serialise");
    body
}

fn ok(v: &impl Serialize) -> Routed {
    Ok((StatusCode::OK, to_json(v, 128)))
}

fn created(v: &impl Serialize) -> Routed {
    Ok((StatusCode::CREATED, to_json(v, 128)))
}

fn status_ok() -> Routed {
    Ok((StatusCode::OK, br#"{"status":"ok"}"#.to_vec()))
}

/// A selection's JSON. `sequence_hashes`, by far the largest field, is
/// written last by the fast array writer into capacity reserved up front
/// (growing a 100 KB reply by doubling copies it several times).
fn selection_json(sel: &Selection) -> Vec<u8> {
    let hashes = sel.sequence_hashes.as_deref();
    let capacity = 512
        + sel.endpoint.len()
        + hashes.map_or(0, |h| crate::json_out::i64_array_capacity(h.len()));
    let mut body = to_json(sel, capacity);
    if let Some(h) = hashes {
        // The object's closing brace comes off and goes back after it.
        debug_assert_eq!(body.last(), Some(&b'}'));
        body.pop();
        body.extend_from_slice(br#","sequence_hashes":"#);
        crate::json_out::push_i64_array(&mut body, h);
        body.push(b'}');
    }
    body
}

fn json(status: StatusCode, body: Vec<u8>) -> Resp {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// `application/json` or `application/*+json`, with any parameters.
pub fn is_json(ct: Option<&HeaderValue>) -> bool {
    let Some(ct) = ct.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || essence
            .strip_prefix("application/")
            .is_some_and(|sub| sub.ends_with("+json") && sub.len() > "+json".len())
}

fn parse_u64(s: &str) -> Result<u64, HttpError> {
    let decoded = percent_decode(s);
    decoded.parse().map_err(|_| {
        HttpError::InvalidPath(format!("Invalid URL: Cannot parse `{decoded}` to a `u64`"))
    })
}

/// Decodes `%XX` escapes; invalid escapes are kept literally.
pub fn percent_decode(s: &str) -> String {
    if !s.contains('%') {
        return s.to_string();
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push(h << 4 | l);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `a=1&b=2` with percent-decoding (`+` is a space in query strings).
struct Query(Vec<(String, String)>);

impl Query {
    fn parse(q: Option<&str>) -> Query {
        let pairs = q
            .unwrap_or("")
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap_or((p, ""));
                (
                    percent_decode(&k.replace('+', " ")),
                    percent_decode(&v.replace('+', " ")),
                )
            })
            .collect();
        Query(pairs)
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_content_types() {
        let ok = |s: &str| is_json(Some(&HeaderValue::from_str(s).unwrap()));
        assert!(ok("application/json"));
        assert!(ok("application/json; charset=utf-8"));
        assert!(ok("Application/JSON"));
        assert!(ok("application/vnd.api+json"));
        assert!(!ok("text/plain"));
        assert!(!ok("application/+json"));
        assert!(!ok("application/jsonx"));
        assert!(!is_json(None));
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("a%20b"), "a b");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz"), "%zz");
        assert_eq!(percent_decode("%41%42"), "AB");
    }

    #[test]
    fn query_strings() {
        let q = Query::parse(Some("model_name=a%2Fb&routing_group=&x"));
        assert_eq!(q.get("model_name"), Some("a/b"));
        assert_eq!(q.get("routing_group"), Some(""));
        assert_eq!(q.get("nope"), None);
    }
}
