//! The cost model and the choice (`selection-api.md` §7). Pure: numbers in,
//! an index out. No I/O, no locks.

use crate::config::RouterConfig;
use crate::index::Overlap;
use crate::parse::RouterConfigOverride;
use rand::Rng;

/// What the cost of one candidate (worker, rank) depends on.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CandidateLoad {
    pub overlap: Overlap,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub active_requests: u64,
    /// The prompt's full-block identities not already active on the rank.
    pub new_blocks: u64,
}

/// The request-level inputs of the cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostContext {
    pub isl_tokens: u64,
    pub block_size: u32,
    pub track_prefill_tokens: bool,
    /// Smallest active prefill among the candidates (credit decay reference).
    pub min_active_prefill_tokens: u64,
}

/// Applies a request's override to the configured weights (§7.5). Values were
/// range-checked by the parser. Unlike the reference 1.6.1, which validates
/// and then ignores the weight overrides, kvselect honours them.
pub fn effective_config(base: &RouterConfig, o: Option<&RouterConfigOverride>) -> RouterConfig {
    let mut c = *base;
    let Some(o) = o else { return c };
    if let Some(v) = o.overlap_score_credit {
        c.overlap_score_credit = v;
    }
    if let Some(v) = o.prefill_load_scale {
        c.prefill_load_scale = v;
    }
    // The deprecated alias wins over both, as the reference's validation
    // shows (`prefill_load_scale: -1` beside a valid weight is accepted).
    if let Some(w) = o.overlap_score_weight {
        c.prefill_load_scale = w;
        if w == 0.0 {
            c.overlap_score_credit = 0.0;
        }
    }
    if let Some(v) = o.router_temperature {
        c.router_temperature = v;
    }
    if let Some(v) = o.assume_kv_reuse {
        c.assume_kv_reuse = v;
    }
    if let Some(v) = o.track_prefill_tokens {
        c.track_prefill_tokens = v;
    }
    c
}

/// Tokens a candidate already holds, with lower tiers discounted:
/// `round((device + host_w * host_ext + disk_w * disk_ext) * block_size)`.
/// The device weight is always 1.0 (the credit weight does not apply here).
pub fn cached_tokens(o: &Overlap, cfg: &RouterConfig, block_size: u32) -> u64 {
    let blocks = o.device as f64
        + cfg.host_cache_hit_weight * o.host_ext as f64
        + cfg.disk_cache_hit_weight * o.disk_ext as f64;
    (blocks * block_size as f64).round() as u64
}

/// Prefill tokens the request would cost on the candidate: `isl - min(isl, cached)`.
pub fn effective_prefill_tokens(o: &Overlap, cfg: &RouterConfig, ctx: &CostContext) -> u64 {
    ctx.isl_tokens - ctx.isl_tokens.min(cached_tokens(o, cfg, ctx.block_size))
}

/// The §7.3 cost; lower is better. With prefill tracking off the prefill
/// term is minus the credit, as the reference has it (§7.3 leaves it out):
/// the cache still attracts a prompt whose prefill is not counted.
pub fn cost(c: &CandidateLoad, cfg: &RouterConfig, ctx: &CostContext) -> f64 {
    let bs = ctx.block_size.max(1) as f64;
    let mut device_credit = cfg.overlap_score_credit;
    if cfg.overlap_score_credit_decay > 0.0 && ctx.isl_tokens > 0 {
        let prompt_blocks = ctx.isl_tokens.div_ceil(ctx.block_size.max(1) as u64) as f64;
        let excess = c
            .active_prefill_tokens
            .saturating_sub(ctx.min_active_prefill_tokens) as f64
            / bs;
        device_credit /= 1.0 + cfg.overlap_score_credit_decay * excess / prompt_blocks;
    }
    let credit = device_credit * c.overlap.device as f64
        + cfg.host_cache_hit_weight * c.overlap.host_ext as f64
        + cfg.disk_cache_hit_weight * c.overlap.disk_ext as f64;
    let prefill = if ctx.track_prefill_tokens {
        let cached = cached_tokens(&c.overlap, cfg, ctx.block_size);
        let raw_prefill = (c.active_prefill_tokens + ctx.isl_tokens.max(cached)) as f64 / bs;
        cfg.prefill_load_scale * (raw_prefill - credit).max(0.0)
    } else {
        // Untracked: the credit alone, unscaled (the test below has the
        // reference's measured cases).
        -credit
    };
    prefill
        + (c.active_decode_blocks + c.new_blocks) as f64
        + cfg.decode_active_request_weight * c.active_requests as f64
}

