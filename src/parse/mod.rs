//! Request parsing: JSON bodies -> typed request views, without an
//! intermediate value tree. (Contract only; the visitor lands with issue 2.)

pub mod request;

pub use request::*;

use crate::pool::Pool;
use std::fmt;

/// How a body failed: the HTTP layer maps `Syntax` to 400, `Shape` to 422 and
/// `TooLarge` to 413.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Not valid JSON (or nesting deeper than the limit).
    Syntax,
    /// Valid JSON of the wrong shape.
    Shape,
    /// More tokens than the configured limit.
    TooLarge,
}

/// A parse failure with where it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    pub class: ErrorClass,
    /// Byte offset into the body.
    pub offset: usize,
    /// 1-based line and column of `offset`, as serde_json reports them.
    pub line: usize,
    pub column: usize,
    /// Dotted field path (`router_config_override.assume_kv_reuse`), empty at
    /// the top level and for the flattened prompt fields.
    pub path: String,
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.path.is_empty() {
            write!(f, "{}: ", self.path)?;
        }
        write!(
            f,
            "{} at line {} column {} (byte {})",
            self.message, self.line, self.column, self.offset
        )
    }
}

impl std::error::Error for ParseError {}

/// Default nesting-depth limit (serde_json's is 128).
pub const DEFAULT_MAX_DEPTH: usize = 128;
/// Default limit on tokens in one array: 4M, more than an 8 MiB body can hold.
pub const DEFAULT_MAX_TOKENS: usize = 4 * 1024 * 1024;

#[derive(Debug, Clone, Copy)]
pub struct ParseLimits {
    pub max_depth: usize,
    pub max_tokens: usize,
}

impl Default for ParseLimits {
    fn default() -> Self {
        ParseLimits {
            max_depth: DEFAULT_MAX_DEPTH,
            max_tokens: DEFAULT_MAX_TOKENS,
        }
    }
}

/// Parses request bodies into views; holds the limits and the buffer pools.
#[derive(Debug, Clone, Default)]
pub struct Parser {
    pub limits: ParseLimits,
    pub tokens: Pool<u32>,
    pub hashes: Pool<u64>,
}
