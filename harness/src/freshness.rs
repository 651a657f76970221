//! The server's own index-freshness figures, read from its Prometheus
//! `/metrics` text before and after a measured window.
//!
//! Owns parsing the text exposition (only what the report needs: samples
//! of a named family, summed over their labels, or their maximum) and the
//! window arithmetic: a histogram's figures over the window come from the
//! difference of its cumulative buckets, `_sum` and `_count`, and a quantile
//! is interpolated linearly within its bucket as Prometheus'
//! `histogram_quantile` does. Every family is optional: a server without it
//! (the reference, or an older kvselect) gives `None`, never an error.
//!
//! Families read:
//! - `kvselect_ingest_apply_delay_seconds` (histogram): reading a KV-event
//!   batch off its socket to applying it to the index;
//! - `kvselect_ingest_engine_delay_seconds` (histogram): the batch's own
//!   engine timestamp to its application;
//! - `kvselect_ingest_queued_batches` (gauge): batches received, not applied;
//! - any family whose name starts with [`LAG_PREFIXES`] (an index-lag
//!   gauge): its largest sample.

use std::collections::BTreeMap;

use serde::Serialize;

pub const APPLY_DELAY: &str = "kvselect_ingest_apply_delay_seconds";
pub const ENGINE_DELAY: &str = "kvselect_ingest_engine_delay_seconds";
pub const QUEUED_BATCHES: &str = "kvselect_ingest_queued_batches";
/// Name prefixes of index-lag gauges, read when the server has them.
pub const LAG_PREFIXES: [&str; 2] = ["kvselect_index_lag", "kvselect_ingest_lag"];

/// One sample line: metric name, the text inside `{}` (empty without
/// labels), value.
fn samples(text: &str) -> impl Iterator<Item = (&str, &str, f64)> {
    text.lines().filter_map(|line| {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return None;
        }
        let (name, labels, rest) = match line.find('{') {
            Some(open) => {
                let close = open + line[open..].find('}')?;
                (&line[..open], &line[open + 1..close], &line[close + 1..])
            }
            None => {
                let sp = line.find(char::is_whitespace)?;
                (&line[..sp], "", &line[sp..])
            }
        };
        // The value, then an optional timestamp.
        let value = rest.split_whitespace().next()?;
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().ok()?,
        };
        Some((name, labels, value))
    })
}

/// The value of label `key` in a label text (`a="x",le="0.5"`).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    loop {
        let eq = rest.find("=\"")?;
        let k = rest[..eq].trim().trim_start_matches(',').trim();
        let v_start = eq + 2;
        let v_len = rest[v_start..].find('"')?;
        if k == key {
            return Some(&rest[v_start..v_start + v_len]);
        }
        rest = &rest[v_start + v_len + 1..];
    }
}

/// A cumulative histogram summed over its label sets.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// `(le, cumulative count)`, ascending `le`, the last one `+Inf`.
    pub buckets: Vec<(f64, f64)>,
    pub sum: f64,
    pub count: f64,
}

impl Histogram {
    /// The histogram family `name` in `text`; `None` when it has no bucket.
    pub fn parse(text: &str, name: &str) -> Option<Histogram> {
        let bucket = format!("{name}_bucket");
        let sum = format!("{name}_sum");
        let count = format!("{name}_count");
        let mut by_le: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
        let mut h = Histogram::default();
        for (n, labels, v) in samples(text) {
            if n == bucket {
                let le = match label(labels, "le") {
                    Some("+Inf") => f64::INFINITY,
                    Some(s) => match s.parse::<f64>() {
                        Ok(le) => le,
                        Err(_) => continue,
                    },
                    None => continue,
                };
                // Non-negative floats order as their bits do.
                by_le.entry(le.max(0.0).to_bits()).or_insert((le, 0.0)).1 += v;
            } else if n == sum {
                h.sum += v;
            } else if n == count {
                h.count += v;
            }
        }
        if by_le.is_empty() {
            return None;
        }
        h.buckets = by_le.into_values().collect();
        Some(h)
    }

