//! `calla inspect --model DIR [--json] [--quant q4|q8|bf16|f32]`: what a checkpoint is and what
//! loading it gives — family, checkpoint style, layer pattern, dims, experts, formats with parameter
//! and byte counts, the weight bytes one decoded token reads, stop tokens, ignored tensors and the MLX
//! quantisation block. It runs the real loader, so a checkpoint that inspects cleanly also loads.

use std::collections::BTreeMap;
use std::io::Write;

use anyhow::{Context, Result};
use calla_model::load::{load_model, LoadOptions, LoadedModel};
use calla_model::tokenizer::Tokenizer;
use calla_model::{FeedForwardSpec, LayerKind, ModelSpec};
use serde_json::json;

use crate::args::ModelArgs;

#[derive(clap::Args)]
#[command(mut_arg("model", |a| a.required(true)))]
pub struct Args {
    /// --quant: show the formats after this load-time conversion.
    #[command(flatten)]
    model: ModelArgs,
    /// Print one JSON object instead of the text summary.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<()> {
    let Some(dir) = &args.model.model else {
        anyhow::bail!("give --model DIR");
    };
    let model = load_model(
        dir,
        &LoadOptions {
            quant: args.model.quant,
        },
    )
    .with_context(|| format!("loading {}", dir.display()))?;
    // The tokenizer is optional here: it only names the stop tokens.
    let tokenizer = Tokenizer::from_dir(dir).ok();
    let text = if args.json {
        serde_json::to_string_pretty(&to_json(&model, tokenizer.as_ref()))? + "\n"
    } else {
        to_text(&model, tokenizer.as_ref())
    };
    // a closed pipe (`calla inspect … | head`) is an io error here, not a panic (main exits quietly)
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    stdout.flush()?;
    Ok(())
}

fn kind_name(kind: LayerKind) -> &'static str {
    match kind {
        LayerKind::DeltaNet => "DN",
        LayerKind::Attention => "Attn",
    }
}

/// The layer list as its shortest repeating unit, e.g. "[DN DN DN Attn] ×10".
pub fn layer_pattern(layers: &[LayerKind]) -> String {
    let n = layers.len();
    let period = (1..=n)
        .find(|&p| {
            n.is_multiple_of(p) && layers.iter().enumerate().all(|(i, k)| *k == layers[i % p])
        })
        .unwrap_or(n);
    let unit: Vec<&str> = layers[..period].iter().map(|&k| kind_name(k)).collect();
    if period == n {
        format!("[{}]", unit.join(" "))
    } else {
        format!("[{}] ×{}", unit.join(" "), n / period)
    }
}

fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

fn human_count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.2}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

fn stop_tokens(spec: &ModelSpec, tokenizer: Option<&Tokenizer>) -> Vec<(u32, Option<String>)> {
    spec.eos_token_ids
        .iter()
        .map(|&id| (id, tokenizer.and_then(|t| t.id_to_token(id))))
        .collect()
}

/// The quantisation block summarised: global parameters plus overrides grouped by parameters.
fn quantization_summary(model: &LoadedModel) -> Option<String> {
    let q = model.report.quantization.as_ref()?;
    let mut groups: BTreeMap<String, usize> = BTreeMap::new();
    for params in q.overrides.values() {
        let key = match params {
            Some(p) => format!("{}-bit g{}", p.bits, p.group_size),
            None => "unquantised".to_string(),
        };
        *groups.entry(key).or_insert(0) += 1;
    }
    let overrides: Vec<String> = groups.iter().map(|(k, n)| format!("{n} × {k}")).collect();
    Some(format!(
        "{} {}-bit g{}{}",
        q.mode,
        q.bits,
        q.group_size,
        if overrides.is_empty() {
            String::new()
        } else {
            format!(", per-module overrides: {}", overrides.join(", "))
        }
    ))
}

