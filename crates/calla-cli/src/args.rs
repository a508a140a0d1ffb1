//! The flags that several subcommands share, as one set of structs each command flattens
//! (`#[command(flatten)]`): the same names, types, defaults and help everywhere.
//!
//! | struct          | flags                                             | used by                          |
//! |-----------------|---------------------------------------------------|----------------------------------|
//! | [`ModelArgs`]   | `--model`, `--quant`                              | inspect, generate, chat, serve, bench |
//! | [`DeviceArgs`]  | `--device`, `--kv-cache`, `--prompt-precision`    | generate, chat, serve, bench     |
//! | [`SamplingArgs`]| `--temperature`, `--top-k`, `--top-p`, `--min-p`  | generate, chat, serve, bench     |
//! | [`CacheArgs`]   | `--max-context`, `--prefix-cache-mb`              | chat, serve                      |
//!
//! Sampling flags left out: `generate` and `bench` decode greedily (deterministic, for scripts and
//! measurements); `chat` and `serve` take the checkpoint's generation_config.json (in `serve` a
//! request's own fields win over both).

use std::path::PathBuf;

use anyhow::{ensure, Result};
use calla_engine::SamplingParams;
use calla_model::load::{GenerationDefaults, Quant};

pub use calla_cuda::PromptPrecision;

/// The checkpoint and its load-time conversion.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ModelArgs {
    /// Checkpoint directory (Hugging Face or MLX layout: config.json, *.safetensors,
    /// tokenizer.json). Required by inspect and generate; without it, serve and chat use the
    /// bundled tiny demo checkpoint (random weights: meaningless text) and bench a synthetic model.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Convert the weights at load: q4 / q8 (MLX affine, group 64), bf16, f32. Default: keep the
    /// stored formats.
    #[arg(long)]
    pub quant: Option<Quant>,
}

/// Which engine runs the model (`--device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Device {
    /// CUDA when a usable GPU is found (driver, NVRTC and device), else the CPU engine; the log
    /// says which and why.
    #[default]
    Auto,
    /// The CPU reference engine (all cores, f32 arithmetic over the stored formats).
    Cpu,
    /// The CUDA engine on GPU 0 (an error if it cannot start).
    Cuda,
}

/// K/V cache element type of the CUDA engine (`--kv-cache`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvCache {
    /// f32: decode matches the f32 CPU reference to rounding.
    F32,
    /// bf16: half the cache's bytes (the engine's default, calla_cuda DEFAULT_KV_CACHE).
    Bf16,
}

impl Default for KvCache {
    fn default() -> Self {
        match calla_cuda::engine::backend::DEFAULT_KV_CACHE {
            calla_cuda::KvDtype::F32 => KvCache::F32,
            calla_cuda::KvDtype::Bf16 => KvCache::Bf16,
        }
    }
}

impl KvCache {
    pub fn to_cuda(self) -> calla_cuda::KvDtype {
        match self {
            KvCache::F32 => calla_cuda::KvDtype::F32,
            KvCache::Bf16 => calla_cuda::KvDtype::Bf16,
        }
    }
}

/// Help of `--prompt-precision`.
pub const PROMPT_PRECISION_HELP: &str =
    "CUDA: precision of the batched prompt (prefill) products: \
balanced (default: half, but the DeltaNet in-projections split; passes the parity checks, 31K \
tok/s at 8K on an H200), split (≈ f32: ~1e-5 from the f32 reference, 21K tok/s), half (f16 \
activations × f16-rounded q4 weights everywhere: 36K tok/s, ~5e-3 in log-probabilities at the \
real shape; split where it cannot run, as in balanced: not q4 in groups of 64, not sm_90a), fast (bf16 \
activations everywhere), auto (by weight format: fast for bf16/quantised, split for f32/f16), \
mixed (routed experts auto, the rest split), experts-up / experts-down (only that routed product \
auto), ffn (routed + shared experts auto); or presets and \
GROUP=fast|split|half|auto overrides, comma-separated, GROUP one of deltanet-in, attention-in, \
mixer-in (both), mixer-out, mixer, experts-gate-up, experts-down, experts, shared (e.g. \
mixed,shared=auto). The MoE router is always split";

/// The environment variable `--prompt-precision` also reads (the engine itself reads none).
pub const PROMPT_PRECISION_ENV: &str = "CALLA_PROMPT_PRECISION";

