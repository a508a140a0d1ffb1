//! The whole engine: CUDA vs the CPU engine on every committed fixture and at the real shapes, and
//! CUDA vs transformers at the real shapes (model made by scripts/gpu-real-shape.py).

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Instant;

use calla_cpu::CpuBackend;
use calla_cuda::{CudaBackend, CudaOptions, KernelChoices, KvDtype};
use calla_engine::generate::{generate_on, GenerateRequest};
use calla_engine::sampling::SamplingParams;
use calla_engine::{Backend, TokenChoice};
use calla_model::load::{load_model, LoadOptions, Quant};
use calla_model::{LayerKind, ModelSpec, Weights};

use crate::support::*;

const STEPS: usize = 64;

/// The committed fixtures: `CALLA_FIXTURES` when set (binaries built in another checkout run
/// against this one's tree), else the tree the test was built from.
fn fixtures() -> PathBuf {
    match std::env::var_os("CALLA_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
    }
}

/// Prefill logits and a greedy run on both engines; one row each. Returns pass.
fn compare_engines(
    name: &str,
    spec: &ModelSpec,
    w: &Weights,
    prompt: &[u32],
    steps: usize,
    kv: KvDtype,
    tol: f32,
) -> bool {
    let mut cpu = CpuBackend::new(spec.clone(), w.clone()).unwrap();
    let opts = CudaOptions {
        max_context: Some(prompt.len() + steps + 8),
        kv_cache: kv,
        ..Default::default()
    };
    let mut gpu = CudaBackend::new(spec, w, &opts).unwrap();

    let mut sc = cpu.new_sequence().unwrap();
    let mut sg = gpu.new_sequence().unwrap();
    let lc = log_softmax(&cpu.forward_logits(sc.as_mut(), prompt).unwrap());
    let lg = log_softmax(&gpu.forward_logits(sg.as_mut(), prompt).unwrap());
    let mut pass = check(
        &format!("{name}: prefill logprobs"),
        &format!("{} tokens, V={}", prompt.len(), spec.vocab_size),
        &lg,
        &lc,
        tol,
        0.0,
    );

    let c = greedy(&mut cpu, prompt, steps);
    let g = greedy(&mut gpu, prompt, steps);
    let same = c
        .iter()
        .zip(&g)
        .take_while(|(a, b)| a.token == b.token)
        .count();
    // Chosen token's log-probability, and every id both top-5 lists share (near-equal alternatives
    // may swap places in the lists).
    let worst =
        c.iter()
            .zip(&g)
            .take(same)
            .flat_map(|(a, b)| {
                std::iter::once((a.logprob - b.logprob).abs()).chain(b.top.iter().filter_map(
                    |(id, lp)| a.top.iter().find(|x| x.0 == *id).map(|x| (x.1 - lp).abs()),
                ))
            })
            .fold(0f32, f32::max);
    pass &= check_count(
        &format!("{name}: greedy tokens"),
        &format!("{steps} steps"),
        same,
        steps,
        &format!("Δlp {worst:.1e}"),
    );
    pass &= worst <= tol;
    if same < steps {
        eprintln!(
            "{name}: first difference at step {same}: cpu {:?} cuda {:?}",
            c.get(same).map(|x| (&x.token, &x.top)),
            g.get(same).map(|x| (&x.token, &x.top))
        );
    }
    pass
}

#[derive(serde::Deserialize)]
struct Golden {
    prompt_ids: Vec<u32>,
}

