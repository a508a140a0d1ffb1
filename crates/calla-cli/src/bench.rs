//! `calla bench`: prefill and decode speed on a synthetic model of a real shape (random weights made
//! on the device; no checkpoint needed) or on a real checkpoint (`--model DIR`).
//!
//!   calla bench --synthetic qwen3.6-35b-a3b --quant q4 --prompt-len 8192 --gen-len 128
//!               [--context N] [--sweep] [--rounds R] [--json]
//!   calla bench --model DIR [--quant q4|q8|bf16|f32] …
//!
//! Decode is timed token by token as a server streams (each token read back as it is chosen, with the
//! next step already queued as generation runs; `--no-pipeline`: one step at a time), after warm-up,
//! as the median over rounds; prefill as time to first token. Every tok/s comes with the bytes it moved and
//! the fraction of the device copy bandwidth measured in the same run. Each round's generated tokens
//! are digested (FNV-1a 64); greedy decoding from the same state must repeat them.

use std::io::{IsTerminal, Write};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use calla_cuda::bench::{self, BenchModel, BenchOptions, BenchReport, Progress};
use calla_cuda::ops::weights::Format;
use calla_model::load::{load_model, LoadOptions, Quant};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::args::{Device, DeviceArgs, ModelArgs, SamplingArgs};

/// The synthetic preset when neither --synthetic nor --model is given.
const DEFAULT_PRESET: &str = "qwen3.6-35b-a3b";

/// Decode contexts of `--sweep` (issue 5: 512, 4K, 32K, 128K).
pub const SWEEP_CONTEXTS: [usize; 4] = [512, 4096, 32768, 131072];

#[derive(clap::Args)]
pub struct Args {
    /// Synthetic model preset: qwen3.6-35b-a3b (the real dims; the default), cpu-mid, tiny.
    #[arg(long, conflicts_with = "model")]
    synthetic: Option<String>,
    /// --model: the checkpoint to benchmark (default: a synthetic model); --quant: for a synthetic
    /// model the weight format to make, q4 (MLX affine g64, 8-bit router; the default) or bf16.
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt tokens (prefill / time to first token).
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    /// Decode tokens timed per round.
    #[arg(long, default_value_t = 128)]
    gen_len: usize,
    /// Measure decode at this context length (tokens already in the sequence). Default: the prompt.
    #[arg(long)]
    context: Option<usize>,
    /// Decode at contexts 512, 4096, 32768 and 131072 (instead of --context); one table.
    #[arg(long)]
    sweep: bool,
    /// Timed rounds (the median is reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Untimed decode steps before each round.
    #[arg(long, default_value_t = 8)]
    warmup: usize,
    /// The engine measured: the CUDA engine (auto and cuda; cpu is refused).
    #[command(flatten)]
    device: DeviceArgs,
    /// Prompt tokens per batched prefill chunk (0: token by token through the decode graph).
    #[arg(long, default_value_t = calla_cuda::CudaOptions::default().prompt_chunk)]
    prompt_chunk: usize,
    /// Also time each kernel of the decode step on its own (launched one by one, CUDA events).
    #[arg(long)]
    profile: bool,
    /// Decode one step at a time (the host reads each token before the next step is queued)
    /// instead of with the next step in flight, as `calla generate` and `calla serve` decode.
    #[arg(long)]
    no_pipeline: bool,
    /// Decode with these sampling settings instead of greedy, e.g. to time a chat client's; the
    /// draws are seeded, so rounds still repeat.
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Print one JSON object instead of the table (no progress bars).
    #[arg(long)]
    json: bool,
}

/// The seed of a sampled bench's draws (fixed: the sampling digests are compared across runs).
const SAMPLING_SEED: u64 = 0x5EED;

pub fn run(args: Args) -> Result<()> {
    if args.device.device == Device::Cpu {
        bail!(
            "calla bench measures the CUDA engine; --device cpu is not benchmarked here (the CPU \
             engine's numbers: docs/cpu-engine.md)"
        );
    }
    let sampling = args.sampling.fixed(SAMPLING_SEED)?;
    let kv_cache = args.device.kv_cache.to_cuda();
    let opts = BenchOptions {
        prompt_len: args.prompt_len,
        gen_len: args.gen_len,
        contexts: decode_contexts(&args),
        rounds: args.rounds,
        warmup: args.warmup,
        kv_cache,
        seed: 0x00CA_11A0,
        profile: args.profile,
        pipelined: !args.no_pipeline,
        sampling,
        prompt_precision: args.device.prompt_precision,
        prompt_chunk: args.prompt_chunk,
        kernels: args.device.kernel_choices(),
    };
    let bars = Bars::new(!args.json);
    let report = match &args.model.model {
        Some(dir) => {
            bars.begin(&format!("loading {}", dir.display()), 0, false);
            let started = Instant::now();
            let loaded = load_model(
                dir,
                &LoadOptions {
                    quant: args.model.quant,
                },
            )
            .with_context(|| format!("loading the checkpoint in {}", dir.display()))?;
            let load_s = started.elapsed().as_secs_f64();
            bars.end();
            let name = dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| dir.display().to_string());
            let model = BenchModel::Checkpoint {
                name: &name,
                spec: &loaded.spec,
                weights: &loaded.weights,
            };
            let mut report = bench::run(model, &opts, &bars)?;
            report.checkpoint_load_s = Some(load_s);
            report
        }
        None => {
            let preset = args.synthetic.as_deref().unwrap_or(DEFAULT_PRESET);
            let Some(spec) = calla_model::synthetic::preset(preset) else {
                bail!(
                    "unknown synthetic preset {preset:?} (known: {})",
                    calla_model::synthetic::PRESETS.join(", ")
                );
            };
            let format = match args.model.quant.unwrap_or(Quant::Q4) {
                Quant::Q4 => Format::Q4,
                Quant::Bf16 => Format::Bf16,
                other => bail!("--quant {other}: the synthetic benchmark makes q4 or bf16 weights"),
            };
            let model = BenchModel::Synthetic {
                name: preset,
                spec: &spec,
                format,
            };
            bench::run(model, &opts, &bars)?
        }
    };
    // a closed pipe (`calla bench … | head`) is an io error here, not a panic (main exits quietly)
    let mut stdout = std::io::stdout().lock();
    if args.json {
        writeln!(stdout, "{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        print_table(&mut stdout, &report)?;
    }
    stdout.flush()?;
    Ok(())
}

