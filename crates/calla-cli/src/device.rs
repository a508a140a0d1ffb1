//! `--device`: which engine runs the model, and opening it.

use anyhow::{Context, Result};
use calla_engine::Backend;
use calla_model::load::LoadedModel;

use crate::args::{Device, DeviceArgs};

/// The KV capacity the CUDA engine allocates when `--max-context` is not given (its own default,
/// calla_cuda CudaOptions::max_context): at most this many positions.
pub const CUDA_DEFAULT_CONTEXT: usize = 32768;

/// The engine `--device` names, with `auto` decided: CUDA when calla_cuda finds a usable GPU
/// (driver, NVRTC, device), else CPU. The log says which and why.
pub fn resolve(device: Device) -> Device {
    match device {
        Device::Cpu | Device::Cuda => device,
        Device::Auto => match calla_cuda::runtime::usable_gpu::usable_gpu(0) {
            Ok(gpu) => {
                tracing::info!("--device auto: using CUDA on {gpu}");
                Device::Cuda
            }
            Err(why) => {
                tracing::info!("--device auto: using the CPU engine; no usable GPU: {why:#}");
                Device::Cpu
            }
        },
    }
}

/// An opened engine and the longest sequence it holds (None: no limit but the model's context).
pub struct Opened {
    pub backend: Box<dyn Backend>,
    pub capacity: Option<usize>,
}

/// Build the engine for `args.device` (auto decided here) from a loaded checkpoint (the weights'
/// bytes are shared, not copied). `max_context`: the CUDA engine's K/V capacity; without it,
/// min(model's context, [`CUDA_DEFAULT_CONTEXT`]).
pub fn open_backend(
    loaded: &LoadedModel,
    args: &DeviceArgs,
    max_context: Option<usize>,
) -> Result<Opened> {
    match resolve(args.device) {
        Device::Cpu | Device::Auto => Ok(Opened {
            backend: Box::new(calla_cpu::CpuBackend::new(
                loaded.spec.clone(),
                loaded.weights.clone(),
            )?),
            capacity: max_context,
        }),
        Device::Cuda => {
            use std::io::IsTerminal;
            let capacity = max_context
                .unwrap_or(CUDA_DEFAULT_CONTEXT)
                .min(loaded.spec.max_position_embeddings)
                .max(1);
            let opts = calla_cuda::CudaOptions {
                progress: std::io::stderr().is_terminal(),
                prompt_precision: args.prompt_precision,
                kv_cache: args.kv_cache.to_cuda(),
                max_context: Some(capacity),
                kernels: args.kernel_choices(),
                ..Default::default()
            };
            let backend = calla_cuda::CudaBackend::new(&loaded.spec, &loaded.weights, &opts)
                .context("starting the CUDA engine (--device cpu runs the CPU engine)")?;
            Ok(Opened {
                backend: Box::new(backend),
                capacity: Some(capacity),
            })
        }
    }
}
