//! Compiling the kernel sources with NVRTC for the device's architecture, with an on-disk cache.
//!
//! Each `kernels/<family>.cu` is compiled as one program: `common.cuh` (our own bf16/f16 helpers,
//! formats and reductions: no CUDA toolkit header is needed at run time), a `#line` directive so
//! errors point into the right file, then the family's source. The result is a CUBIN for the exact
//! architecture (`sm_90a` on Hopper), so the driver does no JIT work.
//!
//! Cache: `$CALLA_KERNEL_CACHE`, else `$XDG_CACHE_HOME/calla/kernels`, else `~/.cache/calla/kernels`;
//! one file per module named by sha256(source ‖ options ‖ NVRTC version ‖ arch). A cache that cannot
//! be written is not an error (the compile just repeats next time).

use std::ffi::{c_char, CString};
use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use cudarc::nvrtc::sys as nv;
use sha2::{Digest, Sha256};

use crate::runtime::kernels::{KernelSource, COMMON_HEADER};
use crate::runtime::probe;

/// Options every module is compiled with (the arch is added per device).
const BASE_OPTIONS: &[&str] = &[
    "--std=c++17",
    "--fmad=true",
    "-default-device",
    "--extra-device-vectorization",
];

/// The NVRTC target for a compute capability: Hopper gets the arch-specific `sm_90a` (wgmma,
/// setmaxnreg); anything else its plain `sm_XY`.
pub fn arch_for(major: i32, minor: i32) -> String {
    if (major, minor) == (9, 0) {
        "sm_90a".to_string()
    } else {
        format!("sm_{major}{minor}")
    }
}

pub fn nvrtc_version() -> Result<(i32, i32)> {
    probe::nvrtc_library()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loaded (probed above); the call writes two ints.
    check(
        unsafe { nv::nvrtcVersion(&mut major, &mut minor) },
        "nvrtcVersion",
    )?;
    Ok((major, minor))
}

fn check(r: nv::nvrtcResult, what: &str) -> Result<()> {
    if r == nv::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        bail!("{what} failed: {r:?}")
    }
}

/// What one compilation produced.
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub from_cache: bool,
    pub seconds: f64,
    /// Compiler warnings (empty when clean).
    pub log: String,
}

fn full_source(k: &KernelSource) -> String {
    format!("{COMMON_HEADER}\n#line 1 \"{}\"\n{}", k.file, k.source)
}

fn options(arch: &str) -> Vec<String> {
    let mut o: Vec<String> = BASE_OPTIONS.iter().map(|s| s.to_string()).collect();
    o.push(format!("--gpu-architecture={arch}"));
    o
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("CALLA_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("calla/kernels"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/calla/kernels"))
}