#[test]
#[ignore = "needs CUDA"]
fn engine_matches_cpu_on_every_fixture() {
    let _ = gpu();
    let mut all = true;
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures().join("models"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 5, "expected the five fixtures");
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let golden: Golden = serde_json::from_str(
            &std::fs::read_to_string(fixtures().join("goldens").join(format!("{name}.json")))
                .unwrap(),
        )
        .unwrap();
        for (quant, tag) in [
            (None, "stored"),
            (Some(Quant::Bf16), "bf16"),
            (Some(Quant::Q4), "q4"),
        ] {
            let loaded = load_model(&dir, &LoadOptions { quant }).unwrap();
            all &= compare_engines(
                &format!("{name} {tag}"),
                &loaded.spec,
                &loaded.weights,
                &golden.prompt_ids,
                STEPS,
                KvDtype::F32,
                2e-2,
            );
        }
    }
    // The bf16 KV cache (the long-context option) on one fixture, for the record.
    let dir = fixtures().join("models/qwen35moe-causal-perexpert");
    let loaded = load_model(&dir, &LoadOptions { quant: None }).unwrap();
    let golden: Golden = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("goldens/qwen35moe-causal-perexpert.json"))
            .unwrap(),
    )
    .unwrap();
    all &= compare_engines(
        "qwen35moe-causal-perexpert bf16 KV",
        &loaded.spec,
        &loaded.weights,
        &golden.prompt_ids,
        STEPS,
        KvDtype::Bf16,
        2e-2,
    );
    assert!(all, "engine parity failures (see the table)");
}

#[test]
#[ignore = "needs CUDA"]
fn engine_matches_cpu_at_real_shapes() {
    let _ = gpu();
    // 4 layers of the real dims (3 DeltaNet + 1 attention, 256 experts), full vocabulary, q4.
    let spec = real_spec(
        &[
            LayerKind::DeltaNet,
            LayerKind::DeltaNet,
            LayerKind::DeltaNet,
            LayerKind::Attention,
        ],
        248_320,
    );
    let w = random_weights(&spec, Some(Quant::Q4), 91);
    let mut rng = Rng::new(92);
    let prompt: Vec<u32> = (0..40).map(|_| rng.below(spec.vocab_size) as u32).collect();
    assert!(compare_engines(
        "real dims ×4 layers q4 vs CPU",
        &spec,
        &w,
        &prompt,
        24,
        KvDtype::F32,
        2e-2
    ));
}

const REAL_X4_STEPS: usize = 24;

/// A random q4 model at the real Qwen3.6-35B-A3B dims with 4 layers (DeltaNet, attention, DeltaNet,
/// DeltaNet) and a random 24-token prompt from `seed`: the engine tests that set two decode paths
/// against each other.
struct RealDimsX4 {
    spec: ModelSpec,
    w: Weights,
    prompt: Vec<u32>,
}

impl RealDimsX4 {
    fn new(seed: u64) -> RealDimsX4 {
        let _ = gpu();
        let spec = real_spec(
            &[
                LayerKind::DeltaNet,
                LayerKind::Attention,
                LayerKind::DeltaNet,
                LayerKind::DeltaNet,
            ],
            248_320,
        );
        let w = random_weights(&spec, Some(Quant::Q4), seed);
        let mut rng = Rng::new(seed + 1);
        let prompt = (0..24).map(|_| rng.below(spec.vocab_size) as u32).collect();
        RealDimsX4 { spec, w, prompt }
    }

    /// REAL_X4_STEPS greedy steps on a fresh backend (bf16 KV) with the kernel variants `kernels`.
    fn greedy(&self, kernels: KernelChoices) -> Vec<TokenChoice> {
        let opts = CudaOptions {
            max_context: Some(self.prompt.len() + REAL_X4_STEPS + 8),
            kv_cache: KvDtype::Bf16,
            kernels,
            ..Default::default()
        };
        let mut be = CudaBackend::new(&self.spec, &self.w, &opts).unwrap();
        greedy(&mut be, &self.prompt, REAL_X4_STEPS)
    }

