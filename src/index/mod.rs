//! The KV index: which blocks each (worker, dp rank) holds, per tier.
//! (Types only; the sharded index lands with issue 3.)

/// One scheduling candidate: a worker's data-parallel rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerRank {
    pub worker_id: u64,
    pub dp_rank: u32,
}

/// Where a block lives. `External` counts with `Disk` in overlap answers but
/// keeps its own name in /dump.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Device,
    HostPinned,
    Disk,
    External,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Device, Tier::HostPinned, Tier::Disk, Tier::External];

    /// The name used by /dump's `storage_tier`.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::HostPinned => "host_pinned",
            Tier::Disk => "disk",
            Tier::External => "external",
        }
    }

    pub fn from_dump_name(s: &str) -> Option<Tier> {
        Tier::ALL.into_iter().find(|t| t.as_str() == s)
    }
}

/// One block of a store: the engine's opaque id and our content hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StoredBlock {
    pub engine_hash: u64,
    pub local_hash: u64,
}

/// Matched prefix of one (worker, rank), in blocks, with cumulative tiers:
/// `device` leading blocks on GPU; then `host_ext` more that are on GPU or
/// host; then `disk_ext` more on any tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overlap {
    pub device: u32,
    pub host_ext: u32,
    pub disk_ext: u32,
}
