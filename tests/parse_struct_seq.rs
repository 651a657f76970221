//! Nested structs given as JSON arrays, as serde reads them (fields in
//! declaration order), with the texts and positions observed on the
//! reference (Dynamo 1.6.1's selection service) for each struct of each
//! route: fewer elements -> 422 `invalid length`, more -> 400 `trailing
//! characters` (or, for the buffered prompt fields, 422 `invalid length N,
//! expected M elements in sequence`), element errors under `field[i]`.

use kvselect::parse::oracle::differential_select;
use kvselect::parse::*;

fn sel(body: &str) -> Result<SelectRequest<'_>, ParseError> {
    Parser::default().select(body.as_bytes(), SelectKind::Select)
}

/// Status class and `<path>: <message> at line L column C`, as the reference
/// prints it.
fn verdict(r: Result<impl std::fmt::Debug, ParseError>) -> (u16, String) {
    let e = r.expect_err("expected an error");
    let status = match e.class {
        ErrorClass::Syntax => 400,
        ErrorClass::Shape => 422,
        ErrorClass::TooLarge => 413,
    };
    let head = if e.path.is_empty() {
        e.message.clone()
    } else {
        format!("{}: {}", e.path, e.message)
    };
    (
        status,
        format!("{head} at line {} column {}", e.line, e.column),
    )
}

