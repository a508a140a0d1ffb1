//! Capturing a fixed chain of launches as a CUDA graph and replaying it.
//!
//! A step's launches read everything that changes between replays (token, position, the sequence's
//! state address, sampling settings, the draw counter) from device memory, so one captured graph
//! serves every step of every sequence.

use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use cudarc::driver::{sys, CudaGraph};

use crate::gpu::{Gpu, Launch};

pub struct StepGraph {
    graph: CudaGraph,
    pub launches: usize,
}

// SAFETY: a CudaGraph is not internally synchronised; a StepGraph is owned by one backend, which
// the engine drives from one thread at a time (Backend is Send, not Sync; replays take &mut self).
unsafe impl Send for StepGraph {}

impl StepGraph {
    /// Capture `launches` (in order) into an instantiated graph. Nothing may allocate meanwhile.
    pub fn capture(gpu: &Arc<Gpu>, launches: &[Launch]) -> Result<StepGraph> {
        gpu.bind()?;
        gpu.sync()?;
        gpu.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .context("beginning graph capture")?;
        let mut failed = None;
        let pdl = programmatic_launch_enabled();
        for (i, l) in launches.iter().enumerate() {
            let run = if pdl && i > 0 && waits_for_predecessor(&l.name) && programmatic_for(&l.name)
            {
                l.run_programmatic(gpu)
            } else {
                l.run(gpu)
            };
            if let Err(e) = run {
                failed = Some(e);
                break;
            }
        }
        let graph = gpu
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .context("ending graph capture")?;
        if let Some(e) = failed {
            return Err(e.context("a launch failed during graph capture"));
        }
        let graph = graph.ok_or_else(|| anyhow!("graph capture produced no graph"))?;
        graph.upload().context("uploading the graph")?;
        Ok(StepGraph {
            graph,
            launches: launches.len(),
        })
    }

    pub fn replay(&self, gpu: &Gpu) -> Result<()> {
        gpu.bind()?;
        self.graph.launch().context("launching the step graph")
    }
}

/// Programmatic dependent launch inside the decode graph (a kernel's blocks may start while its
/// predecessor's last blocks run). Off unless CALLA_PDL=1: measured slower both ways it was built
/// (docs/performance.md: triggered at entry 442 → 372 tok/s, session 5; triggered after the wait,
/// common.cuh griddep_enter, 480 → 457, session 7).
pub fn programmatic_launch_enabled() -> bool {
    std::env::var("CALLA_PDL").is_ok_and(|v| v == "1")
}

/// Lab: CALLA_PDL_ONLY=prefix[,prefix…] (with CALLA_PDL=1) launches only the kernels whose names
/// start with one of them programmatically.
fn programmatic_for(kernel: &str) -> bool {
    match std::env::var("CALLA_PDL_ONLY") {
        Ok(list) => list
            .split(',')
            .any(|p| !p.is_empty() && kernel.starts_with(p)),
        Err(_) => true,
    }
}

/// Kernels that call `griddep_wait()` (common.cuh) before touching anything an earlier kernel
/// wrote or reads, on every path: only these may start before their predecessor finishes.
pub fn waits_for_predecessor(kernel: &str) -> bool {
    const READY: [&str; 10] = [
        "matvec_",
        "moe_router_",
        "moe_gate_up_",
        "moe_down_",
        "deltanet_decode_",
        "attn_prep_",
        "attn_decode_",
        "attn_combine",
        "stream_chain_link", // the chain lab (tests/gpu/stream_floor.rs)
        "stream_chain_bulk",
    ];
    READY.iter().any(|p| kernel.starts_with(p))
}
