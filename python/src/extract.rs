//! Python dicts -> the engine's typed request views, by typed extraction:
//! each known key is read and converted on its own, unknown keys are never
//! looked at, and no JSON text or generic value tree is built.
//!
//! The fields and the optional/required split are the JSON visitor's
//! (`kvselect::parse`), with the value checks shared where they are code
//! (e.g. [`RouterConfigOverride::check`]). What a Python value is accepted as,
//! and the message when it is not, follow Dynamo 1.6.1's embedded selector
//! (`python/tests/REFERENCE_NOTES.md`, checked call by call against it by
//! `harness/interop/py_diff.py`). It reads a request in two ways:
//!
//! * **The prompt** (`token_ids`, `block_hashes`, `sequence_hashes`,
//!   `isl_tokens`, `lora_name`, `cache_salt`, `is_eagle`, `mm_routing_info`,
//!   `block_mm_infos`) through serde: a value of the wrong type is
//!   `invalid type: <serde's word for it>, expected <type>` ([`serde_type`]).
//!   kvselect adds the index of a bad token or hash.
//! * **Everything else** through Python's own conversions: integers by
//!   `__index__` (a `bool` or a numpy integer passes), floats by `__float__`,
//!   flags by truth value, strings, sequences and mappings by type; the
//!   message is Python's (`TypeError: ...`), in a `ValueError`. These are
//!   read in the dict's order, before the prompt, so the first bad one is the
//!   one reported. Their dicts must have string keys.
//!
//! In both, any `collections.abc.Mapping` reads as a dict ([`mapping`]) and
//! any other `Sequence` or set as a list ([`sequence_items`]), as they do in
//! the reference.
//!
//! Tokens are the one large input: a `list` is read item by item with no
//! Python call per item beyond reading the int; buffer-protocol objects of
//! u32 (`array('I')`, numpy `uint32`) and `bytes`/`bytearray`/`memoryview`
//! of little-endian u32 are copied into the pooled buffer in one block.

use kvselect::parse::{
    AffinityTarget, InputTrigger, KvTransferEnforcement, MmRoutingInfo, Parser, PinnedWorker,
    Prompt, PromptQueryRequest, ReservationRequest, RouterConfigOverride, RoutingConstraints,
    SelectKind, SelectRequest, SessionContext, Str, WorkerFields,
};
use kvselect::pool::Pooled;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyFrozenSet, PyInt, PyList, PyMapping,
    PyMemoryView, PySequence, PySet, PyString, PyTuple,
};
use std::borrow::Cow;
use std::collections::BTreeMap;

type R<T> = PyResult<T>;

fn err(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

pub(crate) fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

// ----- Python's conversions (everything but the prompt) -----

/// A Python conversion error as Dynamo reports it: `TypeError: ...` in a
/// `ValueError`.
fn wrapped(e: PyErr) -> PyErr {
    err(e.to_string())
}

/// An integer by `__index__`, as Python converts it to a C `unsigned long
/// long` (`OverflowError` below 0 or past u64).
fn index_u64(v: &Bound<'_, PyAny>) -> R<u64> {
    v.extract::<u64>().map_err(wrapped)
}

/// An integer by `__index__`, as Python converts it to a C `long` and then
/// to u32.
fn index_u32(v: &Bound<'_, PyAny>) -> R<u32> {
    v.extract::<u32>().map_err(wrapped)
}

/// A float by `__float__` (ints and bools pass).
fn real(v: &Bound<'_, PyAny>) -> R<f64> {
    v.extract::<f64>().map_err(wrapped)
}

/// Is `v` a mapping: a dict, or any `collections.abc.Mapping`?
fn is_mapping(v: &Bound<'_, PyAny>) -> bool {
    v.is_instance_of::<PyDict>() || (!builtin(v) && v.cast::<PyMapping>().is_ok())
}

/// Is `v` of a built-in type that is neither a `collections.abc` mapping
/// nor a sequence by registration alone (`None`, numbers, strings, bytes,
/// lists, tuples, dicts, sets)? These are told apart by a type check; the
/// ABCs' `isinstance` (hundreds of ns) is asked only about other types.
fn builtin(v: &Bound<'_, PyAny>) -> bool {
    v.is_none()
        || v.is_instance_of::<PyInt>()
        || v.is_instance_of::<PyFloat>()
        || v.is_instance_of::<PyString>()
        || v.is_instance_of::<PyBytes>()
        || v.is_instance_of::<PyByteArray>()
        || v.is_instance_of::<PyList>()
        || v.is_instance_of::<PyTuple>()
        || v.is_instance_of::<PyDict>()
        || v.is_instance_of::<PySet>()
        || v.is_instance_of::<PyFrozenSet>()
}

/// A mapping's entries as a dict: a dict itself, or another
/// `collections.abc.Mapping` read as Dynamo reads one (its `keys()` and
/// `values()` lists, `len()` entries; what they raise is the error, as
/// `Type: message`). `None` when `v` is no mapping.
fn mapping<'py>(v: &Bound<'py, PyAny>) -> R<Option<Bound<'py, PyDict>>> {
    if let Ok(d) = v.cast::<PyDict>() {
        return Ok(Some(d.clone()));
    }
    if builtin(v) {
        return Ok(None);
    }
    let Ok(m) = v.cast::<PyMapping>() else {
        return Ok(None);
    };
    let entries = || -> R<Bound<'py, PyDict>> {
        let (keys, values) = (m.keys()?, m.values()?);
        let d = PyDict::new(v.py());
        for i in 0..m.len()? {
            d.set_item(keys.get_item(i)?, values.get_item(i)?)?;
        }
        Ok(d)
    };
    entries().map(Some).map_err(wrapped)
}

/// The request itself, or a nested object: a mapping (any other type is
/// refused as Dynamo does).
fn as_dict<'py>(v: &Bound<'py, PyAny>) -> R<Bound<'py, PyDict>> {
    mapping(v)?.ok_or_else(|| {
        err(format!(
            "unexpected type: '{}' object cannot be converted to 'Mapping'",
            type_name(v)
        ))
    })
}