/// The engine and its options (the CUDA ones are ignored by the CPU engine).
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub struct DeviceArgs {
    /// Engine: auto (CUDA when a usable GPU is found, else CPU), cuda, cpu.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    /// CUDA: K/V cache element type: bf16 (half the memory) or f32 (matches the f32 CPU
    /// reference to rounding).
    #[arg(long, value_enum, default_value_t = KvCache::default())]
    pub kv_cache: KvCache,
    #[arg(long, env = PROMPT_PRECISION_ENV, default_value = "balanced", help = PROMPT_PRECISION_HELP)]
    pub prompt_precision: PromptPrecision,
    /// CUDA: the GPU is shared with other processes through MPS (its SMs partitioned among them):
    /// use the kernels whose blocks never wait for each other (attention's ticketed merge, the
    /// selection's last-block draw). Not needed when processes merely time-slice the GPU.
    #[arg(long)]
    pub shared_gpu: bool,
}

impl DeviceArgs {
    /// The kernel variants for the CUDA engine.
    pub fn kernel_choices(&self) -> calla_cuda::KernelChoices {
        if self.shared_gpu {
            calla_cuda::KernelChoices::shared_gpu()
        } else {
            calla_cuda::KernelChoices::default()
        }
    }
}

/// Sampling. Any flag given turns sampling on; `--temperature 0` is greedy.
#[derive(Debug, Clone, Copy, Default, PartialEq, clap::Args)]
pub struct SamplingArgs {
    /// Sampling temperature (0 = greedy). Unset: generate and bench are greedy, chat and serve take
    /// generation_config.json (1 if it has none).
    #[arg(long, allow_negative_numbers = true)]
    pub temperature: Option<f32>,
    /// Keep the K most likely tokens (0 = off).
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Nucleus sampling: keep the most likely tokens whose probabilities sum to P (1 = off).
    #[arg(long, value_name = "P", allow_negative_numbers = true)]
    pub top_p: Option<f32>,
    /// Drop tokens below M × the best token's probability (0 = off).
    #[arg(long, value_name = "M", allow_negative_numbers = true)]
    pub min_p: Option<f32>,
}

impl SamplingArgs {
    /// Whether any sampling flag was given.
    pub fn any(&self) -> bool {
        self.temperature.is_some()
            || self.top_k.is_some()
            || self.top_p.is_some()
            || self.min_p.is_some()
    }

    /// The values given are in range.
    pub fn check(&self) -> Result<()> {
        if let Some(t) = self.temperature {
            ensure!(
                t.is_finite() && t >= 0.0,
                "--temperature must be ≥ 0, got {t}"
            );
        }
        if let Some(p) = self.top_p {
            ensure!(p > 0.0 && p <= 1.0, "--top-p must be in (0, 1], got {p}");
        }
        if let Some(m) = self.min_p {
            ensure!(
                (0.0..=1.0).contains(&m),
                "--min-p must be in [0, 1], got {m}"
            );
        }
        Ok(())
    }

    /// generate and bench: greedy with no flag; with any, the flags not given are off
    /// (temperature 1, top-k 0, top-p 1, min-p 0). generation_config.json is not consulted.
    pub fn fixed(&self, seed: u64) -> Result<SamplingParams> {
        self.check()?;
        let sampled = self.any();
        Ok(SamplingParams {
            temperature: if sampled {
                self.temperature.unwrap_or(1.0)
            } else {
                0.0
            },
            top_k: self.top_k.unwrap_or(0),
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            seed,
            ..SamplingParams::default()
        })
    }

    /// chat and serve: the flags given replace the checkpoint's generation_config.json values (the
    /// defaults a request that does not set them gets). A temperature given also replaces the
    /// config's `do_sample`, so `--temperature 0.7` samples even where the config says greedy.
    pub fn over(&self, mut defaults: GenerationDefaults) -> Result<GenerationDefaults> {
        self.check()?;
        if let Some(t) = self.temperature {
            defaults.temperature = Some(t);
            defaults.do_sample = None;
        }
        if let Some(k) = self.top_k {
            defaults.top_k = Some(u32::try_from(k).unwrap_or(u32::MAX));
        }
        if let Some(p) = self.top_p {
            defaults.top_p = Some(p);
        }
        if let Some(m) = self.min_p {
            defaults.min_p = Some(m);
        }
        Ok(defaults)
    }
}

/// Prefix cache default, MiB.
pub const DEFAULT_PREFIX_CACHE_MB: usize = 4096;