    /// `self - before`: the observations made between the two readings.
    /// Buckets are matched by bound; a bound `before` lacks counts as 0.
    pub fn since(&self, before: &Histogram) -> Histogram {
        let old = |le: f64| {
            before
                .buckets
                .iter()
                .find(|(b, _)| *b == le)
                .map_or(0.0, |(_, c)| *c)
        };
        Histogram {
            buckets: self
                .buckets
                .iter()
                .map(|&(le, c)| (le, (c - old(le)).max(0.0)))
                .collect(),
            sum: (self.sum - before.sum).max(0.0),
            count: (self.count - before.count).max(0.0),
        }
    }

    /// Mean observation; `None` without observations.
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count)
    }

    /// The `q` quantile, interpolated linearly inside its bucket (the lower
    /// edge of the first bucket is 0); in the `+Inf` bucket, the largest
    /// finite bound (as `histogram_quantile`, a lower bound of the truth).
    /// `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total;
        let (mut lo_bound, mut lo_count) = (0.0, 0.0);
        for &(le, c) in &self.buckets {
            if c >= rank {
                if le.is_infinite() {
                    return Some(lo_bound);
                }
                let width = c - lo_count;
                let frac = if width > 0.0 {
                    (rank - lo_count) / width
                } else {
                    1.0
                };
                return Some(lo_bound + (le - lo_bound) * frac);
            }
            lo_bound = if le.is_finite() { le } else { lo_bound };
            lo_count = c;
        }
        Some(lo_bound)
    }
}

/// Sum of the samples of family `name` (all label sets); `None` without any.
pub fn sum_of(text: &str, name: &str) -> Option<f64> {
    samples(text)
        .filter(|(n, _, _)| *n == name)
        .map(|(_, _, v)| v)
        .reduce(|a, b| a + b)
}

/// Largest sample of every family whose name starts with one of
/// [`LAG_PREFIXES`] (histogram `_bucket` lines left out).
pub fn lag_gauges(text: &str) -> BTreeMap<String, f64> {
    let mut out: BTreeMap<String, f64> = BTreeMap::new();
    for (n, _, v) in samples(text) {
        if !LAG_PREFIXES.iter().any(|p| n.starts_with(p)) || n.ends_with("_bucket") {
            continue;
        }
        let e = out.entry(n.to_string()).or_insert(v);
        if v > *e {
            *e = v;
        }
    }
    out
}

/// What one `/metrics` reading holds of the freshness families.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reading {
    pub apply: Option<Histogram>,
    pub engine: Option<Histogram>,
    pub queued_batches: Option<f64>,
    pub lag: BTreeMap<String, f64>,
}

impl Reading {
    pub fn parse(text: &str) -> Reading {
        Reading {
            apply: Histogram::parse(text, APPLY_DELAY),
            engine: Histogram::parse(text, ENGINE_DELAY),
            queued_batches: sum_of(text, QUEUED_BATCHES),
            lag: lag_gauges(text),
        }
    }
}

/// The server's freshness over a window, in milliseconds; every figure is
/// `None` where the server does not publish it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Freshness {
    /// KV-event batches applied in the window (the apply histogram's count).
    pub batches_applied: Option<u64>,
    pub apply_delay_mean_ms: Option<f64>,
    pub apply_delay_p50_ms: Option<f64>,
    pub apply_delay_p99_ms: Option<f64>,
    pub engine_delay_mean_ms: Option<f64>,
    pub engine_delay_p99_ms: Option<f64>,
    /// Batches received but not applied, at the end of the window.
    pub queued_batches_at_end: Option<f64>,
    /// The same after the tail period (the backlog left once load stopped).
    pub queued_batches_after_tail: Option<f64>,
    /// Index-lag gauges at the end of the window: family -> largest sample.
    pub index_lag: BTreeMap<String, f64>,
}

