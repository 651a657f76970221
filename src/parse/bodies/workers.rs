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
                rank_map(cur)
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
            b"taints" => field!(14, "taints", w.taints, {
                let r: PResult<Option<Vec<String>>> = (|| {
                    if cur.null()? {
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
                    if cur.null()? {
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

/// `kv_events_endpoints`: keys are decimal ranks in quotes. A key that is not
/// a number is a *syntax* error, as in serde_json (`expected key to be a
/// number in quotes`); a number that is not a u32 is a shape error. Both
/// carry the `?` path segment serde_path_to_error gives an unparsed key.
fn rank_map(cur: &mut Cur<'_>) -> PResult<Option<BTreeMap<u32, String>>> {
    if cur.null()? {
        return Ok(None);
    }
    cur.object_start("a map")?;
    let mut m = BTreeMap::new();
    object(cur, |cur, k| {
        let rank = rank_key(cur, &k).key("?")?;
        let url = cur.str_val().key_with(|| k.text())?;
        m.insert(rank, url.into_owned());
        Ok(())
    })?;
    Ok(Some(m))
}

fn rank_key(cur: &Cur<'_>, k: &Key<'_>) -> PResult<u32> {
    // Offset of the key's first content byte (just after its opening quote).
    let start = k.end - 1 - k.bytes.len();
    let raw: &[u8] = match &k.bytes {
        Cow::Borrowed(b) if matches!(b.first(), Some(b'0'..=b'9' | b'-')) => b,
        _ => {
            return Err(fail(
                ErrorClass::Syntax,
                start,
                "invalid value: expected key to be a number in quotes",
            ))
        }
    };
    let mut sub = Cur::new(raw, 1);
    let shift = |mut e: Box<failure::Fail>| {
        e.offset += start;
        e
    };
    let n = sub.number().map_err(shift)?;
    if sub.i != raw.len() {
        return Err(fail(ErrorClass::Syntax, start + sub.i + 1, "expected `\"`"));
    }
    let end = k.end;
    match n {
        Num::U64(v) => u32::try_from(v)
            .map_err(|_| cur.shape(end, format!("invalid value: integer `{v}`, expected u32"))),
        n @ Num::I64(_) => Err(cur.shape(
            end,
            format!("invalid value: {}, expected u32", n.unexpected()),
        )),
        n @ Num::F64(_) => Err(cur.shape(
            end,
            format!("invalid type: {}, expected u32", n.unexpected()),
        )),
    }
}
