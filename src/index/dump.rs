//! The GET /dump JSON shape (selection-api.md §4.15) and loading a peer's dump
//! into an [`Index`] (`--indexer-peers` recovery).
//!
//! This is the startup/ops path, so it uses plain serde_json. One dump event is
//! one stored chain: `parent_hash` and every `block_hash` are engine hashes,
//! `tokens_hash` is the local block hash; all print as u64 (signed values are
//! accepted on input and read as two's complement). Unknown `storage_tier`
//! names and events other than `stored` are skipped, not errors.

use serde::{Deserialize, Deserializer, Serialize};

use super::{DumpChain, Index, StoreError, StoredBlock, Tier, WorkerRank};

/// A hash that serialises as u64 and reads either u64 or i64.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Hash(u64);

impl Serialize for Hash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for Hash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            U(u64),
            I(i64),
        }
        Ok(Hash(match Either::deserialize(d)? {
            Either::U(u) => u,
            Either::I(i) => i as u64,
        }))
    }
}

#[derive(Serialize, Deserialize)]
struct RawPartition {
    block_size: u32,
    #[serde(default)]
    events: Vec<RawEvent>,
}

#[derive(Serialize, Deserialize)]
struct RawEvent {
    worker_id: u64,
    storage_tier: String,
    #[serde(default = "worker_domain")]
    residency_domain: String,
    event: RawRouterEvent,
}

fn worker_domain() -> String {
    "worker".to_string()
}

#[derive(Serialize, Deserialize)]
struct RawRouterEvent {
    #[serde(default)]
    event_id: u64,
    data: RawData,
    #[serde(default)]
    dp_rank: u32,
}

#[derive(Serialize, Deserialize)]
struct RawData {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    stored: Option<RawStored>,
}

#[derive(Serialize, Deserialize)]
struct RawStored {
    parent_hash: Option<Hash>,
    #[serde(default)]
    start_position: Option<u64>,
    blocks: Vec<RawBlock>,
}

#[derive(Serialize, Deserialize)]
struct RawBlock {
    block_hash: Hash,
    tokens_hash: Hash,
    #[serde(default)]
    mm_extra_info: Option<serde_json::Value>,
}

/// A dump (or a peer's /dump body) that is not the expected JSON shape.
#[derive(Debug)]
pub struct DumpError(pub String);

impl std::fmt::Display for DumpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "invalid /dump body: {}", self.0)
    }
}

impl std::error::Error for DumpError {}

/// One partition of a parsed /dump body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionDump {
    /// The object key, `"<model>:<group>"`.
    pub key: String,
    /// `key` split at its last `:` (model names may contain `:`, e.g.
    /// `qwen3:8b`); `routing_group` is `"default"` if there is no `:`.
    pub model_name: String,
    pub routing_group: String,
    pub block_size: u32,
    pub chains: Vec<DumpChain>,
}

fn to_raw(chains: &[DumpChain], block_size: u32) -> RawPartition {
    RawPartition {
        block_size,
        events: chains
            .iter()
            .enumerate()
            .map(|(i, c)| RawEvent {
                worker_id: c.wr.worker_id,
                storage_tier: c.tier.as_str().to_string(),
                residency_domain: worker_domain(),
                event: RawRouterEvent {
                    event_id: i as u64,
                    data: RawData {
                        stored: Some(RawStored {
                            parent_hash: c.parent_engine_hash.map(Hash),
                            start_position: None,
                            blocks: c
                                .blocks
                                .iter()
                                .map(|b| RawBlock {
                                    block_hash: Hash(b.engine_hash),
                                    tokens_hash: Hash(b.local_hash),
                                    mm_extra_info: None,
                                })
                                .collect(),
                        }),
                    },
                    dp_rank: c.wr.dp_rank,
                },
            })
            .collect(),
    }
}

/// One partition's dump value: `{"block_size":n,"events":[...]}`.
pub fn partition_value(index: &Index, block_size: u32) -> serde_json::Value {
    chains_value(&index.dump(), block_size)
}

/// `chains` as one partition's dump value.
pub fn chains_value(chains: &[DumpChain], block_size: u32) -> serde_json::Value {
    // Serialising plain structs of strings and integers cannot fail.
    serde_json::to_value(to_raw(chains, block_size)).unwrap_or(serde_json::Value::Null)
}

