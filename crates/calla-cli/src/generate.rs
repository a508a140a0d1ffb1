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

use anyhow::{ensure, Context, Result};
use calla_engine::generate::{generate, GenerateOutput, GenerateRequest};
use calla_engine::TokenChoice;
use calla_model::load::{load_model, LoadOptions};
use calla_model::tokenizer::Tokenizer;
use serde_json::json;

use crate::args::{DeviceArgs, ModelArgs, SamplingArgs};
use crate::device::open_backend;

#[derive(clap::Args)]
#[command(mut_arg("model", |a| a.required(true)))]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
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
    #[command(flatten)]
    sampling: SamplingArgs,
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
    #[command(flatten)]
    device: DeviceArgs,
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
    let sampling = args.sampling.fixed(args.seed)?;
    let Some(dir) = &args.model.model else {
        anyhow::bail!("give --model DIR");
    };
    let loaded = load_model(
        dir,
        &LoadOptions {
            quant: args.model.quant,
        },
    )
    .with_context(|| format!("loading {}", dir.display()))?;
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
    let mut backend = open_backend(&loaded, &args.device, None)?.backend;
    tracing::info!("{} on {}", dir.display(), backend.describe());

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
