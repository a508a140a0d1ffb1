//! The benchmark: a random model of a real shape made on the GPU (or a loaded checkpoint uploaded
//! as `CudaBackend::new` does), prefill and decode timed after warm-up (medians over rounds), bytes
//! moved per token against the device copy bandwidth measured in the same run, and a digest of the
//! generated tokens per round (greedy on the same state: it must repeat). `calla bench`
//! (calla-cli/src/bench.rs) prints what this returns.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Result};
use calla_engine::sampling::SamplingParams;
use calla_engine::{Backend, Selection};
use calla_model::{FeedForwardSpec, LayerKind, ModelSpec, Weights};
use cudarc::driver::sys;
use serde::Serialize;

use crate::engine::backend::{CudaBackend, CudaOptions};
use crate::engine::sequence::CudaSequence;
use crate::ops::weights::{self, DevFfn, DevMatrix, DevMixer, DevModel, Format};
use crate::runtime::gpu::Gpu;
use crate::runtime::pool::{Arena, DEFAULT_BLOCK};
use crate::synthetic;
use crate::KvDtype;

/// What is benchmarked.
pub enum BenchModel<'a> {
    /// Random weights of `spec`'s shape made on the GPU in `format` (q4 or bf16).
    Synthetic {
        name: &'a str,
        spec: &'a ModelSpec,
        format: Format,
    },
    /// A loaded checkpoint, uploaded as `CudaBackend::new` uploads it.
    Checkpoint {
        name: &'a str,
        spec: &'a ModelSpec,
        weights: &'a Weights,
    },
}

impl BenchModel<'_> {
    fn spec(&self) -> &ModelSpec {
        match self {
            BenchModel::Synthetic { spec, .. } | BenchModel::Checkpoint { spec, .. } => spec,
        }
    }
    fn name(&self) -> &str {
        match self {
            BenchModel::Synthetic { name, .. } | BenchModel::Checkpoint { name, .. } => name,
        }
    }
}

/// Progress of the long phases (drawn by the caller; the timed loops only report between rounds).
pub trait Progress: Sync {
    /// A new phase; `total` = 0 when unknown yet; `bytes`: the counts are bytes, else steps.
    fn begin(&self, phase: &str, total: u64, bytes: bool);
    fn set(&self, done: u64, total: u64);
    fn end(&self);
}

/// No progress shown.
pub struct Quiet;

impl Progress for Quiet {
    fn begin(&self, _: &str, _: u64, _: bool) {}
    fn set(&self, _: u64, _: u64) {}
    fn end(&self) {}
}

#[derive(Debug, Clone)]
pub struct BenchOptions {
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
    /// Decode with two steps in flight, as generation does (`Backend::step_pipelined`): the next
    /// step is queued before this one's token is read back. false: one step at a time.
    pub pipelined: bool,
    /// How decode chooses tokens (greedy by default); sampling draws are keyed by (seed, step), so
    /// every round still generates the same tokens.
    pub sampling: SamplingParams,
    /// CudaOptions::prompt_precision (per product group: prompt_precision.rs) and prompt_chunk.
    pub prompt_precision: crate::PromptPrecision,
    pub prompt_chunk: usize,
    /// CudaOptions::kernels (KernelChoices::shared_gpu() on a GPU shared through MPS).
    pub kernels: crate::KernelChoices,
}