/// Context and saved prompt states (the conversation paths: chat and serve).
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct CacheArgs {
    /// Longest prompt + output in tokens. Default: the model's context on the CPU engine;
    /// min(model's context, 32768) on CUDA, whose K/V cache is allocated for it up front.
    #[arg(long, value_name = "TOKENS", value_parser = crate::limits::context_len)]
    pub max_context: Option<usize>,
    /// Memory for saved prompt states (the prefix cache, which makes each chat turn run only its
    /// new tokens), in MiB; 0 disables it.
    #[arg(long, value_name = "MIB", default_value_t = DEFAULT_PREFIX_CACHE_MB, value_parser = crate::limits::cache_mib)]
    pub prefix_cache_mb: usize,
}

impl Default for CacheArgs {
    fn default() -> Self {
        CacheArgs {
            max_context: None,
            prefix_cache_mb: DEFAULT_PREFIX_CACHE_MB,
        }
    }
}

impl CacheArgs {
    pub fn prefix_cache_bytes(&self) -> usize {
        self.prefix_cache_mb.saturating_mul(1 << 20)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct All {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        device: DeviceArgs,
        #[command(flatten)]
        sampling: SamplingArgs,
        #[command(flatten)]
        cache: CacheArgs,
    }

    fn parse(argv: &[&str]) -> Result<All, clap::Error> {
        All::try_parse_from(std::iter::once("calla").chain(argv.iter().copied()))
    }

    #[test]
    fn defaults() {
        let a = parse(&[]).unwrap();
        assert_eq!(a.model.model, None);
        assert_eq!(a.model.quant, None);
        assert_eq!(a.device.device, Device::Auto);
        assert_eq!(a.device.kv_cache, KvCache::Bf16);
        assert_eq!(a.sampling, SamplingArgs::default());
        assert_eq!(a.cache.max_context, None);
        assert_eq!(a.cache.prefix_cache_mb, 4096);
        if std::env::var_os(PROMPT_PRECISION_ENV).is_none() {
            assert_eq!(a.device.prompt_precision, PromptPrecision::default());
        }
    }

    #[test]
    fn fixed_sampling_is_greedy_unless_a_flag_is_given() {
        let greedy = SamplingArgs::default().fixed(0).unwrap();
        assert_eq!(greedy.temperature, 0.0);
        let a = parse(&["--top-p", "0.9"]).unwrap();
        let p = a.sampling.fixed(7).unwrap();
        assert_eq!((p.temperature, p.top_p, p.top_k, p.seed), (1.0, 0.9, 0, 7));
        let a = parse(&["--temperature", "0"]).unwrap();
        assert_eq!(a.sampling.fixed(0).unwrap().temperature, 0.0);
    }

    #[test]
    fn out_of_range_values_are_errors() {
        for (argv, needle) in [
            (["--temperature", "-1"], "--temperature"),
            (["--temperature", "NaN"], "--temperature"),
            (["--top-p", "0"], "--top-p"),
            (["--top-p", "1.5"], "--top-p"),
            (["--min-p", "2"], "--min-p"),
        ] {
            let a = parse(&argv).unwrap();
            let err = a.sampling.fixed(0).unwrap_err().to_string();
            assert!(err.contains(needle), "{argv:?}: {err}");
            assert!(a.sampling.over(GenerationDefaults::default()).is_err());
        }
    }

    #[test]
    fn flags_replace_generation_config_values() {
        let config = GenerationDefaults {
            temperature: Some(0.6),
            top_p: Some(0.95),
            top_k: Some(20),
            do_sample: Some(false),
            ..GenerationDefaults::default()
        };
        let a = parse(&[]).unwrap();
        assert_eq!(a.sampling.over(config.clone()).unwrap(), config);
        let a = parse(&["--temperature", "1.0", "--top-k", "40"]).unwrap();
        let d = a.sampling.over(config).unwrap();
        assert_eq!(d.temperature, Some(1.0));
        assert_eq!(d.top_k, Some(40));
        assert_eq!(d.top_p, Some(0.95));
        assert_eq!(d.do_sample, None, "a temperature given decides");
    }

    #[test]
    fn device_and_cache_values() {
        let a = parse(&[
            "--device",
            "cpu",
            "--kv-cache",
            "f32",
            "--prefix-cache-mb",
            "0",
        ])
        .unwrap();
        assert_eq!(a.device.device, Device::Cpu);
        assert_eq!(a.device.kv_cache, KvCache::F32);
        assert_eq!(a.cache.prefix_cache_bytes(), 0);
        assert!(parse(&["--device", "gpu"]).is_err());
        assert!(parse(&["--kv-cache", "f16"]).is_err());
        assert!(parse(&["--quant", "q3"]).is_err());
    }
}
