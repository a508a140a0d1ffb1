//! Whether this process can run the CUDA engine, asked without compiling anything: what
//! `calla --device auto` decides by. Each step that fails says why in words a user can act on.

use anyhow::{anyhow, bail, Result};
use cudarc::driver::{result as cu, sys};

use crate::runtime::probe;

/// The oldest architecture NVRTC 13 compiles for (Turing, sm_75).
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (7, 5);

/// GPU `ordinal` as the driver describes it, before any context is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsableGpu {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    /// GPUs the driver reports (CUDA_VISIBLE_DEVICES applies)
    pub count: usize,
}

impl std::fmt::Display for UsableGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (major, minor) = self.compute_capability;
        write!(
            f,
            "cuda:{} ({}, compute capability {major}.{minor})",
            self.ordinal, self.name
        )
    }
}

/// GPU `ordinal` if the CUDA engine can run on it: the CUDA 13 driver and NVRTC 13 load, cuInit
/// succeeds, the device exists and NVRTC 13 compiles for its architecture. Cheap: no context is
/// created and no kernel compiled.
pub fn usable_gpu(ordinal: usize) -> Result<UsableGpu> {
    probe::driver_library()?;
    probe::nvrtc_library()?;
    cu::init()
        .map_err(|e| anyhow!("cuInit failed ({e}): no NVIDIA GPU is visible to this process"))?;
    let count = cu::device::get_count().map_err(|e| anyhow!("cuDeviceGetCount failed: {e}"))?;
    if count <= 0 {
        bail!("the NVIDIA driver reports no CUDA device");
    }
    if ordinal >= count as usize {
        bail!("CUDA device {ordinal} does not exist ({count} present)");
    }
    let dev = cu::device::get(ordinal as i32)
        .map_err(|e| anyhow!("cuDeviceGet({ordinal}) failed: {e}"))?;
    let attribute = |a: sys::CUdevice_attribute| {
        // SAFETY: `dev` was returned by cuDeviceGet above.
        unsafe { cu::device::get_attribute(dev, a) }
            .map_err(|e| anyhow!("cuDeviceGetAttribute failed: {e}"))
    };
    let major = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let name = cu::device::get_name(dev).unwrap_or_else(|_| "unknown GPU".into());
    if (major, minor) < MIN_COMPUTE_CAPABILITY {
        let (need_major, need_minor) = MIN_COMPUTE_CAPABILITY;
        bail!(
            "{name} has compute capability {major}.{minor}; NVRTC 13 compiles for \
             {need_major}.{need_minor} or newer"
        );
    }
    Ok(UsableGpu {
        ordinal,
        name,
        compute_capability: (major, minor),
        count: count as usize,
    })
}
