//! Shared helpers: comparisons that print evidence, random data, model rigs.

use std::sync::{Arc, OnceLock};

use calla_cuda::ops::weights::{DevMatrix, Uploader};
use calla_cuda::runtime::gpu::{DPtr, Gpu};
use calla_cuda::runtime::pool::Arena;
use calla_cuda::KernelChoices;
use calla_model::load::Quant;
use calla_model::{LayerKind, Matrix, ModelSpec, Weights};

pub use calla_cpu::random::Rng;

/// One row of the report: name, shape, worst error, where, its share of the tolerance.
/// Passes when every |got − want| ≤ atol + rtol·|want| (NaN never passes).
pub fn check(name: &str, shape: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) -> bool {
    assert_eq!(
        got.len(),
        want.len(),
        "{name}: {} values vs {}",
        got.len(),
        want.len()
    );
    let mut worst = (0.0f32, 0usize, 0.0f32); // (error/tolerance, index, error)
    let mut bad = 0usize;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        let tol = atol + rtol * w.abs();
        let ratio = if err.is_nan() {
            f32::INFINITY
        } else if err == 0.0 {
            0.0
        } else {
            err / tol
        };
        if !(ratio <= 1.0) {
            bad += 1;
        }
        if !(ratio <= worst.0) {
            worst = (ratio, i, err);
        }
    }
    let pass = bad == 0;
    println!(
        "| {:<46} | {:<26} | {:>10.3e} | {:>9} | {:>7.1}% | {} |",
        name,
        shape,
        worst.2,
        worst.1,
        worst.0 * 100.0,
        if pass { "PASS" } else { "FAIL" }
    );
    if !pass {
        let i = worst.1;
        let lo = i.saturating_sub(2);
        let hi = (i + 3).min(got.len());
        eprintln!(
            "{name}: {bad} of {} values out of tolerance; around index {i}: got {:?} want {:?}",
            got.len(),
            &got[lo..hi],
            &want[lo..hi]
        );
    }
    pass
}

/// A row for a count-style check (tokens identical, draws equal).
pub fn check_count(name: &str, shape: &str, equal: usize, total: usize, detail: &str) -> bool {
    check_count_at_least(name, shape, equal, total, total, detail)
}

/// A count-style row that passes with at least `required` of `total` equal.
pub fn check_count_at_least(
    name: &str,
    shape: &str,
    equal: usize,
    total: usize,
    required: usize,
    detail: &str,
) -> bool {
    let pass = equal >= required;
    println!(
        "| {:<46} | {:<26} | {:>10} | {:>9} | {:>8} | {} |",
        name,
        shape,
        format!("{equal}/{total}"),
        detail,
        "",
        if pass { "PASS" } else { "FAIL" }
    );
    pass
}

pub fn gpu() -> Arc<Gpu> {
    static GPU: OnceLock<Arc<Gpu>> = OnceLock::new();
    GPU.get_or_init(|| match Gpu::new(0) {
        Ok(g) => {
            eprintln!("{} ({})", g.describe(), g.libraries);
            g
        }
        Err(e) => panic!("these tests need a CUDA GPU: {e:#}"),
    })
    .clone()
}

/// `m` uploaded into `arena` in the engine's device format.
pub fn upload_matrix(gpu: &Arc<Gpu>, arena: &mut Arena, name: &str, m: &Matrix) -> DevMatrix {
    let mut up = Uploader {
        gpu,
        arena,
        bytes: 0,
        total: 0,
        progress: None,
    };
    up.matrix(name, m)
        .unwrap_or_else(|e| panic!("{name}: {e:#}"))
}

pub fn download(gpu: &Gpu, ptr: DPtr, n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    gpu.dtoh(ptr, &mut v).expect("download");
    v
}

/// The fixtures' shape ([DN, DN, DN, Attn], tiny dims, every dim distinct).
pub fn tiny_spec(family: calla_model::Family) -> ModelSpec {
    calla_cpu::random::tiny_spec(family, 1)
}

/// The real Qwen3.6-35B-A3B layer dimensions with the given layers (all 256 experts).
pub fn real_spec(layers: &[LayerKind], vocab: usize) -> ModelSpec {
    let mut s = calla_model::synthetic::preset("qwen3.6-35b-a3b").expect("preset");
    s.layers = layers.to_vec();
    s.vocab_size = vocab;
    s
}

/// Seeded random weights: f32 (quant None) or converted like the loader's --quant.
pub fn random_weights(spec: &ModelSpec, quant: Option<Quant>, seed: u64) -> Weights {
    match quant {
        None => calla_cpu::random::random_weights(spec, seed),
        Some(q) => calla_model::synthetic::random_weights(spec, q, seed),
    }
}

/// x̂ = rmsnorm₀(x)·(1 + w) as the CPU engine computes it.
pub fn norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    calla_cpu::norm::rms_norm_zero_centred_into(x, w, eps, &mut out);
    out
}

/// Real-dims [DeltaNet, attention] q4 weights (256 experts, 8-bit router), made once per process.
pub fn real_two_layers() -> &'static (ModelSpec, Weights) {
    static W: OnceLock<(ModelSpec, Weights)> = OnceLock::new();
    W.get_or_init(|| {
        let spec = real_spec(&[LayerKind::DeltaNet, LayerKind::Attention], 512);
        let w = random_weights(&spec, Some(Quant::Q4), 53);
        (spec, w)
    })
}

/// The kernel variants the test backends (`rig` and friends) are built with: the defaults unless a
/// test runs a block under [`with_kernel_choices`]. The GPU tests run one at a time
/// (`--test-threads=1`), so one process-wide value is enough.
static TEST_CHOICES: std::sync::Mutex<Option<KernelChoices>> = std::sync::Mutex::new(None);

pub fn kernel_choices() -> KernelChoices {
    TEST_CHOICES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .unwrap_or_default()
}

/// Runs `f` with backends built from now on (and the shared test GPU's launches) taking `choices`,
/// then restores the defaults.
pub fn with_kernel_choices<T>(choices: KernelChoices, f: impl FnOnce() -> T) -> T {
    *TEST_CHOICES.lock().unwrap_or_else(|p| p.into_inner()) = Some(choices);
    gpu().set_choices(choices);
    let out = f();
    *TEST_CHOICES.lock().unwrap_or_else(|p| p.into_inner()) = None;
    gpu().set_choices(KernelChoices::default());
    out
}

pub fn log_softmax(l: &[f32]) -> Vec<f32> {
    let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = m + l.iter().map(|v| (v - m).exp()).sum::<f32>().ln();
    l.iter().map(|v| v - lse).collect()
}

/// Greedy decode: the prompt, then `steps` tokens fed back one at a time.
pub fn greedy(
    be: &mut dyn calla_engine::Backend,
    prompt: &[u32],
    steps: usize,
) -> Vec<calla_engine::TokenChoice> {
    let params = calla_engine::sampling::SamplingParams::greedy();
    let mut seq = be.new_sequence().unwrap();
    let mut out: Vec<calla_engine::TokenChoice> = Vec::new();
    let mut generated: Vec<u32> = Vec::new();
    for step in 0..steps {
        let tokens: Vec<u32> = if step == 0 {
            prompt.to_vec()
        } else {
            vec![*generated.last().unwrap()]
        };
        let sel = calla_engine::Selection {
            params: &params,
            prompt,
            generated: &generated,
            step: step as u64,
            top_logprobs: 5,
        };
        let c = be.step(seq.as_mut(), &tokens, &sel).unwrap();
        generated.push(c.token);
        out.push(c);
    }
    out
}
