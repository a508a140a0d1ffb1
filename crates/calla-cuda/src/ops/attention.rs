//! Launcher for attention.cu: one launch per attention layer and decode step (q/k norm +
//! RoPE + KV append, split-KV attention with the split count chosen from the position on the
//! device, log-sum-exp merge + output gate in the last blocks to finish).

use anyhow::{ensure, Result};
use calla_model::ModelSpec;

use crate::runtime::gpu::{DPtr, Gpu, Launch};

/// Positions per tile of the split-KV kernel (attention.cu ATTN_TILE).
pub const TILE: usize = 32;

/// KV cache element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    Bf16,
    F32,
}

impl KvDtype {
    pub fn size(self) -> usize {
        match self {
            KvDtype::Bf16 => 2,
            KvDtype::F32 => 4,
        }
    }
    fn suffix(self) -> &'static str {
        match self {
            KvDtype::Bf16 => "bf16",
            KvDtype::F32 => "f32",
        }
    }
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct AttnDecodeParams {
    pub qg: u64,
    pub k: u64,
    pub v: u64,
    pub q_gain: u64,
    pub k_gain: u64,
    pub inv_freq: u64,
    pub cursor: u64,
    pub k_off: i64,
    pub v_off: i64,
    pub part_m: u64,
    pub part_l: u64,
    pub part_acc: u64,
    pub tickets: u64,
    pub y: u64,
    pub hq: i32,
    pub hkv: i32,
    pub dh: i32,
    pub rot: i32,
    pub max_ctx: i32,
    pub nsplit: i32,
    pub min_tiles: i32,
    pub gated: i32,
    pub eps: f32,
    pub scale: f32,
}

/// Device buffers of one attention layer's decode step.
pub struct AttentionIo {
    /// q_proj output [Hq, (2)Dh], k [Hkv·Dh], v [Hkv·Dh]
    pub qg: DPtr,
    pub k: DPtr,
    pub v: DPtr,
    pub q_gain: DPtr,
    pub k_gain: DPtr,
    pub inv_freq: DPtr,
    pub cursor: DPtr,
    /// byte offsets of K and V caches [Hkv, max_ctx, Dh] in the sequence state
    pub k_off: usize,
    pub v_off: usize,
    /// scratch: partials m, l [Hq, nsplit]; acc [Hq, nsplit, Dh]
    pub part_m: DPtr,
    pub part_l: DPtr,
    pub part_acc: DPtr,
    /// scratch: merge tickets, u32 [ticket_words(Hkv, nsplit)], zeroed once at allocation (the
    /// kernel leaves them zero)
    pub tickets: DPtr,
    /// grid splits (num_splits(max_ctx)); the kernel uses as many as the position needs
    pub nsplit: usize,
    /// output [Hq·Dh] (gated)
    pub y: DPtr,
}

/// Splits merged per first-level group (attention.cu ATTN_GROUP).
pub const MERGE_GROUP: usize = 16;
/// Most inputs of one merge (attention.cu ATTN_MAX_MERGE).
const MAX_MERGE: usize = 64;
/// Most grid splits: the groups of one kv head fit one merge.
pub const MAX_SPLITS: usize = MERGE_GROUP * MAX_MERGE;

pub fn check_dims(spec: &ModelSpec) -> Result<()> {
    let (hq, hkv, dh) = (
        spec.num_attention_heads,
        spec.num_key_value_heads,
        spec.head_dim,
    );
    ensure!(
        dh % 32 == 0 && dh <= 256,
        "head_dim {dh}: the cuda attention kernels support multiples of 32 up to 256"
    );
    ensure!(
        hkv > 0 && hq % hkv == 0 && hq / hkv <= 16,
        "{hq} query heads over {hkv} KV heads: groups of ≤ 16 supported"
    );
    ensure!(
        spec.rotary_dim.is_multiple_of(2) && spec.rotary_dim <= dh,
        "rotary_dim {} must be even and ≤ head_dim",
        spec.rotary_dim
    );
    Ok(())
}

/// Threads per block of attn_decode_bf16 (attention.cu ATTN_WARPS warps, whatever G).
const BF16_THREADS: usize = 256;
/// K/V tiles in the cp.async ring of attn_decode_bf16 (attention.cu ATTN_STAGES).
const BF16_STAGES: usize = 3;
/// Score partial sums per (position, head) in attn_decode_bf16 (attention.cu ATTN_KGROUPS).
const BF16_KGROUPS: usize = 4;
/// f32 per row of the score partials [kgroup][head][position] (attention.cu ATTN_RED_PITCH).
const BF16_RED_PITCH: usize = 40;

