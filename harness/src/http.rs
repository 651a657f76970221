//! A small keep-alive HTTP/1.1 client over a tokio `TcpStream`, for load
//! generation against a selector on loopback.
//!
//! Owns request framing (`Content-Length` bodies only) and response parsing
//! (status line, `Content-Length` or chunked bodies, `Connection: close`).
//! It is deliberately minimal so that the client never costs more CPU than
//! the request itself: one write per request, the response read into one
//! reused buffer. Every wait is bounded by the caller's timeout.

use std::io;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest response accepted (a `/select_and_reserve` answer for a 200k-token
/// prompt is about 250 KB).
const MAX_RESPONSE: usize = 64 << 20;

/// Longest wait for a TCP connect.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// One keep-alive connection.
pub struct HttpConn {
    stream: TcpStream,
    host: String,
    buf: Vec<u8>,
    head: Vec<u8>,
    /// Body of the last response, valid until the next request.
    body: Vec<u8>,
    /// `Retry-After` of the last response, in its delay-seconds form.
    retry_after: Option<Duration>,
    closed: bool,
}

fn bad(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn parse_usize_hex(s: &[u8]) -> Option<usize> {
    let s = std::str::from_utf8(s).ok()?;
    let s = s.split(';').next()?.trim();
    usize::from_str_radix(s, 16).ok()
}

impl HttpConn {
    /// Connects to `addr` (`host:port`) with `TCP_NODELAY`, giving up after
    /// [`CONNECT_TIMEOUT`] (a server out of file descriptors leaves the SYN
    /// unanswered for minutes).
    pub async fn connect(addr: &str) -> io::Result<Self> {
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
        stream.set_nodelay(true)?;
        Ok(Self {
            stream,
            host: addr.to_string(),
            buf: Vec::with_capacity(64 << 10),
            head: Vec::with_capacity(256),
            body: Vec::new(),
            retry_after: None,
            closed: false,
        })
    }

    /// False once the server asked to close or an error broke the framing.
    pub fn reusable(&self) -> bool {
        !self.closed
    }

    /// Sends one request and returns the status; the body is in
    /// [`HttpConn::body`]. `json_body` is sent with `Content-Type:
    /// application/json` (pass `None` for no body).
    pub async fn request(
        &mut self,
        method: &str,
        path: &str,
        json_body: Option<&[u8]>,
        timeout: Duration,
    ) -> io::Result<u16> {
        match json_body {
            Some(b) => self.request_parts(method, path, Some(&[b]), timeout).await,
            None => self.request_parts(method, path, None, timeout).await,
        }
    }

    /// As [`HttpConn::request`], with the JSON body given as consecutive
    /// parts, written as they are (a 99k-token prompt is ~700 KB; assembling
    /// it first would copy it once more per request).
    pub async fn request_parts(
        &mut self,
        method: &str,
        path: &str,
        json_parts: Option<&[&[u8]]>,
        timeout: Duration,
    ) -> io::Result<u16> {
        match tokio::time::timeout(timeout, self.request_inner(method, path, json_parts)).await {
            Ok(r) => {
                if r.is_err() {
                    self.closed = true;
                }
                r
            }
            Err(_) => {
                self.closed = true;
                Err(io::Error::new(io::ErrorKind::TimedOut, "request timed out"))
            }
        }
    }

    /// Body of the last response.
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// The last response's `Retry-After`, when it gave a number of seconds
    /// (the HTTP-date form is not used by selectors and is ignored).
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    async fn request_inner(
        &mut self,
        method: &str,
        path: &str,
        json_parts: Option<&[&[u8]]>,
    ) -> io::Result<u16> {
        if self.closed {
            return Err(bad("connection closed"));
        }
        self.head.clear();
        self.head.extend_from_slice(method.as_bytes());
        self.head.push(b' ');
        self.head.extend_from_slice(path.as_bytes());
        self.head.extend_from_slice(b" HTTP/1.1\r\nHost: ");
        self.head.extend_from_slice(self.host.as_bytes());
        match json_parts {
            Some(parts) => {
                let len: usize = parts.iter().map(|p| p.len()).sum();
                self.head
                    .extend_from_slice(b"\r\nContent-Type: application/json\r\nContent-Length: ");
                self.head
                    .extend_from_slice(itoa::Buffer::new().format(len).as_bytes());
                self.head.extend_from_slice(b"\r\n\r\n");
                if len <= 4096 {
                    // Small bodies go out in the same segment as the head.
                    for p in parts {
                        self.head.extend_from_slice(p);
                    }
                    self.stream.write_all(&self.head).await?;
                } else {
                    self.stream.write_all(&self.head).await?;
                    for p in parts {
                        self.stream.write_all(p).await?;
                    }
                }
            }
            None => {
                self.head
                    .extend_from_slice(b"\r\nContent-Length: 0\r\n\r\n");
                self.stream.write_all(&self.head).await?;
            }
        }
        self.read_response().await
    }

    async fn fill(&mut self) -> io::Result<()> {
        if self.buf.len() > MAX_RESPONSE {
            return Err(bad("response too large"));
        }
        self.buf.reserve(64 << 10);
        let n = self.stream.read_buf(&mut self.buf).await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed by server",
            ));
        }
        Ok(())
    }

    async fn read_response(&mut self) -> io::Result<u16> {
        let head_end = loop {
            if let Some(p) = find(&self.buf, b"\r\n\r\n") {
                break p;
            }
            self.fill().await?;
        };
        let head = std::str::from_utf8(&self.buf[..head_end]).map_err(|_| bad("non-utf8 head"))?;
        let mut lines = head.split("\r\n");
        let status_line = lines.next().ok_or_else(|| bad("no status line"))?;
        let status: u16 = status_line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad("bad status line"))?;
        let mut content_length = None;
        let mut chunked = false;
        self.retry_after = None;
        for line in lines {
            let Some((k, v)) = line.split_once(':') else {
                continue;
            };
            let v = v.trim();
            if k.eq_ignore_ascii_case("content-length") {
                content_length = Some(v.parse::<usize>().map_err(|_| bad("bad content-length"))?);
            } else if k.eq_ignore_ascii_case("transfer-encoding") {
                chunked = v.eq_ignore_ascii_case("chunked");
            } else if k.eq_ignore_ascii_case("connection") && v.eq_ignore_ascii_case("close") {
                self.closed = true;
            } else if k.eq_ignore_ascii_case("retry-after") {
                self.retry_after = parse_retry_after(v);
            }
        }
        let mut pos = head_end + 4;
        self.body.clear();
        if chunked {
            loop {
                let line_end = loop {
                    if let Some(p) = find(&self.buf[pos..], b"\r\n") {
                        break pos + p;
                    }
                    self.fill().await?;
                };
                let size =
                    parse_usize_hex(&self.buf[pos..line_end]).ok_or_else(|| bad("bad chunk"))?;
                pos = line_end + 2;
                while self.buf.len() < pos + size + 2 {
                    self.fill().await?;
                }
                self.body.extend_from_slice(&self.buf[pos..pos + size]);
                pos += size + 2;
                if size == 0 {
                    break;
                }
            }
        } else {
            let len = content_length.unwrap_or(0);
            if len > MAX_RESPONSE {
                return Err(bad("response too large"));
            }
            while self.buf.len() < pos + len {
                self.fill().await?;
            }
            self.body.extend_from_slice(&self.buf[pos..pos + len]);
            pos += len;
        }
        self.buf.drain(..pos);
        Ok(status)
    }
}