/// Each (body, status, text) pair was answered so by the reference.
const OBSERVED: &[(&str, u16, &str)] = &[
    (r#"{"token_ids":[1,2,3],"pinned_worker":[3]}"#, 422,
     "pinned_worker: invalid length 1, expected struct WorkerWithDpRank with 2 elements at line 1 column 40"),
    (r#"{"token_ids":[1,2,3],"pinned_worker":[]}"#, 422,
     "pinned_worker: invalid length 0, expected struct WorkerWithDpRank with 2 elements at line 1 column 39"),
    (r#"{"token_ids":[1,2,3],"pinned_worker":[3,1,2]}"#, 400,
     "pinned_worker: trailing characters at line 1 column 43"),
    (r#"{"token_ids":[1,2,3],"pinned_worker":[3,1 , 2]}"#, 400,
     "pinned_worker: trailing characters at line 1 column 45"),
    (r#"{"token_ids":[1,2,3],"pinned_worker":[3,1,]}"#, 400,
     "pinned_worker: trailing comma at line 1 column 43"),
    (r#"{"token_ids":[1,2,3],"pinned_worker":[3,1 x]}"#, 400,
     "pinned_worker: trailing characters at line 1 column 43"),
    (r#"{"token_ids":[1,2,3],"pinned_worker":[3,1,{]}"#, 400,
     "pinned_worker: trailing characters at line 1 column 43"),
    (r#"{"token_ids":[1,2,3],"pinned_worker":[3,1"#, 400,
     "pinned_worker: EOF while parsing a list at line 1 column 41"),
    (r#"{"token_ids":[1],"pinned_worker":[3,1,"#, 400,
     "pinned_worker: trailing characters at line 1 column 38"),
    (r#"{"token_ids":[1,2,3],"pinned_worker":[3,"a"]}"#, 422,
     "pinned_worker[1]: invalid type: string \"a\", expected u32 at line 1 column 43"),
    (r#"{"token_ids":[1,2,3],"pinned_worker":[3,null]}"#, 422,
     "pinned_worker[1]: invalid type: null, expected u32 at line 1 column 44"),
    (r#"{"token_ids":[1,2,3],"pinned_worker":[-3,1]}"#, 422,
     "pinned_worker[0]: invalid value: integer `-3`, expected u64 at line 1 column 40"),
    (r#"{"pinned_worker":5}"#, 422,
     "pinned_worker: invalid type: integer `5`, expected struct WorkerWithDpRank at line 1 column 18"),
    (r#"{"token_ids":[1,2,3],"affinity_target":[4]}"#, 422,
     "affinity_target: invalid length 1, expected struct WorkerAffinityTarget with 2 elements at line 1 column 42"),
    (r#"{"token_ids":[1,2,3],"affinity_target":[4,1,1]}"#, 400,
     "affinity_target: trailing characters at line 1 column 45"),
    (r#"{"token_ids":[1,2,3],"routing_constraints":[[], {"a":1}, 5]}"#, 400,
     "routing_constraints: trailing characters at line 1 column 58"),
    (r#"{"token_ids":[1,2,3],"routing_constraints":[5]}"#, 422,
     "routing_constraints[0]: invalid type: integer `5`, expected a sequence at line 1 column 45"),
    (r#"{"token_ids":[1,2,3],"routing_constraints":[[], 5]}"#, 422,
     "routing_constraints[1]: invalid type: integer `5`, expected a map at line 1 column 49"),
    (r#"{"token_ids":[1],"session_context":[]}"#, 422,
     "session_context: invalid length 0, expected struct SelectionSessionContext with 5 elements at line 1 column 37"),
    (r#"{"token_ids":[1],"session_context":[{}]}"#, 422,
     "session_context[0]: invalid type: map, expected a string at line 1 column 36"),
    (r#"{"token_ids":[1],"session_context":["a",null,{}]}"#, 422,
     "session_context[2]: invalid type: map, expected a boolean at line 1 column 45"),
    (r#"{"token_ids":[1],"session_context":["a",null,null,{}]}"#, 400,
     "session_context[3]: expected value at line 1 column 52"),
    (r#"{"token_ids":[1],"session_context":["a",null,null,null,null,1]}"#, 400,
     "session_context: trailing characters at line 1 column 61"),
    (r#"{"token_ids":[1],"session_context":["a","b",true,"tool_result",5]}"#, 422,
     "session_context[4]: invalid type: integer `5`, expected a map at line 1 column 64"),
    (r#"{"token_ids":[1],"session_context":["a","b",true,"bogus",null]}"#, 422,
     "session_context[3]: unknown variant `bogus`, expected one of `user_message`, `tool_result`, `other` at line 1 column 56"),
    (r#"{"token_ids":[1],"session_context":["a",null,null,null,{"x":[1,{"y":null}]}]}"#, 422,
     "session_context[4].x[0]: invalid type: integer `1`, expected a string at line 1 column 62"),
    (r#"{"token_ids":[1],"session_context":{"session_id":"a","agent_headers":5}}"#, 422,
     "session_context.agent_headers: invalid type: integer `5`, expected a map at line 1 column 70"),
    (r#"{"token_ids":[1],"router_config_override":[]}"#, 422,
     "router_config_override: invalid length 0, expected struct RouterConfigOverrideSerde with 7 elements at line 1 column 44"),
    (r#"{"token_ids":[1],"router_config_override":[1,1,1,-1]}"#, 422,
     "router_config_override: invalid length 4, expected struct RouterConfigOverrideSerde with 7 elements at line 1 column 52"),
    (r#"{"token_ids":[1],"router_config_override":[1,1,1,1,true,{}]}"#, 422,
     "router_config_override[5]: invalid type: map, expected a boolean at line 1 column 56"),
    (r#"{"token_ids":[1],"router_config_override":[1,1,1,1,true,true,2]}"#, 422,
     "router_config_override: shared_cache_multiplier must be between 0 and 1 at line 1 column 64"),
    (r#"{"token_ids":[1],"router_config_override":[1,1,1,1,true,true,2], "x":1}"#, 422,
     "router_config_override: shared_cache_multiplier must be between 0 and 1 at line 1 column 63"),
    (r#"{"token_ids":[1],"router_config_override":[-1,1,1,1,true,true,0]}"#, 422,
     "router_config_override: overlap_score_credit must be a finite, non-negative number at line 1 column 65"),
    (r#"{"token_ids":[1],"router_config_override":[1,1,-1,1,true,true,0]}"#, 422,
     "router_config_override: prefill_load_scale must be finite and non-negative at line 1 column 65"),
    (r#"{"token_ids":[1],"router_config_override":[1,1,1,-1,true,true,0]}"#, 422,
     "router_config_override: router_temperature must be finite and non-negative at line 1 column 65"),
    (r#"{"token_ids":[1],"router_config_override":[1,1,1,1,true,true,0.5,1]}"#, 400,
     "router_config_override: trailing characters at line 1 column 66"),
    (r#"{"token_ids":[1],"router_config_override":{"shared_cache_multiplier":2}}"#, 422,
     "router_config_override: shared_cache_multiplier must be between 0 and 1 at line 1 column 72"),
    (r#"{"token_ids":[1],"router_config_override":{"prefill_load_scale":1,"overlap_score_weight":-1}}"#, 422,
     "router_config_override: prefill_load_scale must be finite and non-negative at line 1 column 93"),
    // The prompt fields: read from serde's buffered content, so no path and
    // the position is the end of the top-level object.
    (r#"{"token_ids":[1],"mm_routing_info":[]}"#, 422,
     "invalid length 0, expected struct MmRoutingInfoRequest with 2 elements at line 1 column 38"),
    (r#"{"token_ids":[1],"mm_routing_info":[[1,2],null]}"#, 422,
     "invalid type: null, expected a sequence at line 1 column 48"),
    (r#"{"token_ids":[1],"mm_routing_info":[[1,2],[[]]]}"#, 422,
     "invalid length 0, expected struct BlockExtraInfo with 1 element at line 1 column 48"),
    (r#"{"token_ids":[1],"mm_routing_info":[[1,2],[[[[5]]]]]}"#, 422,
     "invalid length 1, expected struct BlockMmObjectInfo with 2 elements at line 1 column 53"),
    (r#"{"token_ids":[1],"mm_routing_info":[[1,2],[[[[5,[[1,2]],7]]]]]}"#, 422,
     "invalid length 3, expected 2 elements in sequence at line 1 column 63"),
    (r#"{"token_ids":[1],"mm_routing_info":[[1,2],[[[[5,[[1,2]]]],9]]]}"#, 422,
     "invalid length 2, expected 1 element in sequence at line 1 column 63"),
    (r#"{"token_ids":[1],"mm_routing_info":{"routing_token_ids":null}}"#, 422,
     "invalid type: null, expected a sequence at line 1 column 62"),
    (r#"{"token_ids":[1],"mm_routing_info":{}}"#, 422,
     "missing field `routing_token_ids` at line 1 column 38"),
    (r#"{"token_ids":[1],"block_mm_infos":[[[], 1]]}"#, 422,
     "invalid length 2, expected 1 element in sequence at line 1 column 44"),
    (r#"{"token_ids":[1],"block_mm_infos":[[[[5,[],3]]]]}"#, 422,
     "invalid length 3, expected 2 elements in sequence at line 1 column 49"),
    (r#"{"token_ids":[1],"block_mm_infos":[{"mm_objects":[[-5,[]]]}]}"#, 422,
     "invalid value: integer `-5`, expected u64 at line 1 column 61"),
];