/// Threads per block of attn_decode: 32 per q head of a group (f32 cache), 256 (bf16 cache).
pub fn decode_threads(spec: &ModelSpec, kv: KvDtype) -> usize {
    match kv {
        KvDtype::F32 => 32 * (spec.num_attention_heads / spec.num_key_value_heads),
        KvDtype::Bf16 => BF16_THREADS,
    }
}

/// Dynamic shared memory of attn_decode (layouts in attention.cu).
/// f32: q [G, Dh] f32, k and v of position p [Dh] f32 each, then the K and V tiles (reused for the
/// merge weights [G, MAX_MERGE] f32 once the tiles are done).
/// bf16: the K/V ring [STAGES, 2, TILE, Dh + 8] bf16, q rows and the k row [G + 1, Dh] f32 sharing
/// bytes with the score partials [KGROUPS, 16, RED_PITCH] f32, K[p] and V[p] [2, Dh] bf16 (P and
/// the softmax state live in registers; the merge uses no shared memory).
pub fn decode_smem(spec: &ModelSpec, kv: KvDtype) -> usize {
    let g = spec.num_attention_heads / spec.num_key_value_heads;
    let dh = spec.head_dim;
    match kv {
        KvDtype::F32 => {
            let pitch = dh + 4;
            let tiles = TILE * pitch * 4 + TILE * dh * 4;
            g * dh * 4 + 2 * dh * 4 + tiles.max(g * MAX_MERGE * 4)
        }
        KvDtype::Bf16 => {
            let ring = BF16_STAGES * 2 * TILE * (dh + 8) * 2;
            let rows = ((g + 1) * dh).max(BF16_KGROUPS * 16 * BF16_RED_PITCH) * 4;
            ring + rows + 2 * dh * 2
        }
    }
}

/// u32 words of merge tickets for `hkv` KV heads and `nsplit` grid splits: per kv head one for
/// the groups and one per group (the ticketed merge), then (8-byte aligned) a u64 arrival counter per
/// kv head (the barrier merge, attention.cu attn_bar_counter).
pub fn ticket_words(hkv: usize, nsplit: usize) -> usize {
    (hkv * (1 + nsplit.div_ceil(MERGE_GROUP))).next_multiple_of(2) + 2 * hkv
}

/// Live splits the barrier merge takes (attention.cu ATTN_BAR_MAX_SPLITS).
const BARRIER_MAX_SPLITS: usize = 128;

/// The barrier-merge kernel for `spec`'s dims: a copy compiled for head dim 256 with 8 q heads per
/// kv head (Qwen3.5/3.6; its index arithmetic folds to shifts), else the one that reads them from
/// its parameters (always without `compiled_copies`).
pub fn barrier_kernel(compiled_copies: bool, spec: &ModelSpec) -> &'static str {
    let g = spec.num_attention_heads / spec.num_key_value_heads;
    if spec.head_dim == 256 && g == 8 && compiled_copies {
        "attn_decode_bf16_bar_dh256_g8"
    } else {
        "attn_decode_bf16_bar"
    }
}

/// Whether the bf16 cache's splits merge after a barrier among the splits of a kv head
/// (attn_decode_bf16_bar, the default) or through two ticketed levels (attn_decode_bf16: without
/// `KernelChoices::co_resident_grids`, or when not every block of the grid fits on the GPU at once:
/// the barrier's blocks wait for each other). The check assumes calla's one stream has the SMs to
/// itself, as it does under time-slicing with other processes; where SMs are partitioned among
/// processes (MPS, `--shared-gpu`), the ticketed merge needs no co-residency.
pub fn barrier_merge(gpu: &Gpu, spec: &ModelSpec, nsplit: usize) -> Result<bool> {
    let choices = gpu.choices();
    if !choices.co_resident_grids || nsplit > BARRIER_MAX_SPLITS {
        return Ok(false);
    }
    let kv = KvDtype::Bf16;
    let per_sm = gpu.resident_blocks(
        barrier_kernel(choices.compiled_copies, spec),
        decode_threads(spec, kv) as u32,
        decode_smem(spec, kv) as u32,
    )?;
    Ok(per_sm * gpu.sm_count as usize >= nsplit * spec.num_key_value_heads)
}

