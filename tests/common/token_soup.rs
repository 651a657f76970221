//! Token-array elements and separators for the parser property tests
//! (`parse_props.rs`, `parse_stream.rs`): mostly valid ids of every length,
//! sometimes a value or separator the fast paths must refuse.

use proptest::prelude::*;

/// One array element: mostly valid ids of every length, sometimes a value
/// the fast paths must refuse.
pub fn element() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => (0u32..151_936).prop_map(|v| v.to_string()),
        3 => any::<u32>().prop_map(|v| v.to_string()),
        1 => (0u32..10).prop_map(|v| v.to_string()),
        1 => Just(u32::MAX.to_string()),
        1 => Just("4294967296".to_string()),
        1 => Just("99999999999".to_string()),
        1 => Just("18446744073709551616".to_string()),
        1 => (1u32..1000).prop_map(|v| format!("0{v}")),
        1 => (0u32..1000).prop_map(|v| format!("-{v}")),
        1 => Just("-0".to_string()),
        1 => (0u32..100).prop_map(|v| format!("{v}.5")),
        1 => (0u32..100).prop_map(|v| format!("{v}e2")),
        1 => (0u32..100).prop_map(|v| format!("{v}E-1")),
        1 => Just("1.".to_string()),
        1 => Just("true".to_string()),
        1 => Just("null".to_string()),
        1 => Just("\"7\"".to_string()),
        1 => Just("[1]".to_string()),
        1 => Just("".to_string()),
        1 => Just("NaN".to_string()),
    ]
}

pub fn separator() -> impl Strategy<Value = String> {
    prop_oneof![
        10 => Just(",".to_string()),
        6 => Just(", ".to_string()),
        1 => Just(" ,".to_string()),
        1 => Just(",\n  ".to_string()),
        1 => Just(",\t".to_string()),
        1 => Just(",  ".to_string()),
        1 => Just(",,".to_string()),
        1 => Just(" ".to_string()),
    ]
}
