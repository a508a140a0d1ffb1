//! `calla generate`: one prompt, one continuation, printed as it is generated (or as one JSON object).
//!
//! Sampling: with no sampling flag at all the CLI is greedy (deterministic). Any of --temperature,
//! --top-k, --top-p, --min-p turns sampling on; flags not given are disabled (temperature 1, top-k 0,
//! top-p 1, min-p 0), generation_config.json is not consulted; --temperature 0 is greedy. The seed
//! defaults to 0, so a sampled run is reproducible too.
//!
//! The stop token (EOS, or --ignore-eos off) is not printed and not part of `token_ids`/`logprobs`
//! (see calla_engine::generate).

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{ensure, Context, Result};
use calla_engine::generate::{generate, GenerateOutput, GenerateRequest};
use calla_engine::{SamplingParams, TokenChoice};
use calla_model::load::{load_model, LoadOptions, Quant};
use calla_model::tokenizer::Tokenizer;
use serde_json::json;

use crate::device::{open_backend, CudaFlags, Device};

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Prompt text, tokenized with the model's tokenizer (special tokens such as <|im_start|> are
    /// recognised; no BOS is added). No chat template is applied: see `calla chat`.
    #[arg(
        long,
        required_unless_present = "prompt_ids",
        conflicts_with = "prompt_ids"
    )]
    prompt: Option<String>,
    /// Prompt as token ids, comma-separated (e.g. 1,2,3).
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    prompt_ids: Option<Vec<u32>>,
    /// Tokens to generate at most (the stop token counts).
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 = greedy. Without any sampling flag the CLI is greedy.
    #[arg(long)]
    temperature: Option<f32>,
    /// Keep the K most likely tokens (0 = off). Turns sampling on (temperature 1 unless given).
    #[arg(long)]
    top_k: Option<usize>,
    /// Nucleus sampling mass (1 = off). Turns sampling on (temperature 1 unless given).
    #[arg(long)]
    top_p: Option<f32>,
    /// Drop tokens below M × the best token's probability (0 = off). Turns sampling on.
    #[arg(long)]
    min_p: Option<f32>,
    /// Seed of the sampler (draw i uses Philox(seed, i)).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Report the K most likely tokens with their log-probabilities at each step.
    #[arg(long, value_name = "K")]
    logprobs: Option<usize>,
    /// Print one JSON object: prompt_ids, token_ids, text, logprobs, finish_reason.
    #[arg(long)]
    json: bool,
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    #[command(flatten)]
    cuda: CudaFlags,
    /// Convert the weights at load: q4 / q8 (MLX affine, group 64), bf16, f32.
    #[arg(long)]
    quant: Option<Quant>,
}

impl Args {
    fn sampling(&self) -> Result<SamplingParams> {
        let sampled = self.temperature.is_some()
            || self.top_k.is_some()
            || self.top_p.is_some()
            || self.min_p.is_some();
        let p = SamplingParams {
            temperature: if sampled {
                self.temperature.unwrap_or(1.0)
            } else {
                0.0
            },
            top_k: self.top_k.unwrap_or(0),
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            seed: self.seed,
            ..SamplingParams::default()
        };
        ensure!(
            p.temperature.is_finite() && p.temperature >= 0.0,
            "--temperature must be ≥ 0, got {}",
            p.temperature
        );
        ensure!(
            p.top_p > 0.0 && p.top_p <= 1.0,
            "--top-p must be in (0, 1], got {}",
            p.top_p
        );
        ensure!(
            (0.0..=1.0).contains(&p.min_p),
            "--min-p must be in [0, 1], got {}",
            p.min_p
        );
        Ok(p)
    }
}

fn logprobs_json(choice: &TokenChoice) -> serde_json::Value {
    choice
        .top
        .iter()
        .map(|(id, logprob)| json!({ "id": id, "logprob": logprob }))
        .collect()
}

fn report(out: &GenerateOutput) {
    let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    let decoded = out.completion_tokens().saturating_sub(1);
    eprintln!(
        "prompt {} tokens in {:.3} s ({:.1} tok/s); {} tokens decoded in {:.3} s ({:.1} tok/s); finish: {}",
        out.prompt_tokens,
        out.timings.prefill_s,
        rate(out.prompt_tokens, out.timings.prefill_s),
        decoded,
        out.timings.decode_s,
        rate(decoded, out.timings.decode_s),
        out.finish_reason.as_str()
    );
}

pub fn run(args: Args) -> Result<()> {
    let sampling = args.sampling()?;
    let loaded = load_model(&args.model, &LoadOptions { quant: args.quant })
        .with_context(|| format!("loading {}", args.model.display()))?;
    let vocab = loaded.spec.vocab_size;
    let tokenizer = Tokenizer::from_dir(&loaded.dir)
        .with_context(|| format!("reading the tokenizer of {}", loaded.dir.display()))?;
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) => tokenizer.try_encode(text)?,
        (None, None) => anyhow::bail!("give --prompt or --prompt-ids"),
    };
    ensure!(!prompt.is_empty(), "the prompt is empty");
    if let Some((i, id)) = prompt
        .iter()
        .enumerate()
        .find(|(_, id)| **id as usize >= vocab)
    {
        anyhow::bail!(
            "prompt token {id} (position {i}) is out of range: the model's vocab_size is {vocab}"
        );
    }
    let mut backend = open_backend(&loaded, args.device, &args.cuda)?;
    tracing::info!("{} on {}", args.model.display(), backend.describe());

    let req = GenerateRequest {
        prompt: prompt.clone(),
        max_tokens: args.max_tokens,
        sampling,
        stop_token_ids: vec![],
        ignore_eos: args.ignore_eos,
        top_logprobs: args.logprobs.unwrap_or(0),
    };
    // Text leaves out special tokens (skip_special, as vLLM's default).
    let mut stream = tokenizer.incremental_decoder(true);
    let mut stdout = std::io::stdout().lock();
    let out = generate(backend.as_mut(), &req, |choice| {
        if !args.json {
            if let Some(piece) = stream.step(choice.token) {
                // A closed stdout (e.g. `| head`) ends generation rather than failing it.
                if write!(stdout, "{piece}")
                    .and_then(|_| stdout.flush())
                    .is_err()
                {
                    return ControlFlow::Break(());
                }
            }
        }
        ControlFlow::Continue(())
    })?;

    let full_text = tokenizer.decode(&out.tokens, true);
    if args.json {
        let object = json!({
            "prompt_ids": prompt,
            "token_ids": out.tokens,
            "text": full_text,
            "logprobs": out.choices.iter().map(logprobs_json).collect::<Vec<_>>(),
            "finish_reason": out.finish_reason.as_str(),
        });
        writeln!(stdout, "{object}")?;
    } else {
        writeln!(stdout, "{}", stream.finish().unwrap_or_default())?;
        if args.logprobs.is_some() {
            for (step, c) in out.choices.iter().enumerate() {
                let alts: Vec<String> = c
                    .top
                    .iter()
                    .map(|(id, lp)| format!("{id}:{lp:.4}"))
                    .collect();
                writeln!(
                    stdout,
                    "[{step}] {} {:.4} | {}",
                    c.token,
                    c.logprob,
                    alts.join(" ")
                )?;
            }
        }
    }
    report(&out);
    Ok(())
}