impl Freshness {
    /// Figures between the readings `before` and `after` (the window).
    pub fn between(before: &Reading, after: &Reading) -> Freshness {
        let window = |a: &Option<Histogram>, b: &Option<Histogram>| match (a, b) {
            (Some(a), Some(b)) => Some(a.since(b)),
            (Some(a), None) => Some(a.clone()),
            _ => None,
        };
        let ms = |v: Option<f64>| v.map(|s| s * 1000.0);
        let apply = window(&after.apply, &before.apply);
        let engine = window(&after.engine, &before.engine);
        Freshness {
            batches_applied: apply.as_ref().map(|h| h.count as u64),
            apply_delay_mean_ms: ms(apply.as_ref().and_then(Histogram::mean)),
            apply_delay_p50_ms: ms(apply.as_ref().and_then(|h| h.quantile(0.5))),
            apply_delay_p99_ms: ms(apply.as_ref().and_then(|h| h.quantile(0.99))),
            engine_delay_mean_ms: ms(engine.as_ref().and_then(Histogram::mean)),
            engine_delay_p99_ms: ms(engine.as_ref().and_then(|h| h.quantile(0.99))),
            queued_batches_at_end: after.queued_batches,
            queued_batches_after_tail: None,
            index_lag: after.lag.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = "# HELP kvselect_ingest_apply_delay_seconds x\n\
        # TYPE kvselect_ingest_apply_delay_seconds histogram\n\
        kvselect_ingest_apply_delay_seconds_bucket{le=\"0.001\"} 10\n\
        kvselect_ingest_apply_delay_seconds_bucket{le=\"0.01\"} 10\n\
        kvselect_ingest_apply_delay_seconds_bucket{le=\"+Inf\"} 10\n\
        kvselect_ingest_apply_delay_seconds_sum 0.005\n\
        kvselect_ingest_apply_delay_seconds_count 10\n\
        kvselect_ingest_queued_batches 0\n";

    const AFTER: &str = "kvselect_ingest_apply_delay_seconds_bucket{le=\"0.001\"} 60\n\
        kvselect_ingest_apply_delay_seconds_bucket{le=\"0.01\"} 109\n\
        kvselect_ingest_apply_delay_seconds_bucket{le=\"+Inf\"} 110\n\
        kvselect_ingest_apply_delay_seconds_sum 1.005\n\
        kvselect_ingest_apply_delay_seconds_count 110\n\
        kvselect_ingest_queued_batches 7\n\
        kvselect_index_lag_seconds{worker_id=\"1\",dp_rank=\"0\"} 0.25\n\
        kvselect_index_lag_seconds{worker_id=\"2\",dp_rank=\"0\"} 1.5\n";

    #[test]
    fn window_figures_come_from_bucket_differences() {
        let f = Freshness::between(&Reading::parse(BEFORE), &Reading::parse(AFTER));
        // 100 observations in the window: 50 below 1 ms, 49 in (1, 10] ms,
        // 1 above 10 ms; mean 1.0 s / 100.
        assert_eq!(f.batches_applied, Some(100));
        assert!((f.apply_delay_mean_ms.unwrap() - 10.0).abs() < 1e-9);
        // Rank 50 is the top of the first bucket.
        assert!((f.apply_delay_p50_ms.unwrap() - 1.0).abs() < 1e-9);
        // Rank 99 is the last of the 49 in (1, 10] ms.
        assert!((f.apply_delay_p99_ms.unwrap() - 10.0).abs() < 1e-9);
        assert_eq!(f.engine_delay_p99_ms, None);
        assert_eq!(f.queued_batches_at_end, Some(7.0));
        assert_eq!(f.index_lag.get("kvselect_index_lag_seconds"), Some(&1.5));
    }

    #[test]
    fn quantiles_interpolate_and_stop_at_the_last_finite_bound() {
        let h = Histogram {
            buckets: vec![(1.0, 0.0), (2.0, 100.0), (f64::INFINITY, 200.0)],
            sum: 0.0,
            count: 200.0,
        };
        assert_eq!(h.quantile(0.25), Some(1.5));
        assert_eq!(h.quantile(0.99), Some(2.0));
        assert_eq!(Histogram::default().quantile(0.5), None);
        assert_eq!(Histogram::default().mean(), None);
    }

    #[test]
    fn a_server_without_the_families_gives_none() {
        let text = "dynamo_component_requests_total{a=\"b\"} 5\nup 1\n";
        let f = Freshness::between(&Reading::parse(text), &Reading::parse(text));
        assert_eq!(f, Freshness::default());
        assert_eq!(Reading::parse("garbage {{{ \n"), Reading::default());
    }

    #[test]
    fn labels_are_found_by_key() {
        assert_eq!(label("a=\"x\",le=\"0.5\"", "le"), Some("0.5"));
        assert_eq!(label("a=\"x\",le=\"0.5\"", "a"), Some("x"));
        assert_eq!(label("a=\"x\"", "le"), None);
    }
}
