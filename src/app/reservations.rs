//! POST /reservations in both forms (§4.10) and the lifecycle calls (§4.11):
//! replaying a pending selection, booking an explicit worker, prefill
//! completion, output blocks and frees.

use super::{App, ServiceError};
use crate::catalog::partition_display;
use crate::index::WorkerRank;
use crate::mesh::BookMeta;
use crate::parse::ReservationRequest;
use crate::reserve::{Booking, ClaimError, PendingKey, PendingSelection, ReserveError};
use serde::Serialize;
use std::time::Instant;

/// The reply of POST /reservations.
#[derive(Debug, Serialize)]
pub struct Reservation {
    pub selection_id: String,
    pub model_name: String,
    pub routing_group: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub endpoint: String,
}

impl App {
    pub fn create_reservation(
        &self,
        req: &ReservationRequest<'_>,
    ) -> Result<Reservation, ServiceError> {
        let key = PendingKey {
            model_name: req
                .model_name
                .as_deref()
                .unwrap_or(crate::catalog::DEFAULT_MODEL)
                .to_string(),
            routing_group: req
                .routing_group
                .as_deref()
                .unwrap_or(crate::catalog::DEFAULT_ROUTING_GROUP)
                .to_string(),
            selection_id: req.selection_id.to_string(),
        };
        match req.worker_id {
            None => self.replay_reservation(key),
            Some(worker_id) => {
                self.pending.discard(&key);
                self.explicit_reservation(req, key, worker_id)
            }
        }
    }

    fn replay_reservation(&self, key: PendingKey) -> Result<Reservation, ServiceError> {
        let id = key.selection_id.as_str();
        let claimed = self
            .pending
            .claim(&key, Instant::now(), |sel: &PendingSelection| {
                let snap = self.catalog.snapshot();
                let view = self.partition_view(&snap, &key.model_name, &key.routing_group)?;
                let rank = view.rank(sel.wr).ok_or_else(|| {
                    ServiceError::UnknownWorker(format!(
                        "schedulable worker {} (dp_rank {}) not found for {}",
                        sel.wr.worker_id,
                        sel.wr.dp_rank,
                        view.partition.display()
                    ))
                })?;
                // A session bound meanwhile (or all along) to another
                // schedulable worker: refused and unbound, as a booking
                // that leaves out the bound worker, and the selection is
                // used up (measured on the reference: 400, then 404 for the
                // same id, and the session goes by cost).
                if let Some(session) = &sel.session_id {
                    let bound = self.affinity.as_ref().and_then(|a| {
                        a.lookup(&key.model_name, &key.routing_group, session, Instant::now())
                    });
                    if let Some(b) = bound.filter(|b| *b != sel.wr && view.rank(*b).is_some()) {
                        return Ok(Err(self.refuse_bound_elsewhere(
                            &key.model_name,
                            &key.routing_group,
                            session,
                            b,
                            sel.wr,
                        )));
                    }
                }
                let prefill = if sel.track_prefill_tokens {
                    sel.effective_prefill_tokens
                } else {
                    0
                };
                self.book(
                    Booking {
                        selection_id: id,
                        wr: sel.wr,
                        identities: &sel.identities,
                        form: sel.identity_form,
                        prefill_tokens: prefill,
                        now: Instant::now(),
                    },
                    &BookMeta {
                        model_name: &key.model_name,
                        routing_group: &key.routing_group,
                        block_size: view.partition.block_size,
                        lora_name: sel.lora_name.as_deref(),
                        track_prefill_tokens: sel.track_prefill_tokens,
                        effective_prefill_tokens: sel.effective_prefill_tokens,
                        expected_output_tokens: sel.expected_output_tokens,
                    },
                )
                .map_err(|e| reserve_error(e, id))?;
                // The reference binds the selection's session on replay
                // (observed: a later select of the session follows it).
                if let Some(session) = &sel.session_id {
                    self.bind_session(&key.model_name, &key.routing_group, session, sel.wr);
                }
                Ok(Ok((sel.wr, rank.endpoint.to_string())))
            });
        match claimed {
            Ok(Ok((wr, endpoint))) => Ok(reservation(key, wr, endpoint)),
            Ok(Err(e)) => Err(e),
            Err(ClaimError::Rejected(e)) => Err(e),
            Err(ClaimError::InFlight) => Err(reserve_error(ReserveError::Duplicate, id)),
            Err(ClaimError::Missing) => Err(ServiceError::UnknownSelection(format!(
                "no pending selection {id} for {} (expired, already used, or never selected)",
                partition_display(&key.model_name, &key.routing_group)
            ))),
        }
    }