/// A dict whose fields are read by name: every key a string.
fn named_fields<'py>(v: &Bound<'py, PyAny>) -> R<Bound<'py, PyDict>> {
    let d = as_dict(v)?;
    for k in d.keys() {
        if !k.is_instance_of::<PyString>() {
            return Err(err("dict keys must have type str"));
        }
    }
    Ok(d)
}

/// A string, by type.
fn string_value(v: &Bound<'_, PyAny>) -> R<String> {
    match v.cast::<PyString>() {
        Ok(s) => Ok(s.to_str()?.to_string()),
        Err(_) => Err(err(format!(
            "unexpected type: '{}' object cannot be converted to 'PyString'",
            type_name(v)
        ))),
    }
}

fn str_value(v: &Bound<'_, PyAny>) -> R<Str<'static>> {
    string_value(v).map(Cow::Owned)
}

/// `None` as absent, anything else converted.
pub(crate) fn some<T>(
    v: &Bound<'_, PyAny>,
    f: impl FnOnce(&Bound<'_, PyAny>) -> R<T>,
) -> R<Option<T>> {
    if v.is_none() {
        Ok(None)
    } else {
        f(v).map(Some)
    }
}

/// Items of any sequence (a `str` is one: its characters), by `len()` and
/// index as the reference reads them: an object that is both a mapping and
/// a registered `Sequence` gives its items, not its keys.
fn sequence<'py>(v: &Bound<'py, PyAny>) -> R<Vec<Bound<'py, PyAny>>> {
    if let Ok(l) = v.cast::<PyList>() {
        return Ok(l.iter().collect());
    }
    let s = v.cast::<PySequence>().map_err(|_| {
        err(format!(
            "unexpected type: '{}' object cannot be converted to 'Sequence'",
            type_name(v)
        ))
    })?;
    (0..s.len()?).map(|i| s.get_item(i)).collect()
}

fn required<T>(v: Option<T>, name: &str) -> R<T> {
    v.ok_or_else(|| err(format!("missing field `{name}`")))
}

/// An externally tagged enum of unit variants, as serde reads one from
/// Python: a variant name, or a dict of one key naming it.
fn unit_variant<T>(
    v: &Bound<'_, PyAny>,
    variant: impl Fn(&str) -> Option<T>,
    expected: &str,
) -> R<T> {
    let name = if let Some(d) = mapping(v)? {
        if d.len() != 1 {
            return Err(err("expected tagged enum dict to have exactly 1 key"));
        }
        let key = d.keys().get_item(0)?;
        key.cast::<PyString>()
            .map_err(|_| err("dict keys must have type str"))?
            .to_str()?
            .to_string()
    } else {
        v.cast::<PyString>()
            .map_err(|_| err("expected either a str or dict for enum"))?
            .to_str()?
            .to_string()
    };
    variant(&name).ok_or_else(|| err(format!("unknown variant `{name}`, expected {expected}")))
}

// ----- plain arguments -----

/// `r` with a `TypeError` that names argument `name`, in the words of
/// Dynamo's binding (an older pyo3): `argument 'name': ...`. Other errors
/// (`OverflowError`, `ValueError`) are left as they are, as there.
pub fn named<T>(name: &str, r: R<T>) -> R<T> {
    r.map_err(|e| {
        Python::attach(|py| {
            if e.is_instance_of::<PyTypeError>(py) {
                PyTypeError::new_err(format!("argument '{name}': {}", e.value(py)))
            } else {
                e
            }
        })
    })
}

/// A string argument `name`.
pub fn str_arg<'a>(v: &'a Bound<'_, PyAny>, name: &str) -> R<&'a str> {
    match v.cast::<PyString>() {
        Ok(s) => s.to_str(),
        Err(_) => Err(PyTypeError::new_err(format!(
            "argument '{name}': '{}' object cannot be converted to 'PyString'",
            type_name(v)
        ))),
    }
}

/// An argument `name` that is a sequence of strings (a `str` is refused,
/// not read as its characters).
pub fn strings_arg(v: &Bound<'_, PyAny>, name: &str) -> R<Vec<String>> {
    if v.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(format!(
            "argument '{name}': Can't extract `str` to `Vec`"
        )));
    }
    let seq = v.cast::<PySequence>().map_err(|_| {
        PyTypeError::new_err(format!(
            "argument '{name}': '{}' object cannot be converted to 'Sequence'",
            type_name(v)
        ))
    })?;
    let mut out = Vec::new();
    for x in seq.try_iter()? {
        let x = x?;
        out.push(str_arg(&x, name)?.to_string());
    }
    Ok(out)
}

/// A `selection_id` argument, with the `TypeError` Dynamo's binding raises.
pub fn selection_id_arg(v: &Bound<'_, PyAny>) -> R<String> {
    str_arg(v, "selection_id").map(str::to_string)
}

/// A `worker_id` argument: an integer by `__index__`; a `TypeError` names
/// the argument, as Dynamo's binding does.
pub fn worker_id_arg(v: &Bound<'_, PyAny>) -> R<u64> {
    named("worker_id", v.extract::<u64>())
}

// ----- serde's reading (the prompt) -----

