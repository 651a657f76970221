//! The HTTP front door: accept loop, connection bounds, authentication,
//! routing, Content-Type (415) and body-limit (413) checks, then hand-off to
//! [`App`]. Plain hyper 1.x; HTTP/1.1 with keep-alive and HTTP/2 (prior
//! knowledge, or ALPN under TLS) on the same port.
//!
//! Checks run in the reference's order: bearer token (401, when
//! `--auth-token-file` is set; /health is exempt) -> route (404/405) ->
//! Content-Type (415, before any body byte is read) -> body limit (413,
//! enforced while streaming; a declared Content-Length over the limit fails
//! at once) -> body timeout (408) -> parse (400/422) -> handler. Prompt
//! bodies (/select, /select_and_reserve, /reservations, /potential_loads,
//! /overlap_scores) are fed to the parser frame by frame as they arrive
//! (`parse/stream.rs`); the other bodies are collected first.
//!
//! Memory: a body buffer grows with the bytes that have arrived, never with
//! the declared Content-Length, and buffers kept for reuse are capped at
//! [`BODY_POOL_MAX_CAPACITY`]; a client that declares 8 MiB and sends 18
//! bytes costs a few KiB until its body timeout. Connections are capped by
//! `--max-connections` and each is watched by `limits.rs`.
//!
//! Drain ([`Server::serve`] once `shutdown` resolves): connections already
//! queued in the kernel's backlog are taken, the listener closes, then
//! /ready answers 503 and every HTTP/1 response carries `Connection: close`
//! (one reading of the flag per request decides both), every connection is
//! told to finish (`limits.rs` says how), and `serve` returns when the last
//! one has, or at `--shutdown-timeout-secs`, when the rest are dropped.

pub mod error;
pub mod limits;
pub mod wake;

use crate::app::freshness::Answered;
use crate::app::{App, Selection, ServiceError};
use crate::auth::{Auth, Verdict as AuthVerdict};
use crate::ingest::Stale;
use crate::metrics::{Metrics, Timeout};
use crate::parse::{BodyStream, NumberPath, ParseError, SelectKind};
use crate::pool::{Pool, Pooled};
use bytes::Bytes;
use error::{error_body, HttpError};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{
    HeaderName, HeaderValue, ALLOW, AUTHORIZATION, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE,
    RETRY_AFTER, WWW_AUTHENTICATE,
};
use hyper::http::request::Parts;
use hyper::{Method, Request, Response, StatusCode, Version};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use limits::{
    Activity, HttpLimits, InFlight, Open, Tracked, Verdict, CLOSE_GRACE, EVICT_WAIT, EVICT_WAITERS,
};
use serde::Serialize;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use wake::{BodySocket, BodyWake};

/// Idle body buffers kept per server.
const BODY_POOL_BUFFERS: usize = 16;
/// A body buffer that grew past this is freed instead of kept for reuse, so
/// that a burst of large bodies does not stay resident (a 100k-token prompt
/// is about 600 KB of JSON).
pub const BODY_POOL_MAX_CAPACITY: usize = 1024 * 1024;

/// GET /openapi.json: the API as an OpenAPI 3.0 document, checked against the
/// real routes by `tests/http_openapi.rs`.
pub const OPENAPI: &str = include_str!("openapi.json");

/// The `WWW-Authenticate` challenge of a 401.
const BEARER_CHALLENGE: &str = "Bearer realm=\"kvselect\"";
const BEARER_INVALID: &str = "Bearer realm=\"kvselect\", error=\"invalid_token\"";

/// What the accept loop shares with each connection it admits.
struct Gate {
    /// One permit per connection under `--max-connections`.
    slots: Arc<Semaphore>,
    /// Bounds the admissions waiting on an evicted connection's slot.
    waiters: Arc<Semaphore>,
    open: Arc<Open>,
    drain: watch::Receiver<bool>,
    abort: watch::Receiver<bool>,
}

pub struct Server {
    app: Arc<App>,
    bodies: Pool<u8>,
    metrics: Metrics,
    limits: HttpLimits,
    auth: Option<Arc<Auth>>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    builder: auto::Builder<TokioExecutor>,
}

type Resp = Response<Full<Bytes>>;

impl Server {
    /// A plain-HTTP server without authentication, whatever `app.config`
    /// says about tokens and TLS (embedders and tests); see [`from_config`](Self::from_config).
    pub fn new(app: Arc<App>) -> Arc<Server> {
        Arc::new(Server::build(app, None, None))
    }

    /// The server `app.config` describes: its token file and TLS files are
    /// read now, and a failure to read them is an error.
    pub fn from_config(app: Arc<App>) -> Result<Arc<Server>, String> {
        let auth = match &app.config.auth_token_file {
            Some(path) => Some(Arc::new(Auth::load(path)?)),
            None => None,
        };
        let tls = match &app.config.tls {
            Some(files) => Some(crate::tls::acceptor(files)?),
            None => None,
        };
        Ok(Arc::new(Server::build(app, auth, tls)))
    }

