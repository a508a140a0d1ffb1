//! Every committed golden (tests/fixtures/goldens/<model>.json, made by tools/fixtures with transformers
//! in float32): greedy continuation identical for all 40 tokens, and every step's top-16 log-probabilities
//! within 2e-3; also the prompt's last logits. Plus the --quant conversions on one fixture.

use std::path::{Path, PathBuf};

use calla_cpu::CpuBackend;
use calla_engine::Backend;
use calla_model::load::{load_model, LoadOptions, Quant};
use serde::Deserialize;

const LOGPROB_TOL: f32 = 2e-3;

#[derive(Deserialize)]
struct Golden {
    model: String,
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    /// per step: 16 × [id, logprob], best first
    top_logprobs: Vec<Vec<(u32, f32)>>,
    /// 16 × [id, logit]
    prefill_last_logits_top: Vec<(u32, f32)>,
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn goldens() -> Vec<Golden> {
    let mut out = vec![];
    let dir = fixtures().join("goldens");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .expect("goldens dir")
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    for path in paths {
        let text = std::fs::read_to_string(&path).unwrap();
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        // model goldens carry greedy_ids; other files there (deltanet_ref.json) are layer references
        if value.get("greedy_ids").is_some() {
            out.push(
                serde_json::from_value(value).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
            );
        }
    }
    assert!(
        out.len() >= 5,
        "expected the five model goldens, found {}",
        out.len()
    );
    out
}

fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f32>().ln();
    logits.iter().map(|l| l - lse).collect()
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len())
        .max_by(|a, b| v[*a].total_cmp(&v[*b]).then(b.cmp(a)))
        .unwrap() as u32
}

struct Run {
    /// our greedy choice at each step (teacher-forced on the golden's tokens)
    greedy: Vec<u32>,
    /// worst |Δ logprob| over the golden's top-16 ids at each step
    step_errors: Vec<f32>,
    prefill_logit_error: f32,
}

fn run(backend: &mut CpuBackend, g: &Golden) -> Run {
    let mut seq = backend.new_sequence().unwrap();
    let mut logits = backend.forward_logits(seq.as_mut(), &g.prompt_ids).unwrap();
    let prefill_logit_error = g
        .prefill_last_logits_top
        .iter()
        .map(|(id, l)| (logits[*id as usize] - l).abs())
        .fold(0.0, f32::max);
    let (mut greedy, mut step_errors) = (vec![], vec![]);
    for (step, want) in g.greedy_ids.iter().enumerate() {
        let lp = log_softmax(&logits);
        greedy.push(argmax(&logits));
        step_errors.push(
            g.top_logprobs[step]
                .iter()
                .map(|(id, l)| (lp[*id as usize] - l).abs())
                .fold(0.0, f32::max),
        );
        logits = backend.forward_logits(seq.as_mut(), &[*want]).unwrap();
    }
    Run {
        greedy,
        step_errors,
        prefill_logit_error,
    }
}

#[test]
fn every_golden_matches_transformers() {
    let mut failures = vec![];
    for g in goldens() {
        let loaded = load_model(
            &fixtures().join("models").join(&g.model),
            &LoadOptions::default(),
        )
        .unwrap_or_else(|e| panic!("{}: {e}", g.model));
        let mut backend = CpuBackend::new(loaded.spec, loaded.weights).unwrap();
        let r = run(&mut backend, &g);
        let worst = r.step_errors.iter().cloned().fold(0.0, f32::max);
        let mismatches: Vec<usize> = (0..g.greedy_ids.len())
            .filter(|i| r.greedy[*i] != g.greedy_ids[*i])
            .collect();
        println!(
            "{:28} greedy {}/{} identical, worst top-16 |Δlogprob| {worst:.2e} ({:.0}% of {LOGPROB_TOL}), prefill |Δlogit| {:.2e}",
            g.model,
            g.greedy_ids.len() - mismatches.len(),
            g.greedy_ids.len(),
            100.0 * worst / LOGPROB_TOL,
            r.prefill_logit_error
        );
        if !mismatches.is_empty() || worst > LOGPROB_TOL || r.prefill_logit_error > LOGPROB_TOL {
            failures.push(format!(
                "{}: greedy mismatches at steps {mismatches:?}, worst logprob error {worst}",
                g.model
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// `--quant q8` and `--quant q4` on the f32 MoE fixture, against its golden (transformers f32).
///
/// The fixtures are random models with gain-1 weights (std 1/√D) and peaked logits: they amplify any
/// weight noise. Measured: 0.01% multiplicative noise on in_proj_qkv alone already moves a top-16
/// logprob by 0.003 (median) to 0.14 (worst position); 1% noise by 0.35 to 7.5. Quantisation error is of
/// that size (q8 ≈ 0.4% of a group's range, q4 ≈ 7%), so the bounds here are wide, set below what was
/// measured (q8: 33/40 greedy, median 0.46; q4: 16/40, median 4.5), and ordered (q8 beats q4). The
/// exactness of the quantised kernels is proven elsewhere: the qwen35moe-mlx4 golden (transformers on
/// the dequantised weights) is matched to 1e-4 through the q4/q8 code paths, and linear.rs checks every
/// format against its dequantised product.
#[test]
fn quantised_fixture_stays_close() {
    let g = goldens()
        .into_iter()
        .find(|g| g.model == "qwen35moe-causal-perexpert")
        .unwrap();
    let mut medians = vec![];
    // (quant, least greedy agreement out of 40, largest median top-16 logprob error)
    for (quant, min_agree, max_median) in [(Quant::Q8, 28, 1.0), (Quant::Q4, 10, 8.0)] {
        let loaded = load_model(
            &fixtures().join("models").join(&g.model),
            &LoadOptions { quant: Some(quant) },
        )
        .unwrap();
        let mut backend = CpuBackend::new(loaded.spec, loaded.weights).unwrap();
        let r = run(&mut backend, &g);
        let agree = (0..40).filter(|i| r.greedy[*i] == g.greedy_ids[*i]).count();
        let mut errs = r.step_errors.clone();
        errs.sort_by(f32::total_cmp);
        println!(
            "{quant}: greedy agreement {agree}/40, top-16 |Δlogprob| median {:.4} worst {:.4}",
            errs[20], errs[39]
        );
        assert!(
            agree >= min_agree && errs[20] <= max_median,
            "{quant}: agreement {agree}/40, median error {}",
            errs[20]
        );
        medians.push(errs[20]);
    }
    assert!(
        medians[0] < medians[1],
        "q8 must be closer than q4: {medians:?}"
    );
}
