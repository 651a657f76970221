//! Request parsing: JSON bodies -> typed request views, without an
//! intermediate value tree.
//!
//! Owns: the byte cursor (`cursor`) and its internal error (`failure`), one hand-written visitor per body of the
//! API (`bodies`), the number-array loops (`numbers`, scalar) and their AVX2
//! and AVX-512 runs (`simd`, the only `unsafe`), the streamed front that
//! converts token arrays frame by frame as a body arrives (`stream`), and the
//! 400/422/413 classification.
//! Does not: know HTTP (the HTTP layer adds the axum-style message prefixes and
//! picks the status from [`ErrorClass`]).
//!
//! Contract: a body gets the first error the reference meets reading it
//! (serde_json straight into its typed struct): invalid JSON is
//! [`ErrorClass::Syntax`] and valid JSON of the wrong shape
//! [`ErrorClass::Shape`], whichever comes first, except that a shape error
//! in the flattened prompt group waits for the end of the object (the
//! reference buffers that group; `bodies::Parser::prompt_or_defer`). More
//! than `limits.max_tokens` elements in one number array is
//! [`ErrorClass::TooLarge`]. Trailing non-whitespace after a body that
//! parsed is a syntax error (the reference accepts it; we do not). Messages
//! and positions follow serde_json's and serde_path_to_error's.

mod bodies;
mod cursor;
mod failure;
mod numbers;
#[cfg(any(test, feature = "testkit"))]
pub mod oracle;
pub mod request;
mod simd;
mod stream;

pub use simd::{avx2_available, avx512_available, sse41_available};
use simd::{Isa, Vector};

pub use request::*;
pub use stream::{BodyStream, StreamPools};

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

/// Which loop converts token arrays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NumberPath {
    /// The best run the CPU has: AVX-512, else AVX2, else SSE4.1, else
    /// scalar.
    #[default]
    Auto,
    /// The plain byte loop only.
    Scalar,
    /// SSE4.1 runs (scalar on CPUs without SSE4.1 and SSSE3).
    Sse41,
    /// AVX2 runs (SSE4.1, else scalar, on CPUs without AVX2).
    Avx2,
    /// AVX-512 runs (AVX2, else SSE4.1, else scalar, on CPUs without the
    /// AVX-512 parts).
    Avx512,
}