pub fn to_text(model: &LoadedModel, tokenizer: Option<&Tokenizer>) -> String {
    let (s, r) = (&model.spec, &model.report);
    let mut out = String::new();
    let mut line = |label: &str, value: String| out.push_str(&format!("{label:<14}{value}\n"));
    line("model", model.dir.display().to_string());
    line(
        "type",
        format!(
            "{} ({}), family {:?}",
            r.model_type,
            r.architectures.join(", "),
            s.family
        ),
    );
    let mut style = r.style_name.clone();
    if let Some(layout) = r.expert_layout {
        style.push_str(&format!(", experts {layout:?}"));
    }
    if r.norms_stored_plus_one {
        style.push_str(", norms stored as 1+w (shifted back)");
    }
    if r.deltanet_interleaved {
        style.push_str(", Qwen3-Next interleaved DeltaNet projections (reordered)");
    }
    line("checkpoint", style);
    line(
        "layers",
        format!(
            "{}: {} ({} DeltaNet, {} attention)",
            s.num_layers(),
            layer_pattern(&s.layers),
            s.num_deltanet_layers(),
            s.num_attention_layers()
        ),
    );
    line(
        "dims",
        format!(
            "hidden {}, vocab {}, rms eps {:e}, max positions {}, tied embeddings {}",
            s.hidden_size,
            s.vocab_size,
            s.rms_norm_eps,
            s.max_position_embeddings,
            s.tie_word_embeddings
        ),
    );
    line(
        "attention",
        format!(
            "{} q / {} kv heads × {}, rotary {} dims θ={}, output gate {}",
            s.num_attention_heads,
            s.num_key_value_heads,
            s.head_dim,
            s.rotary_dim,
            s.rope_theta,
            s.attn_output_gate
        ),
    );
    line(
        "deltanet",
        format!(
            "{} key heads × {}, {} value heads × {}, conv {} (conv channels {})",
            s.linear_num_key_heads,
            s.linear_key_head_dim,
            s.linear_num_value_heads,
            s.linear_value_head_dim,
            s.linear_conv_kernel_dim,
            s.linear_conv_dim()
        ),
    );
    match &s.feed_forward {
        FeedForwardSpec::Moe { num_experts, top_k, expert_intermediate, shared_intermediate, norm_topk_prob } => line(
            "experts",
            format!(
                "{num_experts}, top-{top_k}, expert I {expert_intermediate}, shared I {shared_intermediate}, renormalise top-k {norm_topk_prob}"
            ),
        ),
        FeedForwardSpec::Dense { intermediate } => line("mlp", format!("dense SwiGLU, I {intermediate}")),
    }
    let stats = &r.stats;
    let mut first = true;
    for (format, count) in &stats.formats {
        line(
            if first { "formats" } else { "" },
            format!(
                "{format:<14} {:>6} tensors {:>9} params {:>11}",
                count.matrices,
                human_count(count.params),
                human_bytes(count.bytes)
            ),
        );
        first = false;
    }
    line(
        "",
        format!(
            "{:<14} {:>6}         {:>9} params {:>11}",
            "total",
            "",
            human_count(stats.total_params),
            human_bytes(stats.total_bytes)
        ),
    );
    if let Some(q) = r.converted_to {
        line("converted", format!("--quant {q} at load"));
    }
    line(
        "bytes/token",
        format!(
            "{} of weights read per decoded token (estimate)",
            human_bytes(stats.bytes_per_token)
        ),
    );
    let stops: Vec<String> = stop_tokens(s, tokenizer)
        .into_iter()
        .map(|(id, tok)| match tok {
            Some(t) => format!("{id} {t}"),
            None => id.to_string(),
        })
        .collect();
    line(
        "stop tokens",
        if stops.is_empty() {
            "none".into()
        } else {
            stops.join(", ")
        },
    );
    let ignored: Vec<String> = r
        .ignored_counts
        .iter()
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    line(
        "ignored",
        if ignored.is_empty() {
            "nothing".into()
        } else {
            format!("{} tensors", ignored.join(", "))
        },
    );
    line(
        "quantization",
        quantization_summary(model).unwrap_or_else(|| "none".into()),
    );
    let stored: Vec<String> = r
        .stored_dtypes
        .iter()
        .map(|(d, c)| format!("{d} {} tensors {}", c.tensors, human_bytes(c.bytes)))
        .collect();
    line("stored dtypes", stored.join(", "));
    let files: Vec<String> = r
        .files
        .iter()
        .map(|(f, b)| format!("{f} ({})", human_bytes(*b)))
        .collect();
    line("files", files.join(", "));
    let g = &model.generation;
    let mut generation: Vec<String> = Vec::new();
    let mut field = |name: &str, value: Option<String>| {
        if let Some(v) = value {
            generation.push(format!("{name} {v}"));
        }
    };
    // f32 fields through Display (0.95, not the widened 0.949999988).
    field("temperature", g.temperature.map(|v| v.to_string()));
    field("top_k", g.top_k.map(|v| v.to_string()));
    field("top_p", g.top_p.map(|v| v.to_string()));
    field("min_p", g.min_p.map(|v| v.to_string()));
    field(
        "repetition_penalty",
        g.repetition_penalty.map(|v| v.to_string()),
    );
    field(
        "presence_penalty",
        g.presence_penalty.map(|v| v.to_string()),
    );
    field(
        "frequency_penalty",
        g.frequency_penalty.map(|v| v.to_string()),
    );
    field("do_sample", g.do_sample.map(|v| v.to_string()));
    field("max_new_tokens", g.max_new_tokens.map(|v| v.to_string()));
    field(
        "eos_token_id",
        g.eos_token_id.as_ref().map(|v| format!("{:?}", v.to_vec())),
    );
    let generation = generation.join(", ");
    line(
        "generation",
        if generation.is_empty() {
            "no generation_config.json".into()
        } else {
            generation
        },
    );
    line("load time", format!("{:.2} s", r.load_seconds));
    out
}