/// One launch per attention layer: norm + RoPE + KV append, split-KV attention, merge + gate.
pub fn decode(
    gpu: &Gpu,
    spec: &ModelSpec,
    kv: KvDtype,
    max_ctx: usize,
    io: &AttentionIo,
) -> Result<Vec<Launch>> {
    check_dims(spec)?;
    ensure!(
        (1..=MAX_SPLITS).contains(&io.nsplit),
        "attention: {} KV splits (attn_decode supports 1..={MAX_SPLITS})",
        io.nsplit
    );
    let (hq, hkv, dh) = (
        spec.num_attention_heads,
        spec.num_key_value_heads,
        spec.head_dim,
    );
    let params = AttnDecodeParams {
        qg: io.qg.0,
        k: io.k.0,
        v: io.v.0,
        q_gain: io.q_gain.0,
        k_gain: io.k_gain.0,
        inv_freq: io.inv_freq.0,
        cursor: io.cursor.0,
        k_off: io.k_off as i64,
        v_off: io.v_off as i64,
        part_m: io.part_m.0,
        part_l: io.part_l.0,
        part_acc: io.part_acc.0,
        tickets: io.tickets.0,
        y: io.y.0,
        hq: hq as i32,
        hkv: hkv as i32,
        dh: dh as i32,
        rot: spec.rotary_dim as i32,
        max_ctx: max_ctx as i32,
        nsplit: io.nsplit as i32,
        min_tiles: gpu.choices().attn_min_tiles_per_split.max(1) as i32,
        gated: spec.attn_output_gate as i32,
        eps: spec.rms_norm_eps,
        scale: (dh as f32).powf(-0.5),
    };
    let name = match kv {
        KvDtype::Bf16 if barrier_merge(gpu, spec, io.nsplit)? => {
            barrier_kernel(gpu.choices().compiled_copies, spec).to_string()
        }
        _ => format!("attn_decode_{}", kv.suffix()),
    };
    Ok(vec![Launch::new(
        gpu,
        &name,
        (io.nsplit as u32, hkv as u32, 1),
        decode_threads(spec, kv) as u32,
        decode_smem(spec, kv) as u32,
        &params,
    )?])
}

/// Grid splits for a cache of `max_ctx` positions: enough blocks to fill the GPU at long context,
/// never more than the context has tiles.
pub fn num_splits(max_ctx: usize) -> usize {
    max_ctx.div_ceil(TILE).clamp(1, 128)
}

/// Live splits at position `pos` with `nsplit` grid splits (attention.cu attn_live_splits): the
/// pos + 1 positions are T tiles; min(nsplit, ⌈T / min_tiles⌉) ≤ T splits.
pub fn live_splits(pos: usize, nsplit: usize, min_tiles: usize) -> usize {
    let tiles = (pos + 1).div_ceil(TILE);
    nsplit.min(tiles.div_ceil(min_tiles.max(1)))
}

/// Positions [t0, t1) of live split `split` of `splits` at position `pos`: tiles
/// [⌊s·T/S⌋, ⌊(s+1)·T/S⌋), the last one cut at pos + 1.
pub fn split_range(pos: usize, split: usize, splits: usize) -> (usize, usize) {
    let tiles = (pos + 1).div_ceil(TILE);
    let t0 = split * tiles / splits * TILE;
    let t1 = ((split + 1) * tiles / splits * TILE).min(pos + 1);
    (t0, t1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every position: the live splits cover [0, pos] exactly, in order, none empty, within one
    /// tile of each other, and all grid splits are live once there are enough tiles.
    #[test]
    fn live_splits_cover_every_position_once() {
        for nsplit in [1, 3, 16, 17, 128] {
            for min_tiles in [1, 2, 4] {
                for pos in 0..(nsplit * TILE * min_tiles * 3) {
                    let splits = live_splits(pos, nsplit, min_tiles);
                    assert!((1..=nsplit).contains(&splits), "pos {pos} nsplit {nsplit}");
                    let mut next = 0;
                    let (mut shortest, mut longest) = (usize::MAX, 0);
                    for s in 0..splits {
                        let (t0, t1) = split_range(pos, s, splits);
                        assert_eq!(t0, next, "pos {pos} split {s}: gap or overlap");
                        assert!(t1 > t0, "pos {pos} split {s} of {splits} empty");
                        assert_eq!(t0 % TILE, 0);
                        next = t1;
                        if s + 1 < splits {
                            shortest = shortest.min(t1 - t0);
                            longest = longest.max(t1 - t0);
                        }
                    }
                    assert_eq!(next, pos + 1, "pos {pos}: not covered");
                    assert!(splits < 2 || longest - shortest <= TILE);
                    if (pos + 1).div_ceil(TILE) >= nsplit * min_tiles {
                        assert_eq!(splits, nsplit, "pos {pos}: not every split live");
                    }
                }
            }
        }
    }

    #[test]
    fn merge_fits_every_grid() {
        assert!(MAX_SPLITS.div_ceil(MERGE_GROUP) <= MAX_MERGE);
        assert!(MERGE_GROUP <= MAX_MERGE);
        assert!(num_splits(usize::MAX / 2) <= MAX_SPLITS);
    }
}
