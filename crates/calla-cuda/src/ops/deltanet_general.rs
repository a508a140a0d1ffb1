//! Launchers for deltanet_general.cu: the Gated DeltaNet for head dims the compiled kernels
//! do not cover, so that every checkpoint the CPU engine runs also runs on CUDA.
//!
//! - Decode: deltanet.cu's kernels are compiled for Dk = 32·KPL (KPL 1, 2, 4, 8) and Dv ≤ 256; any
//!   other Dk or Dv (1 to [`MAX_DIM`]) takes `dngen_decode` (one block per value head, the gated
//!   norm in the block) or `dngen_decode_parts` (8 blocks per head and the norm's Σo² parts, for the
//!   out-projection's head-norm prologue) — see [`decode_is_general`].
//! - Prompt: deltanet_prefill.cu's chunked kernels need Dk ≤ 128, Dv ≤ 256 and both multiples of 4;
//!   prompts of other dims run token by token through the decode chain ([`prefill_is_general`],
//!   engine/backend/prompt.rs). (A token-by-token prompt scan kernel failed the engine parity at
//!   Dk 18, Dk 256 and Dv 320 on the H200 and was not kept: docs/experiments.md.)
//!
//! The kernels read every dim from their parameters (one small module, compiled with the others
//! and cached).

use anyhow::{ensure, Result};
use calla_model::ModelSpec;

use crate::ops::deltanet::{self, DeltaNetIo};
use crate::runtime::gpu::{Gpu, Launch};

/// Largest key or value head dim of the general kernels (prefill_dn_conv's tile of 64 rows of
/// max(Dk, Dv) + 1 floats must fit in shared memory).
pub const MAX_DIM: usize = 512;
const THREADS: u32 = 256;

/// Whether `spec`'s DeltaNet head dims are outside what deltanet.cu's kernels are compiled for
/// (Dk ∈ {32, 64, 128, 256}, Dv ≤ 256): then the decode step runs the general kernels.
pub fn decode_is_general(spec: &ModelSpec) -> bool {
    !matches!(spec.linear_key_head_dim, 32 | 64 | 128 | 256) || spec.linear_value_head_dim > 256
}

/// Whether prompts must run token by token through the decode chain: the chunked prompt kernels
/// take Dk ≤ 128 and Dv ≤ 256, both multiples of 4 (deltanet_prefill::check_dims).
pub fn prefill_is_general(spec: &ModelSpec) -> bool {
    let (dk, dv) = (spec.linear_key_head_dim, spec.linear_value_head_dim);
    !(dk <= 128 && dv <= 256 && dk.is_multiple_of(4) && dv.is_multiple_of(4))
}

/// The head dims every DeltaNet kernel path of this engine takes (the general kernels' range).
pub fn check_head_dims(dk: usize, dv: usize) -> Result<()> {
    ensure!(
        (1..=MAX_DIM).contains(&dk) && (1..=MAX_DIM).contains(&dv),
        "linear_key_head_dim {dk}, linear_value_head_dim {dv}: the cuda DeltaNet kernels support \
         head dims 1 to {MAX_DIM} (compiled fast copies for Dk 32, 64, 128 or 256 with Dv ≤ 256)"
    );
    Ok(())
}

/// Dynamic shared memory of the decode kernels: q, k [Dk], v, o [Dv], 64 floats of reductions.
fn decode_smem(spec: &ModelSpec) -> u32 {
    ((2 * spec.linear_key_head_dim + 2 * spec.linear_value_head_dim + 64) * 4) as u32
}

/// The decode step with the gated norm in the kernel (what `deltanet_decode_kplN` computes), one
/// block per value head.
pub fn decode(gpu: &Gpu, spec: &ModelSpec, io: &DeltaNetIo) -> Result<Launch> {
    deltanet::check_dims(spec)?;
    let p = deltanet::params(spec, io);
    Launch::new(
        gpu,
        "dngen_decode",
        (spec.linear_num_value_heads as u32, 1, 1),
        THREADS,
        decode_smem(spec),
        &p,
    )
}

/// The decode step leaving w·o·silu(z) in `io.y` and after it the [`deltanet::SPLIT`] blocks'
/// Σo² parts per head (what `deltanet_decode_kplN_split8_parts` leaves).
pub fn decode_parts(gpu: &Gpu, spec: &ModelSpec, io: &DeltaNetIo) -> Result<Launch> {
    deltanet::check_dims(spec)?;
    let p = deltanet::params(spec, io);
    Launch::new(
        gpu,
        "dngen_decode_parts",
        (spec.linear_num_value_heads as u32 * deltanet::SPLIT, 1, 1),
        THREADS,
        decode_smem(spec),
        &p,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(dk: usize, dv: usize) -> ModelSpec {
        let mut s = calla_model::synthetic::preset("tiny").unwrap();
        s.linear_key_head_dim = dk;
        s.linear_value_head_dim = dv;
        s
    }

    #[test]
    fn the_family_dims_keep_the_compiled_kernels() {
        for (dk, dv) in [
            (32, 32),
            (64, 48),
            (128, 128),
            (256, 200),
            (256, 256),
            (32, 6),
        ] {
            assert!(!decode_is_general(&spec(dk, dv)), "decode {dk} {dv}");
        }
        for (dk, dv) in [(32, 32), (128, 128), (64, 48), (32, 36), (16, 16), (24, 20)] {
            assert!(!prefill_is_general(&spec(dk, dv)), "prefill {dk} {dv}");
        }
    }

    #[test]
    fn other_dims_take_the_general_kernels() {
        for (dk, dv) in [
            (16, 16),
            (20, 24),
            (24, 32),
            (48, 48),
            (96, 96),
            (128, 320),
            (18, 30),
        ] {
            assert!(decode_is_general(&spec(dk, dv)), "decode {dk} {dv}");
            assert!(check_head_dims(dk, dv).is_ok());
            assert!(deltanet::check_dims(&spec(dk, dv)).is_ok(), "{dk} {dv}");
        }
        for (dk, dv) in [(256, 128), (18, 32), (32, 30), (96, 320)] {
            assert!(prefill_is_general(&spec(dk, dv)), "prefill {dk} {dv}");
        }
        let err = deltanet::check_dims(&spec(600, 64))
            .unwrap_err()
            .to_string();
        assert!(err.contains("linear_key_head_dim 600"), "{err}");
        assert!(deltanet::check_dims(&spec(64, 0)).is_err());
    }

    /// The names the launchers ask for are kernels of the module `gpu::module_of` maps them to.
    #[test]
    fn the_launched_kernels_exist() {
        let src = crate::runtime::kernels::DELTANET_GENERAL.source;
        for name in ["dngen_decode", "dngen_decode_parts"] {
            let def = format!(" {name}(const ");
            assert!(
                src.lines()
                    .any(|l| l.starts_with("extern \"C\" __global__") && l.contains(&def)),
                "deltanet_general.cu defines no kernel {name}"
            );
        }
    }

    #[test]
    fn scan_parameters_match_the_kernel() {}
}