pub fn to_json(model: &LoadedModel, tokenizer: Option<&Tokenizer>) -> serde_json::Value {
    let s = &model.spec;
    let feed_forward = match &s.feed_forward {
        FeedForwardSpec::Moe {
            num_experts,
            top_k,
            expert_intermediate,
            shared_intermediate,
            norm_topk_prob,
        } => json!({
            "kind": "moe", "num_experts": num_experts, "top_k": top_k,
            "expert_intermediate": expert_intermediate, "shared_intermediate": shared_intermediate,
            "norm_topk_prob": norm_topk_prob,
        }),
        FeedForwardSpec::Dense { intermediate } => {
            json!({"kind": "dense", "intermediate": intermediate})
        }
    };
    let stops: Vec<serde_json::Value> = stop_tokens(s, tokenizer)
        .into_iter()
        .map(|(id, tok)| json!({"id": id, "token": tok}))
        .collect();
    json!({
        "model": model.dir,
        "family": format!("{:?}", s.family),
        "layer_pattern": layer_pattern(&s.layers),
        "layers": s.layers.iter().map(|&k| kind_name(k)).collect::<Vec<_>>(),
        "spec": {
            "vocab_size": s.vocab_size, "hidden_size": s.hidden_size, "num_layers": s.num_layers(),
            "rms_norm_eps": s.rms_norm_eps.to_string().parse::<f64>().unwrap_or(s.rms_norm_eps as f64), "num_attention_heads": s.num_attention_heads,
            "num_key_value_heads": s.num_key_value_heads, "head_dim": s.head_dim,
            "rotary_dim": s.rotary_dim, "rope_theta": s.rope_theta, "attn_output_gate": s.attn_output_gate,
            "linear_num_key_heads": s.linear_num_key_heads, "linear_num_value_heads": s.linear_num_value_heads,
            "linear_key_head_dim": s.linear_key_head_dim, "linear_value_head_dim": s.linear_value_head_dim,
            "linear_conv_kernel_dim": s.linear_conv_kernel_dim, "feed_forward": feed_forward,
            "tie_word_embeddings": s.tie_word_embeddings, "max_position_embeddings": s.max_position_embeddings,
        },
        "stop_tokens": stops,
        "report": model.report,
        "generation": model.generation,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use calla_model::load::Quant;
    use std::path::PathBuf;

    fn fixture(name: &str) -> Option<PathBuf> {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/models")
            .join(name);
        dir.is_dir().then_some(dir).or_else(|| {
            eprintln!("SKIPPED: fixture {name} is absent");
            None
        })
    }

    #[test]
    fn pattern_is_the_shortest_repeating_unit() {
        use LayerKind::{Attention as A, DeltaNet as D};
        assert_eq!(
            layer_pattern(&[D, D, D, A, D, D, D, A]),
            "[DN DN DN Attn] ×2"
        );
        assert_eq!(layer_pattern(&[D, D, D, A]), "[DN DN DN Attn]");
        assert_eq!(layer_pattern(&[D, A, D]), "[DN Attn DN]");
        let real: Vec<LayerKind> = (0..40).map(|i| if i % 4 == 3 { A } else { D }).collect();
        assert_eq!(layer_pattern(&real), "[DN DN DN Attn] ×10");
    }

    #[test]
    fn inspects_the_mlx_fixture() {
        let Some(dir) = fixture("qwen35moe-mlx4") else {
            return;
        };
        let model = load_model(&dir, &LoadOptions::default()).unwrap();
        let tokenizer = Tokenizer::from_dir(&dir).ok();
        let text = to_text(&model, tokenizer.as_ref());
        for needle in [
            "mlx (language_model.model.*)",
            "[DN DN DN Attn]",
            "q4g64",
            "q8g64",
            "1+w",
            "affine 4-bit g64",
            "8 × 8-bit g64",
            "stop tokens",
        ] {
            assert!(text.contains(needle), "`{needle}` missing from:\n{text}");
        }
        let v = to_json(&model, tokenizer.as_ref());
        assert_eq!(v["spec"]["hidden_size"], 128);
        assert_eq!(v["report"]["style"], "Mlx");
        assert!(v["report"]["stats"]["bytes_per_token"].as_u64().unwrap() > 0);
        assert_eq!(v["stop_tokens"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn inspects_the_cond_fused_fixture_with_ignored_tensors() {
        let Some(dir) = fixture("qwen35moe-cond-fused") else {
            return;
        };
        let model = load_model(&dir, &LoadOptions::default()).unwrap();
        let text = to_text(&model, None);
        assert!(text.contains("vision") && text.contains("mtp"), "{text}");
        assert!(text.contains("Fused"), "{text}");
        let q4 = load_model(
            &dir,
            &LoadOptions {
                quant: Some(Quant::Q4),
            },
        )
        .unwrap();
        assert!(to_text(&q4, None).contains("--quant q4"));
        assert!(q4.report.stats.total_bytes < model.report.stats.total_bytes);
    }
}
