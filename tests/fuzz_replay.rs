//! Replays the committed fuzz seeds (`fuzz/corpus/<target>/seed-*`) and any
//! crash libFuzzer left (`fuzz/artifacts/<target>/*`) through the same library
//! calls the fuzz targets make, so a found crash stays fixed.

use kvselect::parse::oracle::{differential_select, fuzz_body, BodyKind};
use std::path::Path;

/// What the fuzz target named `target` runs on one input.
fn run_target(target: &str, data: &[u8]) {
    match target {
        "select" => {
            fuzz_body(BodyKind::Select, data);
            fuzz_body(BodyKind::SelectAndReserve, data);
        }
        "reservation" => fuzz_body(BodyKind::Reservation, data),
        "output_block" => fuzz_body(BodyKind::OutputBlock, data),
        "prompt_query" => fuzz_body(BodyKind::PromptQuery, data),
        "worker" => {
            fuzz_body(BodyKind::WorkerUpsert, data);
            fuzz_body(BodyKind::WorkerPatch, data);
        }
        "peer_endpoint" => fuzz_body(BodyKind::PeerEndpoint, data),
        "select_differential" => differential_select(data),
        // Targets owned by other modules replay in their own tests.
        _ => {}
    }
}

fn replay_dir(dir: &Path, only_seeds: bool) -> usize {
    let mut n = 0;
    let Ok(targets) = std::fs::read_dir(dir) else {
        return 0;
    };
    for t in targets.flatten() {
        let target = t.file_name().to_string_lossy().into_owned();
        let Ok(files) = std::fs::read_dir(t.path()) else {
            continue;
        };
        for f in files.flatten() {
            let name = f.file_name().to_string_lossy().into_owned();
            if only_seeds && !name.starts_with("seed-") {
                continue;
            }
            let data = std::fs::read(f.path()).unwrap();
            let r = std::panic::catch_unwind(|| run_target(&target, &data));
            assert!(
                r.is_ok(),
                "{target}/{name} fails: {:?}",
                String::from_utf8_lossy(&data)
            );
            n += 1;
        }
    }
    n
}

#[test]
fn fuzz_seeds_replay() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let n = replay_dir(&root.join("corpus"), true);
    assert!(n >= 50, "expected the committed seeds, found {n}");
}

#[test]
fn fuzz_artifacts_replay() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    replay_dir(&root.join("artifacts"), false);
}
