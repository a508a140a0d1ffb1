//! GPU checks. Every test needs a CUDA GPU and is `#[ignore = "needs CUDA"]`: CI skips them;
//! scripts/gpu-parity.sh runs them on the GPU machine (`--ignored --test-threads=1 --nocapture`)
//! and gathers the `| …` rows they print into one table.
//!
//! kernels.rs: every kernel family against the CPU reference (calla-cpu) on fresh random inputs,
//! odd sizes and the real layer shapes. engine.rs: the whole engine against the CPU engine on every
//! committed fixture, at the real shapes, and against transformers at the real shapes.

#[path = "gpu/support.rs"]
mod support;

#[path = "gpu/kernels.rs"]
mod kernels;

#[path = "gpu/select.rs"]
mod select;

#[path = "gpu/engine.rs"]
mod engine;

#[path = "gpu/pipeline.rs"]
mod pipeline;

#[path = "gpu/dn_general.rs"]
mod dn_general;

#[path = "gpu/masked.rs"]
mod masked;

#[path = "gpu/snapshot.rs"]
mod snapshot;
