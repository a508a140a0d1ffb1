//! Property tests (bounded fuzzing, run by `cargo test`): whatever bytes the safetensors file and
//! whatever values config.json holds, loading returns a result — an error naming the problem or a
//! model — and never panics or allocates by an unchecked size (issue 33). Case counts are small
//! so the whole file runs in seconds; raise PROPTEST_CASES for a longer run.

use std::panic::{catch_unwind, AssertUnwindSafe};

use calla_model::config::ModelConfig;
use calla_model::load::{load_model, LoadOptions, Quant};
use calla_model::synthetic::{preset, random_weights};
use calla_model::weights::export::{
    checkpoint_tensors, config_json, write_checkpoint, ExportOptions,
};
use proptest::prelude::*;
use serde_json::{json, Value};

/// The tiny checkpoint's config and safetensors bytes (made once).
fn base() -> (Value, Vec<u8>) {
    static BASE: std::sync::OnceLock<(Value, Vec<u8>)> = std::sync::OnceLock::new();
    BASE.get_or_init(make_base).clone()
}

fn make_base() -> (Value, Vec<u8>) {
    let spec = preset("tiny").unwrap();
    let weights = random_weights(&spec, Quant::F32, 1);
    let tensors = checkpoint_tensors(&spec, &weights, &ExportOptions::hf_causal());
    let config = config_json(&spec, false, None);
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &config, &tensors, None).unwrap();
    let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    (config, bytes)
}

/// Load a checkpoint of these files; a panic fails the property.
fn load_does_not_panic(config: &Value, weights: &[u8]) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    std::fs::write(dir.path().join("model.safetensors"), weights).unwrap();
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let _ = load_model(dir.path(), &LoadOptions::default());
    }));
    prop_assert!(outcome.is_ok(), "the loader panicked");
    Ok(())
}

/// PROPTEST_CASES, or `default` (CI's bounded run).
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A JSON number that is sometimes sane and sometimes absurd.
fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        (0u64..64).prop_map(|v| json!(v)),
        any::<u64>().prop_map(|v| json!(v)),
        any::<i64>().prop_map(|v| json!(v)),
        any::<f64>().prop_map(|v| json!(v)),
        Just(json!(null)),
        Just(json!("12")),
        Just(json!([1, 2])),
    ]
}

const CONFIG_FIELDS: [&str; 16] = [
    "num_hidden_layers",
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "max_position_embeddings",
    "rms_norm_eps",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(64), failure_persistence: None, ..ProptestConfig::default() })]

    /// Random header edits: offsets, shapes, dtypes, duplicates, junk.
    #[test]
    fn mutated_safetensors_headers_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), 0u8..6, any::<u64>(), any::<u64>()), 1..4),
    ) {
        let (config, bytes) = base();
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Map<String, Value> =
            serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
        let mut entries: Vec<(String, Value)> = header.into_iter().collect();
        for (which, kind, a, b) in edits {
            let i = which.index(entries.len());
            let value = &mut entries[i].1;
            match kind {
                0 => value["data_offsets"] = json!([a, b]),
                1 => value["data_offsets"] = json!([a % 4096, a % 4096 + b % 4096]),
                2 => value["shape"] = json!([a, b]),
                3 => value["shape"] = json!([a % 64, b % 64]),
                4 => value["dtype"] = json!(["F32", "BF16", "U32", "I8", "F64", "X"][(a % 6) as usize]),
                _ => { let dup = entries[i].clone(); entries.push(dup); }
            }
        }
        let text = format!("{{{}}}", entries.iter().map(|(k, v)| format!("{}:{}", json!(k), v)).collect::<Vec<_>>().join(","));
        let mut out = (text.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(text.as_bytes());
        out.extend_from_slice(&bytes[8 + header_len..]);
        load_does_not_panic(&config, &out)?;
    }

    /// Random bytes flipped anywhere in the file, or the file cut anywhere.
    #[test]
    fn corrupted_or_cut_safetensors_never_panic(
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
        cut in any::<prop::sample::Index>(),
        do_cut in any::<bool>(),
    ) {
        let (config, mut bytes) = base();
        for (at, byte) in flips {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        if do_cut {
            bytes.truncate(cut.index(bytes.len()));
        }
        load_does_not_panic(&config, &bytes)?;
    }

    /// Any value in the size fields of config.json: an error or a spec, never a panic or a huge
    /// allocation (each case must finish quickly).
    #[test]
    fn config_values_never_panic(
        edits in prop::collection::vec((0usize..CONFIG_FIELDS.len(), number()), 1..5),
        flat in any::<bool>(),
    ) {
        let (mut config, _) = base();
        for (field, value) in edits {
            let target = if flat { &mut config } else {
                if config.get("text_config").is_none() { config["text_config"] = json!({}); }
                &mut config["text_config"]
            };
            target[CONFIG_FIELDS[field]] = value;
            if CONFIG_FIELDS[field] == "num_hidden_layers" {
                if let Some(o) = config.as_object_mut() { o.remove("layer_types"); }
            }
        }
        let started = std::time::Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            let _ = ModelConfig::from_json(&config).and_then(|c| c.to_spec());
        }));
        prop_assert!(outcome.is_ok(), "config parsing panicked on {config}");
        prop_assert!(started.elapsed() < std::time::Duration::from_secs(2));
    }
}

#[test]
fn the_unmutated_base_loads() {
    let (config, bytes) = base();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    std::fs::write(dir.path().join("model.safetensors"), &bytes).unwrap();
    load_model(dir.path(), &LoadOptions::default()).unwrap();
}
