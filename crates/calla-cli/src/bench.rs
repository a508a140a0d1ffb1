//! `calla bench`: prefill and decode speed on a synthetic model of a real shape (random weights made
//! on the device; no checkpoint needed).
//!
//!   calla bench --synthetic qwen3.6-35b-a3b --quant q4 --prompt-len 8192 --gen-len 128
//!               [--context N] [--sweep] [--rounds R] [--json]
//!
//! Decode is timed token by token as a server streams (each token read back), after warm-up, as the
//! median over rounds; prefill as time to first token. Every tok/s comes with the bytes it moved and
//! the fraction of the measured device copy bandwidth.

use anyhow::{bail, Result};
use calla_cuda::bench::{self, BenchOptions, BenchReport};
use calla_cuda::weights::Format;
use calla_cuda::KvDtype;
use calla_model::load::Quant;

use crate::device::PromptPrecision;

#[derive(clap::Args)]
pub struct Args {
    /// Synthetic model preset: qwen3.6-35b-a3b (the real dims), cpu-mid, tiny.
    #[arg(long, default_value = "qwen3.6-35b-a3b")]
    synthetic: String,
    /// Weight format of the synthetic model: q4 (MLX affine g64, 8-bit router) or bf16.
    #[arg(long, default_value = "q4")]
    quant: Quant,
    /// Prompt tokens (prefill / time to first token).
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    /// Decode tokens timed per round.
    #[arg(long, default_value_t = 128)]
    gen_len: usize,
    /// Measure decode at this context length (tokens already in the sequence). Default: the prompt.
    #[arg(long)]
    context: Option<usize>,
    /// Decode at several contexts: 512, 4096, 16384, 32768.
    #[arg(long)]
    sweep: bool,
    /// Timed rounds (the median is reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Untimed decode steps before each round.
    #[arg(long, default_value_t = 8)]
    warmup: usize,
    /// K/V cache element type: f32 or bf16.
    #[arg(long, default_value = "f32")]
    kv_cache: String,
    /// Precision of the batched prompt products: split (≈ f32, the engine's default), fast (bf16),
    /// auto (by weight format: fast for q4/bf16).
    #[arg(long, value_enum, default_value_t = PromptPrecision::Split)]
    prompt_precision: PromptPrecision,
    /// Prompt tokens per batched prefill chunk (0: token by token through the decode graph).
    #[arg(long, default_value_t = calla_cuda::CudaOptions::default().prompt_chunk)]
    prompt_chunk: usize,
    /// Also time each kernel of the decode step on its own (launched one by one, CUDA events).
    #[arg(long)]
    profile: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<()> {
    let Some(spec) = calla_model::synthetic::preset(&args.synthetic) else {
        bail!(
            "unknown synthetic preset {:?} (known: {})",
            args.synthetic,
            calla_model::synthetic::PRESETS.join(", ")
        );
    };
    let format = match args.quant {
        Quant::Q4 => Format::Q4,
        Quant::Bf16 => Format::Bf16,
        other => bail!("--quant {other}: the synthetic benchmark makes q4 or bf16 weights"),
    };
    let kv_cache = match args.kv_cache.as_str() {
        "f32" => KvDtype::F32,
        "bf16" => KvDtype::Bf16,
        other => bail!("--kv-cache {other:?}: expected f32 or bf16"),
    };
    let contexts = if args.sweep {
        vec![512, 4096, 16384, 32768]
    } else {
        vec![args.context.unwrap_or(args.prompt_len)]
    };
    let opts = BenchOptions {
        format,
        prompt_len: args.prompt_len,
        gen_len: args.gen_len,
        contexts,
        rounds: args.rounds,
        warmup: args.warmup,
        kv_cache,
        seed: 0x00CA_11A0,
        profile: args.profile,
        prompt_precision: args.prompt_precision.to_cuda(),
        prompt_chunk: args.prompt_chunk,
    };
    let report = bench::run(&spec, &args.synthetic, &opts)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

fn print_table(r: &BenchReport) {
    let gb = |b: f64| b / 1e9;
    println!("device      {}", r.device);
    println!(
        "model       {} ({}, KV cache {})",
        r.model, r.format, r.kv_cache
    );
    println!(
        "weights     {:.2} GB on the GPU (made in {:.1} s)",
        gb(r.weight_bytes as f64),
        r.weights_made_s
    );
    println!("peak memory {:.2} GB", gb(r.peak_gpu_memory_bytes as f64));
    println!(
        "copy        {:.0} GB/s device-to-device (read + write)",
        r.copy_gb_s
    );
    println!(
        "decode step {} launches, one CUDA graph",
        r.launches_per_token
    );
    println!(
        "prefill     {} tokens ({} precision, chunks of {}): TTFT {:.1} ms, {:.0} tok/s",
        r.prefill.tokens,
        r.prefill.precision,
        r.prefill.chunk,
        r.prefill.ttft_ms,
        r.prefill.tokens_per_s
    );
    println!("| context | tokens | ms/token | tok/s  | GB/token | GB/s   | of copy BW |");
    println!("|--------:|-------:|---------:|-------:|---------:|-------:|-----------:|");
    for d in &r.decode {
        println!(
            "| {:>7} | {:>6} | {:>8.3} | {:>6.1} | {:>8.3} | {:>6.0} | {:>9.1}% |",
            d.context,
            d.tokens,
            d.ms_per_token,
            d.tokens_per_s,
            gb(d.bytes_per_token),
            d.achieved_gb_s,
            100.0 * d.fraction_of_copy_bandwidth
        );
    }
    if !r.profile.is_empty() {
        let total: f64 = r.profile.iter().map(|p| p.2).sum();
        println!("decode step, kernel by kernel (no graph; {total:.0} µs in all):");
        for (name, n, us) in &r.profile {
            println!(
                "  {name:<28} ×{n:<4} {us:>9.1} µs  {:>5.1}%",
                100.0 * us / total
            );
        }
    }
}
