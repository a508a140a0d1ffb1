//! The device as the engine sees it: one context, one stream, the compiled kernel modules, raw device
//! memory and kernel launches with one `#[repr(C)]` parameter struct each.
//!
//! We deliberately stay below cudarc's `CudaSlice` (which attaches events to every allocation for
//! multi-stream tracking): all engine memory is a few large allocations carved into typed regions
//! (`pool.rs`), every launch goes to the one stream in order, and the decode step is captured as a
//! graph — so raw `CUdeviceptr`s are simpler and graph-safe.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{result as cu, sys, CudaContext, CudaFunction, CudaModule, CudaStream};

use crate::runtime::choices::KernelChoices;
use crate::runtime::kernels;
use crate::runtime::nvrtc;
use crate::runtime::probe;

/// A device address (no ownership; the owning `DeviceBuffer` must outlive its use).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct DPtr(pub u64);

impl DPtr {
    pub const NULL: DPtr = DPtr(0);
    pub fn offset(self, bytes: usize) -> DPtr {
        DPtr(self.0 + bytes as u64)
    }
    pub fn is_null(self) -> bool {
        self.0 == 0
    }
}

/// Where a module came from at start-up (logs, `calla-cuda` smoke output).
#[derive(Debug, Clone)]
pub struct ModuleReport {
    pub name: &'static str,
    pub cubin_bytes: usize,
    pub from_cache: bool,
    pub compile_seconds: f64,
}

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub ordinal: usize,
    pub name: String,
    pub arch: String,
    pub total_memory: usize,
    pub sm_count: i32,
    pub modules_report: Vec<ModuleReport>,
    pub libraries: String,
    modules: HashMap<&'static str, Arc<CudaModule>>,
    /// which kernel variants the launchers pick (CudaOptions; tests switch them)
    choices: Mutex<KernelChoices>,
    functions: Mutex<HashMap<String, CudaFunction>>,
}

/// Which module holds a kernel, by name prefix (kernel names are `<family>_…`).
fn module_of(function: &str) -> Option<&'static str> {
    const PREFIXES: &[(&str, &str)] = &[
        ("matvec_tc_gate_up_", "moe_tc"),
        ("matvec_tc_down_", "moe_tc"),
        ("matvec_tc_", "matvec_tc"),
        ("matvec_", "matvec"),
        ("embed_", "matvec"),
        ("deltanet_", "deltanet"),
        ("dngen_", "deltanet_general"),
        ("attn_", "attention"),
        ("moe_", "moe"),
        ("select_", "select"),
        ("penalty_", "select"),
        ("fill_", "fill"),
        ("gemm_", "gemm"),
        ("prefill_dn_", "deltanet_prefill"),
        ("prefill_attn_", "attention_prefill"),
        ("prefill_moe_", "moe_prefill"),
    ];
    PREFIXES
        .iter()
        .find(|(p, _)| function.starts_with(p))
        .map(|(_, m)| *m)
}

