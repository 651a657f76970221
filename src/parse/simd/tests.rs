//! The helpers against plain arithmetic, and every vector run this CPU has
//! against the scalar loop (values and errors) at every alignment.

use super::*;

#[test]
fn swar_converts_every_length() {
    let text = b"4294967295,,,,,,,,,,,,,,,,";
    for n in 1..=10 {
        let want: u64 = std::str::from_utf8(&text[..n]).unwrap().parse().unwrap();
        assert_eq!(digits_value(text, 0, n), want, "n={n}");
    }
    assert_eq!(digits_value(b"0000000000", 0, 1), 0);
}

/// Every block alignment (the padding shifts the array start) and a
/// refused element at many positions, including across block
/// boundaries: the AVX2 and AVX-512 runs must give exactly the scalar
/// loop's result.
#[test]
fn fixed_blocks_equal_scalar_at_every_alignment() {
    use crate::parse::oracle::{parse_debug, BodyKind};
    use crate::parse::{NumberPath, Parser};
    let scalar = Parser::default().with_number_path(NumberPath::Scalar);
    let paths = NumberPath::available_vectors();
    eprintln!("parse paths tested: scalar, {}", NumberPath::names(&paths));
    let vector: Vec<(Parser, &str)> = paths
        .iter()
        .map(|&(p, name)| (Parser::default().with_number_path(p), name))
        .collect();
    let ids: Vec<String> = (0..120u64)
        .map(|k| {
            // Mostly 1-7 digits (the vector path), a 10-digit id now and
            // then (the exact path).
            let digits = if k % 37 == 36 { 10 } else { k % 7 + 1 };
            ((k * 2_654_435_761) % 10u64.pow(digits as u32) % (1 << 32)).to_string()
        })
        .collect();
    let odd = [
        "0123",
        "-5",
        "1.5",
        "4294967296",
        "12345678901",
        "00",
        " 7",
        "\n7",
        "",
        "1e3",
        "99999999999999999999999",
        "4294967295",
        " ]",
    ];
    let mut checked_ok = 0;
    for pad in 0..64 {
        for at in 0..60 {
            for o in odd.iter().take(if at == 0 { 1 } else { odd.len() }) {
                let mut elems = ids.clone();
                if at > 0 {
                    elems[at] = o.to_string();
                }
                let body = format!(
                    r#"{{"model_name":"{}","routing_group":"d","token_ids":[{}]}}"#,
                    "m".repeat(pad),
                    elems.join(if pad % 2 == 0 { "," } else { ", " })
                );
                let want = parse_debug(&scalar, BodyKind::Select, body.as_bytes());
                checked_ok += want.is_ok() as usize;
                for (v, name) in &vector {
                    assert_eq!(
                        want,
                        parse_debug(v, BodyKind::Select, body.as_bytes()),
                        "{name}: {body}"
                    );
                }
            }
        }
    }
    assert!(checked_ok > 64, "{checked_ok}");
}

/// Dense arrays (32 one-digit numbers per 64 bytes, the most one step
/// finishes), mixed lengths up to 10 digits, both separator styles, and
/// element limits just below, at and above the array's length: every
/// vector run equals the scalar loop, values and errors.
#[test]
fn dense_arrays_and_limits_equal_scalar() {
    use crate::parse::oracle::{parse_debug, BodyKind};
    use crate::parse::{NumberPath, ParseLimits, Parser};
    let mk = |path, max_tokens| {
        Parser::new(
            ParseLimits {
                max_tokens,
                ..ParseLimits::default()
            },
            Default::default(),
            Default::default(),
        )
        .with_number_path(path)
    };
    let paths = NumberPath::available_vectors();
    eprintln!("parse paths tested: scalar, {}", NumberPath::names(&paths));
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for (len, max_digits) in [(300, 1), (301, 2), (257, 5), (400, 9), (333, 10)] {
        let ids: Vec<String> = (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let digits = 1 + (x % max_digits) as u32;
                let v = (x >> 8) % 10u64.pow(digits);
                v.min(u32::MAX as u64).to_string()
            })
            .collect();
        for sep in [",", ", "] {
            let body = format!(r#"{{"token_ids":[{}]}}"#, ids.join(sep));
            for max in [len - 33, len - 1, len, len + 1] {
                let want = parse_debug(
                    &mk(NumberPath::Scalar, max),
                    BodyKind::Select,
                    body.as_bytes(),
                );
                assert_eq!(want.is_ok(), max >= len, "{max} {len}");
                for &(path, name) in &paths {
                    let got = parse_debug(&mk(path, max), BodyKind::Select, body.as_bytes());
                    assert_eq!(want, got, "{name} max {max}: {body}");
                }
            }
        }
    }
}