/// One partition's dump as JSON text, keys in the order of §4.15.
pub fn partition_json(index: &Index, block_size: u32) -> String {
    chains_json(&index.dump(), block_size)
}

/// `chains` as one partition's dump JSON text.
pub fn chains_json(chains: &[DumpChain], block_size: u32) -> String {
    serde_json::to_string(&to_raw(chains, block_size)).unwrap_or_else(|_| "null".into())
}

/// The whole GET /dump body for `(model_name, routing_group, block_size,
/// index)` partitions.
pub fn dump_body<'a>(
    partitions: impl IntoIterator<Item = (&'a str, &'a str, u32, &'a Index)>,
) -> String {
    let mut out = String::from("{");
    for (i, (model, group, bs, ix)) in partitions.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let key = format!("{model}:{group}");
        out.push_str(&serde_json::Value::String(key).to_string());
        out.push(':');
        out.push_str(&partition_json(ix, bs));
    }
    out.push('}');
    out
}

fn from_raw(raw: RawPartition) -> Vec<DumpChain> {
    let mut out = Vec::with_capacity(raw.events.len());
    for ev in raw.events {
        let Some(tier) = Tier::from_dump_name(&ev.storage_tier) else {
            continue;
        };
        let Some(stored) = ev.event.data.stored else {
            continue;
        };
        out.push(DumpChain {
            wr: WorkerRank {
                worker_id: ev.worker_id,
                dp_rank: ev.event.dp_rank,
            },
            tier,
            parent_engine_hash: stored.parent_hash.map(|h| h.0),
            blocks: stored
                .blocks
                .iter()
                .map(|b| StoredBlock {
                    engine_hash: b.block_hash.0,
                    local_hash: b.tokens_hash.0,
                })
                .collect(),
        });
    }
    out
}

/// Parses one partition's dump value.
pub fn parse_partition(value: serde_json::Value) -> Result<(u32, Vec<DumpChain>), DumpError> {
    let raw: RawPartition = serde_json::from_value(value).map_err(|e| DumpError(e.to_string()))?;
    let bs = raw.block_size;
    Ok((bs, from_raw(raw)))
}

/// Parses a peer's whole GET /dump body (an object keyed `"<model>:<group>"`).
/// Partitions come out sorted by key.
pub fn parse_dump(body: &[u8]) -> Result<Vec<PartitionDump>, DumpError> {
    let obj: std::collections::BTreeMap<String, RawPartition> =
        serde_json::from_slice(body).map_err(|e| DumpError(e.to_string()))?;
    Ok(obj
        .into_iter()
        .map(|(key, raw)| {
            let (model_name, routing_group) = match key.rfind(':') {
                Some(i) => (key[..i].to_string(), key[i + 1..].to_string()),
                None => (key.clone(), "default".to_string()),
            };
            PartitionDump {
                model_name,
                routing_group,
                block_size: raw.block_size,
                chains: from_raw(raw),
                key,
            }
        })
        .collect())
}

/// What [`load`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Chains applied.
    pub applied: usize,
    /// Chains dropped: parent never found, or refused as self-referencing.
    pub dropped: usize,
    /// Blocks newly indexed.
    pub blocks: usize,
}