/// serde's word for a Python value (`invalid type: <this>, expected ...`),
/// or the error the reading stops at before any type is expected: an int
/// beyond i64 and u64, and types serde has no word for.
fn serde_word(v: &Bound<'_, PyAny>) -> R<String> {
    if v.is_none() {
        return Ok("unit value".into());
    }
    if v.is_instance_of::<PyBool>() {
        return Ok(format!("boolean `{}`", v.is_truthy()?));
    }
    if v.is_instance_of::<PyInt>() {
        if let Ok(n) = v.extract::<i64>() {
            return Ok(format!("integer `{n}`"));
        }
        if let Ok(n) = v.extract::<u64>() {
            return Ok(format!("integer `{n}`"));
        }
        let wide = if v.lt(0)? { "i128" } else { "u128" };
        return Err(err(format!(
            "invalid type: integer `{v}` as {wide}, expected any value"
        )));
    }
    if v.is_instance_of::<PyFloat>() {
        let f: f64 = v.extract()?;
        let mut s = f.to_string();
        if f.is_finite() && !s.contains(['.', 'e']) {
            s.push_str(".0");
        }
        return Ok(format!("floating point `{s}`"));
    }
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(format!("string {:?}", s.to_str()?));
    }
    if v.is_instance_of::<PyBytes>() {
        return Ok("byte array".into());
    }
    if v.is_instance_of::<PyByteArray>() {
        return Err(err(format!(
            "unexpected type: '{}' object cannot be converted to 'PyBytes'",
            type_name(v)
        )));
    }
    if is_sequence(v) || v.is_instance_of::<PySet>() || v.is_instance_of::<PyFrozenSet>() {
        return Ok("sequence".into());
    }
    if is_mapping(v) {
        return Ok("map".into());
    }
    Err(err(format!("unsupported type {}", type_name(v))))
}

/// serde's error for a value of the wrong type.
fn serde_type(v: &Bound<'_, PyAny>, expected: &str) -> PyErr {
    match serde_word(v) {
        Ok(word) => err(format!("invalid type: {word}, expected {expected}")),
        Err(e) => e,
    }
}

/// An unsigned integer no larger than `max`, as serde reads one (`what`
/// names the type: u32, u64, usize).
fn serde_uint(v: &Bound<'_, PyAny>, max: u64, what: &str) -> R<u64> {
    if v.is_instance_of::<PyBool>() || !v.is_instance_of::<PyInt>() {
        return Err(serde_type(v, what));
    }
    match v.extract::<u64>() {
        Ok(n) if n <= max => Ok(n),
        // The word only on the error path (it is a formatted string).
        _ => {
            let word = serde_word(v)?;
            Err(err(format!("invalid value: {word}, expected {what}")))
        }
    }
}

/// Is `v` read as a sequence: a list, a tuple, or another
/// `collections.abc.Sequence` but a string or bytes (`range`, `deque`,
/// `array`, user sequences)?
fn is_sequence(v: &Bound<'_, PyAny>) -> bool {
    v.is_instance_of::<PyList>()
        || v.is_instance_of::<PyTuple>()
        || (!builtin(v) && v.cast::<PySequence>().is_ok())
}

/// A sequence's items, as serde reads them (`None` when `v` is none): a
/// list or tuple directly, a set in its iteration order, another sequence
/// by `len()` and index (what those raise is the error, as `Type: message`).
fn sequence_items<'py>(v: &Bound<'py, PyAny>) -> R<Option<Vec<Bound<'py, PyAny>>>> {
    if let Ok(l) = v.cast::<PyList>() {
        return Ok(Some(l.iter().collect()));
    }
    if let Ok(t) = v.cast::<PyTuple>() {
        return Ok(Some(t.iter().collect()));
    }
    if v.is_instance_of::<PySet>() || v.is_instance_of::<PyFrozenSet>() {
        let items = || -> R<Vec<Bound<'py, PyAny>>> { v.try_iter()?.collect() };
        return items().map(Some).map_err(wrapped);
    }
    if !is_sequence(v) {
        return Ok(None);
    }
    let s = v.cast::<PySequence>()?;
    let items = || -> R<Vec<Bound<'py, PyAny>>> { (0..s.len()?).map(|i| s.get_item(i)).collect() };
    items().map(Some).map_err(wrapped)
}

/// A sequence, as serde reads one (`expected a sequence` otherwise).
fn serde_seq<'py>(v: &Bound<'py, PyAny>) -> R<Vec<Bound<'py, PyAny>>> {
    sequence_items(v)?.ok_or_else(|| serde_type(v, "a sequence"))
}

/// A struct's fields as serde reads them: from a mapping by name, or from
/// a sequence in order.
enum StructForm<'py> {
    Map(Bound<'py, PyDict>),
    Seq(Vec<Bound<'py, PyAny>>),
}

struct SerdeStruct<'py> {
    form: StructForm<'py>,
    name: &'static str,
    fields: &'static [&'static str],
}

fn serde_struct<'py>(
    v: &Bound<'py, PyAny>,
    name: &'static str,
    fields: &'static [&'static str],
) -> R<SerdeStruct<'py>> {
    let form = if let Some(d) = mapping(v)? {
        StructForm::Map(d)
    } else if let Some(items) = sequence_items(v)? {
        StructForm::Seq(items)
    } else {
        return Err(serde_type(v, &format!("struct {name}")));
    };
    Ok(SerdeStruct { form, name, fields })
}

