//! Python dicts -> the engine's typed request views, by typed extraction:
//! each known key is read and converted on its own, unknown keys are never
//! looked at, and no JSON text or generic value tree is built.
//!
//! The rules are the JSON visitor's (`kvselect::parse`): the same fields, the
//! same optional/required split, the same value checks (shared where they
//! are code, e.g. [`RouterConfigOverride::check`]). Messages follow the ones
//! Dynamo's embedded selector raises (`python/tests/REFERENCE_NOTES.md`),
//! except that a bad token names its index.
//!
//! Tokens are the one large input: a `list` is read item by item with no
//! Python call per item beyond reading the int; buffer-protocol objects
//! (`array('I')`, numpy `uint32`, `bytes`/`memoryview` of little-endian u32)
//! are copied into the pooled buffer in one block.

use kvselect::parse::{
    AffinityTarget, InputTrigger, KvTransferEnforcement, MmRoutingInfo, Parser, PinnedWorker,
    Prompt, PromptQueryRequest, ReservationRequest, RouterConfigOverride, RoutingConstraints,
    SelectKind, SelectRequest, SessionContext, Str, WorkerFields,
};
use kvselect::pool::Pooled;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use std::borrow::Cow;
use std::collections::BTreeMap;

type R<T> = PyResult<T>;

fn err(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// The request itself: a dict (any other type is refused as Dynamo does).
pub fn as_dict<'py>(v: &Bound<'py, PyAny>) -> R<Bound<'py, PyDict>> {
    v.cast::<PyDict>().cloned().map_err(|_| {
        err(format!(
            "unexpected type: '{}' object cannot be converted to 'Mapping'",
            type_name(v)
        ))
    })
}

/// `key`'s value, `None` when absent.
fn get<'py>(d: &Bound<'py, PyDict>, key: &str) -> R<Option<Bound<'py, PyAny>>> {
    d.get_item(key)
}

/// `key`'s value, `None` when absent or Python `None`.
fn get_some<'py>(d: &Bound<'py, PyDict>, key: &str) -> R<Option<Bound<'py, PyAny>>> {
    Ok(get(d, key)?.filter(|v| !v.is_none()))
}

/// A describing phrase of a value for "invalid type" messages (serde's words).
fn unexpected(v: &Bound<'_, PyAny>) -> String {
    if v.is_instance_of::<PyBool>() {
        format!("boolean `{}`", v.is_truthy().unwrap_or(false))
    } else if v.is_instance_of::<PyInt>() {
        format!("integer `{}`", v)
    } else if v.is_instance_of::<PyFloat>() {
        format!("floating point `{}`", v)
    } else if let Ok(s) = v.cast::<PyString>() {
        format!("string {:?}", s.to_string_lossy())
    } else if v.is_none() {
        "null".into()
    } else {
        format!("'{}' object", type_name(v))
    }
}

fn string_value(v: &Bound<'_, PyAny>) -> R<String> {
    match v.cast::<PyString>() {
        Ok(s) => Ok(s.to_str()?.to_string()),
        Err(_) => Err(err(format!(
            "unexpected type: '{}' object cannot be converted to 'PyString'",
            type_name(v)
        ))),
    }
}