/// Applies dumped chains to `index` in any order: chains whose parent is not
/// indexed yet are retried after the others until a pass makes no progress.
pub fn load(index: &Index, chains: &[DumpChain]) -> LoadReport {
    let mut report = LoadReport::default();
    let mut pending: Vec<&DumpChain> = chains.iter().collect();
    loop {
        let before = pending.len();
        let mut orphans = Vec::new();
        for c in pending {
            match index.store(c.wr, c.tier, c.parent_engine_hash, &c.blocks) {
                Ok(n) => {
                    report.applied += 1;
                    report.blocks += n;
                }
                Err(StoreError::UnknownParent) => orphans.push(c),
                Err(StoreError::SelfReference | StoreError::TooManyRanks) => report.dropped += 1,
            }
        }
        if orphans.is_empty() || orphans.len() == before {
            report.dropped += orphans.len();
            return report;
        }
        pending = orphans;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const APPENDIX_A: &str = r#"{"ov:default":{"block_size":16,"events":[
  {"worker_id":200,"storage_tier":"device","residency_domain":"worker","event":{"event_id":0,"data":{"stored":{"parent_hash":null,"start_position":null,
   "blocks":[{"block_hash":1001,"tokens_hash":16863443419780771464,"mm_extra_info":null},
             {"block_hash":1002,"tokens_hash":2287610619914608821,"mm_extra_info":null},
             {"block_hash":1003,"tokens_hash":12129935312930971799,"mm_extra_info":null}]}},"dp_rank":0}},
  {"worker_id":201,"storage_tier":"device","residency_domain":"worker","event":{"event_id":1,"data":{"stored":{"parent_hash":null,"start_position":null,
   "blocks":[{"block_hash":1001,"tokens_hash":16863443419780771464,"mm_extra_info":null}]}},"dp_rank":0}}]}, "hb16:default":{"block_size":16,"events":[]}}"#;

    #[test]
    fn appendix_a_fragment_round_trips() {
        let parts = parse_dump(APPENDIX_A.as_bytes()).unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[1].key, "ov:default");
        assert_eq!(parts[1].model_name, "ov");
        assert_eq!(parts[1].chains.len(), 2);
        let ix = Index::new();
        let r = load(&ix, &parts[1].chains);
        assert_eq!((r.applied, r.dropped, r.blocks), (2, 0, 4));
        let body = dump_body([("ov", "default", 16, &ix)]);
        let again = parse_dump(body.as_bytes()).unwrap();
        assert_eq!(again[0].chains, parts[1].chains);
        // Exact shape of one event (key order as in §4.15).
        assert_eq!(
            chains_json(&again[0].chains[1..], 16),
            r#"{"block_size":16,"events":[{"worker_id":201,"storage_tier":"device","residency_domain":"worker","event":{"event_id":0,"data":{"stored":{"parent_hash":null,"start_position":null,"blocks":[{"block_hash":1001,"tokens_hash":16863443419780771464,"mm_extra_info":null}]}},"dp_rank":0}}]}"#
        );
    }

    #[test]
    fn load_tolerates_children_first_signed_hashes_and_unknown_tiers() {
        let body = r#"{"m:g":{"block_size":16,"events":[
 {"worker_id":1,"storage_tier":"device","event":{"event_id":0,"data":{"stored":{"parent_hash":-2,"blocks":[{"block_hash":3,"tokens_hash":30}]}},"dp_rank":1}},
 {"worker_id":1,"storage_tier":"device","event":{"event_id":1,"data":{"stored":{"parent_hash":null,"blocks":[{"block_hash":18446744073709551614,"tokens_hash":10}]}},"dp_rank":1}},
 {"worker_id":1,"storage_tier":"tape","event":{"event_id":2,"data":{"stored":{"parent_hash":null,"blocks":[{"block_hash":9,"tokens_hash":90}]}},"dp_rank":1}},
 {"worker_id":1,"storage_tier":"device","event":{"event_id":3,"data":{"removed":{"block_hashes":[3]}},"dp_rank":1}},
 {"worker_id":1,"storage_tier":"device","event":{"event_id":4,"data":{"stored":{"parent_hash":77,"blocks":[{"block_hash":4,"tokens_hash":40}]}},"dp_rank":1}}]}}"#;
        let parts = parse_dump(body.as_bytes()).unwrap();
        assert_eq!(parts[0].chains.len(), 3);
        let ix = Index::new();
        let r = load(&ix, &parts[0].chains);
        assert_eq!((r.applied, r.dropped, r.blocks), (2, 1, 2));
        let mut keys = Vec::new();
        crate::hash::sequence_hashes(&[10, 30], crate::hash::PUBLIC_SEED, &mut keys);
        let mut out = Vec::new();
        ix.overlap(&keys, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(
            out[0].0,
            WorkerRank {
                worker_id: 1,
                dp_rank: 1
            }
        );
        assert_eq!(out[0].1.device, 2);
    }

    #[test]
    fn malformed_bodies_are_errors_not_panics() {
        for bad in [&b"[]"[..], b"{", b"{\"a:b\":{\"events\":[]}}", b"\xff"] {
            assert!(parse_dump(bad).is_err());
        }
    }
}