    fn build(
        app: Arc<App>,
        auth: Option<Arc<Auth>>,
        tls: Option<tokio_rustls::TlsAcceptor>,
    ) -> Server {
        let limits = app.config.limits;
        let bodies = Pool::new(
            BODY_POOL_BUFFERS,
            BODY_POOL_MAX_CAPACITY.min(app.config.body_limit_bytes),
        );
        let mut builder = auto::Builder::new(TokioExecutor::new());
        // hyper's header timeout would also cut idle keep-alive connections
        // at the header timeout; limits.rs keeps both instead.
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(None);
        builder
            .http2()
            .timer(TokioTimer::new())
            .max_concurrent_streams(limits.http2_max_streams);
        Server {
            app,
            bodies,
            metrics: Metrics::new(),
            limits,
            auth,
            tls,
            builder,
        }
    }

    pub fn app(&self) -> &Arc<App> {
        &self.app
    }

    /// The tokens in force, when authentication is on (for SIGHUP reloads).
    pub fn auth(&self) -> Option<&Arc<Auth>> {
        self.auth.as_ref()
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Serves connections from `listener` until `shutdown` resolves, then
    /// drains (see the module doc) and returns.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, shutdown: impl Future<Output = ()>) {
        let limits = self.limits;
        let (drain_tx, drain_rx) = watch::channel(false);
        let (abort_tx, abort_rx) = watch::channel(false);
        let gate = Gate {
            slots: Arc::new(Semaphore::new(limits.max_connections)),
            waiters: Arc::new(Semaphore::new(EVICT_WAITERS)),
            open: Arc::new(Open::default()),
            drain: drain_rx,
            abort: abort_rx,
        };
        tokio::pin!(shutdown);
        loop {
            let (stream, peer) = tokio::select! {
                biased;
                _ = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // EMFILE and friends: back off briefly instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            self.admit(stream, peer, &gate);
        }
        // Connections the kernel has completed but the loop has not taken
        // are served, not reset: take them without waiting, then close the
        // listener, and only then turn /ready and the responses' keep-alive
        // off, so a client told `Connection: close` reconnects to a closed
        // port (refused, safe to retry elsewhere) rather than into a backlog
        // that closing resets.
        match listener.into_std() {
            Ok(listener) => {
                while let Ok((stream, peer)) = listener.accept() {
                    let stream = stream
                        .set_nonblocking(true)
                        .and_then(|()| TcpStream::from_std(stream));
                    match stream {
                        Ok(stream) => self.admit(stream, peer, &gate),
                        Err(e) => tracing::debug!(%peer, error = %e, "queued connection lost"),
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "listener could not be drained"),
        }
        self.app.begin_shutdown();
        let _ = drain_tx.send(true);
        let slots = &gate.slots;
        let all = limits.max_connections as u32;
        let open = limits.max_connections - slots.available_permits();
        tracing::info!(
            connections = open,
            "listener closed; finishing in-flight requests"
        );
        let drained = tokio::time::timeout(limits.shutdown_timeout, slots.acquire_many(all)).await;
        if drained.is_ok() {
            tracing::info!("all connections finished");
        } else {
            let open = limits.max_connections - slots.available_permits();
            tracing::warn!(
                connections = open,
                "shutdown deadline reached; closing the remaining connections"
            );
            let _ = abort_tx.send(true);
        }
    }

    /// Serves an accepted socket on its own task, within `--max-connections`.
    fn admit(self: &Arc<Self>, stream: TcpStream, peer: SocketAddr, gate: &Gate) {
        let server = Arc::clone(self);
        let (drain, abort) = (gate.drain.clone(), gate.abort.clone());
        let open = Arc::clone(&gate.open);
        let Ok(permit) = Arc::clone(&gate.slots).try_acquire_owned() else {
            // At the cap: take an idle connection's slot (limits.rs),
            // waiting off the accept loop, a bounded number at a time.
            // Otherwise close at once, which keeps the socket from
            // holding a file descriptor and memory.
            let waiter = Arc::clone(&gate.waiters)
                .try_acquire_owned()
                .ok()
                .filter(|_| open.evict_quietest());
            if let Some(waiter) = waiter {
                let slots = Arc::clone(&gate.slots);
                tokio::spawn(async move {
                    let freed = tokio::time::timeout(EVICT_WAIT, slots.acquire_owned()).await;
                    drop(waiter);
                    match freed {
                        Ok(Ok(permit)) => {
                            server
                                .connection(stream, peer, permit, &open, drain, abort)
                                .await
                        }
                        _ => server.refuse(peer, stream),
                    }
                });
            } else {
                self.refuse(peer, stream);
            }
            return;
        };
        tokio::spawn(async move {
            server
                .connection(stream, peer, permit, &open, drain, abort)
                .await;
        });
    }

    /// Closes a socket accepted beyond `--max-connections`.
    fn refuse(&self, peer: SocketAddr, stream: TcpStream) {
        self.metrics.connection_rejected();
        tracing::debug!(%peer, "connection refused: --max-connections reached");
        drop(stream);
    }

    async fn connection(
        self: Arc<Self>,
        stream: TcpStream,
        peer: SocketAddr,
        _permit: OwnedSemaphorePermit,
        open: &Open,
        drain: watch::Receiver<bool>,
        mut abort: watch::Receiver<bool>,
    ) {
        self.metrics.connection_opened();
        let _ = stream.set_nodelay(true);
        let activity = Arc::new(Activity::new());
        let reg = open.register(Arc::clone(&activity));
        let evict = &reg.conn.evict;
        let socket = BodySocket::of(&stream);
        let io = Tracked::new(stream, Arc::clone(&activity));
        match &self.tls {
            None => {
                self.drive(io, Some(socket), peer, activity, evict, drain, abort)
                    .await
            }
            Some(acceptor) => {
                let handshake =
                    tokio::time::timeout(self.limits.header_read_timeout, acceptor.accept(io));
                tokio::select! {
                    r = handshake => match r {
                        Ok(Ok(tls)) => self.drive(tls, None, peer, activity, evict, drain, abort).await,
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => self.metrics.timeout(Timeout::Header),
                    },
                    _ = evict.notified() => self.metrics.connection_evicted(),
                    _ = abort.changed() => {}
                }
            }
        }
        self.metrics.connection_closed();
    }

    /// Serves one connection under the watchdog of `limits.rs`; `socket`
    /// is its TCP socket when `io` is that socket itself (no TLS), for the
    /// bodies' low-water mark (`wake.rs`).
    #[allow(clippy::too_many_arguments)]
    async fn drive<S>(
        self: &Arc<Self>,
        io: S,
        socket: Option<BodySocket>,
        peer: SocketAddr,
        activity: Arc<Activity>,
        evict: &tokio::sync::Notify,
        mut drain: watch::Receiver<bool>,
        mut abort: watch::Receiver<bool>,
    ) where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let service = {
            let server = Arc::clone(self);
            let activity = Arc::clone(&activity);
            let drain = drain.clone();
            hyper::service::service_fn(move |mut req: Request<Incoming>| {
                BodySocket::tag(&mut req, socket);
                let in_flight = activity.begin(req.version() == Version::HTTP_2);
                let server = Arc::clone(&server);
                let drain = drain.clone();
                async move {
                    let (resp, rest) = server.handle(req).await;
                    match rest {
                        // The request stays in flight while its body is
                        // read: to the watchdog those bytes are a body, not
                        // the head of the next request.
                        Some(body) => {
                            linger_body(body, server.limits.body_read_timeout, in_flight, drain)
                        }
                        None => drop(in_flight),
                    }
                    Ok::<_, Infallible>(resp)
                }
            })
        };
        let conn = self.builder.serve_connection(TokioIo::new(io), service);
        tokio::pin!(conn);
        let limits = self.limits;
        let mut draining = *drain.borrow();
        let mut tick = Activity::watchdog(&limits, draining);
        let ended = |r: Result<(), _>| {
            if let Err(e) = r {
                tracing::debug!(%peer, error = %e, "connection ended with error");
            }
        };
        let verdict = loop {
            tokio::select! {
                r = conn.as_mut() => return ended(r),
                _ = tick.tick() => match activity.verdict(activity.now_ms(), &limits, draining) {
                    Verdict::Keep => {}
                    v => break v,
                },
                _ = drain.changed(), if !draining => {
                    draining = true;
                    tick = Activity::watchdog(&limits, true);
                    if activity.is_http2() {
                        break Verdict::DrainClose;
                    }
                }
                _ = evict.notified() => break Verdict::Evicted,
                _ = abort.changed() => return,
            }
        };
        match verdict {
            Verdict::HeaderTimeout => self.metrics.timeout(Timeout::Header),
            Verdict::IdleTimeout => self.metrics.timeout(Timeout::Idle),
            Verdict::Evicted => self.metrics.connection_evicted(),
            Verdict::DrainClose | Verdict::Keep => {}
        }
        tracing::debug!(%peer, ?verdict, "closing connection");
        conn.as_mut().graceful_shutdown();
        if verdict == Verdict::DrainClose {
            // HTTP/2 streams in flight finish; the drain deadline bounds them.
            tokio::select! {
                r = conn.as_mut() => ended(r),
                _ = abort.changed() => {}
            }
        } else if let Ok(r) = tokio::time::timeout(CLOSE_GRACE, conn.as_mut()).await {
            ended(r);
        }
    }

    /// The answer, and the rest of a request body it did not need, to be
    /// read and dropped after it ([`linger_body`]).
    async fn handle(&self, req: Request<Incoming>) -> (Resp, Option<Incoming>) {
        let started = Instant::now();
        let (req, body) = req.into_parts();
        let mut body = BodySlot::new(body);
        let route = route_label(req.uri.path());
        let head_only = req.method == Method::HEAD;
        let http1 = req.version <= Version::HTTP_11;
        // Read once: a /ready that says 200 is never sent with
        // `Connection: close`, nor a 503 for draining without it.
        let draining = self.app.is_shutting_down();
        let mut close = draining;
        let mut resp = match self.authorize(&req, route) {
            Err(e) => error_response(e),
            Ok(()) if route == "/metrics" && (head_only || req.method == Method::GET) => {
                let mut r = Response::new(Full::new(Bytes::from(self.metrics.render(&self.app))));
                r.headers_mut().insert(
                    CONTENT_TYPE,
                    HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
                );
                r
            }
            Ok(()) => match self.route(&req, &mut body, draining).await {
                Ok(Reply {
                    status,
                    body,
                    index,
                }) => {
                    let mut r = json(status, body);
                    if let Some((a, stale)) = index {
                        freshness_headers(r.headers_mut(), a, stale);
                    }
                    r
                }
                Err(e) => {
                    // A body past the limit is not read to its end here.
                    close |= matches!(e, HttpError::BodyTimeout | HttpError::PayloadTooLarge);
                    error_response(e)
                }
            },
        };
        // A body the answer did not need (a 413, 415, 401, 404, ...): a
        // client that sends its whole body before it reads the answer would
        // get a reset instead of the answer if the connection dropped the
        // rest unread, so it is read and dropped after the answer
        // ([`linger_body`]). Not when the client waits for `100 Continue`
        // and nothing asked for the body: it sends nothing before our answer.
        let rest = body
            .unread()
            .filter(|_| body.polled || !expects_continue(&req.headers));
        if http1 && close {
            resp.headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
        }
        if head_only {
            *resp.body_mut() = Full::new(Bytes::new());
        }
        self.metrics
            .request(route, resp.status().as_u16(), started.elapsed());
        (resp, rest)
    }

    /// Every route but /health needs a bearer token when tokens are set.
    fn authorize(&self, req: &Parts, route: &'static str) -> Result<(), HttpError> {
        let Some(auth) = &self.auth else {
            return Ok(());
        };
        if route == "/health" {
            return Ok(());
        }
        let header = req.headers.get(AUTHORIZATION).map(HeaderValue::as_bytes);
        match auth.check(header) {
            AuthVerdict::Allowed => Ok(()),
            AuthVerdict::Missing => Err(HttpError::Unauthorized { token_given: false }),
            AuthVerdict::Invalid => Err(HttpError::Unauthorized { token_given: true }),
        }
    }

    /// Runs a body parser, timing it.
    fn parse<T>(
        &self,
        body: &'static str,
        f: impl FnOnce() -> Result<T, ParseError>,
    ) -> Result<T, HttpError> {
        let started = Instant::now();
        let r = f();
        self.metrics.parse_time(body, started.elapsed());
        Ok(r?)
    }

    /// Answers the request with head `req`; its body stays in `body` until a
    /// route reads it (see [`Server::handle`] for what happens to a body
    /// left there).
    async fn route(&self, req: &Parts, body: &mut BodySlot, draining: bool) -> Routed {
        let app = &self.app;
        let path = req.uri.path().to_string();
        let query = req.uri.query().map(str::to_string);
        let method = req.method.clone();
        let get = method == Method::GET || method == Method::HEAD;
        let post = method == Method::POST;
        // One leading slash: `//health` is no route, as in the reference.
        let segments: Vec<&str> = path.strip_prefix('/').unwrap_or(&path).split('/').collect();
        let not_allowed = |allow| Err(HttpError::MethodNotAllowed { allow });
        const GET_HEAD: &str = "GET,HEAD";
        match segments.as_slice() {
            ["health"] if get => Ok(Reply::from((
                StatusCode::OK,
                br#"{"status":"ok"}"#.to_vec(),
            ))),
            ["health"] => not_allowed(GET_HEAD),
            ["ready"] if get => {
                let r = app.readiness_when(draining);
                let status = if r.ready {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                Ok(Reply::from((status, to_json(&r, 1024))))
            }
            ["ready"] => not_allowed(GET_HEAD),
            ["workers"] if get => {
                let q = Query::parse(query.as_deref());
                let [model, group] = q.fields(["model_name", "routing_group"])?;
                ok(&app.list_workers(model, group))
            }
            ["workers"] if post => {
                let body = self.body(req, body).await?;
                created(
                    &app.upsert_worker(self.parse("worker", || app.parser.worker_upsert(&body))?),
                )
            }
            ["workers"] => not_allowed("GET,HEAD,POST"),
            // `/workers/` is no route, as in the reference.
            ["workers", id] if method == Method::PATCH && !id.is_empty() => {
                let id = parse_u64(id)?;
                let body = self.body(req, body).await?;
                ok(&app
                    .patch_worker(id, self.parse("worker", || app.parser.worker_patch(&body))?)?)
            }
            ["workers", id] if method == Method::DELETE && !id.is_empty() => {
                ok(&app.delete_worker(parse_u64(id)?)?)
            }
            ["workers", id] if !id.is_empty() => not_allowed("PATCH,DELETE"),
            ["select"] if post => {
                let body = self.body_stream(req, body).await?;
                let kind = SelectKind::Select;
                let req = self.parse("select", || app.parser.select_stream(&body, kind))?;
                let sel = app.select_queued(&req, kind).await?;
                selection_reply(&sel, app.parser.number_path)
            }
            ["select"] => not_allowed("POST"),
            ["select_and_reserve"] if post => {
                let body = self.body_stream(req, body).await?;
                let kind = SelectKind::SelectAndReserve;
                let req = self.parse("select", || app.parser.select_stream(&body, kind))?;
                let sel = app.select_queued(&req, kind).await?;
                selection_reply(&sel, app.parser.number_path)
            }
            ["select_and_reserve"] => not_allowed("POST"),
            ["reservations"] if post => {
                let body = self.body_stream(req, body).await?;
                created(&app.create_reservation(
                    &self.parse("reservation", || app.parser.reservation_stream(&body))?,
                )?)
            }
            ["reservations"] => not_allowed("POST"),
            ["reservations", id] if !id.is_empty() => {
                if method != Method::DELETE {
                    return not_allowed("DELETE");
                }
                app.free_reservation(&selection_id(id)?)?;
                status_ok()
            }
            ["reservations", id, "prefill_complete"] => {
                if !post {
                    return not_allowed("POST");
                }
                app.prefill_complete(&selection_id(id)?)?;
                status_ok()
            }
            ["reservations", id, "output_block"] => {
                if !post {
                    return not_allowed("POST");
                }
                let id = selection_id(id)?;
                let body = self.body(req, body).await?;
                let decay = self
                    .parse("output_block", || app.parser.output_block(&body))?
                    .decay_fraction;
                app.output_block(&id, decay)?;
                status_ok()
            }
            ["loads"] if get => {
                let q = Query::parse(query.as_deref());
                let [model, group] = q.fields(["model_name", "routing_group"])?;
                ok(&app.loads(model, group))
            }
            ["loads"] => not_allowed(GET_HEAD),
            ["potential_loads"] if post => {
                let body = self.body_stream(req, body).await?;
                ok(&app.potential_loads(
                    &self.parse("prompt_query", || app.parser.prompt_query_stream(&body))?,
                )?)
            }
            ["potential_loads"] => not_allowed("POST"),
            ["overlap_scores"] if post => {
                let body = self.body_stream(req, body).await?;
                ok(&app.overlap_scores(&self.parse("prompt_query", || {
                    app.parser.overlap_scores_query_stream(&body)
                })?)?)
            }
            ["overlap_scores"] => not_allowed("POST"),
            ["dump"] if get => Ok(Reply::from((StatusCode::OK, app.dump().into_bytes()))),
            ["dump"] => not_allowed(GET_HEAD),
            ["metrics"] => not_allowed(GET_HEAD),
            ["openapi.json"] if get => {
                Ok(Reply::from((StatusCode::OK, OPENAPI.as_bytes().to_vec())))
            }
            ["openapi.json"] => not_allowed(GET_HEAD),
            ["replica_sync", "peers"] if get => ok(&app.replica_peers()),
            ["replica_sync", "peers"] => not_allowed(GET_HEAD),
            ["replica_sync", "register_peer"] if post => {
                let body = self.body(req, body).await?;
                let endpoint = self.parse("peer", || app.parser.peer_endpoint(&body))?;
                let status = if app.register_replica_peer(&endpoint)? {
                    StatusCode::CREATED
                } else {
                    StatusCode::OK
                };
                Ok(Reply::from((status, br#"{"status":"ok"}"#.to_vec())))
            }
            ["replica_sync", "deregister_peer"] if post => {
                let body = self.body(req, body).await?;
                let endpoint = self.parse("peer", || app.parser.peer_endpoint(&body))?;
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

    /// Checks Content-Type and a declared Content-Length against the limit;
    /// the limit, and the body's low-water mark (`wake.rs`).
    fn body_head(&self, req: &Parts) -> Result<(usize, BodyWake), HttpError> {
        if !is_json(req.headers.get(CONTENT_TYPE)) {
            return Err(HttpError::UnsupportedMediaType);
        }
        let limit = self.app.config.body_limit_bytes;
        let declared = req
            .headers
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(HttpError::PayloadTooLarge);
        }
        Ok((limit, BodyWake::new(req, declared)))
    }

    /// A prompt body, fed to the parser's streamed front frame by frame as
    /// it arrives (`parse/stream.rs`): token arrays are converted while each
    /// frame is in cache and the body is not copied whole. Same checks,
    /// limit and timeout as [`Server::body`].
    async fn body_stream(&self, req: &Parts, body: &mut BodySlot) -> Result<BodyStream, HttpError> {
        let (limit, wake) = self.body_head(req)?;
        let mut stream = self.app.parser.stream();
        self.read_frames(body, limit, wake, |data| stream.feed(data))
            .await?;
        Ok(stream)
    }

    /// Checks Content-Type, then reads the body within the limit.
    async fn body(&self, req: &Parts, body: &mut BodySlot) -> Result<Pooled<u8>, HttpError> {
        let (limit, wake) = self.body_head(req)?;
        // Grows with what arrives (Vec doubling), never with `declared`.
        let mut buf = self.bodies.take();
        self.read_frames(body, limit, wake, |data| buf.extend_from_slice(&data))
            .await?;
        Ok(buf)
    }

    /// Hands each data frame of `body` to `sink` as it arrives: 413 past
    /// `limit` bytes, 408 past `--body-read-timeout-secs`. `wake` keeps the
    /// socket's low-water mark at the bytes still to come (`wake.rs`).
    async fn read_frames(
        &self,
        body: &mut BodySlot,
        limit: usize,
        mut wake: BodyWake,
        mut sink: impl FnMut(Bytes),
    ) -> Result<(), HttpError> {
        // A route reads the body once; a second read finds none.
        let BodySlot { body, polled, done } = body;
        let Some(body) = body.as_mut() else {
            return Ok(());
        };
        *polled = true;
        let read = async {
            let mut len = 0usize;
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| HttpError::BodyRead(e.to_string()))?;
                if let Ok(data) = frame.into_data() {
                    len += data.len();
                    if len > limit {
                        return Err(HttpError::PayloadTooLarge);
                    }
                    sink(data);
                    wake.taken(len);
                }
            }
            Ok(())
        };
        match tokio::time::timeout(self.limits.body_read_timeout, read).await {
            Ok(r) => {
                // Read to its end, or broken: nothing is left to read.
                *done = !matches!(r, Err(HttpError::PayloadTooLarge));
                r
            }
            Err(_) => {
                // It had its time: nothing more is read.
                *done = true;
                self.metrics.timeout(Timeout::Body);
                Err(HttpError::BodyTimeout)
            }
        }
    }
}

type Routed = Result<Reply, HttpError>;

/// A route's answer: status, JSON body and, for selections, the index's
/// freshness when it was answered (sent as headers).
struct Reply {
    status: StatusCode,
    body: Vec<u8>,
    index: Option<(Answered, Option<Stale>)>,
}

impl From<(StatusCode, Vec<u8>)> for Reply {
    fn from((status, body): (StatusCode, Vec<u8>)) -> Reply {
        Reply {
            status,
            body,
            index: None,
        }
    }
}

/// The selection's reply with its freshness headers:
/// `x-kvselect-index-lag-ms` always, `x-kvselect-index-stale: true` when an
/// advisory select was answered past the bound (`app/freshness.rs`).
fn selection_reply(sel: &Selection, path: NumberPath) -> Routed {
    Ok(Reply {
        status: StatusCode::OK,
        body: selection_json(sel, path),
        index: Some((sel.index, sel.worker_stale)),
    })
}

/// `v` as JSON into a buffer of `capacity` bytes to start with.
fn to_json(v: &impl Serialize, capacity: usize) -> Vec<u8> {
    let mut body = Vec::with_capacity(capacity);
    serde_json::to_writer(&mut body, v).expect("reply types serialise");
    body
}

fn ok(v: &impl Serialize) -> Routed {
    Ok(Reply::from((StatusCode::OK, to_json(v, 128))))
}

fn created(v: &impl Serialize) -> Routed {
    Ok(Reply::from((StatusCode::CREATED, to_json(v, 128))))
}

fn status_ok() -> Routed {
    Ok(Reply::from((
        StatusCode::OK,
        br#"{"status":"ok"}"#.to_vec(),
    )))
}

/// A selection's JSON. `sequence_hashes`, by far the largest field, is
/// written last by the fast array writer into capacity reserved up front
/// (growing a 100 KB reply by doubling copies it several times), with the
/// vector step `--simd` chose.
fn selection_json(sel: &Selection, path: NumberPath) -> Vec<u8> {
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
        crate::json_out::push_i64_array(&mut body, h, path);
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

fn freshness_headers(h: &mut hyper::HeaderMap, a: Answered, stale: Option<Stale>) {
    if let Some(s) = stale {
        h.insert(WORKER_STALE_HEADER, HeaderValue::from_static(s.as_str()));
    }
    let ms = format!("{:.1}", a.lag.as_secs_f64() * 1e3);
    if let Ok(v) = HeaderValue::from_str(&ms) {
        h.insert(INDEX_LAG_HEADER, v);
    }
    if a.stale {
        h.insert(INDEX_STALE_HEADER, HeaderValue::from_static("true"));
    }
}

/// How far behind its KV events the index was when the selection was made.
const INDEX_LAG_HEADER: HeaderName = HeaderName::from_static("x-kvselect-index-lag-ms");
/// The chosen rank's KV stream is stale (its overlap counted half):
/// `replaying`, `not-connected` or `silent`.
const WORKER_STALE_HEADER: HeaderName = HeaderName::from_static("x-kvselect-worker-stale");
/// An advisory select answered while the index was past the freshness bound.
const INDEX_STALE_HEADER: HeaderName = HeaderName::from_static("x-kvselect-index-stale");

fn error_response(e: HttpError) -> Resp {
    let (status, msg) = e.status_and_message();
    let mut r = json(status, error_body(&msg));
    match e {
        HttpError::MethodNotAllowed { allow } => {
            r.headers_mut()
                .insert(ALLOW, HeaderValue::from_static(allow));
        }
        HttpError::Service(ServiceError::Busy(_)) => {
            // The queue's wait bound is the natural pause before a retry.
            r.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from_static("1"));
        }
        HttpError::Unauthorized { token_given } => {
            let challenge = if token_given {
                BEARER_INVALID
            } else {
                BEARER_CHALLENGE
            };
            r.headers_mut()
                .insert(WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
        }
        _ => {}
    }
    r
}

/// The route template of `path`, a fixed label set for metrics; paths that
/// match no route are `other`.
pub fn route_label(path: &str) -> &'static str {
    let segments: Vec<&str> = path.strip_prefix('/').unwrap_or(path).split('/').collect();
    match segments.as_slice() {
        ["health"] => "/health",
        ["ready"] => "/ready",
        ["workers"] => "/workers",
        ["workers", id] if !id.is_empty() => "/workers/{worker_id}",
        ["select"] => "/select",
        ["select_and_reserve"] => "/select_and_reserve",
        ["reservations"] => "/reservations",
        ["reservations", id] if !id.is_empty() => "/reservations/{selection_id}",
        ["reservations", _, "prefill_complete"] => "/reservations/{selection_id}/prefill_complete",
        ["reservations", _, "output_block"] => "/reservations/{selection_id}/output_block",
        ["loads"] => "/loads",
        ["potential_loads"] => "/potential_loads",
        ["overlap_scores"] => "/overlap_scores",
        ["dump"] => "/dump",
        ["metrics"] => "/metrics",
        ["openapi.json"] => "/openapi.json",
        ["replica_sync", "peers"] => "/replica_sync/peers",
        ["replica_sync", "register_peer"] => "/replica_sync/register_peer",
        ["replica_sync", "deregister_peer"] => "/replica_sync/deregister_peer",
        _ => "other",
    }
}

/// A request's body while its route runs: read by at most one route
/// (`Server::read_frames`), and what is left of it afterwards.
struct BodySlot {
    body: Option<Incoming>,
    /// A route started reading it (so hyper sent any `100 Continue`).
    polled: bool,
    /// Nothing more is to be read of it: read to its end, broken off, or
    /// past the body read timeout.
    done: bool,
}

impl BodySlot {
    fn new(body: Incoming) -> BodySlot {
        BodySlot {
            body: Some(body),
            polled: false,
            done: false,
        }
    }

    /// The rest of the body, unless it is `done` or known to be empty.
    fn unread(&mut self) -> Option<Incoming> {
        let body = self.body.take()?;
        (!self.done && !hyper::body::Body::is_end_stream(&body)).then_some(body)
    }
}

/// Most bytes of an unneeded request body read and dropped after the
/// answer ([`linger_body`]); past them the connection drops the rest.
pub const LINGER_BYTES: usize = 64 * 1024 * 1024;

/// Reads and drops what is left of a request body the answer did not need,
/// a frame at a time (so in bounded memory), at most [`LINGER_BYTES`] and
/// `timeout` (the body read timeout), and no longer than until the server
/// starts draining, on a task of its own: the connection sends the answer
/// meanwhile, and a client that sends its whole body before it reads gets
/// that answer instead of a reset (the reference reads a body up to its
/// limit before it answers 413). The request counts as in flight until
/// then (`in_flight`), so the watchdog (`limits.rs`) takes the bytes for a
/// body, not for the head of a next request. No low-water mark is set on
/// this body any more (`wake.rs`): [`BodyWake`] reset it when the read
/// stopped.
fn linger_body(
    mut body: Incoming,
    timeout: Duration,
    in_flight: InFlight,
    mut drain: watch::Receiver<bool>,
) {
    tokio::spawn(async move {
        let read = async {
            let mut n = 0usize;
            while let Some(Ok(frame)) = body.frame().await {
                if let Ok(data) = frame.into_data() {
                    n += data.len();
                    if n > LINGER_BYTES {
                        break;
                    }
                }
            }
        };
        tokio::select! {
            _ = tokio::time::timeout(timeout, read) => {}
            _ = drain.wait_for(|d| *d) => {}
        }
        drop(in_flight);
    });
}

/// Does the request wait for `100 Continue` before it sends its body?
fn expects_continue(headers: &hyper::HeaderMap) -> bool {
    headers
        .get(hyper::header::EXPECT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("100-continue"))
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
    let decoded = path_param(s, "worker_id")?;
    decoded.parse().map_err(|_| {
        HttpError::InvalidPath(format!("Invalid URL: Cannot parse `{decoded}` to a `u64`"))
    })
}

/// A `{selection_id}` path segment, decoded.
fn selection_id(s: &str) -> Result<String, HttpError> {
    path_param(s, "selection_id")
}

/// A path segment `name`, decoded; escapes that decode to bytes which are not
/// UTF-8 are a 400, as in the reference (decoded lossily, two different ids
/// would name one booking).
fn path_param(s: &str, name: &str) -> Result<String, HttpError> {
    String::from_utf8(percent_decode_bytes(s))
        .map_err(|_| HttpError::InvalidPath(format!("Invalid URL: Invalid UTF-8 in `{name}`")))
}

/// Decodes `%XX` escapes; invalid escapes are kept literally; bytes that are
/// not UTF-8 become U+FFFD (query values, as the reference reads them).
pub fn percent_decode(s: &str) -> String {
    if !s.contains('%') {
        return s.to_string();
    }
    String::from_utf8_lossy(&percent_decode_bytes(s)).into_owned()
}

/// The bytes `%XX` escapes stand for; invalid escapes are kept literally.
fn percent_decode_bytes(s: &str) -> Vec<u8> {
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
    out
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

    /// The values of fields `keys`; the first of them given twice, in the
    /// query's order, is a 400, as in the reference (other keys are
    /// ignored, repeated or not).
    fn fields<const N: usize>(&self, keys: [&str; N]) -> Result<[Option<&str>; N], HttpError> {
        let mut out = [None; N];
        for (k, v) in &self.0 {
            if let Some(i) = keys.iter().position(|key| key == k) {
                if out[i].is_some() {
                    return Err(HttpError::InvalidPath(format!(
                        "Failed to deserialize query string: duplicate field `{k}`"
                    )));
                }
                out[i] = Some(v.as_str());
            }
        }
        Ok(out)
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
        assert_eq!(percent_decode("%FF"), "\u{FFFD}");
        assert_eq!(selection_id("a%2Fb").unwrap(), "a/b");
        assert_eq!(selection_id("%C3%A9").unwrap(), "\u{e9}");
        for bad in ["%FF", "%C3%28", "x%EF%BF"] {
            let e = selection_id(bad).unwrap_err();
            assert_eq!(
                e.status_and_message().1,
                "Invalid URL: Invalid UTF-8 in `selection_id`"
            );
        }
        assert_eq!(
            parse_u64("%FF").unwrap_err().status_and_message().1,
            "Invalid URL: Invalid UTF-8 in `worker_id`"
        );
    }

    #[test]
    fn query_strings() {
        let q = Query::parse(Some("model_name=a%2Fb&routing_group=&x&x"));
        assert_eq!(
            q.fields(["model_name", "routing_group", "nope"]).unwrap(),
            [Some("a/b"), Some(""), None]
        );
        assert_eq!(q.fields(["x"]).unwrap_err().status_and_message().0, 400);
        // The first key repeated in the query's order is named.
        let q = Query::parse(Some(
            "routing_group=a&model_name=a&routing_group=b&model_name=b",
        ));
        assert_eq!(
            q.fields(["model_name", "routing_group"])
                .unwrap_err()
                .status_and_message()
                .1,
            "Failed to deserialize query string: duplicate field `routing_group`"
        );
    }

    #[test]
    fn one_leading_slash() {
        assert_eq!(route_label("/health"), "/health");
        assert_eq!(route_label("//health"), "other");
    }
}
