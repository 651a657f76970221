//! Property tests of the streamed path (`src/parse/stream.rs`): a body cut
//! into frames at random boundaries (and, for small bodies, at every
//! boundary and every pair of boundaries) parses exactly as the whole-body
//! parser parses it (same class, values, error text, offset and path) on
//! every token loop this CPU has; the whole-body parser is in turn held to
//! serde_json on the same bodies. Valid token bodies must really be
//! converted while streaming, not by the fall-back.

use kvselect::parse::oracle::{
    differential_select, random_cuts, stream_differential, stream_differential_with, BodyKind,
    STREAMED_KINDS,
};
use kvselect::parse::{NumberPath, ParseLimits, Parser};
use proptest::prelude::*;

#[path = "common/token_soup.rs"]
mod soup;
use soup::{element, separator};

/// Every streamed kind at `cuts`, then serde_json on the whole body; the
/// number of token arrays the select stream converted.
fn check(body: &[u8], cuts: &[usize]) -> usize {
    static PRINT: std::sync::Once = std::sync::Once::new();
    PRINT.call_once(|| {
        eprintln!(
            "parse paths tested: {}",
            NumberPath::names(&NumberPath::available())
        )
    });
    let mut converted = 0;
    for kind in STREAMED_KINDS {
        let n = stream_differential(kind, body, cuts);
        if kind == BodyKind::Select {
            converted = n;
        }
    }
    differential_select(body);
    converted
}

/// Sorted, distinct cut positions inside a body of `len` bytes.
fn cuts(len: usize, picks: &[prop::sample::Index]) -> Vec<usize> {
    let mut c: Vec<usize> = picks.iter().map(|p| p.index(len.max(1))).collect();
    c.sort_unstable();
    c.dedup();
    c
}

fn array(elems: &[(String, String)]) -> String {
    let mut s = String::from("[");
    for (i, (e, sep)) in elems.iter().enumerate() {
        if i > 0 {
            s.push_str(sep);
        }
        s.push_str(e);
    }
    s
}

/// A prompt body: fields around `token_ids` and `mm_routing_info`, in any
/// order, sometimes twice, sometimes malformed.
fn body() -> impl Strategy<Value = String> {
    (
        prop::collection::vec((element(), separator()), 0..300),
        prop::collection::vec((element(), separator()), 0..40),
        prop_oneof![4 => Just("]"), 1 => Just(" ]"), 1 => Just(",]"), 1 => Just("")],
        0u8..8,
        any::<bool>(),
    )
        .prop_map(|(tokens, routing, close, extras, mm_first)| {
            let mut fields = vec![format!("\"token_ids\":{}{close}", array(&tokens))];
            if extras & 1 != 0 {
                fields.push(format!(
                    "\"mm_routing_info\":{{\"block_mm_infos\":[null],\"routing_token_ids\":{}]}}",
                    array(&routing)
                ));
            }
            if extras & 2 != 0 {
                fields.push(
                    "\"model_name\":\"m\\\"[\",\"selection_id\":\"s-1\",\"x\":{\"token_ids\":[1,2]}"
                        .into(),
                );
            }
            if extras & 4 != 0 {
                fields.push("\"block_hashes\":[-1,9223372036854775807],\"isl_tokens\":3".into());
            }
            if mm_first {
                fields.reverse();
            }
            format!("{{{}}}", fields.join(","))
        })
}

