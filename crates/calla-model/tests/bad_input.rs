//! Broken checkpoints: every one gives an error (never a panic) whose message names the file, the
//! tensor or field, what was expected and what was found.

use std::collections::BTreeMap;
use std::path::Path;

use calla_model::config::{QuantParams, QuantizationBlock};
use calla_model::load::{load_model, LoadError, LoadOptions, Quant};
use calla_model::synthetic::{preset, random_weights};
use calla_model::weights::assemble::ExpertLayout;
use calla_model::weights::export::{
    checkpoint_tensors, config_json, write_checkpoint, ExportOptions, OwnedTensor,
};
use calla_model::weights::names::CheckpointStyle;
use calla_model::ModelSpec;
use safetensors::Dtype;

type Tensors = BTreeMap<String, OwnedTensor>;

/// A valid tiny HF CausalLM checkpoint's parts (f32, per-expert).
fn base() -> (ModelSpec, serde_json::Value, Tensors) {
    let spec = preset("tiny").unwrap();
    let weights = random_weights(&spec, Quant::F32, 1);
    let tensors = checkpoint_tensors(&spec, &weights, &ExportOptions::hf_causal());
    (spec.clone(), config_json(&spec, false, None), tensors)
}

fn write(config: &serde_json::Value, tensors: &Tensors) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), config, tensors, None).unwrap();
    dir
}

fn load_err(dir: &Path) -> (LoadError, String) {
    match load_model(dir, &LoadOptions::default()) {
        Ok(_) => panic!("the broken checkpoint in {} loaded", dir.display()),
        Err(e) => {
            let msg = e.to_string();
            eprintln!("error as shown to the user: {msg}");
            (e, msg)
        }
    }
}

fn assert_mentions(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "message `{msg}` should mention `{p}`");
    }
}

#[test]
fn the_base_checkpoint_loads() {
    let (_, config, tensors) = base();
    let dir = write(&config, &tensors);
    load_model(dir.path(), &LoadOptions::default()).unwrap();
}

#[test]
fn missing_config() {
    let (_, config, tensors) = base();
    let dir = write(&config, &tensors);
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, LoadError::MissingFile { .. }));
    assert_mentions(&msg, &["config.json", "not found"]);
}

#[test]
fn missing_weights_file() {
    let (_, config, _) = base();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, LoadError::MissingFile { .. }));
    assert_mentions(&msg, &["model.safetensors", "not found"]);
}

#[test]
fn truncated_file_names_the_tensor_that_runs_past_the_end() {
    let (_, config, tensors) = base();
    let dir = write(&config, &tensors);
    let path = dir.path().join("model.safetensors");
    let full = std::fs::read(&path).unwrap();
    std::fs::write(&path, &full[..full.len() - 100]).unwrap();
    let (e, msg) = load_err(dir.path());
    match e {
        LoadError::Truncated {
            tensor,
            needed,
            found,
            ..
        } => {
            assert!(
                tensors.contains_key(&tensor),
                "names a real tensor: {tensor}"
            );
            assert_eq!((needed, found), (full.len(), full.len() - 100));
        }
        other => panic!("expected Truncated, got {other:?}"),
    }
    assert_mentions(&msg, &["model.safetensors", "truncated"]);
}

/// Cutting the file anywhere — inside the length prefix, the header or the data — is an error, not a panic.
#[test]
fn truncation_anywhere_is_an_error() {
    let (_, config, tensors) = base();
    let dir = write(&config, &tensors);
    let path = dir.path().join("model.safetensors");
    let full = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(full[..8].try_into().unwrap()) as usize;
    for cut in [
        0,
        3,
        8,
        9,
        8 + header_len / 2,
        8 + header_len - 1,
        8 + header_len,
        8 + header_len + 1,
        full.len() - 1,
    ] {
        std::fs::write(&path, &full[..cut]).unwrap();
        let (e, msg) = load_err(dir.path());
        assert!(
            matches!(e, LoadError::Truncated { .. } | LoadError::Corrupt { .. }),
            "cut {cut}: {e:?}"
        );
        assert_mentions(&msg, &["model.safetensors"]);
    }
}

