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
    /// Message bytes one ingest thread reads per poll round, over all its
    /// streams, before it applies them: bounds a batch's wait between being
    /// read and being applied (the receipt-to-application delay) under a
    /// burst. What is not read waits in libzmq, counted by the index's lag
    /// (`lag.rs`).
    pub max_bytes_per_round: usize,
    /// Largest message frame accepted (ZMQ_MAXMSGSIZE); a bigger one makes
    /// ZMQ drop the connection (it then reconnects). Bounds the memory a
    /// broken or hostile publisher can make us hold.
    pub max_msg_bytes: i64,
    /// ZMQ_MAX_SOCKETS of the hub's context: one per stream (SUB), one more
    /// per stream with a replay endpoint, two per ingest thread. Size it from
    /// the fd limit with [`IngestConfig::sockets_for_fds`].
    pub max_sockets: i32,
}

pub const DEFAULT_THREADS: usize = 2;
pub const DEFAULT_RECONNECT_MIN: Duration = Duration::from_millis(100);
pub const DEFAULT_RECONNECT_MAX: Duration = Duration::from_secs(5);
pub const DEFAULT_REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
pub const DEFAULT_HEARTBEAT_IVL: Duration = Duration::from_secs(5);
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(15);
pub const DEFAULT_RCVHWM: i32 = 100_000;
pub const DEFAULT_MAX_MSGS_PER_ROUND: usize = 256;
/// About 10-20 ms of decoding and applying on one core.
pub const DEFAULT_MAX_BYTES_PER_ROUND: usize = 4 << 20;
pub const DEFAULT_MAX_MSG_BYTES: i64 = 64 << 20;
/// libzmq's own default; never size below it.
pub const MIN_MAX_SOCKETS: i32 = 1023;
/// File descriptors one connected ZMQ socket costs: its mailbox (an
/// eventfd), its TCP connection and the I/O thread's share of polling it
/// (4,096 subscribed ranks held 12,316 descriptors in `tests/ingest_fleet.rs`).
pub const FDS_PER_SOCKET: u64 = 3;

impl IngestConfig {
    /// ZMQ sockets that fit in `fd_limit` descriptors once `reserved` are
    /// kept for HTTP connections and files (at least [`MIN_MAX_SOCKETS`]).
    pub fn sockets_for_fds(fd_limit: u64, reserved: u64) -> i32 {
        let n = fd_limit.saturating_sub(reserved) / FDS_PER_SOCKET;
        (n.min(i32::MAX as u64) as i32).max(MIN_MAX_SOCKETS)
    }
}

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
            max_bytes_per_round: DEFAULT_MAX_BYTES_PER_ROUND,
            max_msg_bytes: DEFAULT_MAX_MSG_BYTES,
            max_sockets: MIN_MAX_SOCKETS,
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

/// Checks a KV-event or replay endpoint a worker registers, stricter than
/// [`validate_endpoint`]: only `tcp://host:port` with a port in 1..=65535
/// and a real host (an IPv4 address, a bracketed IPv6 address or an RFC 1123
/// host name; no `*`, no interface prefix), or `ipc://path` when
/// `allow_ipc`. `inproc://` is always refused: it can only reach a socket of
/// this process, and a connect to an unbound inproc name holds its socket
/// (and two descriptors) in the ZMQ context until someone binds it.
pub fn validate_kv_endpoint(s: &str, allow_ipc: bool) -> Result<(), EndpointError> {
    validate_endpoint(s)?;
    let fail = |problem: EndpointProblem| {
        Err(EndpointError {
            endpoint: s.to_owned(),
            problem,
        })
    };
    let (scheme, addr) = s.split_once("://").unwrap_or_default();
    match scheme {
        "tcp" => {}
        "ipc" if allow_ipc => return Ok(()),
        "ipc" => return fail(EndpointProblem::IpcNotAllowed),
        "inproc" => return fail(EndpointProblem::InprocRefused),
        other => return fail(EndpointProblem::NotTcp(other.to_owned())),
    }
    // validate_endpoint found a `host:port` with a u16 or `*` port.
    let (host, port) = addr.rsplit_once(':').unwrap_or_default();
    match port.parse::<u16>() {
        Ok(p) if p > 0 => {}
        _ => return fail(EndpointProblem::InvalidPort(port.to_owned())),
    }
    if !valid_host(host) {
        return fail(EndpointProblem::InvalidHost(host.to_owned()));
    }
    Ok(())
}

/// An IPv4 address, a bracketed IPv6 address or an RFC 1123 host name.
fn valid_host(host: &str) -> bool {
    if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return v6.parse::<std::net::Ipv6Addr>().is_ok();
    }
    if host.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return host.parse::<std::net::Ipv4Addr>().is_ok();
    }
    let name = host.strip_suffix('.').unwrap_or(host);
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
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
    InvalidHost(String),
    /// A KV-event endpoint that is neither `tcp://` nor an allowed `ipc://`.
    NotTcp(String),
    IpcNotAllowed,
    InprocRefused,
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
            EndpointProblem::InvalidHost(h) => write!(f, "invalid host `{h}`"),
            EndpointProblem::NotTcp(s) => {
                write!(f, "KV-event endpoints must be tcp://host:port, not `{s}`")
            }
            EndpointProblem::IpcNotAllowed => {
                f.write_str("ipc endpoints are refused without --allow-ipc-endpoints")
            }
            EndpointProblem::InprocRefused => {
                f.write_str("inproc endpoints are refused (they reach only this process)")
            }
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

    #[test]
    fn kv_endpoints_are_tcp_with_a_real_host_and_port() {
        for ok in [
            "tcp://127.0.0.1:5557",
            "tcp://127.0.0.1:65535",
            "tcp://[::1]:5557",
            "tcp://engine-0.svc.cluster.local:1",
            "tcp://localhost.:5557",
        ] {
            assert_eq!(validate_kv_endpoint(ok, false), Ok(()), "{ok}");
        }
        assert_eq!(validate_kv_endpoint("ipc:///tmp/kv.sock", true), Ok(()));
        for (bad, why) in [
            ("tcp://256.1.1.1:1", "invalid host `256.1.1.1`"),
            ("tcp://1.2.3:1", "invalid host `1.2.3`"),
            ("tcp://127.0.0.1:0", "invalid port `0`"),
            ("tcp://127.0.0.1:65536", "invalid port `65536`"),
            ("tcp://*:5557", "invalid host `*`"),
            ("tcp://[::1:5557", "invalid host `[::1`"),
            ("tcp://-bad.host:1", "invalid host `-bad.host`"),
            ("tcp://eth0;10.0.0.1:1", "invalid host `eth0;10.0.0.1`"),
            ("tcp://h:1/x", "invalid port `1/x`"),
            (
                "ipc:///etc/passwd",
                "ipc endpoints are refused without --allow-ipc-endpoints",
            ),
            (
                "inproc://x",
                "inproc endpoints are refused (they reach only this process)",
            ),
            (
                "udp://h:1",
                "KV-event endpoints must be tcp://host:port, not `udp`",
            ),
            ("tcp://host", "missing port"),
        ] {
            assert_eq!(
                validate_kv_endpoint(bad, false).unwrap_err().to_string(),
                format!("invalid ZMQ endpoint `{bad}`: {why}"),
                "{bad}"
            );
        }
        assert!(validate_kv_endpoint("inproc://x", true).is_err());
    }
}