/// A valid body of well-formed ids (the streamed path's home ground).
fn valid_body() -> impl Strategy<Value = String> {
    (
        prop::collection::vec(any::<u32>().prop_map(|v| v >> (v % 32)), 1..600),
        separator().prop_filter("valid", |s| s != ",," && s != " "),
        any::<bool>(),
    )
        .prop_map(|(ids, sep, mm)| {
            let items: Vec<String> = ids.iter().map(|v| v.to_string()).collect();
            let arr = items.join(&sep);
            if mm {
                format!(
                    "{{\"selection_id\":\"s\",\"token_ids\":[{arr}],\"mm_routing_info\":{{\"routing_token_ids\":[{arr}]}}}}"
                )
            } else {
                format!("{{\"selection_id\":\"s\",\"token_ids\":[{arr}]}}")
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, .. ProptestConfig::default() })]

    #[test]
    fn random_bodies_at_random_cuts(b in body(), picks in prop::collection::vec(any::<prop::sample::Index>(), 0..40)) {
        check(b.as_bytes(), &cuts(b.len(), &picks));
    }

    #[test]
    fn random_bodies_in_small_frames(b in body(), seed in any::<u8>()) {
        check(b.as_bytes(), &random_cuts(seed, b.len()));
    }

    /// Valid bodies: same ids, and converted by the stream itself.
    #[test]
    fn valid_bodies_are_converted_while_streaming(b in valid_body(), seed in any::<u8>()) {
        let converted = check(b.as_bytes(), &random_cuts(seed, b.len()));
        prop_assert!(converted >= 1, "the stream fell back on a valid body");
    }

    /// One byte of a valid body replaced, inserted or deleted.
    #[test]
    fn mutated_bodies(b in valid_body(), pos in any::<prop::sample::Index>(), byte in any::<u8>(), op in 0u8..3, seed in any::<u8>()) {
        let mut v = b.into_bytes();
        let i = pos.index(v.len() + 1);
        match op {
            0 if i < v.len() => v[i] = byte,
            1 => v.insert(i, byte),
            _ if i < v.len() => { v.remove(i); }
            _ => v.push(byte),
        }
        check(&v, &random_cuts(seed, v.len()));
    }

    #[test]
    fn arbitrary_bytes(v in prop::collection::vec(any::<u8>(), 0..200), seed in any::<u8>()) {
        check(&v, &random_cuts(seed, v.len()));
    }

    #[test]
    fn token_soup(parts in prop::collection::vec(prop_oneof![
        Just("{"), Just("}"), Just("["), Just("]"), Just(","), Just(":"), Just(" "),
        Just("\"token_ids\""), Just("\"mm_routing_info\""), Just("\"routing_token_ids\""),
        Just("\"token\\u005fids\""), Just("\"model_name\""), Just("\"x\""), Just("\"\\\"\""),
        Just("1"), Just("-1"), Just("0"), Just("01"), Just("12345"), Just("1.5"), Just("true"), Just("null"),
    ], 0..40), seed in any::<u8>()) {
        let b = parts.concat();
        check(b.as_bytes(), &random_cuts(seed, b.len()));
    }
}