#[test]
fn garbage_header() {
    let (_, config, tensors) = base();
    let dir = write(&config, &tensors);
    let path = dir.path().join("model.safetensors");
    let mut bytes = 20u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"this is not json!!!!");
    std::fs::write(&path, &bytes).unwrap();
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, LoadError::Corrupt { .. }));
    assert_mentions(&msg, &["model.safetensors", "header"]);
    // An absurd header length.
    std::fs::write(&path, u64::MAX.to_le_bytes()).unwrap();
    let (e, _) = load_err(dir.path());
    assert!(matches!(e, LoadError::Corrupt { .. }));
}

/// A header entry whose offsets disagree with its shape, or with an unknown dtype, is named.
#[test]
fn corrupt_header_entries() {
    let (_, config, tensors) = base();
    let dir = write(&config, &tensors);
    let path = dir.path().join("model.safetensors");
    for (entry, needle) in [
        (
            r#"{"x.weight":{"dtype":"F32","shape":[4,4],"data_offsets":[0,60]}}"#,
            "x.weight",
        ),
        (
            r#"{"y.weight":{"dtype":"Q4","shape":[4],"data_offsets":[0,8]}}"#,
            "y.weight",
        ),
    ] {
        let mut bytes = (entry.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(entry.as_bytes());
        bytes.extend_from_slice(&[0u8; 64]);
        std::fs::write(&path, &bytes).unwrap();
        let (e, msg) = load_err(dir.path());
        assert!(matches!(e, LoadError::Corrupt { .. }), "{e:?}");
        assert_mentions(&msg, &["model.safetensors", needle]);
    }
}

#[test]
fn dropped_tensor() {
    let (_, config, mut tensors) = base();
    tensors.remove("model.layers.2.linear_attn.A_log");
    let dir = write(&config, &tensors);
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, LoadError::MissingTensor { .. }));
    assert_mentions(
        &msg,
        &[
            "model.layers.2.linear_attn.A_log",
            "[4] vector",
            "model.safetensors",
        ],
    );
}

#[test]
fn dropped_lm_head_when_untied() {
    let (_, config, mut tensors) = base();
    tensors.remove("lm_head.weight");
    let dir = write(&config, &tensors);
    let (_, msg) = load_err(dir.path());
    assert_mentions(&msg, &["missing tensor `lm_head.weight`", "[512, 128]"]);
}

#[test]
fn changed_shape() {
    let (_, config, mut tensors) = base();
    let name = "model.layers.3.self_attn.k_proj.weight";
    tensors.insert(
        name.into(),
        OwnedTensor {
            dtype: Dtype::F32,
            shape: vec![32, 128],
            data: vec![0; 32 * 128 * 4],
        },
    );
    let dir = write(&config, &tensors);
    let (e, msg) = load_err(dir.path());
    match &e {
        LoadError::Shape {
            tensor,
            expected,
            found,
            ..
        } => {
            assert_eq!(
                (tensor.as_str(), expected.as_slice(), found.as_slice()),
                (name, &[64, 128][..], &[32, 128][..])
            );
        }
        other => panic!("expected Shape, got {other:?}"),
    }
    assert_mentions(&msg, &["model.safetensors", name, "[32, 128]", "[64, 128]"]);
}

#[test]
fn changed_dtype() {
    let (_, config, mut tensors) = base();
    let name = "model.layers.0.input_layernorm.weight";
    tensors.insert(
        name.into(),
        OwnedTensor {
            dtype: Dtype::I32,
            shape: vec![128],
            data: vec![0; 128 * 4],
        },
    );
    let dir = write(&config, &tensors);
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, LoadError::DType { .. }));
    assert_mentions(&msg, &[name, "i32", "f32, bf16 or f16"]);
}

#[test]
fn bad_model_type() {
    let (_, mut config, tensors) = base();
    config["model_type"] = serde_json::json!("llama");
    let dir = write(&config, &tensors);
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, LoadError::Config { .. }));
    assert_mentions(
        &msg,
        &["config.json", "model_type", "\"llama\"", "qwen3_5_moe"],
    );
}

#[test]
fn bad_config_field() {
    let (_, mut config, tensors) = base();
    config["num_key_value_heads"] = serde_json::json!(3);
    let dir = write(&config, &tensors);
    let (_, msg) = load_err(dir.path());
    assert_mentions(
        &msg,
        &[
            "config.json",
            "num_key_value_heads",
            "3",
            "must divide num_attention_heads = 4",
        ],
    );

    let (_, mut config, tensors) = base();
    config["layer_types"][1] = serde_json::json!("conv");
    let dir = write(&config, &tensors);
    let (_, msg) = load_err(dir.path());
    assert_mentions(&msg, &["layer_types[1]", "\"conv\""]);

    let dir = write(&base().1, &base().2);
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let (_, msg) = load_err(dir.path());
    assert_mentions(&msg, &["config.json", "invalid JSON"]);
}