/// The contexts decode is measured at: the sweep's, else --context, else the prompt length.
fn decode_contexts(args: &Args) -> Vec<usize> {
    if args.sweep {
        SWEEP_CONTEXTS.to_vec()
    } else {
        vec![args.context.unwrap_or(args.prompt_len)]
    }
}

/// indicatif bars on stderr, one per phase; hidden with --json (and by indicatif itself when stderr
/// is not a terminal).
struct Bars {
    shown: bool,
    bar: Mutex<Option<ProgressBar>>,
}

impl Bars {
    fn new(shown: bool) -> Bars {
        Bars {
            shown: shown && std::io::stderr().is_terminal(),
            bar: Mutex::new(None),
        }
    }
}

impl Progress for Bars {
    fn begin(&self, phase: &str, total: u64, bytes: bool) {
        if !self.shown {
            return;
        }
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        let template = if bytes {
            "{spinner} {msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, {elapsed})"
        } else if total > 0 {
            "{spinner} {msg} [{bar:30}] {pos}/{len} ({elapsed})"
        } else {
            "{spinner} {msg} ({elapsed})"
        };
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(phase.to_string());
        bar.enable_steady_tick(Duration::from_millis(200));
        if let Ok(mut slot) = self.bar.lock() {
            if let Some(old) = slot.replace(bar) {
                old.finish_and_clear();
            }
        }
    }

    fn set(&self, done: u64, total: u64) {
        if let Ok(slot) = self.bar.lock() {
            if let Some(bar) = slot.as_ref() {
                if bar.length() != Some(total) {
                    bar.set_length(total);
                }
                bar.set_position(done);
            }
        }
    }

    fn end(&self) {
        if let Ok(mut slot) = self.bar.lock() {
            if let Some(bar) = slot.take() {
                bar.finish_and_clear();
            }
        }
    }
}