#[derive(Debug, Clone, Serialize)]
pub struct PrefillResult {
    pub tokens: usize,
    /// prompt precision (a preset name: "split", "fast", "mixed", …, or every group spelled out)
    /// and tokens per prefill chunk
    pub precision: String,
    pub chunk: usize,
    /// median over rounds: the prompt step including the first token's selection (= TTFT)
    pub ttft_ms: f64,
    pub tokens_per_s: f64,
    /// the first generated token of each timed round (same prompt, fresh sequence: must repeat)
    pub first_tokens: Vec<u32>,
    pub first_token_repeats: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct DecodeResult {
    pub context: usize,
    pub tokens: usize,
    /// median over rounds of (time for `tokens` steps) / tokens; every token is read back as it is
    /// chosen (as a streaming server does), with the next step already queued (BenchReport's
    /// `decode_pipelined`) or not
    pub ms_per_token: f64,
    pub tokens_per_s: f64,
    pub bytes_per_token: f64,
    pub achieved_gb_s: f64,
    /// achieved / measured device copy bandwidth
    pub fraction_of_copy_bandwidth: f64,
    /// per round: FNV-1a 64 (hex) of the tokens generated in the round (warm-up and timed steps,
    /// each id as 4 little-endian bytes); every round starts from the same state
    pub digests: Vec<String>,
    pub digest_repeats: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub device: String,
    pub model: String,
    /// "synthetic" (random weights made on the GPU) or "checkpoint"
    pub source: String,
    /// the weight format; for a checkpoint the formats on the GPU, largest share first
    pub format: String,
    pub kv_cache: String,
    /// how decode chose its tokens: "greedy", or the sampling settings
    pub decode_sampling: String,
    /// decode with two steps in flight (BenchOptions::pipelined)
    pub decode_pipelined: bool,
    pub weight_bytes: usize,
    /// seconds to make (synthetic) or upload (checkpoint) the weights on the GPU
    pub weights_made_s: f64,
    /// seconds to read the checkpoint from disk (set by the caller; None for synthetic)
    pub checkpoint_load_s: Option<f64>,
    /// bytes one decode step reads at the smallest measured context (weights + state + KV)
    pub bytes_per_decoded_token: f64,
    /// every round's prefill first token and decode digest agreed
    pub digests_repeat: bool,
    /// device-to-device copy, bytes read + written per second
    pub copy_gb_s: f64,
    pub launches_per_token: usize,
    pub decode_graph: bool,
    /// the driver's used memory (total − free), largest sample: after each prefill round and each
    /// decode round, while one sequence is alive
    pub peak_gpu_memory_bytes: usize,
    /// what the engine holds at the end, by use; `other` = peak − the rest (CUDA context, kernel
    /// modules, graphs, driver reservations)
    pub memory: MemoryBreakdown,
    pub prefill: PrefillResult,
    pub decode: Vec<DecodeResult>,
    /// per kernel: (name, launches per step, µs per step), launched one by one with events between
    pub profile: Vec<(String, usize, f64)>,
}

#[derive(Debug, Clone, Serialize)]
pub struct MemoryBreakdown {
    pub weights: usize,
    pub decode_scratch: usize,
    pub prompt_scratch: usize,
    /// one sequence (K/V caches for the capacity, DeltaNet states)
    pub sequence_state: usize,
    pub other: i64,
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

/// Positions each sequence must hold: the largest context (or the prompt) plus the decode steps.
pub fn context_capacity(opts: &BenchOptions) -> usize {
    opts.contexts
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(opts.prompt_len)
        + opts.gen_len
        + opts.warmup
        + 8
}

/// FNV-1a 64 over token ids, each as 4 little-endian bytes.
pub fn token_digest(tokens: &[u32]) -> u64 {
    fnv1a_64(tokens.iter().flat_map(|t| t.to_le_bytes()))
}

fn fnv1a_64(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

fn all_equal<T: PartialEq>(v: &[T]) -> bool {
    v.windows(2).all(|w| w[0] == w[1])
}

/// The formats of the matrices on the GPU, largest share of bytes first ("q4 + q8 + bf16").
fn describe_formats(model: &DevModel) -> String {
    let mut mats: Vec<&DevMatrix> = vec![&model.embed, &model.lm_head];
    for layer in &model.layers {
        match &layer.mixer {
            DevMixer::DeltaNet(d) => mats.extend(d.in_proj.iter().chain([&d.out_proj])),
            DevMixer::Attention(a) => mats.extend(a.in_proj.iter().chain([&a.o_proj])),
        }
        match &layer.ffn {
            DevFfn::Moe(m) => {
                mats.extend([&m.router, &m.gate_up, &m.down]);
                if let Some((a, b)) = &m.shared {
                    mats.extend([a, b]);
                }
            }
            DevFfn::Dense(m) => mats.extend([&m.gate_up, &m.down]),
        }
    }
    let mut by_format: Vec<(&'static str, usize)> = Vec::new();
    for m in mats {
        let name = m.format.suffix();
        match by_format.iter_mut().find(|(n, _)| *n == name) {
            Some(e) => e.1 += m.bytes(),
            None => by_format.push((name, m.bytes())),
        }
    }
    by_format.sort_by_key(|e| std::cmp::Reverse(e.1));
    by_format
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(" + ")
}

fn used_memory(gpu: &Gpu) -> usize {
    gpu.memory_info()
        .map(|(free, total)| total - free)
        .unwrap_or(0)
}

pub fn run(model: BenchModel, opts: &BenchOptions, progress: &dyn Progress) -> Result<BenchReport> {
    ensure!(
        opts.prompt_len >= 1 && opts.gen_len >= 1 && opts.rounds >= 1,
        "prompt, gen and rounds must be ≥ 1"
    );
    let spec = model.spec();
    let gpu = Gpu::new(0)?;
    progress.begin("measuring device copy bandwidth", 0, false);
    let copy_gb_s = copy_bandwidth(&gpu)?;
    progress.end();
    let mut arena = Arena::new(&gpu, DEFAULT_BLOCK);
    let (source, dev_model) = match &model {
        BenchModel::Synthetic { format, .. } => {
            progress.begin("making random weights on the GPU", 0, false);
            let m = synthetic::synthetic_model(&gpu, &mut arena, spec, *format, opts.seed)?;
            progress.end();
            ("synthetic", m)
        }
        BenchModel::Checkpoint { weights, .. } => {
            // The steps of CudaBackend::new, with the upload's progress drawn by the caller.
            crate::ops::deltanet::check_dims(spec)?;
            crate::ops::attention::check_dims(spec)?;
            progress.begin("uploading weights to the GPU", 0, true);
            let report = |done: usize, total: usize| progress.set(done as u64, total as u64);
            let m = weights::upload_model(&gpu, &mut arena, spec, weights, Some(&report))?;
            progress.end();
            ("checkpoint", m)
        }
    };
    let weights_made_s = dev_model.upload_seconds;
    let format = match &model {
        BenchModel::Synthetic { format, .. } => format.suffix().to_string(),
        BenchModel::Checkpoint { .. } => describe_formats(&dev_model),
    };
    let copts = CudaOptions {
        max_context: Some(context_capacity(opts)),
        kv_cache: opts.kv_cache,
        prompt_precision: opts.prompt_precision,
        prompt_chunk: opts.prompt_chunk,
        kernels: opts.kernels,
        ..Default::default()
    };
    let mut be = CudaBackend::from_device_model(gpu.clone(), spec, dev_model, arena, &copts)?;
    let params = opts.sampling.clone();
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
    let mut first_tokens = Vec::new();
    let mut peak = 0;
    progress.begin(
        &format!("prefill {} tokens (warm-up + rounds)", opts.prompt_len),
        (opts.rounds + 1) as u64,
        false,
    );
    for round in 0..=opts.rounds {
        let mut seq = be.new_sequence()?;
        let t = Instant::now();
        let first = be.step(seq.as_mut(), &prompt, &sel(0))?.token;
        peak = peak.max(used_memory(&gpu)); // the sequence and the prompt scratch both alive
        if round > 0 {
            ttft.push(t.elapsed().as_secs_f64());
            first_tokens.push(first);
        }
        progress.set(round as u64 + 1, (opts.rounds + 1) as u64);
    }
    progress.end();
    let ttft_s = median(ttft);

    let mut decode = Vec::new();
    let contexts = if opts.contexts.is_empty() {
        vec![opts.prompt_len]
    } else {
        opts.contexts.clone()
    };
    for &context in &contexts {
        let mut per_round = Vec::new();
        let mut digests = Vec::new();
        progress.begin(
            &format!("decode at context {context} (warm-up + rounds)"),
            opts.rounds as u64,
            false,
        );
        for round in 0..opts.rounds {
            let mut seq = be.new_sequence()?;
            let cs = seq
                .as_any_mut()
                .downcast_mut::<CudaSequence>()
                .expect("cuda sequence");
            // The same fake state every round: greedy decode from it must give the same tokens.
            fake_context(&be, cs, context, opts.seed)?;
            let mut generated = Vec::with_capacity(opts.warmup + opts.gen_len);
            let mut token = prompt[0];
            // Neither loop runs ahead past its end: the timed steps start and end with nothing in
            // flight (the first timed step waits for the host, as every step did before pipelining).
            for i in 0..opts.warmup {
                let ahead = opts.pipelined && i + 1 < opts.warmup;
                token = be
                    .step_pipelined(seq.as_mut(), &[token], &sel(i as u64), ahead)?
                    .token;
                generated.push(token);
            }
            let t = Instant::now();
            for i in 0..opts.gen_len {
                let ahead = opts.pipelined && i + 1 < opts.gen_len;
                token = be
                    .step_pipelined(
                        seq.as_mut(),
                        &[token],
                        &sel((opts.warmup + i) as u64),
                        ahead,
                    )?
                    .token;
                generated.push(token);
            }
            per_round.push(t.elapsed().as_secs_f64() / opts.gen_len as f64);
            digests.push(format!("{:016x}", token_digest(&generated)));
            peak = peak.max(used_memory(&gpu));
            progress.set(round as u64 + 1, opts.rounds as u64);
        }
        progress.end();
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
            digest_repeats: all_equal(&digests),
            digests,
        });
    }
    let mut profile = Vec::new();
    if opts.profile {
        let context = *contexts.last().unwrap_or(&opts.prompt_len);
        progress.begin("profiling the decode step kernel by kernel", 0, false);
        let mut seq = be.new_sequence()?;
        let cs = seq
            .as_any_mut()
            .downcast_mut::<CudaSequence>()
            .expect("cuda sequence");
        fake_context(&be, cs, context, opts.seed + 99)?;
        be.step(seq.as_mut(), &[prompt[0]], &sel(0))?;
        profile = be.profile_decode(seq.as_mut(), prompt[1 % prompt.len()], 20)?;
        progress.end();
    }
    let first_token_repeats = all_equal(&first_tokens);
    let digests_repeat = first_token_repeats && decode.iter().all(|d| d.digest_repeats);
    let smallest = contexts.iter().copied().min().unwrap_or(opts.prompt_len);
    let held = be.memory();
    let memory = MemoryBreakdown {
        weights: held.weights,
        decode_scratch: held.decode_scratch,
        prompt_scratch: held.prompt_scratch,
        sequence_state: held.sequence_state,
        other: peak as i64
            - (held.weights + held.decode_scratch + held.prompt_scratch + held.sequence_state)
                as i64,
    };
    Ok(BenchReport {
        device: be.describe(),
        model: model.name().to_string(),
        source: source.to_string(),
        format,
        kv_cache: format!("{:?}", opts.kv_cache).to_lowercase(),
        decode_pipelined: opts.pipelined,
        decode_sampling: if opts.sampling.is_greedy() {
            "greedy".into()
        } else {
            format!(
                "temperature {}, top-p {}, top-k {}",
                opts.sampling.temperature, opts.sampling.top_p, opts.sampling.top_k
            )
        },
        weight_bytes: be.model.bytes,
        weights_made_s,
        checkpoint_load_s: None,
        bytes_per_decoded_token: bytes_per_token(
            spec,
            &be.model,
            be.layout().kv_bytes_per_token,
            smallest,
        ),
        digests_repeat,
        copy_gb_s,
        launches_per_token: be.report.launches_per_token,
        decode_graph: true,
        peak_gpu_memory_bytes: peak,
        memory,
        prefill: PrefillResult {
            tokens: opts.prompt_len,
            precision: opts.prompt_precision.to_string(),
            chunk: opts.prompt_chunk,
            ttft_ms: ttft_s * 1e3,
            tokens_per_s: opts.prompt_len as f64 / ttft_s,
            first_token_repeats,
            first_tokens,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_64_matches_the_published_vectors() {
        // Test vectors of the FNV reference (isthe.com/chongo/tech/comp/fnv): "", "a", "foobar".
        assert_eq!(fnv1a_64(*b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_64(*b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_64(*b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn token_digest_hashes_little_endian_ids_and_sees_order() {
        let ids = [0x6261u32, 7, 248_319];
        let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(token_digest(&ids), fnv1a_64(bytes));
        assert_ne!(token_digest(&[1, 2]), token_digest(&[2, 1]));
        assert_ne!(token_digest(&[1]), token_digest(&[1, 0]));
    }

    #[test]
    fn capacity_fits_the_largest_context_and_the_decode_steps() {
        let opts = BenchOptions {
            prompt_len: 512,
            gen_len: 64,
            contexts: vec![512, 4096, 32768, 131072],
            rounds: 2,
            warmup: 8,
            kv_cache: KvDtype::F32,
            seed: 1,
            profile: false,
            pipelined: true,
            sampling: SamplingParams::greedy(),
            prompt_precision: crate::PromptPrecision::AUTO,
            prompt_chunk: 8192,
            kernels: crate::KernelChoices::default(),
        };
        assert_eq!(context_capacity(&opts), 131072 + 64 + 8 + 8);
        let prompt_longer = BenchOptions {
            prompt_len: 8192,
            contexts: vec![4096],
            ..opts
        };
        assert_eq!(context_capacity(&prompt_longer), 8192 + 64 + 8 + 8);
    }

    #[test]
    fn all_equal_needs_every_round_to_agree() {
        assert!(all_equal::<u32>(&[]));
        assert!(all_equal(&["a", "a", "a"]));
        assert!(!all_equal(&["a", "a", "b"]));
    }
}