    /// Greedy through the generation loop (two steps in flight) on a fresh backend, three requests
    /// on new sequences: without top logprobs, with 5, without again. Returns whether the backend
    /// chooses plain greedy inside lm_head, and the three requests' choices.
    fn generate_greedy(&self, kernels: KernelChoices) -> (bool, [Vec<TokenChoice>; 3]) {
        let opts = CudaOptions {
            max_context: Some(self.prompt.len() + REAL_X4_STEPS + 8),
            kv_cache: KvDtype::Bf16,
            kernels,
            ..Default::default()
        };
        let mut be = CudaBackend::new(&self.spec, &self.w, &opts).unwrap();
        let mut run = |top_logprobs: usize| {
            let req = GenerateRequest {
                prompt: self.prompt.clone(),
                max_tokens: REAL_X4_STEPS,
                sampling: SamplingParams::greedy(),
                stop_token_ids: vec![],
                ignore_eos: true,
                top_logprobs,
            };
            let mut seq = be.new_sequence().unwrap();
            generate_on(&mut be, seq.as_mut(), &req, Instant::now(), |_| {
                ControlFlow::Continue(())
            })
            .unwrap()
            .choices
        };
        let runs = [run(0), run(5), run(0)];
        (be.fuses_greedy_selection(), runs)
    }
}

/// lm_head with plain greedy fused in (the decode graph for plain greedy: matvec::head_greedy) against
/// lm_head then the selection launch (without `KernelChoices::greedy_head`), through the
/// generation loop with two steps in flight, on the real-dims ×4 model: the same tokens, the
/// log-probabilities within rounding (the sum in another order). In each engine a request with top
/// logprobs (the general graph) between two without must choose the same tokens: the graph changes
/// with the request. Not named engine_… so that gpu-parity.sh's kernel group runs it.
#[test]
#[ignore = "needs CUDA"]
fn greedy_head_matches_the_selection_launch() {
    let model = RealDimsX4::new(97);
    let steps = REAL_X4_STEPS;
    let (fuses, [fused, fused_lp, fused_again]) = model.generate_greedy(KernelChoices::default());
    let separate_choices = KernelChoices {
        greedy_head: false,
        ..KernelChoices::default()
    };
    let (separate_fuses, [separate, separate_lp, _]) = model.generate_greedy(separate_choices);
    assert!(
        fuses && !separate_fuses,
        "the fused head should apply at the real dims, and not without greedy_head"
    );
    let tokens = |c: &[TokenChoice]| c.iter().map(|c| c.token).collect::<Vec<u32>>();
    let same = fused
        .iter()
        .zip(&separate)
        .take_while(|(a, b)| a.token == b.token)
        .count();
    let worst = fused
        .iter()
        .zip(&separate)
        .take(same)
        .map(|(a, b)| (a.logprob - b.logprob).abs())
        .fold(0f32, f32::max);
    let switches = tokens(&fused) == tokens(&fused_lp)
        && tokens(&fused) == tokens(&fused_again)
        && tokens(&separate) == tokens(&separate_lp)
        && fused_lp.iter().all(|c| c.top.len() == 5);
    let pass = check_count(
        "greedy head vs lm_head + select: real dims ×4 q4",
        &format!("{steps} steps, pipelined"),
        same,
        steps,
        &format!(
            "Δlp {worst:.1e}{}",
            if switches { "" } else { " GRAPH SWITCH≠" }
        ),
    ) && worst <= 1e-4
        && switches;
    assert!(
        pass,
        "the fused greedy head differs from lm_head + select ({same}/{steps}, Δlp {worst:.1e}, \
         graph switches agree: {switches})"
    );
}

/// The decode kernels compiled for Qwen3.5/3.6's dims (attention, DeltaNet, gate/up, down, the
/// out- and in-projections: docs/experiments.md) against the general kernels they were made
/// from, on the same random real-dims model: the second backend is built with
/// `KernelChoices::general()`. Same operations in the same order, so every token and every
/// log-probability must be equal to the bit.
/// Not named engine_… so that gpu-parity.sh's kernel group runs it.
#[test]
#[ignore = "needs CUDA"]
fn compiled_copies_match_the_general_kernels() {
    let model = RealDimsX4::new(95);
    let steps = REAL_X4_STEPS;
    let copies = model.greedy(KernelChoices::default());
    let general = model.greedy(KernelChoices::general());
    let bits = |c: &TokenChoice| {
        let top: Vec<(u32, u32)> = c.top.iter().map(|&(id, lp)| (id, lp.to_bits())).collect();
        (c.token, c.logprob.to_bits(), top)
    };
    let same = copies
        .iter()
        .zip(&general)
        .take_while(|(a, b)| bits(a) == bits(b))
        .count();
    let pass = check_count(
        "compiled copies vs general kernels: real dims ×4 q4",
        &format!("{steps} steps, bf16 KV, bits"),
        same,
        steps,
        "bit-equal",
    );
    assert!(
        pass,
        "the compiled copies differ from the general kernels from step {same} on"
    );
}

