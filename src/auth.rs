//! Bearer-token authentication (`--auth-token-file`).
//!
//! The file holds one token per line; blank lines and lines starting with `#`
//! are skipped and surrounding whitespace is trimmed, so a rotation is: add
//! the new token, SIGHUP, move the callers, remove the old token, SIGHUP.
//!
//! Only BLAKE3 digests of the tokens are kept. A presented token is hashed
//! and compared with every stored digest, without stopping at a match, using
//! `blake3::Hash`'s constant-time equality: neither the position of a
//! mismatching byte nor the token's length nor which token matched shows in
//! the time taken.
//!
//! A reload that fails (unreadable file, no token) keeps the tokens in force,
//! so a bad edit cannot open the service or lock every caller out.

use parking_lot::RwLock;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The tokens in force and the file they come from.
pub struct Auth {
    path: PathBuf,
    digests: RwLock<Arc<Vec<blake3::Hash>>>,
}

/// The outcome of checking a request's `Authorization` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Allowed,
    /// No `Authorization: Bearer` header.
    Missing,
    /// A bearer token that is not one of ours.
    Invalid,
}

impl Auth {
    /// Reads `path`; fails when it cannot be read or holds no token.
    pub fn load(path: &Path) -> Result<Auth, String> {
        let digests = read_digests(path)?;
        Ok(Auth {
            path: path.to_path_buf(),
            digests: RwLock::new(Arc::new(digests)),
        })
    }

    /// Re-reads the file; on failure the tokens in force stay. Returns the
    /// number of tokens now in force.
    pub fn reload(&self) -> Result<usize, String> {
        let digests = read_digests(&self.path)?;
        let n = digests.len();
        *self.digests.write() = Arc::new(digests);
        Ok(n)
    }

    /// [`reload`](Self::reload), logging the outcome (the SIGHUP handler).
    pub fn reload_logged(&self) {
        match self.reload() {
            Ok(n) => {
                tracing::info!(tokens = n, path = %self.path.display(), "auth tokens reloaded")
            }
            Err(e) => {
                tracing::error!(error = %e, "auth token reload failed; the previous tokens stay in force")
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Checks the value of an `Authorization` header.
    pub fn check(&self, authorization: Option<&[u8]>) -> Verdict {
        let Some(token) = authorization.and_then(bearer_token) else {
            return Verdict::Missing;
        };
        let presented = blake3::hash(token);
        let digests = Arc::clone(&self.digests.read());
        // No early exit: every stored digest is compared.
        let mut found = false;
        for d in digests.iter() {
            found |= *d == presented;
        }
        if found {
            Verdict::Allowed
        } else {
            Verdict::Invalid
        }
    }
}

/// The token of `Bearer <token>` (scheme case-insensitive, RFC 6750 §2.1).
fn bearer_token(v: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = v.split_at(v.iter().position(|&b| b == b' ')?);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let token = rest.trim_ascii();
    (!token.is_empty()).then_some(token)
}

fn read_digests(path: &Path) -> Result<Vec<blake3::Hash>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read auth token file {}: {e}", path.display()))?;
    let digests: Vec<blake3::Hash> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|t| blake3::hash(t.as_bytes()))
        .collect();
    if digests.is_empty() {
        return Err(format!("auth token file {} holds no token", path.display()));
    }
    Ok(digests)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> (tempdir::Dir, PathBuf) {
        let d = tempdir::Dir::new();
        let p = d.0.join("tokens");
        std::fs::write(&p, text).unwrap();
        (d, p)
    }

    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                let p =
                    std::env::temp_dir().join(format!("kvselect-auth-{}", uuid::Uuid::new_v4()));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn tokens_comments_and_schemes() {
        let (_d, p) = file("# rotation\n  alpha  \n\nbeta\n");
        let a = Auth::load(&p).unwrap();
        assert_eq!(a.check(Some(b"Bearer alpha")), Verdict::Allowed);
        assert_eq!(a.check(Some(b"bearer beta")), Verdict::Allowed);
        assert_eq!(a.check(Some(b"Bearer gamma")), Verdict::Invalid);
        assert_eq!(a.check(Some(b"Bearer alph")), Verdict::Invalid);
        assert_eq!(a.check(Some(b"Basic alpha")), Verdict::Missing);
        assert_eq!(a.check(Some(b"Bearer ")), Verdict::Missing);
        assert_eq!(a.check(None), Verdict::Missing);
        assert_eq!(a.check(Some(b"Bearer # rotation")), Verdict::Invalid);
    }

    #[test]
    fn failed_reload_keeps_tokens() {
        let (_d, p) = file("alpha\n");
        let a = Auth::load(&p).unwrap();
        std::fs::write(&p, "# nothing\n").unwrap();
        assert!(a.reload().is_err());
        assert_eq!(a.check(Some(b"Bearer alpha")), Verdict::Allowed);
        std::fs::write(&p, "beta\n").unwrap();
        assert_eq!(a.reload(), Ok(1));
        assert_eq!(a.check(Some(b"Bearer alpha")), Verdict::Invalid);
        assert_eq!(a.check(Some(b"Bearer beta")), Verdict::Allowed);
        assert!(Auth::load(&p.with_file_name("missing")).is_err());
    }
}
