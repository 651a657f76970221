//! The real `kvselect` binary as a child process on 127.0.0.1:0, and plain
//! blocking HTTP/1.1 over std sockets for probing it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub struct Binary {
    pub child: Child,
    pub addr: SocketAddr,
    /// Every line the process has written to stdout and stderr so far.
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Binary {
    /// Starts `kvselect --port 0 ARGS` and waits for its listening line.
    pub fn start(args: &[&str]) -> Binary {
        Binary::start_env(args, &[])
    }

    pub fn start_env(args: &[&str], env: &[(&str, &str)]) -> Binary {
        Binary::start_limited(args, env, None)
    }

    /// Starts the binary with its soft and hard `RLIMIT_NOFILE` set to
    /// `nofile` (when given), so a test can reach the fd or socket limits.
    #[allow(unsafe_code)]
    pub fn start_limited(args: &[&str], env: &[(&str, &str)], nofile: Option<u64>) -> Binary {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvselect"));
        if let Some(n) = nofile {
            use std::os::unix::process::CommandExt as _;
            // SAFETY: setrlimit is async-signal-safe; the closure touches
            // nothing but its copied argument.
            unsafe {
                cmd.pre_exec(move || {
                    let lim = libc::rlimit {
                        rlim_cur: n,
                        rlim_max: n,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        cmd.args(["--port", "0"])
            .args(args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn kvselect");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel::<SocketAddr>();
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        for (stream, tx) in [
            (Box::new(out) as Box<dyn Read + Send>, Some(tx)),
            (Box::new(err), None),
        ] {
            let log = Arc::clone(&log);
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    if let (Some(tx), true) = (&tx, line.contains("kvselect listening")) {
                        let addr = line
                            .split_whitespace()
                            .find_map(|w| w.strip_prefix("addr="))
                            .and_then(|a| a.trim_matches('"').parse().ok());
                        if let Some(a) = addr {
                            let _ = tx.send(a);
                        }
                    }
                    log.lock().unwrap().push(line);
                }
            });
        }
        let addr = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "kvselect did not start:\n{}",
                    log.lock().unwrap().join("\n")
                );
            }
        };
        Binary { child, addr, log }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    #[allow(unsafe_code)]
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(self.pid(), sig) }, 0);
    }

    /// Resident set size, bytes.
    pub fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .expect("VmRSS");
        kb * 1024
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// Open file descriptors of the process.
    pub fn fd_count(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .expect("read /proc/PID/fd")
            .count()
    }

    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A response read by [`request`].
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    pub head: String,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    }
}

/// One request on a fresh connection (`Connection: close`), read to EOF.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> RawResponse {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: kvselect\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read response");
    parse_response(&raw)
        .unwrap_or_else(|| panic!("bad response: {}", String::from_utf8_lossy(&raw)))
}

/// Splits a complete HTTP/1.1 response (head + Content-Length body).
pub fn parse_response(raw: &[u8]) -> Option<RawResponse> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some(RawResponse {
        status,
        head,
        body: raw[end + 4..].to_vec(),
    })
}

/// Runs `promtool check metrics` on `text`; `None` when promtool is not
/// installed and this is not CI (`.ci/run` installs it).
pub fn promtool(text: &str) -> Option<(bool, String)> {
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) if std::env::var_os("CI").is_none() => {
            eprintln!("SKIPPED promtool check: promtool not runnable ({e}); .ci/run installs it");
            return None;
        }
        Err(e) => panic!("promtool is required in CI: {e}"),
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let msg = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some((out.status.success(), msg))
}

/// Raises this process's soft file-descriptor limit to the hard one and
/// returns it (fleet tests open thousands of sockets).
#[allow(unsafe_code)]
pub fn raise_own_fd_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: valid rlimit pointers for the duration of each call.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
    }
    lim.rlim_cur
}
