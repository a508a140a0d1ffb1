//! `--device`: which engine runs the model.

use anyhow::Result;
use calla_engine::Backend;
use calla_model::load::LoadedModel;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    /// The CPU reference engine (all cores, f32 arithmetic over the stored formats).
    Cpu,
    /// The CUDA engine (GPU 0).
    Cuda,
}

/// Precision of the CUDA engine's batched prompt products (`--prompt-precision`, or the
/// CALLA_PROMPT_PRECISION environment variable): calla_cuda::prompt_precision's policy, parsed
/// from a preset name or a list of group overrides.
pub use calla_cuda::PromptPrecision;

/// Help of `--prompt-precision` (generate, serve, chat, bench).
pub const PROMPT_PRECISION_HELP: &str =
    "CUDA: precision of the batched prompt (prefill) products: \
balanced (default: half, but the DeltaNet in-projections split; passes the parity checks, 30.6K \
tok/s at 8K on an H200), split (≈ f32: ~1e-5 from the f32 reference, 21K tok/s), half (f16 \
activations × f16-rounded q4 weights everywhere: 36K tok/s, ~5e-3 in log-probabilities at the \
real shape; split where it cannot run, as in balanced: not q4 in groups of 64, not sm_90a), fast (bf16 \
activations everywhere), auto (by weight format: fast for bf16/quantised, split for f32/f16), \
mixed (routed experts auto, the rest split), experts-up / experts-down (only that routed product \
auto), ffn (routed + shared experts auto); or presets and \
GROUP=fast|split|half|auto overrides, comma-separated, GROUP one of deltanet-in, attention-in, \
mixer-in (both), mixer-out, mixer, experts-gate-up, experts-down, experts, shared (e.g. \
mixed,shared=auto). The MoE router is always split";

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
        match calla_cuda::backend::DEFAULT_KV_CACHE {
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

/// Options of the CUDA engine (ignored with `--device cpu`).
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub struct CudaFlags {
    #[arg(long, env = calla_cuda::prompt_precision::ENV, default_value = "balanced", help = PROMPT_PRECISION_HELP)]
    pub prompt_precision: PromptPrecision,
    /// CUDA: K/V cache element type: f32 or bf16 (default bf16: half the memory; f32 matches the
    /// f32 CPU reference to rounding).
    #[arg(long, value_enum, default_value_t = KvCache::default())]
    pub kv_cache: KvCache,
}

/// Build the engine for `device` from a loaded checkpoint (the weights' bytes are shared, not copied).
pub fn open_backend(
    loaded: &LoadedModel,
    device: Device,
    cuda: &CudaFlags,
) -> Result<Box<dyn Backend>> {
    match device {
        Device::Cpu => Ok(Box::new(calla_cpu::CpuBackend::new(
            loaded.spec.clone(),
            loaded.weights.clone(),
        )?)),
        Device::Cuda => {
            use std::io::IsTerminal;
            let opts = calla_cuda::CudaOptions {
                progress: std::io::stderr().is_terminal(),
                prompt_precision: cuda.prompt_precision,
                kv_cache: cuda.kv_cache.to_cuda(),
                ..Default::default()
            };
            let backend = calla_cuda::CudaBackend::new(&loaded.spec, &loaded.weights, &opts)?;
            Ok(Box::new(backend))
        }
    }
}