/// A string field that, when present, must be a string (`None` refused).
fn strict_str(d: &Bound<'_, PyDict>, key: &str) -> R<Option<Str<'static>>> {
    get(d, key)?
        .map(|v| string_value(&v).map(Cow::Owned))
        .transpose()
}

/// An optional string field (`None` allowed).
fn opt_str(d: &Bound<'_, PyDict>, key: &str) -> R<Option<Str<'static>>> {
    get_some(d, key)?
        .map(|v| string_value(&v).map(Cow::Owned))
        .transpose()
}

fn opt_string(d: &Bound<'_, PyDict>, key: &str) -> R<Option<String>> {
    get_some(d, key)?.map(|v| string_value(&v)).transpose()
}

/// An unsigned integer no larger than `max` (`what` names the type).
fn uint_value(v: &Bound<'_, PyAny>, max: u64, what: &str) -> R<u64> {
    if v.is_instance_of::<PyBool>() || !v.is_instance_of::<PyInt>() {
        return Err(err(format!(
            "invalid type: {}, expected {what}",
            unexpected(v)
        )));
    }
    match v.extract::<u64>() {
        Ok(n) if n <= max => Ok(n),
        _ => Err(err(format!(
            "invalid value: integer `{v}`, expected {what}"
        ))),
    }
}

fn opt_u64(d: &Bound<'_, PyDict>, key: &str) -> R<Option<u64>> {
    get_some(d, key)?
        .map(|v| uint_value(&v, u64::MAX, "u64"))
        .transpose()
}

fn opt_u32(d: &Bound<'_, PyDict>, key: &str) -> R<Option<u32>> {
    get_some(d, key)?
        .map(|v| uint_value(&v, u32::MAX as u64, "u32").map(|n| n as u32))
        .transpose()
}

fn float_value(v: &Bound<'_, PyAny>, what: &str) -> R<f64> {
    if v.is_instance_of::<PyBool>()
        || !(v.is_instance_of::<PyFloat>() || v.is_instance_of::<PyInt>())
    {
        return Err(err(format!(
            "invalid type: {}, expected {what}",
            unexpected(v)
        )));
    }
    v.extract::<f64>()
}

fn opt_f64(d: &Bound<'_, PyDict>, key: &str) -> R<Option<f64>> {
    get_some(d, key)?
        .map(|v| float_value(&v, "f64"))
        .transpose()
}

fn opt_bool(d: &Bound<'_, PyDict>, key: &str) -> R<Option<bool>> {
    get_some(d, key)?
        .map(|v| {
            if v.is_instance_of::<PyBool>() {
                v.is_truthy()
            } else {
                Err(err(format!(
                    "invalid type: {}, expected a boolean",
                    unexpected(&v)
                )))
            }
        })
        .transpose()
}

fn opt_dict<'py>(d: &Bound<'py, PyDict>, key: &str) -> R<Option<Bound<'py, PyDict>>> {
    get_some(d, key)?.map(|v| as_dict(&v)).transpose()
}

/// Items of a list or tuple (any other type is refused as "expected a
/// sequence").
fn seq_items<'py>(v: &Bound<'py, PyAny>) -> R<Vec<Bound<'py, PyAny>>> {
    if let Ok(l) = v.cast::<PyList>() {
        return Ok(l.iter().collect());
    }
    if let Ok(t) = v.cast::<PyTuple>() {
        return Ok(t.iter().collect());
    }
    Err(err(format!(
        "invalid type: {}, expected a sequence",
        unexpected(v)
    )))
}

fn required<T>(v: Option<T>, name: &str) -> R<T> {
    v.ok_or_else(|| err(format!("missing field `{name}`")))
}

// ----- tokens and hashes -----