/// `Retry-After: <delay-seconds>` as a duration (a fraction is accepted;
/// anything else, such as an HTTP date, is `None`).
pub fn parse_retry_after(v: &str) -> Option<Duration> {
    let secs: f64 = v.trim().parse().ok()?;
    Duration::try_from_secs_f64(secs).ok()
}

/// Finds `"key":<u64>` in a JSON body without parsing the rest (responses to
/// `/select_and_reserve` carry thousands of hashes the client does not need).
pub fn scan_u64(body: &[u8], key: &str) -> Option<u64> {
    let mut pat = Vec::with_capacity(key.len() + 3);
    pat.push(b'"');
    pat.extend_from_slice(key.as_bytes());
    pat.extend_from_slice(b"\":");
    // The first occurrence: a top-level key cannot occur inside a number
    // array, nor unescaped inside a string. kvselect writes the thousands of
    // `sequence_hashes` last, so the search stops before them; behind the
    // reference's (second in its object) it reads through them.
    let at = body.windows(pat.len()).position(|w| w == pat.as_slice())? + pat.len();
    let digits: &[u8] = &body[at..];
    let digits = &digits[..digits
        .iter()
        .position(|c| !c.is_ascii_digit())
        .unwrap_or(digits.len())];
    std::str::from_utf8(digits).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_finds_worker_id() {
        let b = br#"{"selection_id":"x","sequence_hashes":[1,-2],"worker_id":17,"dp_rank":0}"#;
        assert_eq!(scan_u64(b, "worker_id"), Some(17));
        assert_eq!(scan_u64(b, "missing"), None);
        assert_eq!(scan_u64(br#"{"worker_id":"x"}"#, "worker_id"), None);
    }

    #[test]
    fn retry_after_takes_seconds_only() {
        assert_eq!(parse_retry_after(" 1"), Some(Duration::from_secs(1)));
        assert_eq!(parse_retry_after("0.25"), Some(Duration::from_millis(250)));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), None);
        assert_eq!(parse_retry_after("-1"), None);
    }
}