/// The factor a candidate's cost is scaled by for the request's preferred
/// taints: `exp(-tanh(w))`, with `w` the sum of the weights of the preferred
/// taints the candidate carries (1.0 when it carries none).
pub fn preferred_taint_factor<S: AsRef<str>>(preferred: &[(S, f32)], taints: &[String]) -> f64 {
    let w: f64 = preferred
        .iter()
        .filter(|(t, _)| taints.iter().any(|have| have == t.as_ref()))
        .map(|(_, w)| *w as f64)
        .sum();
    (-w.tanh()).exp()
}

/// Picks an index into `costs` (non-empty). Temperature 0: the minimum, exact
/// ties broken uniformly at random. Temperature T > 0: sampled with weight
/// `exp(-(cost - min) / ((max - min) * T))`; all-equal costs are uniform.
pub fn choose(costs: &[f64], temperature: f64, rng: &mut impl Rng) -> usize {
    debug_assert!(!costs.is_empty());
    let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
    for &c in costs {
        min = min.min(c);
        max = max.max(c);
    }
    if temperature > 0.0 && max > min {
        let scale = (max - min) * temperature;
        let total: f64 = costs.iter().map(|c| (-(c - min) / scale).exp()).sum();
        let mut x = rng.random::<f64>() * total;
        for (i, c) in costs.iter().enumerate() {
            x -= (-(c - min) / scale).exp();
            if x <= 0.0 {
                return i;
            }
        }
        return costs.len() - 1;
    }
    // Reservoir sampling over the minima: one pass, uniform among ties.
    let mut chosen = 0;
    let mut seen = 0u32;
    for (i, &c) in costs.iter().enumerate() {
        if c == min {
            seen += 1;
            if seen == 1 || rng.random_range(0..seen) == 0 {
                chosen = i;
            }
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    fn ctx(isl: u64) -> CostContext {
        CostContext {
            isl_tokens: isl,
            block_size: 16,
            track_prefill_tokens: true,
            min_active_prefill_tokens: 0,
        }
    }

    #[test]
    fn preferred_taints_scale_by_exp_minus_tanh_of_the_matching_weights() {
        let taints = vec!["a".to_string(), "b".to_string()];
        let none: [(&str, f32); 0] = [];
        assert_eq!(preferred_taint_factor(&none, &taints), 1.0);
        assert_eq!(preferred_taint_factor(&[("c", 2.0)], &taints), 1.0);
        let both = preferred_taint_factor(&[("a", 0.5), ("b", 0.25), ("c", 9.0)], &taints);
        assert!((both - (-(0.75f64).tanh()).exp()).abs() < 1e-12);
        // A negative weight penalises.
        assert!(preferred_taint_factor(&[("a", -1.0)], &taints) > 1.0);
    }

    fn load(device: u32, host_ext: u32, disk_ext: u32) -> CandidateLoad {
        CandidateLoad {
            overlap: Overlap {
                device,
                host_ext,
                disk_ext,
            },
            new_blocks: 8,
            ..Default::default()
        }
    }

    /// Spec §7.3 worked check: bs 16, 128-token prompt, A device 2; B device 1
    /// + host 3 + disk 2; C host 4; D nothing.
    #[test]
    fn tiered_worked_example() {
        let cfg = RouterConfig::default();
        let c = ctx(128);
        let costs: Vec<f64> = [load(2, 0, 0), load(1, 3, 2), load(0, 4, 0), load(0, 0, 0)]
            .iter()
            .map(|l| cost(l, &cfg, &c))
            .collect();
        assert_eq!(costs, vec![14.0, 12.25, 13.0, 16.0]);
        let eff: Vec<u64> = [load(2, 0, 0), load(1, 3, 2), load(0, 4, 0), load(0, 0, 0)]
            .iter()
            .map(|l| effective_prefill_tokens(&l.overlap, &cfg, &c))
            .collect();
        assert_eq!(eff, vec![96, 68, 80, 128]);
        let mut rng = SmallRng::seed_from_u64(1);
        assert_eq!(choose(&costs, 0.0, &mut rng), 1);
    }

    #[test]
    fn decode_and_prefill_backlog_shift_the_choice() {
        let cfg = RouterConfig::default();
        let c = ctx(128);
        let mut a = load(2, 0, 0);
        let b = load(0, 0, 0);
        a.active_decode_blocks = 1;
        assert_eq!(cost(&a, &cfg, &c), 15.0);
        let mut b2 = b;
        b2.active_prefill_tokens = 48;
        assert_eq!(cost(&b2, &cfg, &c), 19.0);
        // Credit 0 via the environment: A 17 > B 16.
        let zero_credit = RouterConfig {
            overlap_score_credit: 0.0,
            ..cfg
        };
        assert_eq!(cost(&a, &zero_credit, &c), 17.0);
        let zero_scale = RouterConfig {
            prefill_load_scale: 0.0,
            ..cfg
        };
        assert_eq!(cost(&a, &zero_scale, &c), 9.0);
        assert_eq!(cost(&b, &zero_scale, &c), 8.0);
    }

    /// Prefill untracked, measured against the reference (bs 16, an
    /// 11-block prompt): a rank with device 2 + host 4 (credit 5) and d
    /// decode blocks against an idle rank wins for d = 4, ties at 5, and
    /// with prefill_load_scale 2 loses at 7 (the credit is not scaled);
    /// with overlap_score_credit 2 (credit 7) it ties at 7.
    #[test]
    fn untracked_prefill_still_credits_the_cache() {
        let cfg = RouterConfig::default();
        let c = CostContext {
            track_prefill_tokens: false,
            ..ctx(190)
        };
        let idle = CandidateLoad {
            new_blocks: 11,
            ..Default::default()
        };
        let cached = |d: u64| CandidateLoad {
            overlap: Overlap {
                device: 2,
                host_ext: 4,
                disk_ext: 0,
            },
            active_decode_blocks: d,
            new_blocks: 11,
            ..Default::default()
        };
        assert_eq!(cost(&idle, &cfg, &c), 11.0);
        assert_eq!(cost(&cached(4), &cfg, &c), 10.0);
        assert_eq!(cost(&cached(5), &cfg, &c), 11.0);
        let scaled = RouterConfig {
            prefill_load_scale: 2.0,
            ..cfg
        };
        assert_eq!(cost(&cached(7), &scaled, &c), 13.0);
        let credit2 = RouterConfig {
            overlap_score_credit: 2.0,
            ..cfg
        };
        assert_eq!(cost(&cached(7), &credit2, &c), 11.0);
    }

    #[test]
    fn ties_split_uniformly() {
        let mut rng = SmallRng::seed_from_u64(7);
        let mut counts = [0u32; 3];
        for _ in 0..3000 {
            counts[choose(&[5.0, 5.0, 5.0], 0.0, &mut rng)] += 1;
        }
        for c in counts {
            assert!((850..1150).contains(&c), "{counts:?}");
        }
        assert_eq!(choose(&[3.0, 1.0, 2.0], 0.0, &mut rng), 1);
    }

    #[test]
    fn temperature_spreads_close_costs() {
        let mut rng = SmallRng::seed_from_u64(3);
        let mut counts = [0u32; 2];
        for _ in 0..2000 {
            counts[choose(&[15.0, 16.0], 5.0, &mut rng)] += 1;
        }
        // weights 1 and exp(-1/5) = 0.82: about 55/45.
        assert!(counts[1] > 700 && counts[0] > counts[1], "{counts:?}");
    }

    #[test]
    fn override_weights_apply() {
        let base = RouterConfig::default();
        let o = RouterConfigOverride {
            overlap_score_weight: Some(0.0),
            router_temperature: Some(1.5),
            track_prefill_tokens: Some(false),
            ..Default::default()
        };
        let c = effective_config(&base, Some(&o));
        assert_eq!(c.prefill_load_scale, 0.0);
        assert_eq!(c.overlap_score_credit, 0.0);
        assert_eq!(c.router_temperature, 1.5);
        assert!(!c.track_prefill_tokens);
        assert_eq!(effective_config(&base, None), base);
    }
}