    fn explicit_reservation(
        &self,
        req: &ReservationRequest<'_>,
        key: PendingKey,
        worker_id: u64,
    ) -> Result<Reservation, ServiceError> {
        let id = key.selection_id.as_str();
        let snap = self.catalog.snapshot();
        let view = self.partition_view(&snap, &key.model_name, &key.routing_group)?;
        let cfg = crate::select::effective_config(
            &self.config.router,
            req.router_config_override.as_ref(),
        );
        let prompt = self.normalize(&req.prompt, &view, &cfg, false)?;
        if let Some(eff) = req.effective_prefill_tokens {
            if eff > prompt.isl_tokens {
                return Err(ServiceError::Invalid(format!(
                    "effective_prefill_tokens ({eff}) must not exceed isl_tokens ({})",
                    prompt.isl_tokens
                )));
            }
        }
        if view.worker_ranks(worker_id).is_empty() {
            return Err(ServiceError::UnknownWorker(format!(
                "schedulable worker {worker_id} not found for {}",
                view.partition.display()
            )));
        }
        if self.ledger.is_booked(id) {
            return Err(reserve_error(ReserveError::Duplicate, id));
        }
        let dp_rank = req.dp_rank.unwrap_or(0);
        let wr = WorkerRank { worker_id, dp_rank };
        let rank = view.rank(wr).ok_or_else(|| {
            ServiceError::UnknownRank(format!(
                "Worker WorkerWithDpRank {{ worker_id: {worker_id}, dp_rank: {dp_rank} }} not found"
            ))
        })?;
        let track = req
            .track_prefill_tokens
            .unwrap_or(req.effective_prefill_tokens.is_some() || cfg.track_prefill_tokens);
        let prefill = match req.effective_prefill_tokens {
            Some(eff) if track => eff,
            _ => 0,
        };
        self.book(
            Booking {
                selection_id: id,
                wr,
                identities: &prompt.identities,
                form: prompt.form,
                prefill_tokens: prefill,
                now: Instant::now(),
            },
            &BookMeta {
                model_name: &key.model_name,
                routing_group: &key.routing_group,
                block_size: view.partition.block_size,
                lora_name: req.prompt.lora_name.as_deref(),
                track_prefill_tokens: track,
                effective_prefill_tokens: req.effective_prefill_tokens.unwrap_or(0),
                expected_output_tokens: req.expected_output_tokens,
            },
        )
        .map_err(|e| reserve_error(e, id))?;
        let endpoint = rank.endpoint.to_string();
        Ok(reservation(key, wr, endpoint))
    }

    pub fn prefill_complete(&self, id: &str) -> Result<(), ServiceError> {
        self.ledger_prefill_complete(id)
            .map_err(|e| reserve_error(e, id))
    }

    /// One more output block; `decay_fraction` must lie in [0, 1].
    pub fn output_block(&self, id: &str, decay_fraction: Option<f64>) -> Result<(), ServiceError> {
        if let Some(f) = decay_fraction {
            if !(0.0..=1.0).contains(&f) {
                return Err(ServiceError::Invalid(
                    "decay_fraction must be between 0.0 and 1.0".into(),
                ));
            }
        }
        self.ledger
            .output_block(id, decay_fraction)
            .map_err(|e| reserve_error(e, id))
    }

    pub fn free_reservation(&self, id: &str) -> Result<(), ServiceError> {
        self.ledger_free(id).map_err(|e| reserve_error(e, id))
    }
}

pub(super) fn reserve_error(e: ReserveError, id: &str) -> ServiceError {
    match e {
        ReserveError::Duplicate => ServiceError::AlreadyReserved(format!(
            "selection {id} is already reserved or being reserved"
        )),
        ReserveError::NotFound => {
            ServiceError::UnknownSelection(format!("reservation {id} not found"))
        }
    }
}

fn reservation(key: PendingKey, wr: WorkerRank, endpoint: String) -> Reservation {
    Reservation {
        selection_id: key.selection_id,
        model_name: key.model_name,
        routing_group: key.routing_group,
        worker_id: wr.worker_id,
        dp_rank: wr.dp_rank,
        endpoint,
    }
}
