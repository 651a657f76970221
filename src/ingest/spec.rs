//! What the hub is asked to run: its tuning ([`IngestConfig`], every
//! default a named constant), one listener's source ([`ListenerSpec`]), and
//! the syntax check of a ZMQ endpoint ([`validate_endpoint`]).
//!
//! Owns: plain values and their validation. Does not: open sockets or
//! start threads (`hub.rs`).

use crate::index::Index;
use std::sync::Arc;
use std::time::Duration;

/// Hub tuning. Every default is a named constant.
#[derive(Debug, Clone)]
pub struct IngestConfig {
    /// Ingest OS threads (each owns a share of the listeners).
    pub threads: usize,
    /// ZMQ reconnect interval and its cap (exponential in between); also the
    /// backoff for a failed socket creation or a failed replay.
    pub reconnect_min: Duration,
    pub reconnect_max: Duration,
    /// A replay with no reply for this long is abandoned (the gap is counted
    /// as lost and the listener goes back to live batches).
    pub replay_timeout: Duration,
    /// ZMQ heartbeat interval and timeout on SUB sockets.
    pub heartbeat_ivl: Duration,
    pub heartbeat_timeout: Duration,
    /// SUB receive high-water mark (messages). vLLM's PUB uses 100 000.
    pub rcvhwm: i32,
    /// Messages handled per socket per poll round, so one busy engine cannot
    /// starve the other listeners of its thread.
    pub max_msgs_per_round: usize,
    /// Largest message frame accepted (ZMQ_MAXMSGSIZE); a bigger one makes
    /// ZMQ drop the connection (it then reconnects). Bounds the memory a
    /// broken or hostile publisher can make us hold.
    pub max_msg_bytes: i64,
}

pub const DEFAULT_THREADS: usize = 2;
pub const DEFAULT_RECONNECT_MIN: Duration = Duration::from_millis(100);
pub const DEFAULT_RECONNECT_MAX: Duration = Duration::from_secs(5);
pub const DEFAULT_REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
pub const DEFAULT_HEARTBEAT_IVL: Duration = Duration::from_secs(5);
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(15);
pub const DEFAULT_RCVHWM: i32 = 100_000;
pub const DEFAULT_MAX_MSGS_PER_ROUND: usize = 256;
pub const DEFAULT_MAX_MSG_BYTES: i64 = 64 << 20;

impl Default for IngestConfig {
    fn default() -> Self {
        IngestConfig {
            threads: DEFAULT_THREADS,
            reconnect_min: DEFAULT_RECONNECT_MIN,
            reconnect_max: DEFAULT_RECONNECT_MAX,
            replay_timeout: DEFAULT_REPLAY_TIMEOUT,
            heartbeat_ivl: DEFAULT_HEARTBEAT_IVL,
            heartbeat_timeout: DEFAULT_HEARTBEAT_TIMEOUT,
            rcvhwm: DEFAULT_RCVHWM,
            max_msgs_per_round: DEFAULT_MAX_MSGS_PER_ROUND,
            max_msg_bytes: DEFAULT_MAX_MSG_BYTES,
        }
    }
}

/// One listener a worker wants: the KV-events endpoint of one dp rank.
#[derive(Clone)]
pub struct ListenerSpec {
    pub dp_rank: u32,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub index: Arc<Index>,
    pub block_size: u32,
}

impl std::fmt::Debug for ListenerSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerSpec")
            .field("dp_rank", &self.dp_rank)
            .field("endpoint", &self.endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .field("index", &Arc::as_ptr(&self.index))
            .field("block_size", &self.block_size)
            .finish()
    }
}

impl ListenerSpec {
    /// Whether a running listener for `self` can keep serving `other`.
    pub(super) fn same(&self, other: &ListenerSpec) -> bool {
        self.dp_rank == other.dp_rank
            && self.endpoint == other.endpoint
            && self.replay_endpoint == other.replay_endpoint
            && Arc::ptr_eq(&self.index, &other.index)
            && self.block_size == other.block_size
    }
}