fn cache_key(source: &str, opts: &[String], version: (i32, i32), arch: &str) -> String {
    let mut h = Sha256::new();
    h.update(source.as_bytes());
    h.update([0u8]);
    for o in opts {
        h.update(o.as_bytes());
        h.update([0u8]);
    }
    h.update(format!("nvrtc {}.{}\0{arch}", version.0, version.1).as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Compile (or fetch from the cache) one kernel module for `arch`.
pub fn compile(k: &KernelSource, arch: &str, use_cache: bool) -> Result<Compiled> {
    let version = nvrtc_version()?;
    let source = full_source(k);
    let opts = options(arch);
    let key = cache_key(&source, &opts, version, arch);
    let cached = cache_dir().map(|d| d.join(format!("{}-{}.cubin", k.name, &key[..24])));
    if use_cache {
        if let Some(path) = &cached {
            if let Ok(bytes) = std::fs::read(path) {
                return Ok(Compiled {
                    cubin: bytes,
                    from_cache: true,
                    seconds: 0.0,
                    log: String::new(),
                });
            }
        }
    }
    let start = std::time::Instant::now();
    let (cubin, log) = compile_uncached(&source, k.file, &opts)?;
    let seconds = start.elapsed().as_secs_f64();
    if let Some(path) = &cached {
        if let Some(dir) = path.parent() {
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            let written = std::fs::create_dir_all(dir)
                .and_then(|_| std::fs::write(&tmp, &cubin))
                .and_then(|_| std::fs::rename(&tmp, path));
            if let Err(e) = written {
                tracing::warn!("kernel cache {} not written: {e}", dir.display());
            }
        }
    }
    Ok(Compiled {
        cubin,
        from_cache: false,
        seconds,
        log,
    })
}

fn program_log(prog: nv::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: `prog` is a live program; the calls write the size, then that many bytes.
    unsafe {
        if nv::nvrtcGetProgramLogSize(prog, &mut size) != nv::nvrtcResult::NVRTC_SUCCESS
            || size <= 1
        {
            return String::new();
        }
        let mut buf = vec![0u8; size];
        if nv::nvrtcGetProgramLog(prog, buf.as_mut_ptr() as *mut c_char)
            != nv::nvrtcResult::NVRTC_SUCCESS
        {
            return String::new();
        }
        buf.truncate(size.saturating_sub(1));
        String::from_utf8_lossy(&buf).trim().to_string()
    }
}

fn compile_uncached(source: &str, file: &str, opts: &[String]) -> Result<(Vec<u8>, String)> {
    let c_src = CString::new(source).map_err(|_| anyhow!("{file}: source contains a NUL byte"))?;
    let c_name = CString::new(file).map_err(|_| anyhow!("{file}: bad file name"))?;
    let c_opts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()).unwrap())
        .collect();
    let opt_ptrs: Vec<*const c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: the strings outlive the program (destroyed below); no headers are passed.
    check(
        unsafe {
            nv::nvrtcCreateProgram(
                &mut prog,
                c_src.as_ptr(),
                c_name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        },
        "nvrtcCreateProgram",
    )?;
    // SAFETY: `prog` is live; the option pointers are valid C strings for the call's duration.
    let r = unsafe { nv::nvrtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr()) };
    let log = program_log(prog);
    let result = if r != nv::nvrtcResult::NVRTC_SUCCESS {
        Err(anyhow!("NVRTC could not compile {file} ({r:?}):\n{log}"))
    } else {
        let mut size = 0usize;
        // SAFETY: compiled program; the buffer has the size NVRTC reported.
        unsafe {
            check(nv::nvrtcGetCUBINSize(prog, &mut size), "nvrtcGetCUBINSize")
                .and_then(|_| {
                    let mut buf = vec![0u8; size];
                    check(
                        nv::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char),
                        "nvrtcGetCUBIN",
                    )
                    .map(|_| buf)
                })
                .with_context(|| format!("{file}: reading the CUBIN"))
        }
    };
    // SAFETY: destroying the program we created, once.
    unsafe { nv::nvrtcDestroyProgram(&mut prog) };
    result.map(|cubin| (cubin, log))
}

/// Compile every kernel source for `arch` without a GPU (CI): returns one line per module.
pub fn compile_all(arch: &str) -> Result<Vec<String>> {
    let (maj, min) = nvrtc_version()?;
    let mut lines = vec![format!(
        "NVRTC {maj}.{min} ({}), target {arch}",
        probe::nvrtc_library()?
    )];
    let mut failures = Vec::new();
    for k in crate::runtime::kernels::ALL.iter() {
        match compile(k, arch, false) {
            Ok(c) => {
                lines.push(format!(
                    "{:<24} {:>8} bytes of CUBIN in {:.2} s{}",
                    k.file,
                    c.cubin.len(),
                    c.seconds,
                    if c.log.is_empty() {
                        String::new()
                    } else {
                        format!("\n{}", c.log)
                    }
                ));
            }
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    if !failures.is_empty() {
        bail!(
            "{} kernel source(s) failed to compile:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
    Ok(lines)
}