impl<'py> SerdeStruct<'py> {
    /// Reads the fields in serde's order, `read(field index, value)` for
    /// each one present. From a mapping: its entries in order; a key names
    /// a field (a string or bytes), or gives its index (an int >= 0), or is
    /// skipped (another name or index); a key of any other type is refused,
    /// and so is a field given twice. From a sequence: the elements in order;
    /// one too short fails where the missing element is due, one too long
    /// after the last field. Missing fields are the caller's to name.
    fn read(&self, mut read: impl FnMut(usize, &Bound<'py, PyAny>) -> R<()>) -> R<()> {
        match &self.form {
            StructForm::Map(d) => {
                let mut seen = 0u64;
                for (k, v) in d.iter() {
                    let Some(i) = self.field_of(&k)? else {
                        continue;
                    };
                    if seen & (1 << i) != 0 {
                        return Err(err(format!("duplicate field `{}`", self.fields[i])));
                    }
                    seen |= 1 << i;
                    read(i, &v)?;
                }
                Ok(())
            }
            StructForm::Seq(items) => {
                let n = self.fields.len();
                for i in 0..n {
                    let Some(v) = items.get(i) else {
                        let s = if n == 1 { "" } else { "s" };
                        return Err(err(format!(
                            "invalid length {}, expected struct {} with {n} element{s}",
                            items.len(),
                            self.name,
                        )));
                    };
                    read(i, v)?;
                }
                if items.len() > n {
                    return Err(too_long(items.len(), n));
                }
                Ok(())
            }
        }
    }

    /// The field a mapping's key stands for, as serde's field identifier
    /// reads it.
    fn field_of(&self, k: &Bound<'py, PyAny>) -> R<Option<usize>> {
        let by_name = |name: &[u8]| self.fields.iter().position(|f| f.as_bytes() == name);
        if let Ok(s) = k.cast::<PyString>() {
            return Ok(by_name(s.to_str()?.as_bytes()));
        }
        if let Ok(b) = k.cast::<PyBytes>() {
            return Ok(by_name(b.as_bytes()));
        }
        if k.is_instance_of::<PyInt>() && !k.is_instance_of::<PyBool>() {
            if let Ok(i) = k.extract::<u64>() {
                return Ok(usize::try_from(i).ok().filter(|&i| i < self.fields.len()));
            }
        }
        Err(serde_type(k, "field identifier"))
    }
}

/// serde's error for a sequence with elements left after the `read` it wanted.
fn too_long(len: usize, read: usize) -> PyErr {
    let s = if read == 1 { "" } else { "s" };
    err(format!(
        "invalid length {len}, expected {read} element{s} in sequence"
    ))
}

// ----- tokens and hashes -----

/// `token_ids` into a pooled buffer: a list or tuple of ints, a
/// buffer-protocol object of u32 (`array('I')`, numpy `uint32`, in its
/// format's byte order), `bytes`/`bytearray`/`memoryview` read as
/// little-endian u32, or another iterable of ints (by value).
fn tokens(parser: &Parser, v: &Bound<'_, PyAny>, name: &str) -> R<Pooled<u32>> {
    let mut out = parser.tokens.take();
    let too_many = |n: usize| {
        err(format!(
            "{name}: {n} tokens, more than the limit of {}",
            parser.limits.max_tokens
        ))
    };
    if let Ok(list) = v.cast::<PyList>() {
        if list.len() > parser.limits.max_tokens {
            return Err(too_many(list.len()));
        }
        let mut from = 0;
        while let Err(i) = exact_int_list(list, from, &mut out) {
            // Item `i` is not an exact int in range: an int subclass (an
            // `IntEnum`, ...) is read as serde reads it, anything else is
            // named by the error; then the fast path goes on after it.
            out.push(token(&list.get_item(i)?, name, i)?);
            from = i + 1;
        }
        return Ok(out);
    }
    if let Ok(t) = v.cast::<PyTuple>() {
        if t.len() > parser.limits.max_tokens {
            return Err(too_many(t.len()));
        }
        for (i, item) in t.iter().enumerate() {
            out.push(token(&item, name, i)?);
        }
        return Ok(out);
    }
    // Types serde reads as something else than a sequence (a mapping that
    // is also a `Sequence` reads as one).
    if v.is_instance_of::<PyString>()
        || (is_mapping(v) && !is_sequence(v))
        || v.is_instance_of::<PyInt>()
        || v.is_instance_of::<PyFloat>()
    {
        return Err(serde_type(v, "a sequence"));
    }
    let py = v.py();
    if let Ok(buf) = PyBuffer::<u32>::get(v) {
        if buf.dimensions() > 1 {
            return Err(err(format!("{name}: a one-dimensional array is expected")));
        }
        let n = buf.item_count();
        if n > parser.limits.max_tokens {
            return Err(too_many(n));
        }
        out.resize(n, 0);
        buf.copy_to_slice(py, &mut out)?;
        // A byte order given in the format (numpy's `>u4`, struct's `!I`)
        // that is not this machine's: the values, not the bytes.
        let foreign = match buf.format().to_bytes().first() {
            Some(b'>' | b'!') => cfg!(target_endian = "little"),
            Some(b'<') => cfg!(target_endian = "big"),
            _ => false,
        };
        if foreign {
            out.iter_mut().for_each(|t| *t = t.swap_bytes());
        }
        return Ok(out);
    }
    // Raw little-endian u32 bytes only from the byte types themselves; an
    // `array('B')` or a numpy `uint8` array holds one token per item, read
    // by value below.
    let raw_bytes = v.is_instance_of::<PyBytes>()
        || v.is_instance_of::<PyByteArray>()
        || v.is_instance_of::<PyMemoryView>();
    if let Some(buf) = raw_bytes.then(|| PyBuffer::<u8>::get(v).ok()).flatten() {
        let n = buf.item_count();
        if n % 4 != 0 {
            return Err(err(format!(
                "{name}: {n} bytes is not a whole number of little-endian u32 tokens"
            )));
        }
        if n / 4 > parser.limits.max_tokens {
            return Err(too_many(n / 4));
        }
        let mut bytes = vec![0u8; n];
        buf.copy_to_slice(py, &mut bytes)?;
        out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
        return Ok(out);
    }
    // Any other iterable of ints (numpy arrays of other dtypes, ranges).
    let mut push = |i: usize, item: &Bound<'_, PyAny>| -> R<()> {
        if out.len() == parser.limits.max_tokens {
            return Err(too_many(out.len() + 1));
        }
        let n: i128 = item.extract().map_err(|_| {
            err(format!(
                "{name}[{i}]: invalid type: '{}' object, expected u32",
                type_name(item)
            ))
        })?;
        out.push(u32::try_from(n).map_err(|_| {
            err(format!(
                "{name}[{i}]: invalid value: integer `{n}`, expected u32"
            ))
        })?);
        Ok(())
    };
    if is_mapping(v) {
        // Also a `Sequence` (checked above): its items by index, not its keys.
        for (i, item) in sequence_items(v)?.unwrap_or_default().iter().enumerate() {
            push(i, item)?;
        }
    } else {
        let iter = v.try_iter().map_err(|_| serde_type(v, "a sequence"))?;
        for (i, item) in iter.enumerate() {
            push(i, &item?)?;
        }
    }
    Ok(out)
}