/// Checks a ZMQ endpoint's syntax (no network access), with Dynamo's message
/// shape: "invalid ZMQ endpoint `not-a-url`: missing scheme".
pub fn validate_endpoint(s: &str) -> Result<(), EndpointError> {
    let fail = |problem: EndpointProblem| {
        Err(EndpointError {
            endpoint: s.to_owned(),
            problem,
        })
    };
    let Some((scheme, addr)) = s.split_once("://") else {
        return fail(EndpointProblem::MissingScheme);
    };
    if scheme.is_empty() {
        return fail(EndpointProblem::MissingScheme);
    }
    let needs_port = match scheme {
        "tcp" | "udp" | "pgm" | "epgm" | "norm" | "ws" | "wss" => true,
        "ipc" | "inproc" | "vmci" | "tipc" => false,
        other => return fail(EndpointProblem::UnsupportedScheme(other.to_owned())),
    };
    if addr.is_empty() {
        return fail(EndpointProblem::MissingAddress);
    }
    if needs_port {
        // ws/wss may carry a path after the port.
        let hostport = addr.split('/').next().unwrap_or("");
        let Some((host, port)) = hostport.rsplit_once(':') else {
            return fail(EndpointProblem::MissingPort);
        };
        if host.is_empty() {
            return fail(EndpointProblem::MissingHost);
        }
        if port != "*" && port.parse::<u16>().is_err() {
            return fail(EndpointProblem::InvalidPort(port.to_owned()));
        }
    }
    Ok(())
}

/// Why [`validate_endpoint`] refused an endpoint. Its `Display` is the
/// whole message, Dynamo's shape: "invalid ZMQ endpoint `x`: missing scheme".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointError {
    pub endpoint: String,
    pub problem: EndpointProblem,
}

/// What is wrong with an endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointProblem {
    MissingScheme,
    UnsupportedScheme(String),
    MissingAddress,
    MissingPort,
    MissingHost,
    InvalidPort(String),
}

impl std::fmt::Display for EndpointError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "invalid ZMQ endpoint `{}`: ", self.endpoint)?;
        match &self.problem {
            EndpointProblem::MissingScheme => f.write_str("missing scheme"),
            EndpointProblem::UnsupportedScheme(s) => write!(f, "unsupported scheme `{s}`"),
            EndpointProblem::MissingAddress => f.write_str("missing address"),
            EndpointProblem::MissingPort => f.write_str("missing port"),
            EndpointProblem::MissingHost => f.write_str("missing host"),
            EndpointProblem::InvalidPort(p) => write!(f, "invalid port `{p}`"),
        }
    }
}

impl std::error::Error for EndpointError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_validation_messages() {
        assert_eq!(
            validate_endpoint("not-a-url").unwrap_err().to_string(),
            "invalid ZMQ endpoint `not-a-url`: missing scheme"
        );
        for ok in [
            "tcp://127.0.0.1:5557",
            "tcp://*:5557",
            "tcp://[::1]:5557",
            "tcp://engine-0.svc:5557",
            "ipc:///tmp/kv.sock",
            "inproc://kv-events",
            "ws://host:80/path",
            "epgm://eth0;239.192.1.1:5555",
        ] {
            assert_eq!(validate_endpoint(ok), Ok(()), "{ok}");
        }
        for (bad, why) in [
            ("://x:1", "missing scheme"),
            ("http://x:1", "unsupported scheme `http`"),
            ("tcp://", "missing address"),
            ("tcp://host", "missing port"),
            ("tcp://:5557", "missing host"),
            ("tcp://host:http", "invalid port `http`"),
            ("tcp://host:70000", "invalid port `70000`"),
        ] {
            assert_eq!(
                validate_endpoint(bad).unwrap_err().to_string(),
                format!("invalid ZMQ endpoint `{bad}`: {why}")
            );
        }
    }
}
