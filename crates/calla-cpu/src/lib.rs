//! The CPU reference engine: plain f32 arithmetic over the stored weight formats (f32, bf16, f16, MLX
//! affine 4/8-bit), one file per layer kind, readable next to transformers' `modeling_qwen3_5_moe.py`.
//!
//! `forward.rs` is the layer loop; `attention.rs`, `deltanet.rs`, `moe.rs`, `norm.rs` the blocks;
//! `linear.rs` + `simd.rs` the weight products; `sequence.rs` the per-sequence state; `backend.rs` the
//! `calla_engine::Backend` implementation. Work is spread over threads with rayon; every reduction has
//! a fixed order, so results do not depend on the thread count or scheduling.

// `x % n == 0` stays: `is_multiple_of` is newer than the workspace's rust-version (1.85).
#![allow(clippy::manual_is_multiple_of)]

pub mod attention;
pub mod backend;
pub mod deltanet;
pub mod forward;
pub mod linear;
pub mod moe;
pub mod norm;
pub mod random;
pub mod sequence;
mod simd;

pub use backend::CpuBackend;
pub use forward::{Logits, Model, Trace};
pub use sequence::CpuSequence;