#[derive(serde::Deserialize)]
struct Reference {
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    /// per generated step: [[id, logprob] × K], best first
    top_logprobs: Vec<Vec<(u32, f32)>>,
    /// log-softmax of the prompt's last logits: [[id, logprob] × K]
    prefill_top: Vec<(u32, f32)>,
}

/// (c): a random-weight model with the real Qwen3.6-35B-A3B dimensions and 4 layers, made with
/// transformers (scripts/gpu-real-shape.py writes it and transformers' outputs to
/// $CALLA_REAL_SHAPE_DIR): same greedy tokens, log-probabilities within 2e-2.
#[test]
#[ignore = "needs CUDA"]
fn engine_matches_transformers_at_real_shapes() {
    let Some(dir) = std::env::var_os("CALLA_REAL_SHAPE_DIR") else {
        panic!("set CALLA_REAL_SHAPE_DIR to the model written by scripts/gpu-real-shape.py");
    };
    let dir = PathBuf::from(dir);
    let reference: Reference =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let loaded = load_model(&dir, &LoadOptions { quant: None }).unwrap();
    let steps = reference.greedy_ids.len();
    let opts = CudaOptions {
        max_context: Some(reference.prompt_ids.len() + steps + 8),
        progress: true,
        ..Default::default()
    };
    let mut be = CudaBackend::new(&loaded.spec, &loaded.weights, &opts).unwrap();
    eprintln!(
        "{:.2} GB uploaded in {:.2} s",
        be.report.weight_bytes as f64 / 1e9,
        be.report.upload_seconds
    );

    let mut seq = be.new_sequence().unwrap();
    let lp = log_softmax(
        &be.forward_logits(seq.as_mut(), &reference.prompt_ids)
            .unwrap(),
    );
    let got: Vec<f32> = reference
        .prefill_top
        .iter()
        .map(|(id, _)| lp[*id as usize])
        .collect();
    let want: Vec<f32> = reference.prefill_top.iter().map(|(_, l)| *l).collect();
    let mut pass = check(
        "transformers real shape: prefill top logprobs",
        &format!("{} tokens", reference.prompt_ids.len()),
        &got,
        &want,
        2e-2,
        0.0,
    );

    let g = greedy(&mut be, &reference.prompt_ids, steps);
    let same = g
        .iter()
        .zip(&reference.greedy_ids)
        .take_while(|(a, b)| a.token == **b)
        .count();
    let mut worst = 0f32;
    for (c, r) in g.iter().zip(&reference.top_logprobs).take(same) {
        let want = r
            .iter()
            .find(|(id, _)| *id == c.token)
            .map(|x| x.1)
            .unwrap_or(f32::NAN);
        worst = worst.max((c.logprob - want).abs());
    }
    pass &= check_count(
        "transformers real shape: greedy tokens",
        &format!("{steps} steps"),
        same,
        steps,
        &format!("Δlp {worst:.1e}"),
    );
    pass &= worst <= 2e-2;
    if same < steps {
        eprintln!(
            "first difference at step {same}: cuda {:?}, transformers {:?}",
            g.get(same).map(|x| (&x.token, &x.top)),
            reference
                .top_logprobs
                .get(same)
                .map(|t| &t[..5.min(t.len())])
        );
    }
    assert!(pass);
}
