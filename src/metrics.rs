//! GET /metrics: the service's gauges and the ingest counters as
//! Prometheus text exposition.

use crate::app::App;

/// Renders every metric of `app`.
pub fn render(app: &App) -> String {
    // `[(name, value)]` of the named fields of a counters struct.
    macro_rules! fields {
        ($s:expr; $($f:ident),* $(,)?) => { [$((stringify!($f), $s.$f)),*] };
    }
    use std::fmt::Write;
    let mut out = String::new();
    let snap = app.catalog.snapshot();
    let _ = writeln!(out, "# TYPE kvselect_schedulable_workers gauge");
    let _ = writeln!(
        out,
        "kvselect_schedulable_workers {}",
        snap.schedulable_workers
    );
    let _ = writeln!(out, "# TYPE kvselect_index_entries gauge");
    let _ = writeln!(out, "# TYPE kvselect_index_nodes gauge");
    let _ = writeln!(out, "# TYPE kvselect_index_bytes gauge");
    for p in app.catalog.partitions() {
        let st = p.index.stats();
        let labels = format!(
            "model_name={:?},routing_group={:?}",
            p.model_name, p.routing_group
        );
        let _ = writeln!(out, "kvselect_index_entries{{{labels}}} {}", st.entries);
        let _ = writeln!(out, "kvselect_index_nodes{{{labels}}} {}", st.nodes);
        let _ = writeln!(out, "kvselect_index_bytes{{{labels}}} {}", st.bytes);
    }
    let ls = app.ledger.stats();
    let _ = writeln!(out, "# TYPE kvselect_bookings gauge");
    let _ = writeln!(out, "kvselect_bookings {}", ls.bookings);
    let _ = writeln!(out, "# TYPE kvselect_active_identities gauge");
    let _ = writeln!(out, "kvselect_active_identities {}", ls.identities);
    let _ = writeln!(out, "# TYPE kvselect_active_chained_identities gauge");
    let _ = writeln!(
        out,
        "kvselect_active_chained_identities {}",
        ls.chained_identities
    );
    let _ = writeln!(out, "# TYPE kvselect_pending_selections gauge");
    let _ = writeln!(out, "kvselect_pending_selections {}", app.pending.len());
    let _ = writeln!(out, "# TYPE kvselect_pending_selection_bytes gauge");
    let _ = writeln!(
        out,
        "kvselect_pending_selection_bytes {}",
        app.pending.bytes()
    );
    if let Some(aff) = &app.affinity {
        let _ = writeln!(out, "# TYPE kvselect_session_bindings gauge");
        let _ = writeln!(out, "kvselect_session_bindings {}", aff.len());
    }
    if let Some(mesh) = app.mesh() {
        crate::mesh::render_metrics(mesh, &mut out);
    }
    let c = app.catalog.hub().stats().counters;
    for (name, v) in [
        ("messages", c.messages),
        ("batches_applied", c.batches_applied),
        ("malformed_dropped", c.malformed),
        ("gaps", c.gaps),
        ("gaps_lost", c.gaps_lost),
        ("replays_started", c.replays_started),
        ("replays_failed", c.replays_failed),
        ("replayed_batches", c.replayed_batches),
        ("engine_restarts", c.restarts),
        ("stale_dropped", c.stale_dropped),
        ("connect_errors", c.connect_errors),
    ]
    .into_iter()
    .chain(
        fields!(c.apply; events_applied, blocks_stored, blocks_removed, clears,
        stores_dropped_block_size, stores_dropped_shape, stores_dropped_self_reference,
        stores_dropped_unknown_parent, stores_dropped_other, events_ignored_group,
        events_dropped_unknown_medium, events_dropped_non_local, events_dropped_unknown_type),
    ) {
        let _ = writeln!(out, "# TYPE kvselect_ingest_{name}_total counter");
        let _ = writeln!(out, "kvselect_ingest_{name}_total {v}");
    }
    out
}
