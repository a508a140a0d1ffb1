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

/// Build the engine for `device` from a loaded checkpoint (the weights' bytes are shared, not copied).
pub fn open_backend(loaded: &LoadedModel, device: Device) -> Result<Box<dyn Backend>> {
    match device {
        Device::Cpu => Ok(Box::new(calla_cpu::CpuBackend::new(
            loaded.spec.clone(),
            loaded.weights.clone(),
        )?)),
        Device::Cuda => {
            use std::io::IsTerminal;
            let opts = calla_cuda::CudaOptions {
                progress: std::io::stderr().is_terminal(),
                ..Default::default()
            };
            let backend = calla_cuda::CudaBackend::new(&loaded.spec, &loaded.weights, &opts)?;
            Ok(Box::new(backend))
        }
    }
}
