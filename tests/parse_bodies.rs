//! Every body kind against the spec's observed request -> response table
//! (`selection-api.md` §2.2, §10): accepted values, the 400/422/413 class, and
//! serde's message texts and positions where the spec quotes them.

use kvselect::parse::*;
use kvselect::pool::Pool;

fn parser() -> Parser {
    Parser::default()
}

fn sel(body: &str) -> Result<SelectRequest<'_>, ParseError> {
    parser().select(body.as_bytes(), SelectKind::Select)
}

fn err(r: Result<impl std::fmt::Debug, ParseError>) -> ParseError {
    r.expect_err("expected an error")
}

/// `<path>: <message> at line L column C` as the reference prints it.
fn text(e: &ParseError) -> String {
    let head = if e.path.is_empty() {
        e.message.clone()
    } else {
        format!("{}: {}", e.path, e.message)
    };
    format!("{head} at line {} column {}", e.line, e.column)
}

#[test]
fn select_reads_every_field() {
    let body = r#"{"model_name":"m","routing_group":"g","selection_id":"s1","session_id":"ss",
      "session_context":{"session_id":"c","parent_session_id":"p","session_final":true,"input_trigger":"tool_result"},
      "router_config_override":{"overlap_score_credit":2.0,"prefill_load_scale":0.5,"overlap_score_weight":1,
        "router_temperature":0,"assume_kv_reuse":false,"track_prefill_tokens":true,"shared_cache_multiplier":0.25},
      "expected_output_tokens":7,"priority_jump":-1.5,"strict_priority":3,
      "pinned_worker":{"worker_id":18446744073709551615,"dp_rank":2},"affinity_target":{"worker_id":4},
      "allowed_worker_ids":[1,2,3],"routing_constraints":{"required_taints":["a","b"],"preferred_taints":{"x":0.5}},
      "advisory":true,"token_ids":[1, 2,3 ,4294967295],"block_hashes":[-1,9223372036854775807],
      "sequence_hashes":[],"isl_tokens":4,"lora_name":"l\u00e9","cache_salt":"salt","is_eagle":false,
      "block_mm_infos":[null,{"mm_objects":[{"mm_hash":5,"offsets":[[0,3]]}]}],
      "mm_routing_info":{"routing_token_ids":[9,8],"block_mm_infos":[]},
      "unknown":{"deep":[[[{"x":[1e5,-0.0,"\ud83d\ude00"]}]]]}}"#;
    let r = sel(body).unwrap();
    assert_eq!(r.model_name.as_deref(), Some("m"));
    assert_eq!(r.routing_group.as_deref(), Some("g"));
    assert_eq!(r.selection_id.as_deref(), Some("s1"));
    assert_eq!(r.session_id.as_deref(), Some("ss"));
    let sc = r.session_context.as_ref().unwrap();
    assert_eq!(sc.session_id, "c");
    assert_eq!(sc.parent_session_id.as_deref(), Some("p"));
    assert_eq!(sc.session_final, Some(true));
    assert_eq!(sc.input_trigger, Some(InputTrigger::ToolResult));
    let o = r.router_config_override.unwrap();
    assert_eq!(o.overlap_score_credit, Some(2.0));
    assert_eq!(o.overlap_score_weight, Some(1.0));
    assert_eq!(o.shared_cache_multiplier, Some(0.25));
    assert_eq!(o.assume_kv_reuse, Some(false));
    assert_eq!(r.expected_output_tokens, Some(7));
    assert_eq!(r.priority_jump, Some(-1.5));
    assert_eq!(r.strict_priority, Some(3));
    assert_eq!(
        r.pinned_worker,
        Some(PinnedWorker {
            worker_id: u64::MAX,
            dp_rank: 2
        })
    );
    assert_eq!(
        r.affinity_target,
        Some(AffinityTarget {
            worker_id: 4,
            dp_rank: None
        })
    );
    assert_eq!(r.allowed_worker_ids, Some(vec![1, 2, 3]));
    let rc = r.routing_constraints.as_ref().unwrap();
    assert_eq!(rc.required_taints, vec!["a", "b"]);
    assert_eq!(rc.preferred_taints[0].0, "x");
    assert_eq!(r.advisory, Some(true));
    let p = &r.prompt;
    assert_eq!(p.token_ids.as_deref().unwrap(), &[1, 2, 3, u32::MAX]);
    assert_eq!(
        p.block_hashes.as_deref().unwrap(),
        &[u64::MAX, i64::MAX as u64]
    );
    assert!(p.sequence_hashes.as_deref().unwrap().is_empty());
    assert_eq!(p.isl_tokens, Some(4));
    assert_eq!(p.lora_name.as_deref(), Some("lé"));
    assert_eq!(p.cache_salt.as_deref(), Some("salt"));
    assert_eq!(p.is_eagle, Some(false));
    assert_eq!(p.block_mm_infos, Some(vec![None, Some(vec![5])]));
    let mm = p.mm_routing_info.as_ref().unwrap();
    assert_eq!(mm.routing_token_ids.as_deref().unwrap(), &[9, 8]);
    assert_eq!(mm.block_mm_infos, Some(vec![]));
}

