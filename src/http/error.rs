//! The one place that turns every failure into an HTTP status and an
//! `{"error": "..."}` body. The match is exhaustive on purpose: a new error
//! kind must choose its status here.

use crate::app::ServiceError;
use crate::parse::{ErrorClass, ParseError};
use hyper::StatusCode;

/// Failures of the HTTP front door itself, before a handler runs.
#[derive(Debug)]
pub enum HttpError {
    Service(ServiceError),
    UnsupportedMediaType,
    PayloadTooLarge,
    RouteNotFound,
    MethodNotAllowed {
        allow: &'static str,
    },
    /// A path parameter that does not parse (e.g. `/workers/abc`).
    InvalidPath(String),
    /// The client's body stream failed mid-way.
    BodyRead(String),
    /// The body did not arrive within `--body-read-timeout-secs`.
    BodyTimeout,
    /// `--auth-token-file` is set and the request carries no bearer token
    /// (`token_given: false`) or not one of ours.
    Unauthorized {
        token_given: bool,
    },
}

impl From<ServiceError> for HttpError {
    fn from(e: ServiceError) -> Self {
        HttpError::Service(e)
    }
}

impl From<ParseError> for HttpError {
    fn from(e: ParseError) -> Self {
        HttpError::Service(ServiceError::Parse(e))
    }
}

impl HttpError {
    pub fn status_and_message(&self) -> (StatusCode, String) {
        match self {
            HttpError::Service(e) => match e {
                ServiceError::Parse(p) => match p.class {
                    ErrorClass::Syntax => (
                        StatusCode::BAD_REQUEST,
                        format!("Failed to parse the request body as JSON: {p}"),
                    ),
                    ErrorClass::Shape => (
                        StatusCode::UNPROCESSABLE_ENTITY,
                        format!("Failed to deserialize the JSON body into the target type: {p}"),
                    ),
                    ErrorClass::TooLarge => (
                        StatusCode::PAYLOAD_TOO_LARGE,
                        format!("Request body too large: {p}"),
                    ),
                },
                ServiceError::Invalid(m) | ServiceError::Refused(m) => {
                    (StatusCode::BAD_REQUEST, m.clone())
                }
                ServiceError::NoWorkers(m) => (StatusCode::SERVICE_UNAVAILABLE, m.clone()),
                ServiceError::NoCandidates => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                ServiceError::UnknownWorker(m)
                | ServiceError::UnknownRank(m)
                | ServiceError::UnknownSelection(m)
                | ServiceError::UnknownPeer(m) => (StatusCode::NOT_FOUND, m.clone()),
                ServiceError::AlreadyReserved(m) => (StatusCode::CONFLICT, m.clone()),
                ServiceError::ReplicaSyncDisabled => (StatusCode::CONFLICT, e.to_string()),
                ServiceError::Busy(m) => (StatusCode::TOO_MANY_REQUESTS, m.clone()),
            },
            HttpError::UnsupportedMediaType => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "Expected request with `Content-Type: application/json`".to_string(),
            ),
            HttpError::PayloadTooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "Failed to buffer the request body: length limit exceeded".to_string(),
            ),
            HttpError::RouteNotFound => (StatusCode::NOT_FOUND, "route not found".to_string()),
            HttpError::MethodNotAllowed { .. } => (
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed".to_string(),
            ),
            HttpError::InvalidPath(m) => (StatusCode::BAD_REQUEST, m.clone()),
            HttpError::BodyRead(m) => (
                StatusCode::BAD_REQUEST,
                format!("Failed to buffer the request body: {m}"),
            ),
            HttpError::BodyTimeout => (
                StatusCode::REQUEST_TIMEOUT,
                "Failed to buffer the request body: timed out".to_string(),
            ),
            HttpError::Unauthorized { token_given } => (
                StatusCode::UNAUTHORIZED,
                if *token_given {
                    "invalid bearer token".to_string()
                } else {
                    "missing bearer token (Authorization: Bearer <token>)".to_string()
                },
            ),
        }
    }
}

/// `{"error": msg}` with proper JSON escaping.
pub fn error_body(msg: &str) -> Vec<u8> {
    #[derive(serde::Serialize)]
    struct E<'a> {
        error: &'a str,
    }
    serde_json::to_vec(&E { error: msg }).expect("serialises")
}
