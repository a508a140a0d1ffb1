//! `calla generate` as outside checks call it: the built binary on a committed fixture and its golden.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const FIXTURE: &str = "qwen35moe-causal-perexpert";

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn golden() -> Value {
    let path = fixtures().join("goldens").join(format!("{FIXTURE}.json"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn calla(args: &[&str]) -> (bool, String, String) {
    let model = fixtures().join("models").join(FIXTURE);
    let out = Command::new(env!("CARGO_BIN_EXE_calla"))
        .arg("generate")
        .arg("--model")
        .arg(&model)
        .args(args)
        .output()
        .expect("run calla");
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

fn join(ids: &[u64]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn json_output_has_the_contract_shape_and_the_golden_tokens() {
    let g = golden();
    let prompt = ids(&g["prompt_ids"]);
    let (ok, stdout, stderr) = calla(&[
        "--prompt-ids",
        &join(&prompt),
        "--max-tokens",
        "40",
        "--ignore-eos",
        "--logprobs",
        "16",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "--json prints exactly one object: {stdout}");
    let out: Value = serde_json::from_str(lines[0]).unwrap();
    let keys: Vec<&str> = out
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.as_str())
        .collect();
    assert_eq!(
        keys,
        [
            "prompt_ids",
            "token_ids",
            "text",
            "logprobs",
            "finish_reason"
        ]
    );
    assert_eq!(ids(&out["prompt_ids"]), prompt);
    assert_eq!(ids(&out["token_ids"]), ids(&g["greedy_ids"]));
    assert_eq!(out["finish_reason"], "length");

    let tokenizer =
        calla_model::tokenizer::Tokenizer::from_dir(&fixtures().join("models").join(FIXTURE))
            .unwrap();
    let token_ids: Vec<u32> = ids(&out["token_ids"]).iter().map(|i| *i as u32).collect();
    assert_eq!(
        out["text"].as_str().unwrap(),
        tokenizer.decode(&token_ids, true)
    );

    let logprobs = out["logprobs"].as_array().unwrap();
    assert_eq!(logprobs.len(), 40, "one entry per generated token");
    for (step, (ours, theirs)) in logprobs
        .iter()
        .zip(g["top_logprobs"].as_array().unwrap())
        .enumerate()
    {
        let ours = ours.as_array().unwrap();
        assert_eq!(ours.len(), 16);
        assert_eq!(
            ours[0]["id"], out["token_ids"][step],
            "greedy: the chosen token is the best"
        );
        let values: Vec<f64> = ours
            .iter()
            .map(|e| e["logprob"].as_f64().unwrap())
            .collect();
        assert!(values.windows(2).all(|w| w[0] >= w[1]), "best first");
        for pair in theirs.as_array().unwrap() {
            let (id, want) = (pair[0].as_u64().unwrap(), pair[1].as_f64().unwrap());
            if let Some(e) = ours.iter().find(|e| e["id"].as_u64() == Some(id)) {
                let got = e["logprob"].as_f64().unwrap();
                assert!(
                    (got - want).abs() < 2e-3,
                    "step {step} id {id}: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn text_prompt_encodes_like_the_golden() {
    let g = golden();
    let text = g["prompt_text"].as_str().unwrap();
    let (ok, stdout, stderr) = calla(&[
        "--prompt",
        text,
        "--max-tokens",
        "3",
        "--ignore-eos",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let out: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(ids(&out["prompt_ids"]), ids(&g["prompt_ids"]));
    assert_eq!(ids(&out["token_ids"]), ids(&g["greedy_ids"])[..3]);
    assert_eq!(out["logprobs"].as_array().unwrap().len(), 3);
}

#[test]
fn seeded_sampling_repeats_and_plain_output_streams_text() {
    let args = [
        "--prompt-ids",
        "316,460,381",
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--seed",
        "11",
        "--json",
    ];
    let (ok, first, stderr) = calla(&args);
    assert!(ok, "{stderr}");
    let (_, second, _) = calla(&args);
    assert_eq!(first, second);
    let (_, plain, _) = calla(&[
        "--prompt-ids",
        "316,460,381",
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--seed",
        "11",
    ]);
    let out: Value = serde_json::from_str(first.trim()).unwrap();
    assert_eq!(plain.trim_end_matches('\n'), out["text"].as_str().unwrap());
}

#[test]
fn bad_input_is_a_clean_error() {
    for (args, needle) in [
        (
            vec!["--prompt-ids", "1,512", "--max-tokens", "2"],
            "vocab_size is 512",
        ),
        (
            vec!["--prompt-ids", "1", "--max-tokens", "2", "--top-p", "0"],
            "--top-p",
        ),
        (
            vec!["--prompt-ids", "1", "--max-tokens", "2", "--quant", "q3"],
            "q3",
        ),
    ] {
        let (ok, _, stderr) = calla(&args);
        assert!(!ok, "{args:?} must fail");
        assert!(
            stderr.contains(needle) && !stderr.contains("panicked"),
            "{args:?}: {stderr}"
        );
    }
    // Without a GPU (CI), --device cuda is a clean error that names CUDA; with one it runs.
    let (ok, _, stderr) = calla(&["--prompt-ids", "1", "--max-tokens", "2", "--device", "cuda"]);
    assert!(
        ok || (stderr.to_lowercase().contains("cuda") && !stderr.contains("panicked")),
        "{stderr}"
    );
}

/// CALLA_PROMPT_PRECISION set but empty means unset, as the engine reads it (the parity script
/// passes the variable through); a bad value is still a clean error that names it.
#[test]
fn an_empty_prompt_precision_variable_is_unset() {
    let model = fixtures().join("models").join(FIXTURE);
    let run = |value: &str| {
        Command::new(env!("CARGO_BIN_EXE_calla"))
            .args(["generate", "--model"])
            .arg(&model)
            .args(["--prompt-ids", "1,2", "--max-tokens", "2"])
            .env("CALLA_PROMPT_PRECISION", value)
            .output()
            .expect("run calla")
    };
    let out = run("");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run("quarter");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("quarter") && !stderr.contains("panicked"),
        "{stderr}"
    );
}