impl Gpu {
    /// Open device `ordinal`: probe the libraries (clear errors, no panics), create the context and
    /// stream, compile (or load from the cache) every kernel module for the device's architecture.
    pub fn new(ordinal: usize) -> Result<Arc<Gpu>> {
        let driver = probe::driver_library()?;
        let nvrtc_lib = probe::nvrtc_library()?;
        cu::init().map_err(|e| {
            anyhow!("cuInit failed ({e}): is an NVIDIA GPU visible to this process?")
        })?;
        let count = cu::device::get_count().map_err(|e| anyhow!("cuDeviceGetCount failed: {e}"))?;
        if count <= 0 {
            bail!("no CUDA device found (the driver reports {count} devices)");
        }
        if ordinal >= count as usize {
            bail!("CUDA device {ordinal} does not exist ({count} present)");
        }
        let ctx = CudaContext::new(ordinal)
            .with_context(|| format!("creating a CUDA context on device {ordinal}"))?;
        // SAFETY: no allocation has been made through cudarc's tracked types yet (we never make any).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().context("creating a CUDA stream")?;
        let (major, minor) = ctx.compute_capability()?;
        let arch = nvrtc::arch_for(major, minor);
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let total_memory = ctx.total_mem()?;
        let sm_count =
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        // Compile (or fetch from the cache) every module, in parallel: NVRTC programs are
        // independent, and the big prompt-path modules take tens of seconds each.
        let compiled: Vec<Result<nvrtc::Compiled>> = std::thread::scope(|s| {
            let handles: Vec<_> = kernels::ALL
                .iter()
                .map(|k| s.spawn(|| nvrtc::compile(k, &arch, true)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow!("an NVRTC compile thread panicked")))
                })
                .collect()
        });
        let mut modules = HashMap::new();
        let mut modules_report = Vec::new();
        for (k, c) in kernels::ALL.iter().zip(compiled) {
            let c = c?;
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(c.cubin.clone()))
                .with_context(|| format!("loading the {} kernels (CUBIN for {arch})", k.name))?;
            modules.insert(k.name, module);
            modules_report.push(ModuleReport {
                name: k.name,
                cubin_bytes: c.cubin.len(),
                from_cache: c.from_cache,
                compile_seconds: c.seconds,
            });
        }
        Ok(Arc::new(Gpu {
            ctx,
            stream,
            ordinal,
            name,
            arch,
            total_memory,
            sm_count,
            modules_report,
            libraries: format!("driver: {driver}; nvrtc: {nvrtc_lib}"),
            modules,
            choices: Mutex::new(KernelChoices::default()),
            functions: Mutex::new(HashMap::new()),
        }))
    }

    /// Which kernel variants the launchers pick.
    pub fn choices(&self) -> KernelChoices {
        match self.choices.lock() {
            Ok(c) => *c,
            Err(poisoned) => *poisoned.into_inner(),
        }
    }

    /// Changes the kernel variants for launches built from now on (already captured graphs keep
    /// theirs).
    pub fn set_choices(&self, choices: KernelChoices) {
        match self.choices.lock() {
            Ok(mut c) => *c = choices,
            Err(poisoned) => *poisoned.into_inner() = choices,
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "cuda:{} ({}, {}, {} SMs)",
            self.ordinal, self.name, self.arch, self.sm_count
        )
    }

    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        let mut map = self
            .functions
            .lock()
            .map_err(|_| anyhow!("kernel table poisoned"))?;
        if let Some(f) = map.get(name) {
            return Ok(f.clone());
        }
        let module_name =
            module_of(name).ok_or_else(|| anyhow!("no kernel module provides {name}"))?;
        let module = self
            .modules
            .get(module_name)
            .ok_or_else(|| anyhow!("the {module_name} kernels are not loaded"))?;
        let f = module
            .load_function(name)
            .with_context(|| format!("kernel {name} not found in its module"))?;
        map.insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// The SM clock the device reports (its maximum), in MHz.
    pub fn clock_mhz(&self) -> Result<f64> {
        let khz = self
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)?;
        Ok(khz as f64 / 1e3)
    }

    /// How many blocks of `name` (with `block` threads and `smem` bytes of dynamic shared memory)
    /// fit on one SM at once (registers, shared memory, threads), at least 1.
    pub fn resident_blocks(&self, name: &str, block: u32, smem: u32) -> Result<usize> {
        self.bind()?; // the occupancy query needs the context current on this thread
        let f = self.function(name)?;
        allow_dynamic_smem(&f, name, smem)?;
        let n = f
            .occupancy_max_active_blocks_per_multiprocessor(block, smem as usize, None)
            .with_context(|| format!("occupancy of {name} (block {block}, smem {smem})"))?;
        Ok((n as usize).max(1))
    }

    /// Launch `name` with one parameter struct on the engine's stream.
    pub fn launch<P: Copy>(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        params: &P,
    ) -> Result<()> {
        let launch = Launch::new(self, name, grid, block, smem, params)?;
        launch.run(self)
    }

    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .context("binding the CUDA context")
    }

    /// Allocate `bytes` of device memory (synchronous cuMemAlloc: never inside a captured step).
    pub fn alloc(self: &Arc<Self>, bytes: usize) -> Result<DeviceBuffer> {
        self.bind()?;
        let bytes = bytes.max(256);
        // SAFETY: plain allocation; freed by DeviceBuffer::drop.
        let ptr = unsafe { cu::malloc_sync(bytes) }.map_err(|e| {
            let (free, total) = cu::mem_get_info().unwrap_or((0, 0));
            anyhow!(
                "out of GPU memory: asked for {:.2} GiB, {:.2} of {:.2} GiB free ({e})",
                bytes as f64 / (1u64 << 30) as f64,
                free as f64 / (1u64 << 30) as f64,
                total as f64 / (1u64 << 30) as f64
            )
        })?;
        Ok(DeviceBuffer {
            ptr: DPtr(ptr),
            bytes,
            gpu: self.clone(),
        })
    }

    /// Copy host → device, ordered on the stream. The source may be dropped when this returns
    /// (pageable memory is staged by the driver before the call returns).
    pub fn htod<T: Copy>(&self, dst: DPtr, src: &[T]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let bytes = std::mem::size_of_val(src);
        // SAFETY: dst points at ≥ bytes of device memory (callers carve regions of known size).
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst.0,
                src.as_ptr() as *const c_void,
                bytes,
                self.stream.cu_stream(),
            )
        }
        .result()
        .with_context(|| format!("copying {bytes} bytes to the GPU"))
    }

    /// Copy device → host and wait for it.
    pub fn dtoh<T: Copy>(&self, src: DPtr, dst: &mut [T]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let bytes = std::mem::size_of_val(dst);
        // SAFETY: src has ≥ bytes of device memory; dst is a live host slice of that size.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                dst.as_mut_ptr() as *mut c_void,
                src.0,
                bytes,
                self.stream.cu_stream(),
            )
        }
        .result()
        .with_context(|| format!("copying {bytes} bytes from the GPU"))?;
        self.sync()
    }

    pub fn dtod(&self, dst: DPtr, src: DPtr, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both regions have ≥ bytes (callers' invariant).
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst.0, src.0, bytes, self.stream.cu_stream()) }
            .result()
            .context("device-to-device copy")
    }

    pub fn memset_zero(&self, dst: DPtr, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: dst has ≥ bytes of device memory.
        unsafe { sys::cuMemsetD8Async(dst.0, 0, bytes, self.stream.cu_stream()) }
            .result()
            .context("memset")
    }

    /// Wait for all work on the stream; reports asynchronous kernel faults.
    pub fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| anyhow!("CUDA error while running kernels: {e}"))
    }

    /// (free, total) device memory in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        Ok(cu::mem_get_info()?)
    }
}