#[test]
fn bad_generation_config() {
    let (_, config, tensors) = base();
    let dir = write(&config, &tensors);
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"temperature": "hot"}"#,
    )
    .unwrap();
    let (_, msg) = load_err(dir.path());
    assert_mentions(&msg, &["generation_config.json", "temperature"]);
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"eos_token_id": [1, 99999]}"#,
    )
    .unwrap();
    let (_, msg) = load_err(dir.path());
    assert_mentions(&msg, &["generation_config.json", "eos_token_id", "99999"]);
}

#[test]
fn leftover_tensor() {
    let (_, config, mut tensors) = base();
    tensors.insert(
        "model.layers.0.mystery.weight".into(),
        OwnedTensor {
            dtype: Dtype::F32,
            shape: vec![2],
            data: vec![0; 8],
        },
    );
    let dir = write(&config, &tensors);
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, LoadError::Unconsumed { count: 1, .. }));
    assert_mentions(&msg, &["model.layers.0.mystery.weight", "ignore list"]);
}

#[test]
fn sharded_index_problems() {
    let (_, config, tensors) = base();
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &config, &tensors, Some(300_000)).unwrap();
    let index_path = dir.path().join("model.safetensors.index.json");
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    load_model(dir.path(), &LoadOptions::default()).unwrap();

    // A shard that is gone.
    let shard = index["weight_map"]["lm_head.weight"]
        .as_str()
        .unwrap()
        .to_string();
    let saved = std::fs::read(dir.path().join(&shard)).unwrap();
    std::fs::remove_file(dir.path().join(&shard)).unwrap();
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, LoadError::MissingFile { .. }));
    assert_mentions(&msg, &[&shard, "not found"]);
    std::fs::write(dir.path().join(&shard), saved).unwrap();

    // The index names the wrong shard for a tensor.
    let mut wrong = index.clone();
    let other = index["weight_map"]["model.embed_tokens.weight"]
        .as_str()
        .unwrap()
        .to_string();
    let misplaced = index["weight_map"]
        .as_object()
        .unwrap()
        .iter()
        .find(|(_, f)| f.as_str() != Some(&other))
        .map(|(n, _)| n.clone())
        .unwrap();
    wrong["weight_map"][&misplaced] = serde_json::json!(other);
    std::fs::write(&index_path, wrong.to_string()).unwrap();
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, LoadError::Index { .. }));
    assert_mentions(&msg, &["model.safetensors.index.json", &misplaced, &other]);
}

fn mlx_parts(router_bits_in_config: u32) -> (serde_json::Value, Tensors) {
    let spec = preset("tiny").unwrap();
    let weights = random_weights(&spec, Quant::Q4, 2);
    let opts = ExportOptions {
        style: CheckpointStyle::Mlx,
        experts: ExpertLayout::SwitchMlp,
        mlx_conventions: true,
        ..ExportOptions::hf_causal()
    };
    let mut overrides = BTreeMap::new();
    for i in 0..spec.num_layers() {
        overrides.insert(
            format!("language_model.model.layers.{i}.mlp.gate"),
            Some(QuantParams {
                group_size: 64,
                bits: router_bits_in_config,
            }),
        );
        overrides.insert(
            format!("language_model.model.layers.{i}.mlp.shared_expert_gate"),
            Some(QuantParams {
                group_size: 64,
                bits: 8,
            }),
        );
    }
    let block = QuantizationBlock {
        group_size: 64,
        bits: 4,
        mode: "affine".into(),
        overrides,
    };
    (
        config_json(&spec, true, Some(&block)),
        checkpoint_tensors(&spec, &weights, &opts),
    )
}

#[test]
fn quantisation_block_disagrees_with_the_tensors() {
    let (config, tensors) = mlx_parts(8);
    load_model(write(&config, &tensors).path(), &LoadOptions::default()).unwrap();
    let (config, tensors) = mlx_parts(4);
    let dir = write(&config, &tensors);
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, LoadError::Quantization { .. }));
    assert_mentions(
        &msg,
        &[
            "language_model.model.layers.0.mlp.gate.weight",
            "stored as 8-bit group 64",
            "says 4-bit group 64",
        ],
    );
}