fn print_table(out: &mut impl Write, r: &BenchReport) -> std::io::Result<()> {
    let gb = |b: f64| b / 1e9;
    writeln!(out, "device      {}", r.device)?;
    writeln!(
        out,
        "model       {} ({} {}, KV cache {}; decode {})",
        r.model, r.source, r.format, r.kv_cache, r.decode_sampling
    )?;
    let made = if r.source == "synthetic" {
        "made"
    } else {
        "uploaded"
    };
    match r.checkpoint_load_s {
        Some(load_s) => writeln!(
            out,
            "weights     {:.2} GB on the GPU (read from disk in {load_s:.1} s, {made} in {:.1} s)",
            gb(r.weight_bytes as f64),
            r.weights_made_s
        )?,
        None => writeln!(
            out,
            "weights     {:.2} GB on the GPU ({made} in {:.1} s)",
            gb(r.weight_bytes as f64),
            r.weights_made_s
        )?,
    }
    let m = &r.memory;
    writeln!(
        out,
        "peak memory {:.2} GB (weights {:.2}, sequence state {:.2}, prompt scratch {:.2}, decode \
         scratch {:.3}, other {:.2})",
        gb(r.peak_gpu_memory_bytes as f64),
        gb(m.weights as f64),
        gb(m.sequence_state as f64),
        gb(m.prompt_scratch as f64),
        gb(m.decode_scratch as f64),
        gb(m.other as f64)
    )?;
    writeln!(
        out,
        "copy        {:.0} GB/s device-to-device (read + write)",
        r.copy_gb_s
    )?;
    writeln!(
        out,
        "decode step {} launches, one CUDA graph; {}",
        r.launches_per_token,
        if r.decode_pipelined {
            "two steps in flight (the next queued before a token is read)"
        } else {
            "one step at a time (--no-pipeline)"
        }
    )?;
    writeln!(
        out,
        "prefill     {} tokens ({} precision, chunks of {}): TTFT {:.1} ms, {:.0} tok/s",
        r.prefill.tokens,
        r.prefill.precision,
        r.prefill.chunk,
        r.prefill.ttft_ms,
        r.prefill.tokens_per_s
    )?;
    writeln!(
        out,
        "read/token  {:.3} GB per decoded token at context {}",
        gb(r.bytes_per_decoded_token),
        r.decode.iter().map(|d| d.context).min().unwrap_or(0)
    )?;
    writeln!(
        out,
        "| context | tokens | ms/token | tok/s  | GB/token | GB/s   | of copy BW |"
    )?;
    writeln!(
        out,
        "|--------:|-------:|---------:|-------:|---------:|-------:|-----------:|"
    )?;
    for d in &r.decode {
        writeln!(
            out,
            "| {:>7} | {:>6} | {:>8.3} | {:>6.1} | {:>8.3} | {:>6.0} | {:>9.1}% |",
            d.context,
            d.tokens,
            d.ms_per_token,
            d.tokens_per_s,
            gb(d.bytes_per_token),
            d.achieved_gb_s,
            100.0 * d.fraction_of_copy_bandwidth
        )?;
    }
    let yes_no = |b: bool| if b { "yes" } else { "no" };
    writeln!(
        out,
        "first token per round: {:?} (repeats: {})",
        r.prefill.first_tokens,
        yes_no(r.prefill.first_token_repeats)
    )?;
    for d in &r.decode {
        writeln!(
            out,
            "digest at context {:>6}: {} (repeats: {})",
            d.context,
            d.digests.join(" "),
            yes_no(d.digest_repeats)
        )?;
    }
    writeln!(out, "digest repeats: {}", yes_no(r.digests_repeat))?;
    if !r.profile.is_empty() {
        let total: f64 = r.profile.iter().map(|p| p.2).sum();
        writeln!(
            out,
            "decode step, kernel by kernel (no graph; {total:.0} µs in all):"
        )?;
        for (name, n, us) in &r.profile {
            writeln!(
                out,
                "  {name:<28} ×{n:<4} {us:>9.1} µs  {:>5.1}%",
                100.0 * us / total
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::PromptPrecision;
    use clap::Parser;
    use std::path::PathBuf;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn parse(argv: &[&str]) -> Result<Args, clap::Error> {
        Cli::try_parse_from(std::iter::once("bench").chain(argv.iter().copied())).map(|c| c.args)
    }

    #[test]
    fn model_and_synthetic_are_exclusive() {
        let err = parse(&["--model", "m", "--synthetic", "tiny"]).err();
        assert_eq!(
            err.map(|e| e.kind()),
            Some(clap::error::ErrorKind::ArgumentConflict)
        );
    }

    #[test]
    fn quant_is_optional_and_parsed() {
        let a = parse(&["--model", "m"]).expect("parses");
        assert_eq!(a.model.quant, None);
        assert_eq!(a.model.model, Some(PathBuf::from("m")));
        let a = parse(&["--synthetic", "tiny", "--quant", "bf16"]).expect("parses");
        assert_eq!(a.model.quant, Some(Quant::Bf16));
        assert!(parse(&["--quant", "q3"]).is_err());
    }

    #[test]
    fn prompt_precision_takes_presets_and_group_overrides() {
        let a = parse(&["--prompt-precision", "mixed"]).expect("parses");
        assert_eq!(a.device.prompt_precision, PromptPrecision::MIXED);
        let a = parse(&["--prompt-precision", "mixed,shared=auto"]).expect("parses");
        assert_eq!(a.device.prompt_precision, PromptPrecision::FFN);
        let a = parse(&["--prompt-precision", "mixed,experts=fast"]).expect("parses");
        assert_eq!(
            a.device.prompt_precision.expert_down,
            Some(calla_cuda::ops::gemm::Precision::Fast)
        );
        let a = parse(&["--prompt-precision", "experts-up"]).expect("parses");
        assert_eq!(a.device.prompt_precision, PromptPrecision::EXPERTS_UP);
        let err = parse(&["--prompt-precision", "mixd"])
            .err()
            .expect("rejected");
        assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
        assert!(err.to_string().contains("mixed"), "{err}");
        // without the flag: balanced (the engine's default too), unless CALLA_PROMPT_PRECISION
        // says otherwise
        if std::env::var_os(crate::args::PROMPT_PRECISION_ENV).is_none() {
            let a = parse(&[]).expect("parses");
            assert_eq!(a.device.prompt_precision, PromptPrecision::BALANCED);
            assert_eq!(a.device.prompt_precision, PromptPrecision::default());
        }
    }

    #[test]
    fn decode_contexts_sweep_then_context_then_prompt() {
        let sweep = parse(&["--sweep", "--context", "100", "--json"]).expect("parses");
        assert_eq!(decode_contexts(&sweep), vec![512, 4096, 32768, 131072]);
        let one = parse(&["--context", "32768", "--prompt-len", "8192"]).expect("parses");
        assert_eq!(decode_contexts(&one), vec![32768]);
        let prompt = parse(&["--prompt-len", "8192"]).expect("parses");
        assert_eq!(decode_contexts(&prompt), vec![8192]);
    }
}