#[test]
fn strings_borrow_unless_escaped() {
    let r =
        sel(r#"{"model_name":"plain","routing_group":"a\"b","lora_name":"\ud83d\ude00"}"#).unwrap();
    assert!(matches!(
        r.model_name,
        Some(std::borrow::Cow::Borrowed("plain"))
    ));
    assert!(matches!(r.routing_group, Some(std::borrow::Cow::Owned(ref s)) if s == "a\"b"));
    assert_eq!(r.prompt.lora_name.as_deref(), Some("😀"));
    // An escaped key still matches its field.
    let r = sel(r#"{"model\u005fname":"m","token\u005fids":[1]}"#).unwrap();
    assert_eq!(r.model_name.as_deref(), Some("m"));
    assert_eq!(r.prompt.token_ids.as_deref().unwrap(), &[1]);
}

#[test]
fn nulls_and_empties_where_the_spec_allows_them() {
    let r = sel(r#" { "token_ids" : null , "selection_id":null } "#).unwrap();
    assert!(r.prompt.token_ids.is_none());
    assert!(r.model_name.is_none());
    // `model_name` and `routing_group` default when absent but are never
    // null: the reference answers 422 naming the field.
    for field in ["model_name", "routing_group"] {
        let e = sel(&format!(r#"{{"token_ids":[1],"{field}":null}}"#)).unwrap_err();
        assert_eq!(e.class, ErrorClass::Shape, "{field}");
        assert_eq!(e.path, field);
        assert!(
            e.message.contains("invalid type: null, expected a string"),
            "{e}"
        );
    }
    let r = sel("{\"token_ids\":[]}").unwrap();
    assert!(r.prompt.token_ids.as_deref().unwrap().is_empty());
    let r = sel("\t\r\n{\n\"token_ids\"\n:\n[\n1\n,\n2\n]\n}\n").unwrap();
    assert_eq!(r.prompt.token_ids.as_deref().unwrap(), &[1, 2]);
    assert!(sel("{}").is_ok());
    let r = parser()
        .select(
            br#"{"selection_id":null,"advisory":"skipped"}"#,
            SelectKind::SelectAndReserve,
        )
        .unwrap();
    assert!(r.selection_id.is_none());
    assert!(
        r.advisory.is_none(),
        "advisory is unknown for select_and_reserve"
    );
}

#[test]
fn spec_table_texts() {
    // §10 #9, #10
    let e = err(sel(r#"{"token_ids":[1"#));
    assert_eq!(e.class, ErrorClass::Syntax);
    assert_eq!(
        text(&e),
        "token_ids: EOF while parsing a list at line 1 column 15"
    );
    let e = err(sel(""));
    assert_eq!(text(&e), "EOF while parsing a value at line 1 column 0");
    assert_eq!(e.class, ErrorClass::Syntax);
    // #11, #12
    let e = err(sel("[]"));
    assert_eq!(e.class, ErrorClass::Shape);
    assert_eq!(
        text(&e),
        "invalid type: sequence, expected struct SelectRequest at line 1 column 0"
    );
    let e = err(sel("null"));
    assert_eq!(
        text(&e),
        "invalid type: null, expected struct SelectRequest at line 1 column 4"
    );
    // #13 .. #16: flattened prompt fields, no path, end of the object.
    let e = err(sel(r#"{"token_ids": [-1]}"#));
    assert_eq!(e.class, ErrorClass::Shape);
    assert_eq!(
        text(&e),
        "invalid value: integer `-1`, expected u32 at line 1 column 19"
    );
    let e = err(sel(r#"{"token_ids": [4294967296]}"#));
    assert_eq!(
        text(&e),
        "invalid value: integer `4294967296`, expected u32 at line 1 column 27"
    );
    let e = err(sel(r#"{"token_ids": [1.5]}"#));
    assert_eq!(
        text(&e),
        "invalid type: floating point `1.5`, expected u32 at line 1 column 20"
    );
    let e = err(sel(r#"{"token_ids": "abc"}"#));
    assert_eq!(
        text(&e),
        "invalid type: string \"abc\", expected a sequence at line 1 column 20"
    );
    // #17, #18
    let e = err(sel(r#"{"token_ids":[1],"is_eagle": "yes"}"#));
    assert_eq!(
        e.message,
        "invalid type: string \"yes\", expected a boolean"
    );
    assert_eq!(e.path, "");
    let e = err(sel(r#"{"model_name": 5}"#));
    assert_eq!(
        text(&e),
        "model_name: invalid type: integer `5`, expected a string at line 1 column 16"
    );
    // #47
    let e = err(sel(r#"{"block_hashes":[18446744073709551615]}"#));
    assert_eq!(
        e.message,
        "invalid value: integer `18446744073709551615`, expected i64"
    );
    // #51, #52, #80
    let e = err(sel(r#"{"pinned_worker":{"worker_id":15}}"#));
    assert_eq!(e.class, ErrorClass::Shape);
    assert_eq!(
        text(&e),
        "pinned_worker: missing field `dp_rank` at line 1 column 33"
    );
    let e = err(sel(
        r#"{"router_config_override":{"overlap_score_credit":-1}}"#,
    ));
    assert_eq!(e.class, ErrorClass::Shape);
    assert_eq!(
        e.to_string().split(" at line").next().unwrap(),
        "router_config_override: overlap_score_credit must be a finite, non-negative number"
    );
    let e = err(sel(r#"{"session_context":{"parent_session_id":"p"}}"#));
    assert_eq!(e.path, "session_context");
    assert_eq!(e.message, "missing field `session_id`");
    // #74 (we reject trailing garbage), #75
    let e = err(sel(r#"{"model_name":"hb16","token_ids":[1]} x"#));
    assert_eq!(e.class, ErrorClass::Syntax);
    assert_eq!(e.message, "trailing characters");
    let e = err(sel(
        r#"{"model_name":"hb16","model_name":"hb16","token_ids":[1]}"#,
    ));
    assert_eq!(e.class, ErrorClass::Shape);
    assert_eq!(text(&e), "duplicate field `model_name` at line 1 column 33");
}

#[test]
fn syntax_errors_are_400() {
    for body in [
        r#"{"token_ids":[1,]}"#,
        r#"{"token_ids":[1],}"#,
        r#"{"token_ids":[01]}"#,
        r#"{"token_ids":[NaN]}"#,
        r#"{"token_ids":[Infinity]}"#,
        "{\"lora_name\":\"a\u{1}b\"}",
        r#"{"lora_name":"\x"}"#,
        r#"{"lora_name":"\ud800"}"#,
        r#"{"lora_name":"\udc00x"}"#,
        r#"{"x":1e400}"#,
        r#"{"token_ids":[1] "#,
        r#"{"token_ids":[1]}}"#,
    ] {
        let e = err(sel(body));
        assert_eq!(e.class, ErrorClass::Syntax, "{body}: {e}");
    }
}

/// The first error in the order the reference reads the body wins, with
/// its text (measured against Dynamo 1.6.1 with
/// `harness/interop/http_diff.py`). A shape error in a field read straight
/// into the struct stops there, before any later syntax error; the
/// flattened prompt group's shape errors wait until the object's end, after
/// the other fields' errors and missing fields, and after any syntax error
/// in the object.
#[test]
fn errors_come_in_the_reference_reading_order() {
    for (body, want) in [
        // An offsets pair of more than two elements is read from the
        // prompt group's buffer: a shape error, counted and deferred
        // (a select_differential finding; texts measured on Dynamo 1.6.1).
        (
            r#"{"token_ids":[1,2],"mm_routing_info":[[5,6],[null,[[[7,[[0,888,8]]]]]]]}"#,
            "invalid length 3, expected 2 elements in sequence at line 1 column 72",
        ),
        (
            r#"{"token_ids":[1,2],"block_mm_infos":[null,{"mm_objects":[{"mm_hash":7,"offsets":[[0,1,2,"x",[3]]]}]}]}"#,
            "invalid length 5, expected 2 elements in sequence at line 1 column 102",
        ),
        (
            r#"{"token_ids":[1,2],"block_mm_infos":[null,{"mm_objects":[{"mm_hash":7,"offsets":[[0,1,tru]]}]}]}"#,
            "block_mm_infos[1].mm_objects[0].offsets[0][2]: expected ident at line 1 column 90",
        ),
        (
            r#"{"token_ids":[1,2],"block_mm_infos":[null,{"mm_objects":[[7,[[0,1]],tru]]}]}"#,
            "block_mm_infos[1].mm_objects[0][2]: expected ident at line 1 column 72",
        ),
        (
            r#"{"model_name":5, "x": tru}"#,
            "model_name: invalid type: integer `5`, expected a string at line 1 column 15",
        ),
        (
            r#"{"routing_constraints":{"required_taints":[1,x]}}"#,
            "routing_constraints.required_taints[0]: invalid type: integer `1`, expected a string at line 1 column 44",
        ),
        // Not nullable, as in the reference; the prompt's error waits (flatten).
        (
            r#"{"model_name":"m","token_ids":[1,2],"routing_constraints" : null }"#,
            "routing_constraints: invalid type: null, expected struct RoutingConstraints at line 1 column 64",
        ),
        (
            r#"{"token_ids":"x","routing_constraints":null}"#,
            "routing_constraints: invalid type: null, expected struct RoutingConstraints at line 1 column 43",
        ),
        (
            r#"{"allowed_worker_ids":[-1,2,3] ,"#,
            "allowed_worker_ids[0]: invalid value: integer `-1`, expected u64 at line 1 column 25",
        ),
        (
            "[1,",
            "invalid type: sequence, expected struct SelectRequest at line 1 column 0",
        ),
        (
            r#"{"token_ids":[-1], "x": [1,}"#,
            "x[1]: expected value at line 1 column 28",
        ),
        (
            r#"{"token_ids":[false],"model_name":5}"#,
            "model_name: invalid type: integer `5`, expected a string at line 1 column 35",
        ),
        (
            r#"{"token_ids":[false],"router_config_override":[1,2,3,4,5,6,7,8,9,10]}"#,
            "router_config_override[4]: invalid type: integer `5`, expected a boolean at line 1 column 56",
        ),
        (
            r#"{"token_ids":[false],"pinned_worker":[1,2,3]}"#,
            "pinned_worker: trailing characters at line 1 column 43",
        ),
        (
            r#"{"token_ids":[false],"model_name":"m","model_name":"m"}"#,
            "duplicate field `model_name` at line 1 column 50",
        ),
        (
            r#"{"token_ids":[false],"session_context":{}}"#,
            "session_context: missing field `session_id` at line 1 column 41",
        ),
        (
            r#"{"token_ids":[false],"token_ids":[1]}"#,
            "invalid type: boolean `false`, expected u32 at line 1 column 37",
        ),
        (
            r#"{"token_ids":[1],"token_ids":[false]}"#,
            "duplicate field `token_ids` at line 1 column 37",
        ),
        (
            "{\"token_ids\":[false]}   ",
            "invalid type: boolean `false`, expected u32 at line 1 column 21",
        ),
        (
            r#"{"model_name":"m","token_ids":[1,false,2,x]}"#,
            "token_ids[3]: expected value at line 1 column 42",
        ),
        // A duplicate struct field is found before its colon is read (after
        // the whitespace that follows its name); a prompt field's colon comes
        // first (the reference buffers the group).
        (
            r#"{"allowed_worker_ids":[499],"allowed_worker_ids"[[499]]}"#,
            "duplicate field `allowed_worker_ids` at line 1 column 48",
        ),
        (
            r#"{"model_name":"a",  "model_name"  "#,
            "duplicate field `model_name` at line 1 column 34",
        ),
        (
            r#"{"token_ids":[1],"token_ids"[1]}"#,
            "expected `:` at line 1 column 29",
        ),
        (
            r#"{"session_context":{"session_id":"a","session_id"1}}"#,
            "session_context: duplicate field `session_id` at line 1 column 49",
        ),
    ] {
        assert_eq!(text(&err(sel(body))), want, "{body}");
    }
    assert_eq!(err(sel(&"[".repeat(200))).class, ErrorClass::Shape);
    let r = parser().reservation(br#"{"worker_id":1,"token_ids":[false]}"#);
    assert_eq!(
        text(&err(r)),
        "missing field `selection_id` at line 1 column 35"
    );
}

/// Syntax errors where a key is expected carry serde_path_to_error's `?`
/// (none when that is the whole path); an unknown field of a struct the
/// reference reads directly is skipped as `IgnoredAny`, with no path inside
/// it and its strings checked only for their escapes' shape.
#[test]
fn paths_and_texts_of_skipped_and_unread_keys() {
    for (body, want) in [
        (
            r#"{"model_name":"m","#,
            "EOF while parsing a value at line 1 column 18",
        ),
        (
            r#"{"session_context":{"session_id":"a","#,
            "session_context.?: EOF while parsing a value at line 1 column 37",
        ),
        (
            r#"{"routing_constraints":{"preferred_taints":{"a":1"#,
            "routing_constraints.preferred_taints.?: EOF while parsing an object at line 1 column 49",
        ),
        (
            r#"{"routing_constraints":{"preferred_taints":{"a""#,
            "routing_constraints.preferred_taints: EOF while parsing an object at line 1 column 47",
        ),
        (
            r#"{"session_context":{"session_id":"a","x":{"y":[1,x]}}}"#,
            "session_context.x: expected value at line 1 column 50",
        ),
        (
            r#"{"y":{"z":[1,x]}}"#,
            "y.z[1]: expected value at line 1 column 14",
        ),
        (
            r#"{"model_name":1e16}"#,
            "model_name: invalid type: floating point `1e+16`, expected a string at line 1 column 18",
        ),
        (
            r#"{"model_name":2e3}"#,
            "model_name: invalid type: floating point `2000.0`, expected a string at line 1 column 17",
        ),
        (
            r#"{"model_name":"\ud800"}"#,
            "model_name: unexpected end of hex escape at line 1 column 22",
        ),
        (
            r#"{"model_name":"\uZZ"}"#,
            "model_name: invalid escape at line 1 column 21",
        ),
        // An enum's map form: the variant is checked before the colon, and
        // named in the path of its value's error.
        (
            r#"{"session_context":{"session_id":"s","input_trigger":{"S"}}}"#,
            "session_context.input_trigger: unknown variant `S`, expected one of `user_message`, `tool_result`, `other` at line 1 column 57",
        ),
        (
            r#"{"session_context":{"session_id":"s","input_trigger":{"other":1}}}"#,
            "session_context.input_trigger.other: invalid type: integer `1`, expected unit at line 1 column 63",
        ),
        (
            r#"{"session_context":{"session_id":"s","input_trigger":{1}}}"#,
            "session_context.input_trigger: key must be a string at line 1 column 55",
        ),
    ] {
        assert_eq!(text(&err(sel(body))), want, "{body}");
    }
    let bad_utf8 = parser().select(b"{\"model_name\":\"m\xff\"}", SelectKind::Select);
    assert_eq!(
        text(&err(bad_utf8)),
        "model_name: invalid unicode code point at line 1 column 18"
    );
    let w = |body: &[u8]| parser().worker_upsert(body);
    assert_eq!(
        text(&err(w(br#"{"worker_id":1,"token_ids":{"a":[1,x]}}"#))),
        "token_ids: expected value at line 1 column 36"
    );
    assert_eq!(
        text(&err(w(br#"{"worker_id":1,"zz":"\uZZ"}"#))),
        "zz: invalid escape at line 1 column 27"
    );
    // Lone surrogates and invalid UTF-8 in a skipped string pass, and so
    // does a number beyond f64's range (skipped by its shape).
    assert!(w(br#"{"worker_id":1,"zz":"\ud800x"}"#).is_ok());
    assert!(w(br#"{"worker_id":1,"zz":[-1.5e999, 1]}"#).is_ok());
    assert_eq!(
        text(&err(w(br#"{"worker_id":1,"zz":01}"#))),
        "zz: invalid number at line 1 column 22"
    );
    assert!(w(b"{\"worker_id\":1,\"zz\":{\"\xff\":\"\xfe\"}}").is_ok());
    assert_eq!(
        text(&err(w(br#""x""#))),
        "invalid type: string \"x\", expected struct WorkerRequest at line 1 column 3"
    );
    assert_eq!(
        text(&err(parser().worker_patch(br#""x""#))),
        "invalid type: string \"x\", expected struct WorkerPatchRequest at line 1 column 3"
    );
}

#[test]
fn shape_errors_are_422() {
    for (body, msg) in [
        (
            r#"{"token_ids":[-0]}"#,
            "invalid type: floating point `-0.0`, expected u32",
        ),
        (
            r#"{"token_ids":[1e2]}"#,
            "invalid type: floating point `100.0`, expected u32",
        ),
        (
            r#"{"token_ids":[1.0]}"#,
            "invalid type: floating point `1.0`, expected u32",
        ),
        (
            r#"{"token_ids":[true]}"#,
            "invalid type: boolean `true`, expected u32",
        ),
        (
            r#"{"token_ids":[null]}"#,
            "invalid type: null, expected u32",
        ),
        (
            r#"{"token_ids":[[1]]}"#,
            "invalid type: sequence, expected u32",
        ),
        (
            r#"{"is_eagle":"false"}"#,
            "invalid type: string \"false\", expected a boolean",
        ),
        (
            r#"{"is_eagle":0}"#,
            "invalid type: integer `0`, expected a boolean",
        ),
        (
            r#"{"token_ids":[1],"token_ids":[2]}"#,
            "duplicate field `token_ids`",
        ),
        (
            r#"{"isl_tokens":-5}"#,
            "invalid value: integer `-5`, expected usize",
        ),
        (
            r#"{"allowed_worker_ids":[1,"2"]}"#,
            "invalid type: string \"2\", expected u64",
        ),
        (
            "5",
            "invalid type: integer `5`, expected struct SelectRequest",
        ),
        (
            r#""s""#,
            "invalid type: string \"s\", expected struct SelectRequest",
        ),
    ] {
        let e = err(sel(body));
        assert_eq!(e.class, ErrorClass::Shape, "{body}: {e}");
        assert_eq!(e.message, msg, "{body}");
    }
    let e = err(sel(r#"{"allowed_worker_ids":[1,"2"]}"#));
    assert_eq!(e.path, "allowed_worker_ids[1]");
}

#[test]
fn limits_depth_and_tokens() {
    let limits = ParseLimits {
        max_depth: 4,
        max_tokens: 3,
    };
    let p = Parser::new(limits, Pool::default(), Pool::default());
    assert!(p
        .select(br#"{"token_ids":[1,2,3]}"#, SelectKind::Select)
        .is_ok());
    let e = p
        .select(br#"{"token_ids":[1,2,3,4]}"#, SelectKind::Select)
        .unwrap_err();
    assert_eq!(e.class, ErrorClass::TooLarge);
    assert!(p.select(br#"{"x":[[1]]}"#, SelectKind::Select).is_ok());
    let e = p
        .select(br#"{"x":[[[1]]]}"#, SelectKind::Select)
        .unwrap_err();
    assert_eq!(e.class, ErrorClass::Syntax);
    assert_eq!(e.message, "recursion limit exceeded");
    // serde_json's default: 127 levels pass, 128 do not.
    let deep = |n: usize| format!("{{\"x\":{}{}}}", "[".repeat(n - 1), "]".repeat(n - 1));
    assert!(sel(&deep(127)).is_ok());
    assert_eq!(err(sel(&deep(128))).class, ErrorClass::Syntax);
    // Long token arrays go through the SIMD run and still hit the limit.
    let limits = ParseLimits {
        max_depth: 128,
        max_tokens: 1000,
    };
    let p = Parser::new(limits, Pool::default(), Pool::default());
    let ok = format!("{{\"token_ids\":{:?}}}", (0..1000).collect::<Vec<u32>>());
    assert_eq!(
        p.select(ok.as_bytes(), SelectKind::Select)
            .unwrap()
            .prompt
            .token_ids
            .unwrap()
            .len(),
        1000
    );
    let big = format!("{{\"token_ids\":{:?}}}", (0..1001).collect::<Vec<u32>>());
    let e = p.select(big.as_bytes(), SelectKind::Select).unwrap_err();
    assert_eq!(e.class, ErrorClass::TooLarge);
}

#[test]
fn reservations_both_forms() {
    let p = parser();
    let r = p
        .reservation(br#"{"selection_id":"c1","model_name":"rv","token_ids":[9,9,9]}"#)
        .unwrap();
    assert_eq!(r.selection_id, "c1");
    assert!(r.worker_id.is_none());
    assert_eq!(r.prompt.token_ids.as_deref().unwrap(), &[9, 9, 9]);
    let r = p
        .reservation(
            br#"{"selection_id":"x","worker_id":400,"dp_rank":5,"effective_prefill_tokens":41,
                "isl_tokens":40,"sequence_hashes":[1],"track_prefill_tokens":false}"#,
        )
        .unwrap();
    assert_eq!(r.worker_id, Some(400));
    assert_eq!(r.dp_rank, Some(5));
    assert_eq!(r.effective_prefill_tokens, Some(41));
    assert_eq!(r.track_prefill_tokens, Some(false));
    let e = p.reservation(br#"{"model_name": "x"}"#).unwrap_err();
    assert_eq!(e.class, ErrorClass::Shape);
    assert_eq!(text(&e), "missing field `selection_id` at line 1 column 19");
    let e = p.reservation(br#"{"selection_id": null}"#).unwrap_err();
    assert_eq!(e.class, ErrorClass::Shape);
}

#[test]
fn output_block_and_peer() {
    let p = parser();
    assert_eq!(p.output_block(b"{}").unwrap().decay_fraction, None);
    assert_eq!(
        p.output_block(br#"{"decay_fraction":0.5}"#)
            .unwrap()
            .decay_fraction,
        Some(0.5)
    );
    let e = p.output_block(br#"{"decay_fraction":"a"}"#).unwrap_err();
    assert_eq!(
        text(&e),
        "decay_fraction: invalid type: string \"a\", expected f64 at line 1 column 21"
    );
    assert_eq!(
        p.output_block(b"null").unwrap_err().class,
        ErrorClass::Shape
    );
    assert_eq!(
        p.peer_endpoint(br#"{"endpoint":"tcp://h:1"}"#).unwrap(),
        "tcp://h:1"
    );
    let e = p.peer_endpoint(b"{}").unwrap_err();
    assert_eq!(e.message, "missing field `endpoint`");
    assert_eq!(e.class, ErrorClass::Shape);
}

#[test]
fn prompt_query_body() {
    let r = parser()
        .prompt_query(br#"{"model_name":"m","token_ids":[1,2],"router_config_override":{"router_temperature":1}}"#)
        .unwrap();
    assert_eq!(r.model_name.as_deref(), Some("m"));
    assert_eq!(r.prompt.token_ids.as_deref().unwrap(), &[1, 2]);
    assert_eq!(
        r.router_config_override.unwrap().router_temperature,
        Some(1.0)
    );
    let e = parser()
        .prompt_query(br#"{"router_config_override":{"shared_cache_multiplier":1.5}}"#)
        .unwrap_err();
    assert_eq!(e.message, "shared_cache_multiplier must be between 0 and 1");
    assert_eq!(e.path, "router_config_override");
}

#[test]
fn worker_upsert_and_patch() {
    let p = parser();
    let w = p
        .worker_upsert(
            br#"{"worker_id":10,"model_name":"mA","endpoint":"http://w","block_size":16,
                "kv_events_endpoints":{"0":"tcp://127.0.0.1:25001","3":"tcp://x:1"},
                "data_parallel_size":2,"taints":["gpu"],"topology_domains":{"rack":"r1"},
                "kv_transfer_enforcement":"preferred","kv_transfer_preferred_weight":0.5,"is_eagle":null}"#,
        )
        .unwrap();
    assert_eq!(w.worker_id, 10);
    assert_eq!(w.model_name.as_deref(), Some("mA"));
    assert_eq!(w.block_size, Some(16));
    let eps = w.kv_events_endpoints.unwrap();
    assert_eq!(eps[&0], "tcp://127.0.0.1:25001");
    assert_eq!(eps[&3], "tcp://x:1");
    assert_eq!(w.taints, Some(vec!["gpu".to_string()]));
    assert_eq!(w.topology_domains.unwrap()["rack"], "r1");
    assert_eq!(
        w.kv_transfer_enforcement,
        Some(KvTransferEnforcement::Preferred)
    );
    assert_eq!(w.kv_transfer_preferred_weight, Some(0.5));
    assert_eq!(w.is_eagle, None);

    // §10 #22, #23, #24, #28, #32, #33
    let e = p.worker_upsert(br#"{"model_name": "x"}"#).unwrap_err();
    assert_eq!(text(&e), "missing field `worker_id` at line 1 column 19");
    let e = p.worker_upsert(br#"{"worker_id": -1}"#).unwrap_err();
    assert_eq!(
        text(&e),
        "worker_id: invalid value: integer `-1`, expected u64 at line 1 column 16"
    );
    let e = p.worker_upsert(br#"{"worker_id": "1"}"#).unwrap_err();
    assert_eq!(
        text(&e),
        "worker_id: invalid type: string \"1\", expected u64 at line 1 column 17"
    );
    let e = p
        .worker_upsert(br#"{"worker_id":1,"kv_events_endpoints":{"x":"tcp://a:1"}}"#)
        .unwrap_err();
    assert_eq!(e.class, ErrorClass::Syntax);
    assert_eq!(e.path, "kv_events_endpoints.?");
    assert_eq!(
        e.message,
        "invalid value: expected key to be a number in quotes"
    );
    let e = p
        .worker_upsert(br#"{"worker_id":1,"kv_events_endpoints":{"-1":"tcp://a:1"}}"#)
        .unwrap_err();
    assert_eq!(e.class, ErrorClass::Shape);
    let e = p
        .worker_upsert(br#"{"worker_id":1,"block_size":4294967296}"#)
        .unwrap_err();
    assert_eq!(e.path, "block_size");
    assert_eq!(
        e.message,
        "invalid value: integer `4294967296`, expected u32"
    );
    let e = p
        .worker_upsert(br#"{"worker_id":1,"kv_transfer_enforcement":"bogus"}"#)
        .unwrap_err();
    assert_eq!(e.class, ErrorClass::Shape);
    assert_eq!(
        e.to_string().split(" at line").next().unwrap(),
        "kv_transfer_enforcement: unknown variant `bogus`, expected `required` or `preferred`"
    );
    let e = p
        .worker_upsert(br#"{"worker_id":1,"worker_id":2}"#)
        .unwrap_err();
    assert_eq!(e.message, "duplicate field `worker_id`");

    // PATCH: identity fields are skipped like unknown ones (even repeated).
    let w = p
        .worker_patch(br#"{"worker_id":"x","model_name":"a","model_name":"b","routing_group":7,"block_size":32}"#)
        .unwrap();
    assert_eq!(w.worker_id, 0);
    assert_eq!(w.model_name, None);
    assert_eq!(w.routing_group, None);
    assert_eq!(w.block_size, Some(32));
    assert_eq!(p.worker_patch(b"{}").unwrap(), WorkerFields::default());
}

/// `kv_events_endpoints` keys are read as serde_json reads a numeric map key:
/// the number straight after the quote, its shape checked before its closing
/// quote and the colon. The texts are Dynamo 1.6.1's for the same bodies.
#[test]
fn rank_keys_read_in_the_reference_order() {
    use ErrorClass::{Shape, Syntax};
    let p = parser();
    let cases: &[(&str, ErrorClass, &str)] = &[
        (
            r#"{"x" "tcp://a:1"}}"#,
            Syntax,
            r#"kv_events_endpoints.?: invalid value: expected key to be a number in quotes at line 1 column 78"#,
        ),
        (
            r#"{"4294967296" "tcp://a:1"}}"#,
            Shape,
            r#"kv_events_endpoints.4294967296: invalid value: integer `4294967296`, expected u32 at line 1 column 88"#,
        ),
        (
            r#"{"1.5" 5}}"#,
            Shape,
            r#"kv_events_endpoints.?: invalid type: floating point `1.5`, expected u32 at line 1 column 81"#,
        ),
        (
            r#"{"1" 5}}"#,
            Syntax,
            r#"kv_events_endpoints: expected `:` at line 1 column 82"#,
        ),
        (
            r#"{"1x": 5}}"#,
            Syntax,
            r#"kv_events_endpoints.1: expected `"` at line 1 column 80"#,
        ),
        (
            r#"{"12""#,
            Syntax,
            r#"kv_events_endpoints: EOF while parsing an object at line 1 column 81"#,
        ),
        (
            r#"{"01": 5}}"#,
            Syntax,
            r#"kv_events_endpoints.?: invalid number at line 1 column 80"#,
        ),
        (
            r#"{"-": 5}}"#,
            Syntax,
            r#"kv_events_endpoints.?: invalid number at line 1 column 80"#,
        ),
        (
            r#"{"-5x": 5}}"#,
            Shape,
            r#"kv_events_endpoints.-5: invalid value: integer `-5`, expected u32 at line 1 column 80"#,
        ),
        (
            r#"{"99999999999999999999": 5}}"#,
            Shape,
            r#"kv_events_endpoints.?: invalid type: floating point `1e+20`, expected u32 at line 1 column 98"#,
        ),
        (
            r#"{"3": 5}}"#,
            Shape,
            r#"kv_events_endpoints.3: invalid type: integer `5`, expected a string at line 1 column 83"#,
        ),
        (
            r#"{"\u0031": "x"}}"#,
            Syntax,
            r#"kv_events_endpoints.?: invalid value: expected key to be a number in quotes at line 1 column 78"#,
        ),
        (
            r#"{"-0": "x"}}"#,
            Shape,
            r#"kv_events_endpoints.?: invalid type: floating point `-0.0`, expected u32 at line 1 column 80"#,
        ),
        (
            r#"{"1"#,
            Syntax,
            r#"kv_events_endpoints.1: expected `"` at line 1 column 79"#,
        ),
        (
            r#"{"-"#,
            Syntax,
            r#"kv_events_endpoints.?: EOF while parsing a value at line 1 column 79"#,
        ),
        (
            r#"{""#,
            Syntax,
            r#"kv_events_endpoints.?: invalid value: expected key to be a number in quotes at line 1 column 78"#,
        ),
        (
            r#"{"1e""#,
            Syntax,
            r#"kv_events_endpoints.?: invalid number at line 1 column 81"#,
        ),
        (
            r#"{"2": "a",}}"#,
            Syntax,
            r#"kv_events_endpoints.?: trailing comma at line 1 column 87"#,
        ),
    ];
    let pre = r#"{"worker_id":7,"model_name":"m","endpoint":"http://w","kv_events_endpoints":"#;
    for (tail, class, want) in cases {
        let body = format!("{pre}{tail}");
        let e = p.worker_upsert(body.as_bytes()).unwrap_err();
        assert_eq!((e.class, text(&e).as_str()), (*class, *want), "{body}");
    }
    let w = p
        .worker_upsert(format!(r#"{pre}{{"2": "a", "2": "b", "0":"c"}}}}"#).as_bytes())
        .unwrap();
    let eps = w.kv_events_endpoints.unwrap();
    assert_eq!(
        (eps[&2].as_str(), eps[&0].as_str(), eps.len()),
        ("b", "c", 2)
    );
}

#[test]
fn positions_count_lines_like_serde() {
    let e = err(sel("{\n  \"model_name\": 5\n}"));
    assert_eq!((e.line, e.column), (2, 17));
    assert_eq!(e.path, "model_name");
    let body = "{\n\"token_ids\": [1,\n -1]\n}";
    let e = err(sel(body));
    // Flattened: reported at the end of the object, like the reference.
    assert_eq!((e.line, e.column), (4, 1));
    assert_eq!(e.offset, body.len());
}