#[test]
fn unsupported_packed_width() {
    let (config, mut tensors) = mlx_parts(8);
    // 3-bit codes for 128 inputs = 12 words per row: not a supported width.
    let name = "language_model.model.layers.3.self_attn.k_proj.weight";
    tensors.insert(
        name.into(),
        OwnedTensor {
            dtype: Dtype::U32,
            shape: vec![64, 12],
            data: vec![0; 64 * 12 * 4],
        },
    );
    let dir = write(&config, &tensors);
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, LoadError::Quantization { .. }));
    assert_mentions(&msg, &[name, "12 u32 words per row for 128 inputs"]);
}

#[test]
fn codes_with_a_float_dtype() {
    let (config, mut tensors) = mlx_parts(8);
    let name = "language_model.model.layers.3.self_attn.k_proj.weight";
    tensors.insert(
        name.into(),
        OwnedTensor {
            dtype: Dtype::F32,
            shape: vec![64, 16],
            data: vec![0; 64 * 16 * 4],
        },
    );
    let dir = write(&config, &tensors);
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, LoadError::DType { .. }));
    assert_mentions(&msg, &[name, "u32"]);
}

#[test]
fn mixed_conv_layouts() {
    let (_, config, mut tensors) = base();
    let name = "model.layers.1.linear_attn.conv1d.weight";
    let t = tensors.remove(name).unwrap();
    tensors.insert(
        name.into(),
        OwnedTensor {
            shape: vec![256, 4, 1],
            ..t
        },
    );
    let dir = write(&config, &tensors);
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, LoadError::Inconsistent { .. }));
    assert_mentions(&msg, &[name, "[C, K, 1]", "[C, 1, K]"]);
}

#[test]
fn conv_with_a_wrong_shape() {
    let (_, config, mut tensors) = base();
    let name = "model.layers.1.linear_attn.conv1d.weight";
    let t = tensors.remove(name).unwrap();
    tensors.insert(
        name.into(),
        OwnedTensor {
            shape: vec![256, 2, 2],
            ..t
        },
    );
    let dir = write(&config, &tensors);
    let (_, msg) = load_err(dir.path());
    assert_mentions(&msg, &[name, "[256, 2, 2]", "[256, 1, 4]"]);
}

#[test]
fn no_language_model_tensors() {
    let (_, config, _) = base();
    let mut tensors = Tensors::new();
    tensors.insert(
        "model.visual.x.weight".into(),
        OwnedTensor {
            dtype: Dtype::F32,
            shape: vec![1],
            data: vec![0; 4],
        },
    );
    let dir = write(&config, &tensors);
    let (_, msg) = load_err(dir.path());
    assert_mentions(&msg, &["no language-model tensors"]);
}

/// Rewrite the header of `path` (entries in order, duplicates allowed); the data bytes stay.
fn rewrite_header(path: &Path, edit: impl FnOnce(&mut Vec<(String, serde_json::Value)>)) {
    let bytes = std::fs::read(path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let mut entries: Vec<(String, serde_json::Value)> = header.into_iter().collect();
    edit(&mut entries);
    let text = format!(
        "{{{}}}",
        entries
            .iter()
            .map(|(k, v)| format!("{}:{}", serde_json::json!(k), v))
            .collect::<Vec<_>>()
            .join(",")
    );
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&bytes[8 + header_len..]);
    std::fs::write(path, out).unwrap();
}

fn offsets(v: &serde_json::Value) -> (u64, u64) {
    let o = v["data_offsets"].as_array().unwrap();
    (o[0].as_u64().unwrap(), o[1].as_u64().unwrap())
}

/// Offsets near 2^64 (they used to wrap and panic in `Blob::bytes`, exit 101).
#[test]
fn offsets_that_wrap_past_2_64_are_an_error() {
    let (_, config, tensors) = base();
    let dir = write(&config, &tensors);
    let path = dir.path().join("model.safetensors");
    let mut victim = String::new();
    rewrite_header(&path, |entries| {
        let (name, value) = entries
            .iter_mut()
            .find(|(n, _)| n != "__metadata__")
            .unwrap();
        victim = name.clone();
        let (begin, end) = offsets(value);
        let new_begin = u64::MAX - (end - begin) - 7;
        value["data_offsets"] = serde_json::json!([new_begin, new_begin + (end - begin)]);
    });
    let (e, msg) = load_err(dir.path());
    assert!(
        matches!(e, LoadError::Corrupt { .. } | LoadError::Truncated { .. }),
        "{e:?}"
    );
    assert_mentions(&msg, &["model.safetensors", &victim]);
}

