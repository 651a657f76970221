//! The worker bodies: `POST /workers` (upsert) and `PATCH /workers/{id}`,
//! with the per-rank endpoint maps.
//!
//! Owns: [`worker_fields`] and its rank maps. Does not: validate endpoints
//! (the catalog does) or touch the pools.

use super::*;

pub(super) fn worker_fields(cur: &mut Cur<'_>, upsert: bool) -> PResult<WorkerFields> {
    top_object(
        cur,
        if upsert {
            "WorkerRequest"
        } else {
            "WorkerPatchRequest"
        },
    )?;
    let mut w = WorkerFields::default();
    let mut wid = None;
    let mut set = 0u64;
    fields(cur, |cur, k| {
        macro_rules! field {
            ($bit:expr, $name:literal, $slot:expr, $e:expr) => {{
                seen(cur, &mut set, $bit, &k, $name)?;
                $slot = $e.key($name)?;
            }};
        }
        match &*k.bytes {
            b"worker_id" if upsert => field!(0, "worker_id", wid, cur.u64_val("u64").map(Some)),
            b"model_name" if upsert => field!(
                1,
                "model_name",
                w.model_name,
                present_str(cur).map(|v| v.map(Cow::into_owned))
            ),
            b"routing_group" if upsert => {
                field!(
                    2,
                    "routing_group",
                    w.routing_group,
                    present_str(cur).map(|v| v.map(Cow::into_owned))
                )
            }
            b"endpoint" => field!(3, "endpoint", w.endpoint, opt_string(cur)),
            b"kv_events_endpoint" => {
                field!(
                    4,
                    "kv_events_endpoint",
                    w.kv_events_endpoint,
                    opt_string(cur)
                )
            }
            b"kv_events_endpoints" => field!(
                5,
                "kv_events_endpoints",
                w.kv_events_endpoints,
                rank_map(cur, !upsert)
            ),
            b"replay_endpoint" => field!(6, "replay_endpoint", w.replay_endpoint, opt_string(cur)),
            b"block_size" => field!(7, "block_size", w.block_size, opt_u32(cur)),
            b"data_parallel_start_rank" => field!(
                8,
                "data_parallel_start_rank",
                w.data_parallel_start_rank,
                opt_u32(cur)
            ),
            b"data_parallel_size" => {
                field!(9, "data_parallel_size", w.data_parallel_size, opt_u32(cur))
            }
            b"max_num_batched_tokens" => field!(
                10,
                "max_num_batched_tokens",
                w.max_num_batched_tokens,
                opt_u64(cur, "u64")
            ),
            b"total_kv_blocks" => {
                field!(
                    11,
                    "total_kv_blocks",
                    w.total_kv_blocks,
                    opt_u64(cur, "u64")
                )
            }
            b"stable_routing_id" => {
                field!(
                    12,
                    "stable_routing_id",
                    w.stable_routing_id,
                    opt_string(cur)
                )
            }
            b"is_eagle" => field!(13, "is_eagle", w.is_eagle, opt_bool(cur)),
            // The upsert's taints, topology domains and endpoint map default
            // when absent but are not `Option`s in the reference: `null` is a
            // shape error there; a patch's `null` leaves the field as it is.
            b"taints" => field!(14, "taints", w.taints, {
                let r: PResult<Option<Vec<String>>> = (|| {
                    if !upsert && cur.null()? {
                        return Ok(None);
                    }
                    Ok(Some(
                        str_array(cur)?.into_iter().map(Cow::into_owned).collect(),
                    ))
                })();
                r
            }),
            b"topology_domains" => field!(15, "topology_domains", w.topology_domains, {
                let r: PResult<Option<BTreeMap<String, String>>> = (|| {
                    if !upsert && cur.null()? {
                        return Ok(None);
                    }
                    cur.object_start("a map")?;
                    let mut m = BTreeMap::new();
                    object(cur, |cur, k| {
                        let v = cur.str_val().key_with(|| k.text())?;
                        m.insert(k.text(), v.into_owned());
                        Ok(())
                    })?;
                    Ok(Some(m))
                })();
                r
            }),
            b"kv_transfer_domain" => {
                field!(
                    16,
                    "kv_transfer_domain",
                    w.kv_transfer_domain,
                    opt_string(cur)
                )
            }
            b"kv_transfer_enforcement" => {
                field!(17, "kv_transfer_enforcement", w.kv_transfer_enforcement, {
                    let r: PResult<Option<KvTransferEnforcement>> = (|| {
                        if cur.null()? {
                            return Ok(None);
                        }
                        Ok(Some(match enum_val(cur, &["required", "preferred"])? {
                            0 => KvTransferEnforcement::Required,
                            _ => KvTransferEnforcement::Preferred,
                        }))
                    })();
                    r
                })
            }
            b"kv_transfer_preferred_weight" => field!(
                18,
                "kv_transfer_preferred_weight",
                w.kv_transfer_preferred_weight,
                opt_f64(cur, "f32").map(|o| o.map(|v| v as f32))
            ),
            _ => skip_ignored(cur, &k)?,
        }
        Ok(())
    })?;
    if upsert {
        w.worker_id = wid.ok_or_else(|| missing(cur, "worker_id"))?;
    }
    Ok(w)
}

/// `kv_events_endpoints`: keys are decimal ranks in quotes, read as serde_json
/// reads a numeric map key: the number straight after the opening quote,
/// then its closing quote, then the colon. A key that does not start like a
/// number is a *syntax* error (`expected key to be a number in quotes`), as
/// is a number not closed by its quote; a number that is not a u32 is a
/// shape error, reported before the closing quote is looked at.
/// `null` is `None` when `null_ok` (a patch), else a shape error.
fn rank_map(cur: &mut Cur<'_>, null_ok: bool) -> PResult<Option<BTreeMap<u32, String>>> {
    if null_ok && cur.null()? {
        return Ok(None);
    }
    cur.object_start("a map")?;
    let mut m = BTreeMap::new();
    let mut first = true;
    while cur.map_key_start(first)? {
        first = false;
        let rank = rank_key(cur)?;
        cur.colon()?;
        let url = cur.str_val().key_with(|| rank.to_string())?;
        m.insert(rank, url.into_owned());
    }
    Ok(Some(m))
}

/// A rank key from its opening quote to just past its closing one. Error
/// paths end in the key as serde_path_to_error records it: the integer once
/// one was read (even when it is out of range or its quote is missing), `?`
/// before that or for a float.
fn rank_key(cur: &mut Cur<'_>) -> PResult<u32> {
    cur.i += 1;
    if !matches!(cur.peek(), Some(b'0'..=b'9' | b'-')) {
        return Err(fail(
            ErrorClass::Syntax,
            cur.i,
            "invalid value: expected key to be a number in quotes",
        ))
        .key("?");
    }
    let n = cur.number().key("?")?;
    let seg = match n {
        Num::U64(v) => v.to_string(),
        Num::I64(v) => v.to_string(),
        Num::F64(_) => "?".to_owned(),
    };
    let rank = cur.u32_of(n).key(&seg)?;
    if cur.peek() != Some(b'"') {
        return Err(cur.syntax_here("expected `\"`")).key(&seg);
    }
    cur.i += 1;
    Ok(rank)
}
