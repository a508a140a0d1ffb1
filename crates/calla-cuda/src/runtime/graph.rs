//! Capturing a fixed chain of launches as a CUDA graph and replaying it.
//!
//! A step's launches read everything that changes between replays (token, position, the sequence's
//! state address, sampling settings, the draw counter) from device memory, so one captured graph
//! serves every step of every sequence.

use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use cudarc::driver::{sys, CudaGraph};

use crate::runtime::gpu::{Gpu, Launch};

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
        for (i, l) in launches.iter().enumerate() {
            let run = if i > 0 && programmatic_launch(&l.name) {
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
/// predecessor's last blocks run, and wait in `griddep_wait()`): by default for the K = 2048
/// tensor-core matvecs only (Qwen3.6-35B-A3B's in-projections and lm_head), which follow the MoE down
/// kernel, whose one block per SM leaves room for theirs: step −16 µs at 4K (docs/experiments.md).
/// Other widths are not measured and launch as before. For every kernel it was slower each way it
/// was built (+343 µs), and per kernel
/// class it was neutral (gate/up, attention) or slower (down +112 µs, the out-projections +55…+63,
/// DeltaNet +15), each where the kernel before fills the SMs' registers.
const PROGRAMMATIC_BY_DEFAULT: [&str; 1] = ["matvec_tc_q4_c2"];

/// Whether the launch of `kernel` in the decode graph is programmatic (see above).
pub fn programmatic_launch(kernel: &str) -> bool {
    if !waits_for_predecessor(kernel) {
        return false;
    }
    PROGRAMMATIC_BY_DEFAULT
        .iter()
        .any(|p| kernel.starts_with(p))
}

/// Kernels that call `griddep_wait()` (common.cuh) before touching anything an earlier kernel
/// wrote or reads, on every path: only these may start before their predecessor finishes.
pub fn waits_for_predecessor(kernel: &str) -> bool {
    const READY: [&str; 8] = [
        "matvec_",
        "moe_router_",
        "moe_gate_up_",
        "moe_down_",
        "deltanet_decode_",
        "attn_prep_",
        "attn_decode_",
        "attn_combine",
    ];
    READY.iter().any(|p| kernel.starts_with(p))
}