impl NumberPath {
    /// The path a `--simd` / `KVSELECT_SIMD` value asks for, given which
    /// vector runs the CPU has (pure, so tests can pass any CPU). `auto`
    /// resolves to the best the CPU has; a named path the CPU lacks, or an
    /// unknown value, is an error with the message the server exits with.
    pub fn choose(
        value: &str,
        sse41: bool,
        avx2: bool,
        avx512: bool,
    ) -> Result<NumberPath, String> {
        let lacks = |name: &str| {
            Err(format!(
                "--simd {name}: this CPU lacks the {name} features the token loop needs (available: {})",
                Self::names_for(sse41, avx2, avx512)
            ))
        };
        match value.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(if avx512 {
                NumberPath::Avx512
            } else if avx2 {
                NumberPath::Avx2
            } else if sse41 {
                NumberPath::Sse41
            } else {
                NumberPath::Scalar
            }),
            "scalar" => Ok(NumberPath::Scalar),
            "sse4.1" if sse41 => Ok(NumberPath::Sse41),
            "sse4.1" => lacks("sse4.1"),
            "avx2" if avx2 => Ok(NumberPath::Avx2),
            "avx2" => lacks("avx2"),
            "avx512" if avx512 => Ok(NumberPath::Avx512),
            "avx512" => lacks("avx512"),
            other => Err(format!(
                "--simd / KVSELECT_SIMD: `{other}` is not one of auto, avx512, avx2, sse4.1, scalar"
            )),
        }
    }

    /// [`NumberPath::choose`] for this CPU.
    pub fn choose_here(value: &str) -> Result<NumberPath, String> {
        Self::choose(
            value,
            sse41_available(),
            avx2_available(),
            avx512_available(),
        )
    }

    /// "scalar, sse4.1, avx2, avx512" as far as the CPU has them.
    fn names_for(sse41: bool, avx2: bool, avx512: bool) -> String {
        let mut v = vec!["scalar"];
        for (has, name) in [(sse41, "sse4.1"), (avx2, "avx2"), (avx512, "avx512")] {
            if has {
                v.push(name);
            }
        }
        v.join(", ")
    }

    /// The widest run this path allows that the CPU has (`None`: scalar).
    fn vector(self) -> Option<Vector> {
        let widest = match self {
            NumberPath::Scalar => return None,
            NumberPath::Sse41 => Isa::Sse41,
            NumberPath::Avx2 => Isa::Avx2,
            NumberPath::Auto | NumberPath::Avx512 => Isa::Avx512,
        };
        Vector::detect(widest)
    }

    /// The loop this path really runs on this CPU: `scalar`, `sse4.1`,
    /// `avx2` or `avx512` (`auto` and the quiet fall-backs resolved).
    pub fn effective_name(self) -> &'static str {
        match self.effective() {
            NumberPath::Scalar => "scalar",
            NumberPath::Sse41 => "sse4.1",
            NumberPath::Avx2 => "avx2",
            NumberPath::Auto | NumberPath::Avx512 => "avx512",
        }
    }

    /// The path this one really is on this CPU: [`NumberPath::Scalar`],
    /// [`NumberPath::Sse41`] only where SSE4.1, SSSE3 and POPCNT were
    /// detected, [`NumberPath::Avx2`] only where AVX2 (with BMI1, LZCNT,
    /// POPCNT) was, [`NumberPath::Avx512`] only where the AVX-512 parts were;
    /// each falls back to the next narrower one; never `Auto`. The reply
    /// writer (`json_out`) follows it too, so a forced path governs every
    /// vector loop of a request.
    pub fn effective(self) -> NumberPath {
        match self.vector().map(Vector::isa) {
            Some(Isa::Avx512) => NumberPath::Avx512,
            Some(Isa::Avx2) => NumberPath::Avx2,
            Some(Isa::Sse41) => NumberPath::Sse41,
            None => NumberPath::Scalar,
        }
    }

    /// The token loops this CPU really runs, scalar first, each with the name
    /// tests print. A vector path is listed only where the CPU has its
    /// features, so a comparison never runs AVX2 (or the scalar loop) under
    /// an "avx512" label: [`NumberPath::Avx2`] and [`NumberPath::Avx512`]
    /// themselves fall back quietly.
    #[cfg(any(test, feature = "testkit"))]
    pub fn available() -> Vec<(NumberPath, &'static str)> {
        let mut paths = vec![(NumberPath::Scalar, "scalar")];
        if sse41_available() {
            paths.push((NumberPath::Sse41, "sse4.1"));
        }
        if avx2_available() {
            paths.push((NumberPath::Avx2, "avx2"));
        }
        if avx512_available() {
            paths.push((NumberPath::Avx512, "avx512"));
        }
        paths
    }

    /// [`NumberPath::available`] without the scalar loop: the paths a test
    /// compares with it.
    #[cfg(any(test, feature = "testkit"))]
    pub fn available_vectors() -> Vec<(NumberPath, &'static str)> {
        Self::available()
            .into_iter()
            .filter(|&(p, _)| p != NumberPath::Scalar)
            .collect()
    }

    /// "scalar, sse4.1, avx2, avx512": the names of `paths`, for a test to print
    /// which ran.
    #[cfg(any(test, feature = "testkit"))]
    pub fn names(paths: &[(NumberPath, &'static str)]) -> String {
        paths.iter().map(|&(_, n)| n).collect::<Vec<_>>().join(", ")
    }
}

/// Parses request bodies into views; holds the limits and the buffer pools.
#[derive(Debug, Clone, Default)]
pub struct Parser {
    pub limits: ParseLimits,
    pub tokens: Pool<u32>,
    pub hashes: Pool<u64>,
    /// Token-array loop; [`NumberPath::Auto`] unless a bench or test pins it.
    pub number_path: NumberPath,
    /// Skeleton and frame-list buffers of streamed bodies (`stream.rs`).
    pub stream_pools: StreamPools,
}

impl Parser {
    pub fn new(limits: ParseLimits, tokens: Pool<u32>, hashes: Pool<u64>) -> Self {
        Parser {
            limits,
            tokens,
            hashes,
            number_path: NumberPath::Auto,
            stream_pools: StreamPools::default(),
        }
    }

    /// The same parser with its token loop pinned (benches, property tests).
    pub fn with_number_path(mut self, path: NumberPath) -> Self {
        self.number_path = path;
        self
    }

    fn vector(&self) -> Option<Vector> {
        self.number_path.vector()
    }
}