/// Appends the items of `list` from index `from` on while they are exact
/// ints in u32 range, with no Python call per item beyond reading the int;
/// `Err` with the index of the first that is not (the caller reads that one
/// through [`token`]).
#[allow(unsafe_code)]
fn exact_int_list(list: &Bound<'_, PyList>, from: usize, out: &mut Vec<u32>) -> Result<(), usize> {
    use pyo3::ffi;
    let n = list.len();
    out.reserve(n.saturating_sub(from));
    let ptr = list.as_ptr();
    for i in from..n {
        // SAFETY: `ptr` is a live list (we hold a reference and the GIL, so
        // it is not resized under us) and `i < n == len(list)`: the item is a
        // valid borrowed pointer. `PyLong_CheckExact` only reads its type.
        // `PyLong_AsLongLongAndOverflow` on an exact int cannot fail (it
        // reports overflow through the flag, not an exception).
        let v = unsafe {
            let item = ffi::PyList_GET_ITEM(ptr, i as ffi::Py_ssize_t);
            if ffi::PyLong_CheckExact(item) == 0 {
                return Err(i);
            }
            let mut overflow = 0;
            let v = ffi::PyLong_AsLongLongAndOverflow(item, &mut overflow);
            if overflow != 0 {
                return Err(i);
            }
            v
        };
        match u32::try_from(v) {
            Ok(t) => out.push(t),
            Err(_) => return Err(i),
        }
    }
    Ok(())
}

/// One token of a list or tuple: an int in u32 range, as serde reads it,
/// with its index named.
#[inline]
fn token(item: &Bound<'_, PyAny>, name: &str, i: usize) -> R<u32> {
    if let Ok(int) = item.cast_exact::<PyInt>() {
        if let Ok(n) = int.extract::<u32>() {
            return Ok(n);
        }
    }
    serde_uint(item, u32::MAX as u64, "u32")
        .map(|n| n as u32)
        .map_err(|e| indexed(e, name, i))
}

/// `e`'s message under `name[i]: `.
fn indexed(e: PyErr, name: &str, i: usize) -> PyErr {
    Python::attach(|py| err(format!("{name}[{i}]: {}", e.value(py))))
}

/// i64 hashes (as Dynamo sends them), kept as their u64 bit patterns.
fn hashes(parser: &Parser, v: &Bound<'_, PyAny>, name: &str) -> R<Pooled<u64>> {
    let mut out = parser.hashes.take();
    for (i, item) in serde_seq(v)?.iter().enumerate() {
        let n = if item.is_instance_of::<PyBool>() || !item.is_instance_of::<PyInt>() {
            Err(serde_type(item, "i64"))
        } else {
            match item.extract::<i64>() {
                Ok(n) => Ok(n),
                Err(_) => {
                    // Beyond 64 bits, serde's own error, with no index.
                    let word = serde_word(item)?;
                    Err(err(format!("invalid value: {word}, expected i64")))
                }
            }
        };
        out.push(n.map_err(|e| indexed(e, name, i))? as u64);
    }
    Ok(out)
}

/// `block_mm_infos`: per block `None` or `{"mm_objects": [{"mm_hash", "offsets"}]}`.
fn block_mm_infos(v: &Bound<'_, PyAny>) -> R<Vec<Option<Vec<u64>>>> {
    let mut out = Vec::new();
    for block in serde_seq(v)? {
        if block.is_none() {
            out.push(None);
            continue;
        }
        let b = serde_struct(&block, "BlockExtraInfo", &["mm_objects"])?;
        let mut hashes = None;
        b.read(|_, objs| {
            hashes = Some(mm_objects(objs)?);
            Ok(())
        })?;
        out.push(Some(required(hashes, "mm_objects")?));
    }
    Ok(out)
}

/// A block's `mm_objects`: their `mm_hash`es, each object's `offsets`
/// checked as serde reads them.
fn mm_objects(v: &Bound<'_, PyAny>) -> R<Vec<u64>> {
    let mut hashes = Vec::new();
    for o in serde_seq(v)? {
        let o = serde_struct(&o, "BlockMmObjectInfo", &["mm_hash", "offsets"])?;
        let (mut hash, mut offsets) = (None, false);
        o.read(|i, x| {
            if i == 0 {
                hash = Some(serde_uint(x, u64::MAX, "u64")?);
            } else {
                mm_offsets(x)?;
                offsets = true;
            }
            Ok(())
        })?;
        let hash = required(hash, "mm_hash")?;
        required(offsets.then_some(()), "offsets")?;
        hashes.push(hash);
    }
    Ok(hashes)
}

/// An object's `offsets`: pairs of usize.
fn mm_offsets(v: &Bound<'_, PyAny>) -> R<()> {
    for pair in serde_seq(v)? {
        let Some(p) = sequence_items(&pair)? else {
            return Err(serde_type(&pair, "a tuple of size 2"));
        };
        // The first two are read, then the length is checked.
        for x in p.iter().take(2) {
            serde_uint(x, u64::MAX, "usize")?;
        }
        if p.len() < 2 {
            return Err(err(format!(
                "invalid length {}, expected a tuple of size 2",
                p.len()
            )));
        }
        if p.len() > 2 {
            return Err(too_long(p.len(), 2));
        }
    }
    Ok(())
}

/// A request dict's entries that no Python conversion read: the prompt and
/// unknown fields, in the dict's order.
type Rest<'py> = Vec<(Bound<'py, PyString>, Bound<'py, PyAny>)>;

