//! The synthetic benchmark at the real shape: a random model made on the GPU, prefill and decode
//! timed after warm-up (medians over rounds), bytes moved per token against the measured copy
//! bandwidth. `calla bench` (calla-cli/src/bench.rs) prints what this returns.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Result};
use calla_engine::sampling::SamplingParams;
use calla_engine::{Backend, Selection};
use calla_model::{FeedForwardSpec, LayerKind, ModelSpec};
use cudarc::driver::sys;
use serde::Serialize;

use crate::backend::{CudaBackend, CudaOptions};
use crate::gpu::Gpu;
use crate::pool::Arena;
use crate::sequence::CudaSequence;
use crate::synthetic;
use crate::weights::{DevFfn, DevMixer, DevModel, Format};
use crate::KvDtype;

#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub format: Format,
    pub prompt_len: usize,
    pub gen_len: usize,
    /// decode measured at these context lengths (tokens already in the sequence)
    pub contexts: Vec<usize>,
    pub rounds: usize,
    pub warmup: usize,
    pub kv_cache: KvDtype,
    pub seed: u64,
    /// Also time each kernel of the decode step on its own (at the last context).
    pub profile: bool,
    /// CudaOptions::prompt_precision (None: by weight format) and prompt_chunk.
    pub prompt_precision: Option<crate::gemm::Precision>,
    pub prompt_chunk: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct PrefillResult {
    pub tokens: usize,
    /// prompt precision ("auto", "fast", "split") and tokens per prefill chunk
    pub precision: String,
    pub chunk: usize,
    /// median over rounds: the prompt step including the first token's selection (= TTFT)
    pub ttft_ms: f64,
    pub tokens_per_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct DecodeResult {
    pub context: usize,
    pub tokens: usize,
    /// median over rounds of (time for `tokens` steps) / tokens, each step synchronous (the token
    /// is read back, as a streaming server does)
    pub ms_per_token: f64,
    pub tokens_per_s: f64,
    pub bytes_per_token: f64,
    pub achieved_gb_s: f64,
    /// achieved / measured device copy bandwidth
    pub fraction_of_copy_bandwidth: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub device: String,
    pub model: String,
    pub format: String,
    pub kv_cache: String,
    pub weight_bytes: usize,
    pub weights_made_s: f64,
    /// device-to-device copy, bytes read + written per second
    pub copy_gb_s: f64,
    pub launches_per_token: usize,
    pub decode_graph: bool,
    pub peak_gpu_memory_bytes: usize,
    pub prefill: PrefillResult,
    pub decode: Vec<DecodeResult>,
    /// per kernel: (name, launches per step, µs per step), launched one by one with events between
    pub profile: Vec<(String, usize, f64)>,
}

/// Bytes one decode step must read (and write, for the DeltaNet states) at `context`.
pub fn bytes_per_token(
    spec: &ModelSpec,
    model: &DevModel,
    kv_bytes_per_token: usize,
    context: usize,
) -> f64 {
    let mut b =
        model.lm_head.bytes() as f64 + (model.embed.bytes() / model.embed.rows.max(1)) as f64;
    for (layer, kind) in model.layers.iter().zip(&spec.layers) {
        b += match &layer.mixer {
            DevMixer::DeltaNet(d) => {
                d.in_proj.iter().map(|m| m.bytes()).sum::<usize>() + d.out_proj.bytes()
            }
            DevMixer::Attention(a) => {
                a.in_proj.iter().map(|m| m.bytes()).sum::<usize>() + a.o_proj.bytes()
            }
        } as f64;
        if *kind == LayerKind::DeltaNet {
            let s = spec.linear_num_value_heads
                * spec.linear_value_head_dim
                * spec.linear_key_head_dim
                * 4;
            let conv = spec.linear_conv_kernel_dim * spec.linear_conv_dim() * 4;
            b += (2 * s + conv) as f64;
        }
        b += match (&layer.ffn, &spec.feed_forward) {
            (
                DevFfn::Moe(m),
                FeedForwardSpec::Moe {
                    num_experts, top_k, ..
                },
            ) => {
                let per_expert = (m.gate_up.bytes() + m.down.bytes()) as f64 / *num_experts as f64;
                m.router.bytes() as f64
                    + per_expert * *top_k as f64
                    + m.shared
                        .as_ref()
                        .map(|(a, b)| a.bytes() + b.bytes())
                        .unwrap_or(0) as f64
            }
            (DevFfn::Dense(m), _) => (m.gate_up.bytes() + m.down.bytes()) as f64,
            _ => 0.0,
        };
    }
    b + (kv_bytes_per_token * context) as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Device copy bandwidth (read + write) over a 1 GiB buffer, median of 10 copies.
pub fn copy_bandwidth(gpu: &Arc<Gpu>) -> Result<f64> {
    let bytes = 1usize << 30;
    let a = gpu.alloc(bytes)?;
    let b = gpu.alloc(bytes)?;
    synthetic::fill_f32(gpu, a.ptr, bytes / 4, -1.0, 1.0, 7)?;
    let start = gpu
        .ctx
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
    let end = gpu
        .ctx
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
    let mut times = Vec::new();
    for i in 0..12 {
        start.record(&gpu.stream)?;
        gpu.dtod(b.ptr, a.ptr, bytes)?;
        end.record(&gpu.stream)?;
        end.synchronize()?;
        if i >= 2 {
            times.push(start.elapsed_ms(&end)? as f64 / 1e3);
        }
    }
    Ok(2.0 * bytes as f64 / median(times) / 1e9)
}

/// Pretend `context` tokens were already processed: random K/V and DeltaNet states (never zeros),
/// sequence length set. Decode cost depends only on how much state there is, not on its values.
fn fake_context(be: &CudaBackend, seq: &mut CudaSequence, context: usize, seed: u64) -> Result<()> {
    let gpu = be.gpu().clone();
    let layout = be.layout();
    for (i, kind) in be.spec().layers.iter().enumerate() {
        let (a, b) = layout.layers[i];
        match kind {
            LayerKind::DeltaNet => {
                let n = (b - a) / 4;
                synthetic::fill_f32(&gpu, seq.base().offset(a), n, -0.5, 0.5, seed + i as u64)?;
                let spec = be.spec();
                let s = spec.linear_num_value_heads
                    * spec.linear_value_head_dim
                    * spec.linear_key_head_dim;
                synthetic::fill_f32(
                    &gpu,
                    seq.base().offset(b),
                    s,
                    -0.05,
                    0.05,
                    seed + 100 + i as u64,
                )?;
            }
            LayerKind::Attention => {
                let n = layout.kv_bytes_per_token
                    / (2 * be.spec().num_attention_layers())
                    / layout.kv.size()
                    * layout.max_ctx;
                for (k, off) in [a, b].into_iter().enumerate() {
                    match layout.kv {
                        KvDtype::F32 => synthetic::fill_f32(
                            &gpu,
                            seq.base().offset(off),
                            n,
                            -1.0,
                            1.0,
                            seed + 200 + 2 * i as u64 + k as u64,
                        )?,
                        KvDtype::Bf16 => synthetic::fill_bf16(
                            &gpu,
                            seq.base().offset(off),
                            n,
                            -1.0,
                            1.0,
                            seed + 200 + 2 * i as u64 + k as u64,
                        )?,
                    }
                }
            }
        }
    }
    gpu.sync()?;
    seq.len = context;
    Ok(())
}

pub fn run(spec: &ModelSpec, model_name: &str, opts: &BenchOptions) -> Result<BenchReport> {
    ensure!(
        opts.prompt_len >= 1 && opts.gen_len >= 1 && opts.rounds >= 1,
        "prompt, gen and rounds must be ≥ 1"
    );
    let gpu = Gpu::new(0)?;
    let copy_gb_s = copy_bandwidth(&gpu)?;
    let mut arena = Arena::new(&gpu, 1 << 30);
    let model = synthetic::synthetic_model(&gpu, &mut arena, spec, opts.format, opts.seed)?;
    let weights_made_s = model.upload_seconds;
    let max_ctx = opts
        .contexts
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(opts.prompt_len)
        + opts.gen_len
        + opts.warmup
        + 8;
    let copts = CudaOptions {
        max_context: Some(max_ctx),
        kv_cache: opts.kv_cache,
        prompt_precision: opts.prompt_precision,
        prompt_chunk: opts.prompt_chunk,
        ..Default::default()
    };
    let mut be = CudaBackend::from_device_model(gpu.clone(), spec, model, arena, &copts)?;
    let params = SamplingParams::greedy();
    let mut rng = calla_rng(opts.seed);
    let prompt: Vec<u32> = (0..opts.prompt_len)
        .map(|_| (rng() % spec.vocab_size as u64) as u32)
        .collect();
    let sel = |step: u64| Selection {
        params: &params,
        prompt: &[],
        generated: &[],
        step,
        top_logprobs: 0,
    };

    // Prefill (TTFT): one warm-up, then rounds on fresh sequences.
    let mut ttft = Vec::new();
    for round in 0..=opts.rounds {
        let mut seq = be.new_sequence()?;
        let t = Instant::now();
        be.step(seq.as_mut(), &prompt, &sel(0))?;
        if round > 0 {
            ttft.push(t.elapsed().as_secs_f64());
        }
    }
    let ttft_s = median(ttft);
    let mut peak = gpu
        .memory_info()
        .map(|(free, total)| total - free)
        .unwrap_or(0);

    let mut decode = Vec::new();
    let contexts = if opts.contexts.is_empty() {
        vec![opts.prompt_len]
    } else {
        opts.contexts.clone()
    };
    for &context in &contexts {
        let mut per_round = Vec::new();
        for round in 0..opts.rounds {
            let mut seq = be.new_sequence()?;
            let cs = seq
                .as_any_mut()
                .downcast_mut::<CudaSequence>()
                .expect("cuda sequence");
            fake_context(&be, cs, context, opts.seed + round as u64)?;
            let mut token = prompt[0];
            for i in 0..opts.warmup {
                token = be.step(seq.as_mut(), &[token], &sel(i as u64))?.token;
            }
            let t = Instant::now();
            for i in 0..opts.gen_len {
                token = be
                    .step(seq.as_mut(), &[token], &sel((opts.warmup + i) as u64))?
                    .token;
            }
            per_round.push(t.elapsed().as_secs_f64() / opts.gen_len as f64);
            peak = peak.max(
                gpu.memory_info()
                    .map(|(free, total)| total - free)
                    .unwrap_or(0),
            );
        }
        let s = median(per_round);
        let bytes = bytes_per_token(spec, &be.model, be.layout().kv_bytes_per_token, context);
        let gb_s = bytes / s / 1e9;
        decode.push(DecodeResult {
            context,
            tokens: opts.gen_len,
            ms_per_token: s * 1e3,
            tokens_per_s: 1.0 / s,
            bytes_per_token: bytes,
            achieved_gb_s: gb_s,
            fraction_of_copy_bandwidth: gb_s / copy_gb_s,
        });
    }
    let mut profile = Vec::new();
    if opts.profile {
        let context = *contexts.last().unwrap_or(&opts.prompt_len);
        let mut seq = be.new_sequence()?;
        let cs = seq
            .as_any_mut()
            .downcast_mut::<CudaSequence>()
            .expect("cuda sequence");
        fake_context(&be, cs, context, opts.seed + 99)?;
        be.step(seq.as_mut(), &[prompt[0]], &sel(0))?;
        profile = be.profile_decode(seq.as_mut(), prompt[1 % prompt.len()], 20)?;
    }
    Ok(BenchReport {
        device: be.describe(),
        model: model_name.to_string(),
        format: opts.format.suffix().to_string(),
        kv_cache: format!("{:?}", opts.kv_cache).to_lowercase(),
        weight_bytes: be.model.bytes,
        weights_made_s,
        copy_gb_s,
        launches_per_token: be.report.launches_per_token,
        decode_graph: true,
        peak_gpu_memory_bytes: peak,
        prefill: PrefillResult {
            tokens: opts.prompt_len,
            precision: match opts.prompt_precision {
                None => "auto".to_string(),
                Some(p) => format!("{p:?}").to_lowercase(),
            },
            chunk: opts.prompt_chunk,
            ttft_ms: ttft_s * 1e3,
            tokens_per_s: opts.prompt_len as f64 / ttft_s,
        },
        decode,
        profile,
    })
}

/// splitmix64 as a closure (prompt ids).
fn calla_rng(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed;
    move || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}