/// `token_ids` into a pooled buffer: a list or tuple of ints, or any
/// buffer-protocol object of u32 (`array('I')`, numpy `uint32`) or of bytes
/// read as little-endian u32.
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
        if let Err(i) = exact_int_list(list, &mut out) {
            // The slow path names what is wrong with item `i`.
            let item = list.get_item(i)?;
            return Err(match token(&item, name, i) {
                Err(e) => e,
                Ok(_) => err(format!("{name}[{i}]: invalid value, expected u32")),
            });
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
    if v.is_instance_of::<PyString>() {
        return Err(err(format!(
            "invalid type: {}, expected a sequence",
            unexpected(v)
        )));
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
        return Ok(out);
    }
    if let Ok(buf) = PyBuffer::<u8>::get(v) {
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
    let iter = v.try_iter().map_err(|_| {
        err(format!(
            "invalid type: {}, expected a sequence",
            unexpected(v)
        ))
    })?;
    for (i, item) in iter.enumerate() {
        let item = item?;
        if out.len() == parser.limits.max_tokens {
            return Err(too_many(out.len() + 1));
        }
        let n: i128 = item.extract().map_err(|_| {
            err(format!(
                "{name}[{i}]: invalid type: {}, expected u32",
                unexpected(&item)
            ))
        })?;
        out.push(u32::try_from(n).map_err(|_| {
            err(format!(
                "{name}[{i}]: invalid value: integer `{n}`, expected u32"
            ))
        })?);
    }
    Ok(out)
}

/// Appends every item of `list` when all are exact ints in u32 range, with no
/// Python call per item beyond reading the int; else the index of the first
/// item that is not (the caller reports it through [`token`]).
#[allow(unsafe_code)]
fn exact_int_list(list: &Bound<'_, PyList>, out: &mut Vec<u32>) -> Result<(), usize> {
    use pyo3::ffi;
    let n = list.len();
    out.reserve(n);
    let ptr = list.as_ptr();
    for i in 0..n {
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

/// One token of a list: an exact int in u32 range.
#[inline]
fn token(item: &Bound<'_, PyAny>, name: &str, i: usize) -> R<u32> {
    if let Ok(int) = item.cast_exact::<PyInt>() {
        if let Ok(n) = int.extract::<u32>() {
            return Ok(n);
        }
        return Err(err(format!(
            "{name}[{i}]: invalid value: integer `{int}`, expected u32"
        )));
    }
    if item.is_instance_of::<PyInt>() && !item.is_instance_of::<PyBool>() {
        if let Ok(n) = item.extract::<u32>() {
            return Ok(n);
        }
        return Err(err(format!(
            "{name}[{i}]: invalid value: integer `{item}`, expected u32"
        )));
    }
    Err(err(format!(
        "{name}[{i}]: invalid type: {}, expected u32",
        unexpected(item)
    )))
}

/// i64 hashes (as Dynamo sends them), kept as their u64 bit patterns.
fn hashes(parser: &Parser, v: &Bound<'_, PyAny>, name: &str) -> R<Pooled<u64>> {
    let mut out = parser.hashes.take();
    for (i, item) in seq_items(v)?.iter().enumerate() {
        if item.is_instance_of::<PyBool>() || !item.is_instance_of::<PyInt>() {
            return Err(err(format!(
                "{name}[{i}]: invalid type: {}, expected i64",
                unexpected(item)
            )));
        }
        let n: i64 = item.extract().map_err(|_| {
            err(format!(
                "{name}[{i}]: invalid value: integer `{item}`, expected i64"
            ))
        })?;
        out.push(n as u64);
    }
    Ok(out)
}

fn opt_hashes(parser: &Parser, d: &Bound<'_, PyDict>, key: &str) -> R<Option<Pooled<u64>>> {
    get_some(d, key)?
        .map(|v| hashes(parser, &v, key))
        .transpose()
}

fn opt_tokens(parser: &Parser, d: &Bound<'_, PyDict>, key: &str) -> R<Option<Pooled<u32>>> {
    get_some(d, key)?
        .map(|v| tokens(parser, &v, key))
        .transpose()
}

/// `block_mm_infos`: per block `None` or `{"mm_objects": [{"mm_hash", "offsets"}]}`.
fn block_mm_infos(d: &Bound<'_, PyDict>, key: &str) -> R<Option<Vec<Option<Vec<u64>>>>> {
    let Some(v) = get_some(d, key)? else {
        return Ok(None);
    };
    let mut out = Vec::new();
    for block in seq_items(&v)? {
        if block.is_none() {
            out.push(None);
            continue;
        }
        let b = as_dict(&block)?;
        let mut hashes = Vec::new();
        if let Some(objs) = get_some(&b, "mm_objects")? {
            for o in seq_items(&objs)? {
                let o = as_dict(&o)?;
                let h = required(get_some(&o, "mm_hash")?, "mm_hash")?;
                hashes.push(uint_value(&h, u64::MAX, "u64")?);
                if let Some(offsets) = get_some(&o, "offsets")? {
                    for pair in seq_items(&offsets)? {
                        let p = seq_items(&pair)?;
                        if p.len() != 2 {
                            return Err(err(format!(
                                "invalid length {}, expected a tuple of size 2",
                                p.len()
                            )));
                        }
                        for x in &p {
                            uint_value(x, u64::MAX, "usize")?;
                        }
                    }
                }
            }
        }
        out.push(Some(hashes));
    }
    Ok(Some(out))
}

fn prompt(parser: &Parser, d: &Bound<'_, PyDict>) -> R<Prompt<'static>> {
    let mm_routing_info = match opt_dict(d, "mm_routing_info")? {
        Some(m) => Some(MmRoutingInfo {
            routing_token_ids: opt_tokens(parser, &m, "routing_token_ids")?,
            block_mm_infos: block_mm_infos(&m, "block_mm_infos")?,
        }),
        None => None,
    };
    Ok(Prompt {
        token_ids: opt_tokens(parser, d, "token_ids")?,
        mm_routing_info,
        block_mm_infos: block_mm_infos(d, "block_mm_infos")?,
        block_hashes: opt_hashes(parser, d, "block_hashes")?,
        sequence_hashes: opt_hashes(parser, d, "sequence_hashes")?,
        isl_tokens: opt_u64(d, "isl_tokens")?,
        lora_name: opt_str(d, "lora_name")?,
        cache_salt: opt_str(d, "cache_salt")?,
        is_eagle: opt_bool(d, "is_eagle")?,
    })
}

fn router_config_override(d: &Bound<'_, PyDict>) -> R<Option<RouterConfigOverride>> {
    let Some(o) = opt_dict(d, "router_config_override")? else {
        return Ok(None);
    };
    let r = RouterConfigOverride {
        overlap_score_credit: opt_f64(&o, "overlap_score_credit")?,
        prefill_load_scale: opt_f64(&o, "prefill_load_scale")?,
        overlap_score_weight: opt_f64(&o, "overlap_score_weight")?,
        router_temperature: opt_f64(&o, "router_temperature")?,
        assume_kv_reuse: opt_bool(&o, "assume_kv_reuse")?,
        track_prefill_tokens: opt_bool(&o, "track_prefill_tokens")?,
        shared_cache_multiplier: opt_f64(&o, "shared_cache_multiplier")?,
    };
    r.check()
        .map_err(|m| err(format!("router_config_override: {m}")))?;
    Ok(Some(r))
}

fn session_context(d: &Bound<'_, PyDict>) -> R<Option<SessionContext<'static>>> {
    let Some(s) = opt_dict(d, "session_context")? else {
        return Ok(None);
    };
    let input_trigger = match opt_string(&s, "input_trigger")?.as_deref() {
        None => None,
        Some("user_message") => Some(InputTrigger::UserMessage),
        Some("tool_result") => Some(InputTrigger::ToolResult),
        Some("other") => Some(InputTrigger::Other),
        Some(v) => {
            return Err(err(format!(
                "session_context.input_trigger: unknown variant `{v}`, expected one of `user_message`, `tool_result`, `other`"
            )))
        }
    };
    Ok(Some(SessionContext {
        session_id: required(strict_str(&s, "session_id")?, "session_id")?,
        parent_session_id: opt_str(&s, "parent_session_id")?,
        session_final: opt_bool(&s, "session_final")?,
        input_trigger,
    }))
}

fn routing_constraints(d: &Bound<'_, PyDict>) -> R<Option<RoutingConstraints<'static>>> {
    let Some(c) = opt_dict(d, "routing_constraints")? else {
        return Ok(None);
    };
    let mut out = RoutingConstraints::default();
    if let Some(req) = get_some(&c, "required_taints")? {
        for t in seq_items(&req)? {
            out.required_taints.push(Cow::Owned(string_value(&t)?));
        }
    }
    if let Some(pref) = get_some(&c, "preferred_taints")? {
        // A map of taint -> weight, as in the JSON body.
        let pref = pref.cast::<PyDict>().map_err(|_| {
            err(format!(
                "routing_constraints.preferred_taints: invalid type: {}, expected a map",
                unexpected(&pref)
            ))
        })?;
        for (t, w) in pref.iter() {
            out.preferred_taints.push((
                Cow::Owned(string_value(&t)?),
                float_value(&w, "f32")? as f32,
            ));
        }
    }
    Ok(Some(out))
}

fn opt_u64_list(d: &Bound<'_, PyDict>, key: &str) -> R<Option<Vec<u64>>> {
    get_some(d, key)?
        .map(|v| {
            seq_items(&v)?
                .iter()
                .map(|x| uint_value(x, u64::MAX, "u64"))
                .collect()
        })
        .transpose()
}

pub fn select_request(
    parser: &Parser,
    v: &Bound<'_, PyAny>,
    kind: SelectKind,
) -> R<SelectRequest<'static>> {
    let d = as_dict(v)?;
    let pinned_worker = match opt_dict(&d, "pinned_worker")? {
        Some(p) => Some(PinnedWorker {
            worker_id: required(opt_u64(&p, "worker_id")?, "worker_id")?,
            dp_rank: required(opt_u32(&p, "dp_rank")?, "dp_rank")?,
        }),
        None => None,
    };
    let affinity_target = match opt_dict(&d, "affinity_target")? {
        Some(p) => Some(AffinityTarget {
            worker_id: required(opt_u64(&p, "worker_id")?, "worker_id")?,
            dp_rank: opt_u32(&p, "dp_rank")?,
        }),
        None => None,
    };
    Ok(SelectRequest {
        model_name: strict_str(&d, "model_name")?,
        routing_group: strict_str(&d, "routing_group")?,
        selection_id: opt_str(&d, "selection_id")?,
        session_id: opt_str(&d, "session_id")?,
        session_context: session_context(&d)?,
        router_config_override: router_config_override(&d)?,
        expected_output_tokens: opt_u32(&d, "expected_output_tokens")?,
        priority_jump: opt_f64(&d, "priority_jump")?,
        strict_priority: opt_u32(&d, "strict_priority")?,
        pinned_worker,
        affinity_target,
        allowed_worker_ids: opt_u64_list(&d, "allowed_worker_ids")?,
        routing_constraints: routing_constraints(&d)?,
        advisory: match kind {
            SelectKind::Select => opt_bool(&d, "advisory")?,
            SelectKind::SelectAndReserve => None,
        },
        prompt: prompt(parser, &d)?,
    })
}

pub fn reservation_request(
    parser: &Parser,
    v: &Bound<'_, PyAny>,
) -> R<ReservationRequest<'static>> {
    let d = as_dict(v)?;
    Ok(ReservationRequest {
        selection_id: required(strict_str(&d, "selection_id")?, "selection_id")?,
        model_name: strict_str(&d, "model_name")?,
        routing_group: strict_str(&d, "routing_group")?,
        worker_id: opt_u64(&d, "worker_id")?,
        dp_rank: opt_u32(&d, "dp_rank")?,
        router_config_override: router_config_override(&d)?,
        expected_output_tokens: opt_u32(&d, "expected_output_tokens")?,
        effective_prefill_tokens: opt_u64(&d, "effective_prefill_tokens")?,
        track_prefill_tokens: opt_bool(&d, "track_prefill_tokens")?,
        prompt: prompt(parser, &d)?,
    })
}

pub fn prompt_query_request(
    parser: &Parser,
    v: &Bound<'_, PyAny>,
) -> R<PromptQueryRequest<'static>> {
    let d = as_dict(v)?;
    Ok(PromptQueryRequest {
        model_name: strict_str(&d, "model_name")?,
        routing_group: strict_str(&d, "routing_group")?,
        router_config_override: router_config_override(&d)?,
        prompt: prompt(parser, &d)?,
    })
}

/// An integer read as Dynamo reads `worker_id` and rank keys: a non-int is
/// a `TypeError`'s text, a negative int an `OverflowError`'s, both raised
/// as `ValueError`.
fn python_uint(v: &Bound<'_, PyAny>, max: u64) -> R<u64> {
    if v.is_instance_of::<PyBool>() || !v.is_instance_of::<PyInt>() {
        return Err(err(format!(
            "TypeError: '{}' object cannot be interpreted as an integer",
            type_name(v)
        )));
    }
    if v.lt(0)? {
        return Err(err("OverflowError: can't convert negative int to unsigned"));
    }
    match v.extract::<u64>() {
        Ok(n) if n <= max => Ok(n),
        _ => Err(err("OverflowError: int too big to convert")),
    }
}

pub fn worker_fields(v: &Bound<'_, PyAny>) -> R<WorkerFields> {
    let d = as_dict(v)?;
    let worker_id = match get(&d, "worker_id")? {
        None => return Err(err("missing field `worker_id`")),
        Some(id) => python_uint(&id, u64::MAX)?,
    };
    let kv_events_endpoints = match opt_dict(&d, "kv_events_endpoints")? {
        Some(m) => {
            let mut out = BTreeMap::new();
            for (k, v) in m.iter() {
                out.insert(python_uint(&k, u32::MAX as u64)? as u32, string_value(&v)?);
            }
            Some(out)
        }
        None => None,
    };
    let taints = get_some(&d, "taints")?
        .map(|v| {
            seq_items(&v)?
                .iter()
                .map(string_value)
                .collect::<R<Vec<_>>>()
        })
        .transpose()?;
    let topology_domains = match opt_dict(&d, "topology_domains")? {
        Some(m) => {
            let mut out = BTreeMap::new();
            for (k, v) in m.iter() {
                out.insert(string_value(&k)?, string_value(&v)?);
            }
            Some(out)
        }
        None => None,
    };
    let kv_transfer_enforcement = match opt_string(&d, "kv_transfer_enforcement")?.as_deref() {
        None => None,
        Some("required") => Some(KvTransferEnforcement::Required),
        Some("preferred") => Some(KvTransferEnforcement::Preferred),
        Some(v) => {
            return Err(err(format!(
                "unknown variant `{v}`, expected `required` or `preferred`"
            )))
        }
    };
    Ok(WorkerFields {
        worker_id,
        model_name: strict_str(&d, "model_name")?.map(Cow::into_owned),
        routing_group: strict_str(&d, "routing_group")?.map(Cow::into_owned),
        endpoint: opt_string(&d, "endpoint")?,
        kv_events_endpoint: opt_string(&d, "kv_events_endpoint")?,
        kv_events_endpoints,
        replay_endpoint: opt_string(&d, "replay_endpoint")?,
        block_size: opt_u32(&d, "block_size")?,
        data_parallel_start_rank: opt_u32(&d, "data_parallel_start_rank")?,
        data_parallel_size: opt_u32(&d, "data_parallel_size")?,
        max_num_batched_tokens: opt_u64(&d, "max_num_batched_tokens")?,
        total_kv_blocks: opt_u64(&d, "total_kv_blocks")?,
        stable_routing_id: opt_string(&d, "stable_routing_id")?,
        is_eagle: opt_bool(&d, "is_eagle")?,
        taints,
        topology_domains,
        kv_transfer_domain: opt_string(&d, "kv_transfer_domain")?,
        kv_transfer_enforcement,
        kv_transfer_preferred_weight: opt_f64(&d, "kv_transfer_preferred_weight")?
            .map(|w| w as f32),
    })
}