/// The check serde makes while it buffers a value, before any type is
/// expected: every int within i64 or u64, every object of a type it has a
/// word for (`serde_word`), throughout lists, tuples and dicts.
fn buffered(v: &Bound<'_, PyAny>) -> R<()> {
    // Built-in containers and scalars first, without copies or words.
    if let Ok(l) = v.cast::<PyList>() {
        return l.iter().try_for_each(|x| buffered(&x));
    }
    if let Ok(t) = v.cast::<PyTuple>() {
        return t.iter().try_for_each(|x| buffered(&x));
    }
    if let Ok(d) = v.cast::<PyDict>() {
        return d.iter().try_for_each(|(k, x)| {
            buffered(&k)?;
            buffered(&x)
        });
    }
    if v.is_none()
        || v.is_instance_of::<PyFloat>()
        || v.is_instance_of::<PyString>()
        || v.is_instance_of::<PyBytes>()
        || (v.is_instance_of::<PyInt>()
            && (v.extract::<i64>().is_ok() || v.extract::<u64>().is_ok()))
    {
        return Ok(());
    }
    if let Some(items) = sequence_items(v)? {
        return items.iter().try_for_each(buffered);
    }
    if let Some(d) = mapping(v)? {
        return d.iter().try_for_each(|(k, x)| {
            buffered(&k)?;
            buffered(&x)
        });
    }
    serde_word(v).map(drop)
}

