//! Finding the CUDA driver and NVRTC before any cudarc call.
//!
//! cudarc loads `libcuda` and `libnvrtc` by name on first use and panics when they are missing; calla
//! must instead say clearly what is absent. So every entry point calls [`nvrtc_library`] /
//! [`driver_library`] first. Besides the loader's own search (`LD_LIBRARY_PATH`, `ld.so.cache`), we
//! try a few well-known directories and load the library there by absolute path: a later `dlopen` by
//! name then finds the already-loaded object through its SONAME.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{bail, Result};

/// Directories where CUDA libraries live on common installs, after the loader's own search.
fn candidate_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["CALLA_CUDA_LIB_DIR", "CUDA_HOME", "CUDA_PATH"] {
        if let Some(v) = std::env::var_os(var) {
            let p = PathBuf::from(v);
            dirs.push(p.join("lib64"));
            dirs.push(p.join("lib"));
            dirs.push(p);
        }
    }
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/local/cuda-13.0/lib64",
        "/usr/local/nvidia/lib64",
        "/usr/local/nvidia/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
    ] {
        dirs.push(PathBuf::from(d));
    }
    // pip wheels (nvidia-cuda-nvrtc 13.x) next to a Python install.
    for root in ["/usr/local/lib", "/usr/lib", "/opt/torch/.venv/lib"] {
        if let Ok(entries) = std::fs::read_dir(root) {
            for e in entries.flatten() {
                let name = e.file_name();
                if name.to_string_lossy().starts_with("python3") {
                    for sp in ["site-packages", "dist-packages"] {
                        dirs.push(e.path().join(sp).join("nvidia/cu13/lib"));
                        dirs.push(e.path().join(sp).join("nvidia/cuda_nvrtc/lib"));
                    }
                }
            }
        }
    }
    dirs
}

/// dlopen `path` globally and keep it loaded for the life of the process.
fn preload(path: &Path) -> bool {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading a CUDA library runs only its initialisers, which have no preconditions.
    match unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) } {
        Ok(lib) => {
            std::mem::forget(lib);
            true
        }
        Err(_) => false,
    }
}

fn loadable_by_name(name: &str) -> bool {
    // SAFETY: as in `preload`.
    unsafe { libloading::Library::new(name) }.is_ok()
}

/// The first library among `names` that the loader finds by name, else by a well-known directory.
fn find(names: &[&str], extra: &[&str]) -> Option<String> {
    for n in names {
        if loadable_by_name(n) {
            return Some(format!("{n} (by the loader's search path)"));
        }
    }
    for dir in candidate_dirs() {
        for n in names {
            let p = dir.join(n);
            if p.is_file() && preload(&p) {
                for e in extra {
                    let pe = dir.join(e);
                    if pe.is_file() {
                        preload(&pe);
                    }
                }
                return Some(p.display().to_string());
            }
        }
    }
    None
}

/// Make sure NVRTC 13 can be loaded; returns where it was found.
pub fn nvrtc_library() -> Result<&'static str> {
    static FOUND: OnceLock<Result<String, String>> = OnceLock::new();
    let found = FOUND.get_or_init(|| {
        let Some(at) = find(
            &["libnvrtc.so.13", "libnvrtc.so"],
            &["libnvrtc-builtins.so.13.0"],
        ) else {
            return Err(
                "NVRTC (libnvrtc.so.13) was not found: calla compiles its CUDA kernels at \
                 start-up and needs the CUDA 13 runtime compiler. Install the CUDA 13.0 toolkit or \
                 `pip install \"nvidia-cuda-nvrtc==13.0.*\"` and put its lib directory on \
                 LD_LIBRARY_PATH (or set CALLA_CUDA_LIB_DIR)."
                    .to_string(),
            );
        };
        // SAFETY: the library is present (checked above); nvrtcVersion only writes two ints.
        let (mut major, mut minor) = (0i32, 0i32);
        let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS || major < 13 {
            return Err(format!(
                "NVRTC at {at} is version {major}.{minor}; calla needs NVRTC 13.x (CUDA 13.0)"
            ));
        }
        Ok(format!("{at}, NVRTC {major}.{minor}"))
    });
    match found {
        Ok(s) => Ok(s.as_str()),
        Err(e) => bail!("{e}"),
    }
}

/// Make sure the CUDA driver library can be loaded and is new enough; returns where it was found.
pub fn driver_library() -> Result<&'static str> {
    static FOUND: OnceLock<Result<String, String>> = OnceLock::new();
    let found = FOUND.get_or_init(|| {
        let Some(at) = find(&["libcuda.so.1", "libcuda.so"], &[]) else {
            return Err("no NVIDIA driver found (libcuda.so.1 is not loadable): --device cuda needs \
                 an NVIDIA GPU with driver R580 or newer (CUDA 13.0)"
                .to_string());
        };
        let mut version = 0i32;
        // SAFETY: the library is present; cuDriverGetVersion only writes one int and needs no cuInit.
        let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS || version < 13000 {
            return Err(format!(
                "the NVIDIA driver at {at} supports CUDA {}.{}; calla needs CUDA 13.0 (driver R580 or newer)",
                version / 1000,
                (version % 1000) / 10
            ));
        }
        Ok(format!("{at}, CUDA driver API {}.{}", version / 1000, (version % 1000) / 10))
    });
    match found {
        Ok(s) => Ok(s.as_str()),
        Err(e) => bail!("{e}"),
    }
}
