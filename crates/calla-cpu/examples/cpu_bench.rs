//! CPU prefill and decode throughput on a synthetic model (calla_model::synthetic).
//!
//!   cargo run --release -p calla-cpu --example cpu_bench -- [--preset cpu-mid] [--quant f32|bf16|q8|q4]
//!       [--prompt 512] [--decode 32] [--rounds 5]
//!
//! Per round: a fresh sequence, prefill of `--prompt` tokens (timed), then `--decode` greedy steps of
//! one token (timed). One warm-up round is discarded; medians over the rounds are printed, with the
//! decode weight traffic (bytes of the matrices one token reads: every dense matrix, top_k experts,
//! one embedding row) as GB/s.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use calla_cpu::CpuBackend;
use calla_engine::{Backend, SamplingParams, Selection};
use calla_model::load::Quant;
use calla_model::synthetic::{preset, random_weights};
use calla_model::{FeedForwardSpec, FeedForwardWeights, MixerWeights, ModelSpec, Weights};

struct Options {
    preset: String,
    quant: Quant,
    prompt: usize,
    decode: usize,
    rounds: usize,
}

fn parse() -> Result<Options> {
    let mut o = Options {
        preset: "cpu-mid".into(),
        quant: Quant::F32,
        prompt: 512,
        decode: 32,
        rounds: 5,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let value = pair
            .get(1)
            .with_context(|| format!("{} needs a value", pair[0]))?;
        match pair[0].as_str() {
            "--preset" => o.preset = value.clone(),
            "--quant" => o.quant = value.parse().map_err(anyhow::Error::msg)?,
            "--prompt" => o.prompt = value.parse()?,
            "--decode" => o.decode = value.parse()?,
            "--rounds" => o.rounds = value.parse()?,
            other => bail!("unknown option {other}"),
        }
    }
    Ok(o)
}

/// Bytes of weights one decode token reads.
fn decode_bytes(spec: &ModelSpec, w: &Weights) -> usize {
    let mut total = w.lm_head.byte_size() + w.embed_tokens.byte_size() / spec.vocab_size;
    for layer in &w.layers {
        total += match &layer.mixer {
            MixerWeights::DeltaNet(m) => [
                &m.in_proj_qkv,
                &m.in_proj_z,
                &m.in_proj_a,
                &m.in_proj_b,
                &m.out_proj,
            ]
            .iter()
            .map(|m| m.byte_size())
            .sum::<usize>(),
            MixerWeights::Attention(m) => [&m.q_proj, &m.k_proj, &m.v_proj, &m.o_proj]
                .iter()
                .map(|m| m.byte_size())
                .sum(),
        };
        let mlp = |m: &calla_model::MlpWeights| {
            m.gate_proj.byte_size() + m.up_proj.byte_size() + m.down_proj.byte_size()
        };
        total += match (&layer.feed_forward, &spec.feed_forward) {
            (FeedForwardWeights::Moe(m), FeedForwardSpec::Moe { top_k, .. }) => {
                m.router.byte_size()
                    + mlp(&m.experts[0]) * top_k
                    + m.shared_expert.as_ref().map_or(0, mlp)
                    + m.shared_expert_gate.as_ref().map_or(0, |g| g.byte_size())
            }
            (FeedForwardWeights::Dense(m), _) => mlp(m),
            _ => 0,
        };
    }
    total
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let o = parse()?;
    let spec = preset(&o.preset).with_context(|| format!("unknown preset {}", o.preset))?;
    let t0 = Instant::now();
    let weights = random_weights(&spec, o.quant, 1);
    let bytes = decode_bytes(&spec, &weights);
    let mut backend = CpuBackend::new(spec.clone(), weights)?;
    eprintln!(
        "{} ({} layers, hidden {}, vocab {}) as {}, built in {:.1} s, {} threads; decode reads {:.1} MB/token",
        o.preset,
        spec.num_layers(),
        spec.hidden_size,
        spec.vocab_size,
        o.quant,
        t0.elapsed().as_secs_f64(),
        rayon::current_num_threads(),
        bytes as f64 / 1e6
    );
    let prompt: Vec<u32> = (0..o.prompt)
        .map(|i| ((i as u64 * 2_654_435_761) % spec.vocab_size as u64) as u32)
        .collect();
    let params = SamplingParams::greedy();
    let (mut prefill, mut decode) = (vec![], vec![]);
    for round in 0..=o.rounds {
        let mut seq = backend.new_sequence()?;
        let sel = |step: u64| Selection {
            params: &params,
            prompt: &prompt,
            generated: &[],
            step,
            top_logprobs: 0,
        };
        let t = Instant::now();
        let mut token = backend.step(seq.as_mut(), &prompt, &sel(0))?.token;
        let prefill_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for step in 1..=o.decode {
            token = backend
                .step(seq.as_mut(), &[token], &sel(step as u64))?
                .token;
        }
        let decode_s = t.elapsed().as_secs_f64();
        let (p, d) = (o.prompt as f64 / prefill_s, o.decode as f64 / decode_s);
        eprintln!(
            "round {round}{}: prefill {p:.1} tok/s, decode {d:.2} tok/s",
            if round == 0 { " (warm-up)" } else { "" }
        );
        if round > 0 {
            prefill.push(p);
            decode.push(d);
        }
    }
    let best = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
    let (p_best, d_best) = (best(&prefill), best(&decode));
    let (p, d) = (median(prefill), median(decode));
    println!(
        "{} {}: prefill {} tokens {p:.1} tok/s | decode {d:.2} tok/s, {:.2} GB/s of weights (median of {} rounds; best {p_best:.1} / {d_best:.2})",
        o.preset,
        o.quant,
        o.prompt,
        d * bytes as f64 / 1e9,
        o.rounds
    );
    Ok(())
}