#[test]
fn duplicate_tensor_names_in_one_header_are_an_error() {
    let (_, config, tensors) = base();
    let dir = write(&config, &tensors);
    let path = dir.path().join("model.safetensors");
    let mut twice = String::new();
    rewrite_header(&path, |entries| {
        let entry = entries
            .iter()
            .find(|(n, _)| n != "__metadata__")
            .unwrap()
            .clone();
        twice = entry.0.clone();
        entries.push(entry);
    });
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, LoadError::Corrupt { .. }), "{e:?}");
    assert_mentions(&msg, &[&twice, "twice"]);
}

#[test]
fn overlapping_tensors_are_an_error() {
    let (_, config, tensors) = base();
    let dir = write(&config, &tensors);
    let path = dir.path().join("model.safetensors");
    rewrite_header(&path, |entries| {
        // Two tensors of one byte length: point the second at the first one's bytes.
        let real: Vec<usize> = (0..entries.len())
            .filter(|&i| entries[i].0 != "__metadata__")
            .collect();
        let len = |i: usize| {
            let (b, e) = offsets(&entries[i].1);
            e - b
        };
        let (a, b) = real
            .iter()
            .flat_map(|&a| real.iter().map(move |&b| (a, b)))
            .find(|&(a, b)| a != b && len(a) == len(b) && len(a) > 0)
            .expect("two tensors of one size");
        let first = entries[a].1["data_offsets"].clone();
        entries[b].1["data_offsets"] = first;
    });
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, LoadError::Corrupt { .. }), "{e:?}");
    assert_mentions(&msg, &["overlap"]);
}

/// A FIFO named model.safetensors used to block the loader for ever (issue 33 defect 12).
#[cfg(unix)]
#[test]
fn a_fifo_in_place_of_the_weights_is_an_error_not_a_hang() {
    let (_, config, tensors) = base();
    let dir = write(&config, &tensors);
    let path = dir.path().join("model.safetensors");
    std::fs::remove_file(&path).unwrap();
    let made = std::process::Command::new("mkfifo").arg(&path).status();
    if !made.is_ok_and(|s| s.success()) {
        eprintln!("mkfifo unavailable: skipped");
        return;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let dir_path = dir.path().to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(
            load_model(&dir_path, &LoadOptions::default())
                .err()
                .map(|e| e.to_string()),
        );
    });
    let err = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the loader hung on a FIFO")
        .expect("a FIFO must not load");
    assert_mentions(&err, &["model.safetensors", "regular file"]);
}

/// --no-mmap: the weights are read into memory, so changing the file afterwards changes nothing;
/// mapped, the change is noticed by the stamps.
#[test]
fn read_weights_do_not_follow_the_file_and_mapped_changes_are_noticed() {
    use calla_model::load::{load_model_with, Residency};
    let (_, config, tensors) = base();
    let dir = write(&config, &tensors);
    let path = dir.path().join("model.safetensors");
    let read = load_model_with(dir.path(), &LoadOptions::default(), Residency::Read).unwrap();
    assert!(read.mapped.is_empty());
    let before = read.weights.embed_tokens.clone();
    let mapped = load_model(dir.path(), &LoadOptions::default()).unwrap();
    assert_eq!(mapped.mapped.len(), 1);
    assert_eq!(mapped.mapped[0].changed(), None);
    // Overwrite in place with zeros (same length), as `cp` over a file would change its bytes.
    let len = std::fs::metadata(&path).unwrap().len() as usize;
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(&path, vec![0u8; len]).unwrap();
    let change = mapped.mapped[0].changed().expect("the change is noticed");
    eprintln!("change: {change}");
    let bytes = |m: &calla_model::Matrix| match &m.data {
        calla_model::matrix::MatrixData::Dense { data, .. } => data.bytes().to_vec(),
        _ => unreachable!("f32 fixture"),
    };
    assert_eq!(bytes(&read.weights.embed_tokens), bytes(&before));
    assert!(bytes(&before).iter().any(|&b| b != 0));
    drop(mapped);
}
