//! The parser's internal error on its way up: class, offset, message and
//! the field path it gathers while unwinding, then rendered once into the
//! public [`ParseError`] (serde_path_to_error's path, serde_json's line and
//! column).
//!
//! Owns: [`Fail`], [`Context`] (adding path segments) and the rendering.
//! Does not: decide which error a body gets (the cursor and the visitors do),
//! or allocate on the happy path (a `Fail` is built only when one is raised).

use super::{ErrorClass, ParseError};

/// One segment of an error's field path (serde_path_to_error style).
#[derive(Debug)]
pub(crate) enum Seg {
    Key(String),
    Index(usize),
    /// A key not read yet (`?`).
    Unknown,
}

/// An error on its way up; boxed so `PResult<T>` stays small on the hot path.
#[derive(Debug)]
pub(crate) struct Fail {
    pub class: ErrorClass,
    pub offset: usize,
    pub message: String,
    /// Innermost segment first (pushed while unwinding).
    pub segs: Vec<Seg>,
    /// A shape error inside the flattened prompt group: reported without a
    /// path (and, once deferred, at the end of the top-level object), as
    /// the reference does.
    pub flattened: bool,
}

pub(crate) type PResult<T> = Result<T, Box<Fail>>;

#[cold]
pub(crate) fn fail(class: ErrorClass, offset: usize, message: impl Into<String>) -> Box<Fail> {
    Box::new(Fail {
        class,
        offset,
        message: message.into(),
        segs: Vec::new(),
        flattened: false,
    })
}

/// Adds path context while an error unwinds out of a field's value.
pub(crate) trait Context<T> {
    fn key(self, key: &str) -> PResult<T>;
    fn index(self, i: usize) -> PResult<T>;
    fn flattened(self) -> PResult<T>;
}

impl<T> Context<T> for PResult<T> {
    #[inline]
    fn key(self, key: &str) -> PResult<T> {
        self.map_err(|mut e| {
            e.segs.push(Seg::Key(key.to_owned()));
            e
        })
    }
    #[inline]
    fn index(self, i: usize) -> PResult<T> {
        self.map_err(|mut e| {
            e.segs.push(Seg::Index(i));
            e
        })
    }
    #[inline]
    fn flattened(self) -> PResult<T> {
        self.map_err(|mut e| {
            if e.class == ErrorClass::Shape {
                e.flattened = true;
            }
            e
        })
    }
}

impl Fail {
    /// The public error: path rendered like serde_path_to_error, line and
    /// column computed like serde_json's `SliceRead::position_of_index`.
    #[cold]
    pub(crate) fn finish(self, body: &[u8]) -> ParseError {
        let path = if self.flattened && self.class == ErrorClass::Shape {
            String::new()
        } else {
            render_path(&self.segs)
        };
        let offset = self.offset;
        let offset = offset.min(body.len());
        let (line, column) = line_column(body, offset);
        ParseError {
            class: self.class,
            offset,
            line,
            column,
            path,
            message: self.message,
        }
    }
}

fn render_path(segs: &[Seg]) -> String {
    let mut out = String::new();
    // serde_path_to_error prints no path that is only unknown segments.
    if segs.iter().all(|s| matches!(s, Seg::Unknown)) {
        return out;
    }
    for (n, seg) in segs.iter().rev().enumerate() {
        match seg {
            Seg::Key(k) => {
                if n > 0 {
                    out.push('.');
                }
                out.push_str(k);
            }
            Seg::Index(i) => {
                out.push('[');
                out.push_str(&i.to_string());
                out.push(']');
            }
            Seg::Unknown => {
                if n > 0 {
                    out.push('.');
                }
                out.push('?');
            }
        }
    }
    out
}

/// serde_json's position: line = 1 + newlines before the line start, column =
/// bytes between the line start and `offset`.
pub(crate) fn line_column(body: &[u8], offset: usize) -> (usize, usize) {
    let head = &body[..offset];
    let start = head.iter().rposition(|&b| b == b'\n').map_or(0, |p| p + 1);
    let line = 1 + head[..start].iter().filter(|&&b| b == b'\n').count();
    (line, offset - start)
}