/// Small bodies, valid and invalid, cut at every boundary and at every pair
/// of boundaries.
#[test]
fn small_bodies_at_every_boundary() {
    let bodies: &[&str] = &[
        r#"{"token_ids":[1,22,333,4444,55555,4294967295]}"#,
        r#"{"token_ids":[ 1 , 2 ,3 ],"model_name":"m"}"#,
        r#"{"model_name":"a\"b","token_ids":[0,10,200],"isl_tokens":3}"#,
        r#"{"token_ids":[],"selection_id":"s"}"#,
        r#"{"token_ids":null}"#,
        r#"{"mm_routing_info":{"routing_token_ids":[7,8,9]},"token_ids":[1,2]}"#,
        r#"{"mm_routing_info":[[7,8,9]],"token_ids":[1,2]}"#,
        r#"{"token\u005fids":[1,2]}"#,
        r#"{"x":{"token_ids":[1,2]},"token_ids":[3]}"#,
        r#"{"token_ids":[1,2],"token_ids":[3]}"#,
        r#"{"token_ids":[1,2,]}"#,
        r#"{"token_ids":[1,02]}"#,
        r#"{"token_ids":[1,2.5]}"#,
        r#"{"token_ids":[1,4294967296]}"#,
        r#"{"token_ids":[1,-2]}"#,
        r#"{"token_ids":[1 2]}"#,
        r#"{"token_ids":[1,2]"#,
        r#"{"token_ids":[1,2"#,
        r#"{"token_ids":[1,2]} x"#,
        r#"{"token_ids":[1,2],"model_name":7}"#,
        r#"{"model_name":7,"token_ids":[1,2]}"#,
        r#"{"token_ids":[1,2],"pinned_worker":{"worker_id":1}}"#,
        r#"{"token_ids":[1,2],"x":[1,}"#,
        r#"[{"token_ids":[1,2]}]"#,
        r#"{"token_ids":[1,2],"selection_id":"s","worker_id":1,"dp_rank":0}"#,
        "{\"token_ids\":[1,\n2],\n\"is_eagle\":\"no\"}",
    ];
    let mut pairs = 0;
    for b in bodies {
        let b = b.as_bytes();
        check(b, &[]);
        for i in 1..b.len() {
            check(b, &[i]);
            for j in i + 1..b.len() {
                for kind in STREAMED_KINDS {
                    stream_differential(kind, b, &[i, j]);
                }
                pairs += 1;
            }
        }
        // Every byte its own frame.
        check(b, &(1..b.len()).collect::<Vec<_>>());
    }
    assert!(pairs > 10_000, "{pairs} cut pairs");
}

/// The 100k-token body in 16 KiB and 64 KiB frames and in odd sizes: the
/// ids of the whole-body parse, converted while streaming.
#[test]
fn large_body_in_frames() {
    let ids: Vec<String> = (0..100_000u32)
        .map(|i| (i * 7919 % 151_936).to_string())
        .collect();
    let b = format!(
        r#"{{"model_name":"qwen","selection_id":"s-1","token_ids":[{}],"isl_tokens":100000}}"#,
        ids.join(",")
    );
    for frame in [16 * 1024, 64 * 1024, 8191, 1000, 97] {
        let cuts: Vec<usize> = (1..=b.len() / frame).map(|k| k * frame).collect();
        for kind in STREAMED_KINDS {
            let p = Parser::default();
            assert_eq!(
                stream_differential_with(&p, kind, b.as_bytes(), &cuts),
                1,
                "{kind:?} fell back"
            );
        }
    }
    // With the hashes of its 6,250 blocks after it: still streamed.
    let hashes: Vec<String> = (0..6_250i64)
        .map(|i| (i * -7_919_000_000_123).to_string())
        .collect();
    let both = format!(
        r#"{}, "block_hashes":[{}]}}"#,
        &b[..b.len() - 1],
        hashes.join(",")
    );
    let cuts: Vec<usize> = (1..=both.len() / 16384).map(|k| k * 16384).collect();
    let p = Parser::default();
    assert_eq!(
        stream_differential_with(&p, BodyKind::Select, both.as_bytes(), &cuts),
        1
    );
    // Only 100k hashes: the front gives the body to the whole-body parser.
    let hashes: Vec<String> = (0..100_000i64)
        .map(|i| (i * -7_919_000_000_123).to_string())
        .collect();
    let only = format!(
        r#"{{"model_name":"m","block_hashes":[{}]}}"#,
        hashes.join(",")
    );
    let cuts: Vec<usize> = (1..=only.len() / 16384).map(|k| k * 16384).collect();
    assert_eq!(
        stream_differential_with(&p, BodyKind::Select, only.as_bytes(), &cuts),
        0
    );
    // One token over the limit: the whole-body 413, with its offset.
    let p = Parser::default();
    let tight = Parser {
        limits: ParseLimits {
            max_tokens: 99_999,
            ..p.limits
        },
        ..p
    };
    let cuts: Vec<usize> = (1..=b.len() / 4096).map(|k| k * 4096).collect();
    assert_eq!(
        stream_differential_with(&tight, BodyKind::Select, b.as_bytes(), &cuts),
        0
    );
}