#[test]
fn errors_match_the_reference() {
    let mut bad = Vec::new();
    for &(body, status, text) in OBSERVED {
        let got = verdict(sel(body));
        if got != (status, text.to_string()) {
            bad.push(format!(
                "{body}\n  want {status} {text}\n  got  {} {}",
                got.0, got.1
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn arrays_fill_fields_in_declaration_order() {
    let r = sel(
        r#"{"token_ids":[1],"pinned_worker":[3,1],"affinity_target":[4,null],
        "session_context":["s","p",true,"tool_result",{"h":["v"]}],
        "router_config_override":[0.5,2,null,1,false,true,0.25],
        "routing_constraints":[["gpu"],{"fast":0.5}]}"#,
    )
    .unwrap();
    assert_eq!(
        r.pinned_worker,
        Some(PinnedWorker {
            worker_id: 3,
            dp_rank: 1
        })
    );
    assert_eq!(
        r.affinity_target,
        Some(AffinityTarget {
            worker_id: 4,
            dp_rank: None
        })
    );
    let sc = r.session_context.unwrap();
    assert_eq!(sc.session_id, "s");
    assert_eq!(sc.parent_session_id.as_deref(), Some("p"));
    assert_eq!(sc.session_final, Some(true));
    assert_eq!(sc.input_trigger, Some(InputTrigger::ToolResult));
    let o = r.router_config_override.unwrap();
    assert_eq!(o.overlap_score_credit, Some(0.5));
    assert_eq!(o.prefill_load_scale, Some(2.0));
    assert_eq!(o.overlap_score_weight, None);
    assert_eq!(o.router_temperature, Some(1.0));
    assert_eq!(o.assume_kv_reuse, Some(false));
    assert_eq!(o.track_prefill_tokens, Some(true));
    assert_eq!(o.shared_cache_multiplier, Some(0.25));
    let rc = r.routing_constraints.unwrap();
    assert_eq!(rc.required_taints, vec!["gpu"]);
    assert_eq!(rc.preferred_taints, vec![("fast".into(), 0.5)]);
}

#[test]
fn defaults_fill_a_short_array_where_serde_has_them() {
    let r = sel(r#"{"session_context":["s"],"routing_constraints":[]}"#).unwrap();
    let sc = r.session_context.unwrap();
    assert_eq!((sc.session_id.as_ref(), sc.session_final), ("s", None));
    let rc = r.routing_constraints.unwrap();
    assert!(rc.required_taints.is_empty() && rc.preferred_taints.is_empty());
    // mm_routing_info: block_mm_infos defaults, the tokens do not.
    let r = sel(r#"{"mm_routing_info":[[7,8]]}"#).unwrap();
    let mm = r.prompt.mm_routing_info.unwrap();
    assert_eq!(
        mm.routing_token_ids.as_deref().map(|v| v.to_vec()),
        Some(vec![7, 8])
    );
    assert_eq!(mm.block_mm_infos, None);
    let r = sel(r#"{"block_mm_infos":[[[[5,[[0,4]]],{"mm_hash":6,"offsets":[]}]],null]}"#).unwrap();
    assert_eq!(r.prompt.block_mm_infos, Some(vec![Some(vec![5, 6]), None]));
}

#[test]
fn a_weight_replaces_the_scale_it_aliases() {
    // Accepted by the reference: the weight wins over prefill_load_scale,
    // and a weight of 0 zeroes the credit before the checks.
    sel(r#"{"router_config_override":{"prefill_load_scale":-1,"overlap_score_weight":1}}"#)
        .unwrap();
    sel(r#"{"router_config_override":{"overlap_score_credit":-1,"overlap_score_weight":0}}"#)
        .unwrap();
    sel(r#"{"router_config_override":[1,-1,1,1,true,true,0]}"#).unwrap();
}

#[test]
fn other_routes_name_their_structs() {
    let p = Parser::default();
    let names = [
        (verdict(p.reservation(b"[1]")), "ReservationRequest"),
        (verdict(p.prompt_query(b"[1]")), "PotentialLoadsRequest"),
        (
            verdict(p.overlap_scores_query(b"[1]")),
            "OverlapScoresRequest",
        ),
    ];
    for ((status, text), name) in names {
        assert_eq!(status, 422);
        assert_eq!(
            text,
            format!("invalid type: sequence, expected struct {name} at line 1 column 0")
        );
    }
    let r = p
        .reservation(br#"{"selection_id":"s","router_config_override":[null,null,null,null,null,false,null]}"#)
        .unwrap();
    assert_eq!(
        r.router_config_override.unwrap().track_prefill_tokens,
        Some(false)
    );
    let (status, text) = verdict(p.prompt_query(br#"{"router_config_override":[1]}"#));
    assert_eq!(status, 422);
    assert!(
        text.contains(
            "invalid length 1, expected struct RouterConfigOverrideSerde with 7 elements"
        ),
        "{text}"
    );
}

#[test]
fn the_serde_oracle_agrees_on_array_forms() {
    for &(body, _, _) in OBSERVED {
        differential_select(body.as_bytes());
    }
    for body in [
        r#"{"token_ids":[1],"pinned_worker":[3,1],"affinity_target":[4,2]}"#,
        r#"{"session_context":["s",null,false,{"other":null},{}]}"#,
        r#"{"router_config_override":[0,0,0,0,true,false,1]}"#,
        r#"{"routing_constraints":[["a","b"]]}"#,
        r#"{"mm_routing_info":[[1],[null,[[[9,[[0,1]]]]]]]}"#,
    ] {
        sel(body).unwrap();
        differential_select(body.as_bytes());
    }
}
