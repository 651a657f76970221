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

/// A small deterministic generator (xorshift64), so failures replay.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One array element: valid ids of every width 1 to 10 (most of them),
/// values at and just past `u32::MAX`, 11+ digits, leading zeros, minus
/// signs, fractions, exponents, and a few non-numbers.
fn element(r: &mut Rng) -> String {
    match r.below(40) {
        0 => format!("0{}", r.below(100_000)),
        1 => format!("-{}", r.below(100_000)),
        2 => format!("{}e{}", r.below(1000), r.below(3)),
        3 => format!("{}.{}", r.below(1000), r.below(10)),
        4 => (u32::MAX as u64 - r.below(5)).to_string(),
        5 => (u32::MAX as u64 + 1 + r.below(1000)).to_string(),
        6 => format!(
            "{}{}",
            r.below(10_000_000_000) + 10_000_000_000,
            r.below(10)
        ),
        7 => "00".to_string(),
        8 => "-0".to_string(),
        9 => ["true", "null", "\"5\"", "[1]", ""][r.below(5) as usize].to_string(),
        _ => {
            let width = 1 + r.below(10) as u32;
            let lo = if width == 1 { 0 } else { 10u64.pow(width - 1) };
            (lo + r.below(10u64.pow(width) - lo))
                .min(u32::MAX as u64)
                .to_string()
        }
    }
}

/// A separator: mostly `,` and `, `, sometimes other whitespace around it.
fn separator(r: &mut Rng) -> &'static str {
    const SEPS: [&str; 12] = [
        ",", ",", ",", ",", ", ", ", ", ",  ", " ,", ",\n", "\t,", ",\r\n ", " , ",
    ];
    SEPS[r.below(SEPS.len() as u64) as usize]
}

/// `body` parsed by every vector run equals the scalar loop exactly
/// (values, error texts and offsets), and every loop agrees with the
/// serde_json oracle on the class and the values. Returns whether the
/// body parsed.
fn check_all_paths(body: &[u8]) -> bool {
    use crate::parse::oracle::{differential_select_with, parse_debug, BodyKind};
    use crate::parse::{NumberPath, Parser};
    let scalar = Parser::default().with_number_path(NumberPath::Scalar);
    let want = parse_debug(&scalar, BodyKind::Select, body);
    differential_select_with(&scalar, body);
    for (path, name) in NumberPath::available_vectors() {
        let v = Parser::default().with_number_path(path);
        assert_eq!(
            want,
            parse_debug(&v, BodyKind::Select, body),
            "scalar != {name} on {:?}",
            String::from_utf8_lossy(body)
        );
        differential_select_with(&v, body);
    }
    want.is_ok()
}

/// Random arrays: random widths (1 to 10 digits), random spacing, and the
/// odd elements of [`element`] at random places; the padding before the
/// array moves it across every step alignment.
#[test]
fn random_arrays_equal_scalar_and_serde() {
    let mut r = Rng(0x2545_F491_4F6C_DD1D);
    let mut ok = 0;
    for case in 0..3000 {
        let len = r.below(if case % 10 == 0 { 400 } else { 60 }) as usize;
        // Mostly clean arrays (the vector runs' home ground), some with
        // odd elements and separators.
        let odd = r.below(3) == 0;
        let mut s = format!(
            r#"{{"model_name":"{}","token_ids":["#,
            "m".repeat(r.below(64) as usize)
        );
        for k in 0..len {
            if k > 0 {
                s.push_str(if odd || r.below(8) == 0 {
                    separator(&mut r)
                } else {
                    ","
                });
            }
            if odd && r.below(6) == 0 {
                s.push_str(&element(&mut r));
            } else {
                let width = 1 + r.below(10) as u32;
                let v = r.below(10u64.pow(width));
                s.push_str(&v.min(u32::MAX as u64).to_string());
            }
        }
        s.push_str(["]", " ]", ",]", "\n]"][r.below(4) as usize]);
        s.push_str(r#","isl_tokens":3}"#);
        ok += check_all_paths(s.as_bytes()) as usize;
    }
    assert!(ok > 1000, "{ok}");
}

/// One valid body of ids of every width, then: every byte of its array
/// replaced by each of a set of bad (or merely different) bytes, a byte
/// inserted at every position, and the body cut at every length. Every
/// vector run equals the scalar loop (and the oracle) on each.
#[test]
fn bad_bytes_and_cuts_at_every_position() {
    let mut r = Rng(0x9E37_79B9_7F4A_7C15);
    let ids: Vec<String> = (0..90)
        .map(|k| {
            let width = 1 + (k % 10) as u32;
            let lo = if width == 1 { 0 } else { 10u64.pow(width - 1) };
            (lo + r.below(10u64.pow(width) - lo))
                .min(u32::MAX as u64)
                .to_string()
        })
        .collect();
    let body = format!(
        r#"{{"model_name":"qwen","token_ids":[{}],"isl_tokens":3}}"#,
        ids.join(",")
    );
    let b = body.as_bytes();
    assert!(check_all_paths(b));
    let start = body.find('[').unwrap();
    let end = body.find(']').unwrap();
    let bad = [
        b'x', b'-', b'+', b'.', b'e', b'E', b' ', b'\n', b'\t', b',', b']', b'[', b'0', b'9', b'"',
        b'/', b':', 0x00, 0x80, 0xFF,
        // Around the wrap of the AVX2 digit test ('0'..='9' + 0x50 are the
        // signed bytes -128..=-119): none of these is a digit.
        0x7F, 0xAF, 0xB0, 0xB9, 0xC9, 0xD0,
    ];
    let mut ok = 0;
    for at in start..=end {
        for &c in &bad {
            let mut v = b.to_vec();
            v[at] = c;
            ok += check_all_paths(&v) as usize;
            let mut v = b.to_vec();
            v.insert(at, c);
            ok += check_all_paths(&v) as usize;
        }
    }
    // Some replacements are still valid (a digit for a digit, `,` + ` `).
    assert!(ok > 100, "{ok}");
    for cut in 0..b.len() {
        assert!(!check_all_paths(&b[..cut]), "cut at {cut}");
    }
}
