//! Reservations and active load (spec §4.9–§4.12, §6).
//!
//! Two pure in-memory components, no I/O and no HTTP knowledge:
//!
//! * [`Ledger`] — the process-wide reservation index (`selection_id ->
//!   booking`) and the active load it implies per (worker, dp rank): prefill
//!   tokens not yet prefill-complete, weighted distinct decode blocks, live
//!   bookings. It also answers the selection hot path's question "how many of
//!   this prompt's identities are *not* active on each candidate rank"
//!   ([`Ledger::new_blocks`]) in O(identities + hits), not O(ranks x identities).
//! * [`PendingCache`] — the pending-selection cache behind the replay form of
//!   `POST /reservations`: single use, latest wins, TTL, entry cap and byte
//!   budget, and entries survive a rejected replay.
//!
//! Worker ids are global across partitions, so load is keyed by
//! [`WorkerRank`](crate::index::WorkerRank) alone and selection ids are global too.
//!
//! Both components are lock-sharded where a global order is not needed, never
//! call out while holding a lock, and never hand a guard to the caller.
//! Errors are small enums; the HTTP layer owns the status codes and texts
//! (409 `selection <id> is already reserved or being reserved`,
//! 404 `reservation <id> not found`).

pub mod ledger;
pub mod pending;
mod table;

pub use ledger::{
    Booking, BookingInfo, IdentityForm, Ledger, LedgerStats, RankLoad, DEFAULT_BOOKING_EXPIRY,
};
pub use pending::{
    ClaimError, PendingCache, PendingKey, PendingSelection, DEFAULT_PENDING_MAX_BYTES,
    DEFAULT_PENDING_MAX_ENTRIES, DEFAULT_PENDING_TTL,
};

use std::fmt;

/// Why a ledger operation was refused. Knows nothing of HTTP: the HTTP layer
/// maps `Duplicate` to 409 and `NotFound` to 404.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReserveError {
    /// The selection id is already booked (ids are global across partitions).
    Duplicate,
    /// No live booking has this id (never booked, freed, expired or dropped).
    NotFound,
}

impl fmt::Display for ReserveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReserveError::Duplicate => f.write_str("selection id is already reserved"),
            ReserveError::NotFound => f.write_str("reservation not found"),
        }
    }
}

impl std::error::Error for ReserveError {}