/// An owned device allocation.
pub struct DeviceBuffer {
    pub ptr: DPtr,
    pub bytes: usize,
    gpu: Arc<Gpu>,
}

impl DeviceBuffer {
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: allocated by cu::malloc_sync, freed once. Pending work that uses it has been
            // ordered before by the owner (sequences and arenas sync before they drop).
            let _ = unsafe { cu::free_sync(self.ptr.0) };
        }
    }
}

/// Kernels that use more than 48 KiB of shared memory (dynamic and static) must say so before they
/// are launched or their occupancy is asked.
fn allow_dynamic_smem(f: &CudaFunction, name: &str, smem: u32) -> Result<()> {
    // the opt-in is for more than 48 KiB in all, the kernel's static shared memory included
    let static_smem = f
        .shared_size_bytes()
        .with_context(|| format!("{name}: its static shared memory"))?;
    if smem as usize + static_smem.max(0) as usize > 48 * 1024 {
        f.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .with_context(|| format!("{name}: {smem} bytes of shared memory"))?;
    }
    Ok(())
}

/// One recorded kernel launch: everything cuLaunchKernel needs, parameter bytes included, so a
/// step can be run directly or captured into a graph and replayed.
#[derive(Clone)]
pub struct Launch {
    pub name: String,
    func: CudaFunction,
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub smem: u32,
    /// The parameter struct's bytes (8-aligned storage).
    params: Vec<u64>,
}

impl Launch {
    pub fn new<P: Copy>(
        gpu: &Gpu,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        params: &P,
    ) -> Result<Launch> {
        let func = gpu.function(name)?;
        allow_dynamic_smem(&func, name, smem)?;
        let size = std::mem::size_of::<P>();
        let mut words = vec![0u64; size.div_ceil(8)];
        // SAFETY: P is a plain #[repr(C)] struct of integers/floats (Copy); we copy its bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                params as *const P as *const u8,
                words.as_mut_ptr() as *mut u8,
                size,
            );
        }
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 || block == 0 {
            bail!("{name}: empty launch (grid {grid:?}, block {block})");
        }
        Ok(Launch {
            name: name.to_string(),
            func,
            grid,
            block,
            smem,
            params: words,
        })
    }

    /// Like `run`, with programmatic dependent launch allowed
    /// (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION): the kernel may start while the
    /// previous kernel in the stream still runs, so it must call `griddep_wait()` (common.cuh)
    /// before it reads or writes anything another kernel touches (graph.rs decides which).
    pub fn run_programmatic(&self, gpu: &Gpu) -> Result<()> {
        gpu.bind()?;
        let mut args = [self.params.as_ptr() as *mut c_void];
        // SAFETY: a zeroed CUlaunchAttribute is a valid plain C struct; id and value set below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: self.grid.0,
            gridDimY: self.grid.1,
            gridDimZ: self.grid.2,
            blockDimX: self.block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: self.smem,
            hStream: gpu.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: as in `run`; `config` and `attr` outlive the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.func.cu_function(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .with_context(|| {
            format!(
                "launching {} with programmatic dependent launch (grid {:?}, block {}, smem {})",
                self.name, self.grid, self.block, self.smem
            )
        })
    }

    pub fn run(&self, gpu: &Gpu) -> Result<()> {
        gpu.bind()?;
        let mut args = [self.params.as_ptr() as *mut c_void];
        // SAFETY: the function takes exactly one parameter struct whose bytes are `params` (the
        // launcher built them from the matching #[repr(C)] struct); every pointer inside it was
        // checked against its region's size by the launcher that made this Launch.
        unsafe {
            cu::launch_kernel(
                self.func.cu_function(),
                self.grid,
                (self.block, 1, 1),
                self.smem,
                gpu.stream.cu_stream(),
                &mut args,
            )
        }
        .with_context(|| {
            format!(
                "launching {} (grid {:?}, block {}, smem {})",
                self.name, self.grid, self.block, self.smem
            )
        })
    }
}

