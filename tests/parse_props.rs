//! Property tests: the AVX2 and AVX-512 token loops (those this CPU has)
//! equal the scalar loop exactly (values and errors), and both agree with serde_json (the oracle) on the class
//! (ok / 400 / 422) and on the values, on random and adversarial bodies.

use kvselect::parse::oracle::{differential_select, parse_debug, BodyKind};
use kvselect::parse::{NumberPath, Parser};
use proptest::prelude::*;

#[path = "common/token_soup.rs"]
mod soup;
use soup::{element, separator};

/// The scalar loop and the vector loops it is compared with: only those
/// this CPU has (named, and printed once per run).
fn parsers() -> (Parser, Vec<(Parser, &'static str)>) {
    static PRINT: std::sync::Once = std::sync::Once::new();
    PRINT.call_once(|| {
        eprintln!(
            "parse paths tested: {}",
            NumberPath::names(&NumberPath::available())
        )
    });
    let p = Parser::default();
    (
        p.clone().with_number_path(NumberPath::Scalar),
        NumberPath::available_vectors()
            .into_iter()
            .map(|(path, name)| (p.clone().with_number_path(path), name))
            .collect(),
    )
}

/// All loops, then the oracle.
fn check(body: &[u8]) {
    let (scalar, vector) = parsers();
    for kind in [
        BodyKind::Select,
        BodyKind::PromptQuery,
        BodyKind::Reservation,
    ] {
        let want = parse_debug(&scalar, kind, body);
        for (v, name) in &vector {
            assert_eq!(
                want,
                parse_debug(v, kind, body),
                "scalar != {name} on {:?}",
                String::from_utf8_lossy(body)
            );
        }
    }
    differential_select(body);
}

/// A /select-like body whose token array mixes the elements above.
fn body() -> impl Strategy<Value = String> {
    (
        prop::collection::vec((element(), separator()), 0..300),
        any::<bool>(),
        prop_oneof![Just("]"), Just(" ]"), Just(",]"), Just("")],
        any::<bool>(),
    )
        .prop_map(|(elems, first_key, close, hashes)| {
            let mut s = String::from("{");
            if first_key {
                s.push_str("\"model_name\":\"m\",");
            }
            s.push_str("\"token_ids\":[");
            for (i, (e, sep)) in elems.iter().enumerate() {
                if i > 0 {
                    s.push_str(sep);
                }
                s.push_str(e);
            }
            s.push_str(close);
            if hashes {
                s.push_str(",\"block_hashes\":[-1,9223372036854775807],\"isl_tokens\":3");
            }
            s.push('}');
            s
        })
}

/// A valid body of only well-formed ids (the fast path's home ground).
fn valid_body() -> impl Strategy<Value = String> {
    (
        prop::collection::vec(any::<u32>().prop_map(|v| v >> (v % 32)), 0..400),
        separator().prop_filter("valid", |s| s != ",," && s != " "),
    )
        .prop_map(|(ids, sep)| {
            let items: Vec<String> = ids.iter().map(|v| v.to_string()).collect();
            format!("{{\"token_ids\":[{}]}}", items.join(&sep))
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, .. ProptestConfig::default() })]

    #[test]
    fn random_token_bodies(b in body()) {
        check(b.as_bytes());
    }

    #[test]
    fn valid_bodies_parse_to_the_same_ids(b in valid_body()) {
        let (scalar, vector) = parsers();
        let want: serde_json::Value = serde_json::from_str(&b).unwrap();
        let want: Vec<u32> = want["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        for p in std::iter::once(&scalar).chain(vector.iter().map(|(p, _)| p)) {
            let r = p.select(b.as_bytes(), kvselect::parse::SelectKind::Select).unwrap();
            prop_assert_eq!(&r.prompt.token_ids.as_ref().unwrap()[..], &want[..]);
        }
        check(b.as_bytes());
    }

    /// Adversarial: one byte of a valid body replaced, inserted or deleted.
    #[test]
    fn mutated_bodies(b in valid_body(), pos in any::<prop::sample::Index>(), byte in any::<u8>(), op in 0u8..3) {
        let mut v = b.into_bytes();
        let i = pos.index(v.len() + 1);
        match op {
            0 if i < v.len() => v[i] = byte,
            1 => v.insert(i, byte),
            _ if i < v.len() => { v.remove(i); }
            _ => v.push(byte),
        }
        check(&v);
    }

    /// Arbitrary bytes: no panic, and the oracle agrees.
    #[test]
    fn arbitrary_bytes(v in prop::collection::vec(any::<u8>(), 0..200)) {
        check(&v);
    }

    /// Arbitrary JSON-ish text built from JSON tokens.
    #[test]
    fn token_soup(parts in prop::collection::vec(prop_oneof![
        Just("{"), Just("}"), Just("["), Just("]"), Just(","), Just(":"), Just(" "),
        Just("\"token_ids\""), Just("\"model_name\""), Just("\"is_eagle\""), Just("\"pinned_worker\""),
        Just("\"worker_id\""), Just("\"dp_rank\""), Just("\"x\""), Just("\"\\u00e9\""), Just("\"\\ud800\""),
        Just("1"), Just("-1"), Just("0"), Just("01"), Just("1.5"), Just("true"), Just("null"), Just("\"a\""),
    ], 0..40)) {
        check(parts.concat().as_bytes());
    }
}