/// The prompt of a request dict (`rest`: the entries no Python conversion
/// read), as serde reads it.
fn prompt(parser: &Parser, rest: &Rest<'_>) -> R<Prompt<'static>> {
    let read = read_prompt(parser, rest);
    buffer(rest, read.is_err())?;
    read
}

/// serde buffers all of `rest`, unknown fields included, before it reads
/// anything: an int beyond 64 bits or a value of a type it has no word for,
/// anywhere in it, is the error ahead of any other. The pass is made always
/// for unknown fields and the multimodal structs (whose unknown keys the
/// typed reading skips), and for the token and hash lists only when `all`
/// (once something failed): a list that reads cleanly has no such value.
fn buffer(rest: &Rest<'_>, all: bool) -> R<()> {
    for (k, v) in rest {
        let key = k.to_str()?;
        if all && matches!(key, "token_ids" | "block_hashes" | "sequence_hashes") {
            // A bad token or hash names its index here too.
            if let Ok(items) = serde_seq(v) {
                for (i, x) in items.iter().enumerate() {
                    buffered(x).map_err(|e| indexed(e, key, i))?;
                }
            }
        } else if all || !PROMPT_FIELDS.contains(&key) || key == "block_mm_infos" {
            buffered(v)?;
        } else if key == "mm_routing_info" {
            match mapping(v)? {
                // All but its tokens, which the typed reading took in full.
                Some(d) => d.iter().try_for_each(|(k, x)| {
                    if k.is_instance_of::<PyString>() && k.eq("routing_token_ids")? {
                        return Ok(());
                    }
                    buffered(&k)?;
                    buffered(&x)
                })?,
                None => buffered(v)?,
            }
        }
    }
    Ok(())
}

const PROMPT_FIELDS: &[&str] = &[
    "token_ids",
    "block_hashes",
    "sequence_hashes",
    "isl_tokens",
    "lora_name",
    "cache_salt",
    "is_eagle",
    "block_mm_infos",
    "mm_routing_info",
];

fn read_prompt(parser: &Parser, rest: &Rest<'_>) -> R<Prompt<'static>> {
    let mut p = Prompt::default();
    let opt_string = |v: &Bound<'_, PyAny>| -> R<Option<Str<'static>>> {
        some(v, |v| {
            if let Ok(s) = v.cast::<PyString>() {
                return Ok(Cow::Owned(s.to_str()?.to_string()));
            }
            // serde takes bytes for a string when they are UTF-8.
            match v
                .cast::<PyBytes>()
                .map(|b| std::str::from_utf8(b.as_bytes()))
            {
                Ok(Ok(s)) => Ok(Cow::Owned(s.to_string())),
                Ok(Err(_)) => Err(err("invalid value: byte array, expected a string")),
                Err(_) => Err(serde_type(v, "a string")),
            }
        })
    };
    for (k, v) in rest {
        match k.to_str()? {
            "token_ids" => p.token_ids = some(v, |v| tokens(parser, v, "token_ids"))?,
            "block_hashes" => p.block_hashes = some(v, |v| hashes(parser, v, "block_hashes"))?,
            "sequence_hashes" => {
                p.sequence_hashes = some(v, |v| hashes(parser, v, "sequence_hashes"))?
            }
            "isl_tokens" => p.isl_tokens = some(v, |v| serde_uint(v, u64::MAX, "usize"))?,
            "lora_name" => p.lora_name = opt_string(v)?,
            "cache_salt" => p.cache_salt = opt_string(v)?,
            "is_eagle" => {
                p.is_eagle = some(v, |v| {
                    if v.is_instance_of::<PyBool>() {
                        v.is_truthy()
                    } else {
                        Err(serde_type(v, "a boolean"))
                    }
                })?
            }
            "block_mm_infos" => p.block_mm_infos = some(v, block_mm_infos)?,
            "mm_routing_info" => p.mm_routing_info = some(v, |v| mm_routing_info(parser, v))?,
            _ => {}
        }
    }
    Ok(p)
}

fn mm_routing_info(parser: &Parser, v: &Bound<'_, PyAny>) -> R<MmRoutingInfo> {
    let m = serde_struct(
        v,
        "MmRoutingInfoRequest",
        &["routing_token_ids", "block_mm_infos"],
    )?;
    // Absent `block_mm_infos` is none; `None` is refused (not an optional field).
    let (mut routing_token_ids, mut infos) = (None, None);
    m.read(|i, x| {
        if i == 0 {
            routing_token_ids = Some(tokens(parser, x, "routing_token_ids")?);
        } else {
            infos = Some(block_mm_infos(x)?);
        }
        Ok(())
    })?;
    required(routing_token_ids.as_ref(), "routing_token_ids")?;
    Ok(MmRoutingInfo {
        routing_token_ids,
        block_mm_infos: infos,
    })
}

// ----- the other fields -----

/// `{worker_id, dp_rank}` of `pinned_worker` (both required) or
/// `affinity_target` (`dp_rank` optional): converted in the dict's order,
/// then the missing ones named.
fn worker_rank(v: &Bound<'_, PyAny>, rank_required: bool) -> R<(u64, Option<u32>)> {
    let d = named_fields(v)?;
    let (mut worker_id, mut dp_rank) = (None, None);
    for (k, v) in d.iter() {
        match k.cast::<PyString>()?.to_str()? {
            "worker_id" => worker_id = Some(index_u64(&v)?),
            "dp_rank" if rank_required => dp_rank = Some(index_u32(&v)?),
            "dp_rank" => dp_rank = some(&v, index_u32)?,
            _ => {}
        }
    }
    let worker_id = required(worker_id, "worker_id")?;
    if rank_required {
        required(dp_rank, "dp_rank")?;
    }
    Ok((worker_id, dp_rank))
}

fn router_config_override(v: &Bound<'_, PyAny>) -> R<RouterConfigOverride> {
    let d = named_fields(v)?;
    let mut r = RouterConfigOverride::default();
    for (k, v) in d.iter() {
        let slot = match k.cast::<PyString>()?.to_str()? {
            "overlap_score_credit" => &mut r.overlap_score_credit,
            "prefill_load_scale" => &mut r.prefill_load_scale,
            "overlap_score_weight" => &mut r.overlap_score_weight,
            "router_temperature" => &mut r.router_temperature,
            "shared_cache_multiplier" => &mut r.shared_cache_multiplier,
            "assume_kv_reuse" => {
                r.assume_kv_reuse = some(&v, |v| v.is_truthy())?;
                continue;
            }
            "track_prefill_tokens" => {
                r.track_prefill_tokens = some(&v, |v| v.is_truthy())?;
                continue;
            }
            _ => continue,
        };
        *slot = some(&v, real)?;
    }
    r.check().map_err(err)?;
    Ok(r)
}

fn session_context(v: &Bound<'_, PyAny>) -> R<SessionContext<'static>> {
    let d = named_fields(v)?;
    let mut session_id = None;
    let mut c = SessionContext {
        session_id: Cow::Borrowed(""),
        parent_session_id: None,
        session_final: None,
        input_trigger: None,
    };
    for (k, v) in d.iter() {
        match k.cast::<PyString>()?.to_str()? {
            "session_id" => session_id = Some(str_value(&v)?),
            "parent_session_id" => c.parent_session_id = some(&v, str_value)?,
            "session_final" => c.session_final = some(&v, |v| v.is_truthy())?,
            "input_trigger" => {
                c.input_trigger = some(&v, |v| {
                    unit_variant(
                        v,
                        |n| match n {
                            "user_message" => Some(InputTrigger::UserMessage),
                            "tool_result" => Some(InputTrigger::ToolResult),
                            "other" => Some(InputTrigger::Other),
                            _ => None,
                        },
                        "one of `user_message`, `tool_result`, `other`",
                    )
                })?
            }
            _ => {}
        }
    }
    c.session_id = required(session_id, "session_id")?;
    Ok(c)
}

/// `routing_constraints`: present means a dict, and each of its lists present
/// means a sequence and a dict (`None` is refused, not absent).
fn routing_constraints(v: &Bound<'_, PyAny>) -> R<RoutingConstraints<'static>> {
    let d = named_fields(v)?;
    let mut out = RoutingConstraints::default();
    for (k, v) in d.iter() {
        match k.cast::<PyString>()?.to_str()? {
            "required_taints" => {
                out.required_taints = sequence(&v)?.iter().map(str_value).collect::<R<_>>()?
            }
            "preferred_taints" => {
                out.preferred_taints = as_dict(&v)?
                    .iter()
                    .map(|(t, w)| Ok((str_value(&t)?, real(&w)? as f32)))
                    .collect::<R<_>>()?
            }
            _ => {}
        }
    }
    Ok(out)
}

fn allowed_worker_ids(v: &Bound<'_, PyAny>) -> R<Vec<u64>> {
    sequence(v)?.iter().map(index_u64).collect()
}

/// A request dict read in its order: `read` converts each field it knows and
/// answers whether it did; the others are returned for the prompt.
fn request_fields<'py>(
    v: &Bound<'py, PyAny>,
    mut read: impl FnMut(&str, &Bound<'py, PyAny>) -> R<bool>,
) -> R<Rest<'py>> {
    let d = named_fields(v)?;
    let mut rest = Rest::new();
    for (k, v) in d.iter() {
        let k = k.cast_into::<PyString>()?;
        if !read(k.to_str()?, &v)? {
            rest.push((k, v));
        }
    }
    Ok(rest)
}

pub fn select_request(
    parser: &Parser,
    v: &Bound<'_, PyAny>,
    kind: SelectKind,
) -> R<SelectRequest<'static>> {
    let mut r = SelectRequest::default();
    let rest = request_fields(v, |k, v| {
        match k {
            "model_name" => r.model_name = Some(str_value(v)?),
            "routing_group" => r.routing_group = Some(str_value(v)?),
            "selection_id" => r.selection_id = some(v, str_value)?,
            "session_id" => r.session_id = some(v, str_value)?,
            "session_context" => r.session_context = some(v, session_context)?,
            "router_config_override" => r.router_config_override = some(v, router_config_override)?,
            "expected_output_tokens" => r.expected_output_tokens = some(v, index_u32)?,
            "priority_jump" => r.priority_jump = some(v, real)?,
            "strict_priority" => r.strict_priority = some(v, index_u32)?,
            "pinned_worker" => {
                r.pinned_worker = some(v, |v| {
                    let (worker_id, dp_rank) = worker_rank(v, true)?;
                    Ok(PinnedWorker {
                        worker_id,
                        dp_rank: dp_rank.unwrap_or(0),
                    })
                })?
            }
            "affinity_target" => {
                r.affinity_target = some(v, |v| {
                    let (worker_id, dp_rank) = worker_rank(v, false)?;
                    Ok(AffinityTarget { worker_id, dp_rank })
                })?
            }
            "allowed_worker_ids" => r.allowed_worker_ids = some(v, allowed_worker_ids)?,
            "routing_constraints" => r.routing_constraints = Some(routing_constraints(v)?),
            "advisory" if kind == SelectKind::Select => r.advisory = some(v, |v| v.is_truthy())?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    r.prompt = prompt(parser, &rest)?;
    Ok(r)
}

pub fn reservation_request(
    parser: &Parser,
    v: &Bound<'_, PyAny>,
) -> R<ReservationRequest<'static>> {
    let mut r = ReservationRequest::default();
    let mut selection_id = None;
    let rest = request_fields(v, |k, v| {
        match k {
            "selection_id" => selection_id = Some(str_value(v)?),
            "model_name" => r.model_name = Some(str_value(v)?),
            "routing_group" => r.routing_group = Some(str_value(v)?),
            "worker_id" => r.worker_id = some(v, index_u64)?,
            "dp_rank" => r.dp_rank = some(v, index_u32)?,
            "router_config_override" => r.router_config_override = some(v, router_config_override)?,
            "expected_output_tokens" => r.expected_output_tokens = some(v, index_u32)?,
            "effective_prefill_tokens" => r.effective_prefill_tokens = some(v, index_u64)?,
            "track_prefill_tokens" => r.track_prefill_tokens = some(v, |v| v.is_truthy())?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    // serde finds the id missing after buffering the rest, and before it
    // reads the prompt.
    if selection_id.is_none() {
        buffer(&rest, true)?;
    }
    r.selection_id = required(selection_id, "selection_id")?;
    r.prompt = prompt(parser, &rest)?;
    Ok(r)
}

pub fn prompt_query_request(
    parser: &Parser,
    v: &Bound<'_, PyAny>,
) -> R<PromptQueryRequest<'static>> {
    let mut r = PromptQueryRequest::default();
    let rest = request_fields(v, |k, v| {
        match k {
            "model_name" => r.model_name = Some(str_value(v)?),
            "routing_group" => r.routing_group = Some(str_value(v)?),
            "router_config_override" => r.router_config_override = some(v, router_config_override)?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    r.prompt = prompt(parser, &rest)?;
    Ok(r)
}

/// Which worker dict: an upsert reads `worker_id`, `model_name` and
/// `routing_group`; a patch leaves them alone, whatever their values.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum WorkerDict {
    Upsert,
    Patch,
}

pub fn worker_fields(v: &Bound<'_, PyAny>, form: WorkerDict) -> R<WorkerFields> {
    let d = named_fields(v)?;
    let mut w = WorkerFields::default();
    let mut worker_id = None;
    let opt_string = |v: &Bound<'_, PyAny>| some(v, string_value);
    for (k, v) in d.iter() {
        let key = k.cast::<PyString>()?.to_str()?;
        match (key, form) {
            ("worker_id" | "model_name" | "routing_group", WorkerDict::Patch) => {}
            ("worker_id", _) => worker_id = Some(index_u64(&v)?),
            ("model_name", _) => w.model_name = Some(string_value(&v)?),
            ("routing_group", _) => w.routing_group = Some(string_value(&v)?),
            ("endpoint", _) => w.endpoint = opt_string(&v)?,
            ("kv_events_endpoint", _) => w.kv_events_endpoint = opt_string(&v)?,
            ("replay_endpoint", _) => w.replay_endpoint = opt_string(&v)?,
            ("stable_routing_id", _) => w.stable_routing_id = opt_string(&v)?,
            ("kv_transfer_domain", _) => w.kv_transfer_domain = opt_string(&v)?,
            ("kv_events_endpoints", _) => {
                w.kv_events_endpoints = some(&v, |m| {
                    as_dict(m)?
                        .iter()
                        .map(|(k, v)| Ok((index_u32(&k)?, string_value(&v)?)))
                        .collect::<R<BTreeMap<_, _>>>()
                })?
            }
            ("block_size", _) => w.block_size = some(&v, index_u32)?,
            ("data_parallel_start_rank", _) => w.data_parallel_start_rank = some(&v, index_u32)?,
            ("data_parallel_size", _) => w.data_parallel_size = some(&v, index_u32)?,
            ("max_num_batched_tokens", _) => w.max_num_batched_tokens = some(&v, index_u64)?,
            ("total_kv_blocks", _) => w.total_kv_blocks = some(&v, index_u64)?,
            ("is_eagle", _) => w.is_eagle = some(&v, |v| v.is_truthy())?,
            // `None` is refused by an upsert and left alone by a patch.
            ("taints", WorkerDict::Patch) if v.is_none() => {}
            ("taints", _) => {
                w.taints = Some(sequence(&v)?.iter().map(string_value).collect::<R<_>>()?)
            }
            ("topology_domains", _) => {
                w.topology_domains = some(&v, |m| {
                    as_dict(m)?
                        .iter()
                        .map(|(k, v)| Ok((string_value(&k)?, string_value(&v)?)))
                        .collect::<R<BTreeMap<_, _>>>()
                })?
            }
            ("kv_transfer_enforcement", _) => {
                w.kv_transfer_enforcement = some(&v, |v| {
                    unit_variant(
                        v,
                        |n| match n {
                            "required" => Some(KvTransferEnforcement::Required),
                            "preferred" => Some(KvTransferEnforcement::Preferred),
                            _ => None,
                        },
                        "`required` or `preferred`",
                    )
                })?
            }
            ("kv_transfer_preferred_weight", _) => {
                w.kv_transfer_preferred_weight = some(&v, real)?.map(|x| x as f32)
            }
            _ => {}
        }
    }
    if form == WorkerDict::Upsert {
        w.worker_id = required(worker_id, "worker_id")?;
    }
    Ok(w)
}