/// Page-locked host slots, mapped into the device's address space, that a kernel writes a small
/// result into (select.cu's slot pos & 1), each with an event: the host waits for one slot's step
/// while the next step stays queued behind it (two decode steps in flight), and nothing is queued
/// between the steps to copy the result out.
pub struct ReadbackSlots<T: Copy> {
    host: *mut T,
    device: DPtr,
    events: Vec<cudarc::driver::CudaEvent>,
    gpu: Arc<Gpu>,
}

// SAFETY: the host slots are only touched through &self/&mut self of the one owner (the backend,
// driven from one thread at a time), after the event of the step that wrote them has completed.
unsafe impl<T: Copy> Send for ReadbackSlots<T> {}

impl<T: Copy> ReadbackSlots<T> {
    pub fn new(gpu: &Arc<Gpu>, slots: usize) -> Result<ReadbackSlots<T>> {
        gpu.bind()?;
        let events = (0..slots)
            .map(|_| gpu.ctx.new_event(None))
            .collect::<Result<Vec<_>, _>>()
            .context("creating readback events")?;
        let bytes = slots * std::mem::size_of::<T>();
        // SAFETY: page-locked allocation (not write-combined: the host reads it), freed in drop.
        let host = unsafe { cu::malloc_host(bytes.max(1), sys::CU_MEMHOSTALLOC_DEVICEMAP) }
            .map_err(|e| {
                anyhow!("allocating {bytes} bytes of mapped page-locked host memory: {e}")
            })? as *mut T;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: host was allocated with DEVICEMAP just above.
        if let Err(e) =
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host as *mut c_void, 0) }
                .result()
        {
            // SAFETY: allocated above, not yet shared.
            let _ = unsafe { cu::free_host(host as *mut c_void) };
            bail!("mapping page-locked host memory into the device: {e}");
        }
        Ok(ReadbackSlots {
            host,
            device: DPtr(device),
            events,
            gpu: gpu.clone(),
        })
    }

    /// The slots' address for kernels.
    pub fn device_ptr(&self) -> DPtr {
        self.device
    }

    /// Mark `slot` as written by the work queued so far (record its event).
    pub fn record(&self, slot: usize) -> Result<()> {
        anyhow::ensure!(
            slot < self.events.len(),
            "readback slot {slot} out of range"
        );
        self.gpu.bind()?;
        self.events[slot]
            .record(&self.gpu.stream)
            .context("recording a readback event")
    }

    /// Wait for the work recorded for `slot` (and so for everything queued before it) and read it.
    pub fn wait(&self, slot: usize) -> Result<T> {
        anyhow::ensure!(
            slot < self.events.len(),
            "readback slot {slot} out of range"
        );
        self.events[slot]
            .synchronize()
            .map_err(|e| anyhow!("CUDA error while running kernels: {e}"))?;
        // SAFETY: the kernel that wrote this slot has completed (its writes to mapped host memory
        // are visible once the event is); nothing writes it until a later step is queued.
        Ok(unsafe { std::ptr::read_volatile(self.host.add(slot)) })
    }
}

impl<T: Copy> Drop for ReadbackSlots<T> {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // copies into the slots may still be queued: wait for them before the memory goes
            let _ = self.gpu.sync();
            // SAFETY: allocated by malloc_host in new(), freed once.
            let _ = unsafe { cu::free_host(self.host as *mut c_void) };
        }
    }
}
