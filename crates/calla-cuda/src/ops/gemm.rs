//! Launchers for gemm.cu: prompt-sized products `Y = X·Wᵀ` on the tensor cores, the
//! RMSNorm → bf16-planes row kernel that feeds them, and the embedding of T tokens.
//!
//! Activations enter a GEMM as bf16 [`Planes`]: `hi = bf16(x)` and, in [`Precision::Split`],
//! `lo = bf16(x − hi)`. Fast precision multiplies hi·hi (bf16 products, f32 accumulation); split
//! adds lo(x)·hi(w) + hi(x)·lo(w), which is f32-accurate to ~1e-6 relative — the precision of the
//! f32 CPU reference, for f32 fixture models, the router, and parity tests. q4 weights in groups of
//! 64 take a split kernel that never rounds them: hi(x)·q + lo(x)·q on the exact codes, scaled per
//! k-tile (gemm.cu, XQ); on Hopper (sm_90a) the same product runs on warpgroup MMA (wgmma,
//! [`TensorCores`]).
//!
//! Legend: M rows (tokens or sorted expert slots), N output features (W rows), K input features,
//! E experts.

use anyhow::{bail, ensure, Result};

use crate::ops::prompt_precision::{Product, PromptPrecision};
use crate::ops::weights::{DevMatrix, Format, MatrixRef};
use crate::runtime::gpu::{DPtr, Gpu, Launch};

pub const BM: usize = 128;
pub const BN: usize = 128;
pub const BK: usize = 64;
pub const THREADS: u32 = 256;
const TILE_BYTES: usize = BM * BK * 2;

pub use crate::ops::prompt_precision::Precision;

/// Activation planes `[rows, ld]` (u16 each): bf16 `hi` and `lo` for fast and split consumers,
/// and one f16 plane for half consumers; absent planes are NULL. A plane read by one consumer only
/// may have its f16 plane share the lo plane's memory: its producer then gets
/// [`Planes::for_precision`], which keeps only what that consumer reads.
#[derive(Debug, Clone, Copy)]
pub struct Planes {
    pub hi: DPtr,
    pub lo: DPtr,
    pub ld: usize,
    pub f16: DPtr,
}

impl Planes {
    pub fn new(hi: DPtr, lo: DPtr, ld: usize) -> Planes {
        Planes {
            hi,
            lo,
            ld,
            f16: DPtr::NULL,
        }
    }
    /// The same planes with an f16 plane.
    pub fn with_f16(self, f16: DPtr) -> Planes {
        Planes { f16, ..self }
    }
    /// The same planes without the lo and f16 planes (a fast-precision consumer).
    pub fn hi_only(self) -> Planes {
        Planes {
            lo: DPtr::NULL,
            f16: DPtr::NULL,
            ..self
        }
    }
    /// The planes a consumer of `precision` reads (the others NULL).
    pub fn for_precision(self, precision: Precision) -> Planes {
        self.for_readers([precision])
    }
    /// The planes consumers of `precisions` read together, for their producer to write: hi for
    /// fast and split, lo for split, f16 for half.
    pub fn for_readers(self, precisions: impl IntoIterator<Item = Precision>) -> Planes {
        let (mut hi, mut lo, mut f16) = (false, false, false);
        for p in precisions {
            match p {
                Precision::Fast => hi = true,
                Precision::Split => (hi, lo) = (true, true),
                Precision::Half => f16 = true,
            }
        }
        debug_assert!(
            !(lo && f16 && self.lo == self.f16),
            "lo and f16 share bytes: one reader only"
        );
        let keep = |on: bool, q: DPtr| if on { q } else { DPtr::NULL };
        Planes {
            hi: keep(hi, self.hi),
            lo: keep(lo, self.lo),
            ld: self.ld,
            f16: keep(f16, self.f16),
        }
    }
}

/// Where a GEMM's result goes.
#[derive(Debug, Clone, Copy)]
pub enum GemmOut {
    /// f32 `[M, ld]`, stored or added to (`accumulate`: the residual add).
    F32 {
        ptr: DPtr,
        ld: usize,
        accumulate: bool,
    },
    /// planes (the next GEMM's input): bf16 hi (+ lo), or the f16 plane alone when hi is NULL.
    Planes(Planes),
}

/// Device-built tile list of a grouped (all-experts) GEMM: `tile_map[i] = {expert, m0, m1, 0}`
/// for i < *tile_count; W rows of expert e start at `e · expert_rows`.
#[derive(Debug, Clone, Copy)]
pub struct Grouped {
    pub tile_map: DPtr,
    pub tile_count: DPtr,
    /// grid size: an upper bound of the tile count (⌈M/BM⌉ + E)
    pub max_tiles: usize,
    pub expert_rows: usize,
}

/// One GEMM: `out[m, n] = (row_scale[m] ·) Σ_k A[a_row(m), k] · W[w_row(n), k]`.
#[derive(Debug, Clone, Copy)]
pub struct Gemm<'a> {
    pub a: Planes,
    /// i32 `[M]`: A row of each output row (MoE gather), or None (row m).
    pub gather: Option<DPtr>,
    /// rows (for grouped: the total of sorted slots; the tiles say which rows exist)
    pub m: usize,
    pub w: &'a DevMatrix,
    /// W rows used (per expert when grouped); with `swiglu` these are 2·N_out rows, gate then up
    pub n: usize,
    pub swiglu: bool,
    pub out: GemmOut,
    pub row_scale: Option<DPtr>,
    pub precision: Precision,
    pub grouped: Option<Grouped>,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct GemmParams {
    pub a_hi: u64,
    pub a_lo: u64,
    pub a_rows: u64,
    pub w: MatrixRef,
    pub out: u64,
    pub out_lo: u64,
    pub row_scale: u64,
    pub tile_map: u64,
    pub tile_count: u64,
    pub expert_rows: i64,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub lda: i32,
    pub ldo: i32,
    pub group_size: i32,
    pub mode: i32,
    pub swiglu: i32,
}

const OUT_F32: i32 = 0;
const OUT_F32_ACC: i32 = 1;
const OUT_BF16: i32 = 2;
const OUT_F16: i32 = 3;

/// Which tensor-core instructions run the q4 (group 64) split products: Hopper's warpgroup MMA
/// (`gemm_q4_wgx_split`, sm_90a only) or the portable `mma.sync` kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorCores {
    MmaSync,
    Wgmma,
}

impl TensorCores {
    /// wgmma where the device has it (sm_90a), else the portable mma.sync kernels.
    pub fn for_gpu(gpu: &Gpu) -> TensorCores {
        if gpu.arch == "sm_90a" {
            TensorCores::Wgmma
        } else {
            TensorCores::MmaSync
        }
    }
}

/// The wgmma kernel's pipeline (gemm.cu, `WGX_*`): 4 stages of A hi, A lo, B with its ones row,
/// (scale, bias), and the codes and parameters as copied; 2 consumer warpgroups and a producer.
const WGX_STAGES: usize = 4;
const WGX_THREADS: u32 = 384;
fn wgx_smem_bytes() -> usize {
    let stage = 2 * TILE_BYTES + (BN + 8) * 128 + BN * 8 + BN * 40; // + the codes and params as stored
    WGX_STAGES * stage + 1024 + WGX_STAGES * 16 // + the realignment to 1024 bytes + the mbarriers
}

/// The half-precision kernel's pipeline (gemm.cu, `WGH_*`): 8 stages of the X tile (128 tokens ×
/// 64 f16), the codes of 256 W rows and their (scale, bias); 2 consumer warpgroups and a producer.
const WGH_STAGES: usize = 8;
const WGH_BN: usize = 256;
fn wgh_smem_bytes() -> usize {
    let stage = BM * BK * 2 + WGH_BN * 32 + WGH_BN * 8;
    WGH_STAGES * stage + 1024 + WGH_STAGES * 16
}

/// `precision` where `w` and the tensor cores can run it: half needs q4 in groups of 64 on wgmma,
/// and becomes split elsewhere (the same accuracy class or better).
pub fn runnable(precision: Precision, cores: TensorCores, w: &DevMatrix) -> Precision {
    match precision {
        Precision::Half
            if !(w.format == Format::Q4 && w.group_size == BK && cores == TensorCores::Wgmma) =>
        {
            Precision::Split
        }
        p => p,
    }
}

/// The precision `policy` calls for `product` over `w`, as this device can run it.
pub fn precision_for(
    gpu: &Gpu,
    policy: &PromptPrecision,
    product: Product,
    w: &DevMatrix,
) -> Precision {
    runnable(
        policy.resolve(product, w.format),
        TensorCores::for_gpu(gpu),
        w,
    )
}

/// Dynamic shared memory of one GEMM block (the `mma.sync` kernels).
pub fn smem_bytes(format: Format, precision: Precision) -> usize {
    let split = precision == Precision::Split;
    let planes = 2 + split as usize + (split && format != Format::Bf16) as usize;
    2 * planes * TILE_BYTES
}

/// Output columns of a GEMM (N, or N/2 under SwiGLU).
pub fn out_cols(n: usize, swiglu: bool) -> usize {
    if swiglu {
        n / 2
    } else {
        n
    }
}

pub fn gemm(gpu: &Gpu, g: &Gemm) -> Result<Launch> {
    gemm_on(gpu, g, TensorCores::for_gpu(gpu))
}

/// [`gemm`] on the given tensor-core instructions (tests compare the two).
pub fn gemm_on(gpu: &Gpu, g: &Gemm, cores: TensorCores) -> Result<Launch> {
    let w = g.w;
    let k = w.cols;
    ensure!(
        k.is_multiple_of(BK),
        "gemm: K = {k} must be a multiple of {BK}"
    );
    let half = g.precision == Precision::Half;
    ensure!(
        g.a.ld >= k,
        "gemm: activations of row stride {} for K = {k}",
        g.a.ld
    );
    ensure!(
        !(if half { g.a.f16 } else { g.a.hi }).is_null(),
        "gemm: no {} activation plane for the {:?} product over the {}×{k} matrix",
        if half { "f16" } else { "bf16" },
        g.precision,
        w.rows
    );
    ensure!(
        g.precision != Precision::Split || !g.a.lo.is_null(),
        "gemm: split precision needs the activations' lo plane"
    );
    ensure!(
        !half || runnable(Precision::Half, cores, w) == Precision::Half,
        "gemm: half precision needs q4 weights in groups of {BK} and wgmma (sm_90a), not {:?} in groups of {}",
        w.format,
        w.group_size
    );
    ensure!(
        g.n > 0 && g.m > 0,
        "gemm: empty product ({} × {})",
        g.m,
        g.n
    );
    ensure!(
        !g.swiglu || g.n.is_multiple_of(2),
        "gemm: SwiGLU needs gate and up rows (N = {} is odd)",
        g.n
    );
    if w.format.is_affine() {
        ensure!(
            w.group_size.is_multiple_of(w.format.per_unit()),
            "gemm: group size {} too small",
            w.group_size
        );
    }
    match &g.grouped {
        Some(gr) => ensure!(
            gr.expert_rows >= g.n && w.rows.is_multiple_of(gr.expert_rows) && gr.max_tiles > 0,
            "gemm: {} W rows do not split into experts of {} rows (N = {})",
            w.rows,
            gr.expert_rows,
            g.n
        ),
        None => ensure!(g.n <= w.rows, "gemm: N = {} but W has {} rows", g.n, w.rows),
    }
    let cols = out_cols(g.n, g.swiglu);
    let (out, out_lo, ldo, mode) = match g.out {
        GemmOut::F32 {
            ptr,
            ld,
            accumulate,
        } => (
            ptr,
            DPtr::NULL,
            ld,
            if accumulate { OUT_F32_ACC } else { OUT_F32 },
        ),
        GemmOut::Planes(p) if p.hi.is_null() => (p.f16, DPtr::NULL, p.ld, OUT_F16),
        GemmOut::Planes(p) => (p.hi, p.lo, p.ld, OUT_BF16),
    };
    ensure!(
        ldo >= cols && !out.is_null(),
        "gemm: output row stride {ldo} < {cols} columns"
    );
    if g.m > i32::MAX as usize || ldo > i32::MAX as usize || g.a.ld > i32::MAX as usize {
        bail!(
            "gemm: {} rows of stride {} / {} do not fit 32-bit indices",
            g.m,
            g.a.ld,
            ldo
        );
    }
    let p = GemmParams {
        a_hi: if half { g.a.f16.0 } else { g.a.hi.0 },
        a_lo: if g.precision == Precision::Split {
            g.a.lo.0
        } else {
            0
        },
        a_rows: g.gather.map(|d| d.0).unwrap_or(0),
        w: w.kref(),
        out: out.0,
        out_lo: out_lo.0,
        row_scale: g.row_scale.map(|d| d.0).unwrap_or(0),
        tile_map: g.grouped.map(|gr| gr.tile_map.0).unwrap_or(0),
        tile_count: g.grouped.map(|gr| gr.tile_count.0).unwrap_or(0),
        expert_rows: g.grouped.map(|gr| gr.expert_rows as i64).unwrap_or(0),
        m: g.m as i32,
        n: g.n as i32,
        k: k as i32,
        lda: g.a.ld as i32,
        ldo: ldo as i32,
        group_size: w.group_size.max(1) as i32,
        mode,
        swiglu: g.swiglu as i32,
    };
    let grid_y = match &g.grouped {
        Some(gr) => gr.max_tiles,
        None => g.m.div_ceil(BM),
    };
    ensure!(
        grid_y <= 65535,
        "gemm: {grid_y} row tiles exceed the grid limit (split the prompt)"
    );
    // q4 in split precision with groups of BK: the exact-code kernels (gemm.cu, XQ): the codes are
    // exact in bf16 and each k-tile is one group, so scale and bias apply per k-tile; on wgmma
    // where the device has it. (Fast keeps the dequantising kernel: measured faster.)
    let q4_groups_of_bk = w.format == Format::Q4 && w.group_size == BK;
    let split = g.precision == Precision::Split;
    let mut grid = (g.n.div_ceil(BN) as u32, grid_y as u32, 1);
    let (name, threads, smem) = if half {
        let tiles = g.n.div_ceil(WGH_BN) * grid_y;
        grid = (tiles.min(gpu.sm_count.max(1) as usize) as u32, 1, 1);
        ("gemm_q4_wgh".to_string(), WGX_THREADS, wgh_smem_bytes())
    } else if q4_groups_of_bk && split && cores == TensorCores::Wgmma {
        // persistent: one block per SM, each looping over tiles (the grouped tile count is read on
        // the device)
        let tiles = g.n.div_ceil(BN) * grid_y;
        grid = (tiles.min(gpu.sm_count.max(1) as usize) as u32, 1, 1);
        (
            "gemm_q4_wgx_split".to_string(),
            WGX_THREADS,
            wgx_smem_bytes(),
        )
    } else if q4_groups_of_bk && split {
        (
            "gemm_q4_splitx".to_string(),
            THREADS,
            smem_bytes(w.format, g.precision),
        )
    } else {
        (
            format!("gemm_{}_{}", w.format.suffix(), g.precision.suffix()),
            THREADS,
            smem_bytes(w.format, g.precision),
        )
    };
    // SAFETY (of the eventual launch): every pointer above was checked non-null where required and
    // the kernel bounds rows by M (or the tile's m1) and columns by N; strides checked above.
    Launch::new(gpu, &name, grid, threads, smem as u32, &p)
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RowNormParams {
    pub x: u64,
    pub gain: u64,
    pub hi: u64,
    pub lo: u64,
    pub t: i32,
    pub d: i32,
    pub eps: f32,
    pub pad: i32,
    pub f16: u64,
}

/// `planes[t] = rmsnorm₀(x[t])·gain` (gain = 1 + w), or a plain f32 → planes conversion without a
/// gain. x `[T, D]` f32 → planes `[T, D]`.
pub fn rmsnorm_planes(
    gpu: &Gpu,
    x: DPtr,
    gain: Option<DPtr>,
    eps: f32,
    t: usize,
    d: usize,
    out: Planes,
) -> Result<Launch> {
    ensure!(
        out.ld == d,
        "rmsnorm_planes: output stride {} for D = {d}",
        out.ld
    );
    let p = RowNormParams {
        x: x.0,
        gain: gain.map(|g| g.0).unwrap_or(0),
        hi: out.hi.0,
        lo: out.lo.0,
        t: t as i32,
        d: d as i32,
        eps,
        pad: 0,
        f16: out.f16.0,
    };
    Launch::new(gpu, "gemm_rmsnorm_planes", (t as u32, 1, 1), 256, 0, &p)
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct EmbedRowsParams {
    pub m: MatrixRef,
    pub tokens: u64,
    pub out: u64,
    pub t: i32,
    pub d: i32,
    pub group_size: i32,
    pub rows: i32,
}

/// `h[t] = E[tokens[t]]` (dequantised): tokens i32 `[T]` on the device → h `[T, D]` f32.
pub fn embed_rows(gpu: &Gpu, table: &DevMatrix, tokens: DPtr, t: usize, h: DPtr) -> Result<Launch> {
    let p = EmbedRowsParams {
        m: table.kref(),
        tokens: tokens.0,
        out: h.0,
        t: t as i32,
        d: table.cols as i32,
        group_size: table.group_size.max(1) as i32,
        rows: table.rows as i32,
    };
    Launch::new(
        gpu,
        &format!("gemm_embed_rows_{}", table.format.suffix()),
        (t as u32, 1, 1),
        256,
        0,
        &p,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn producers_write_exactly_the_planes_their_readers_read() {
        let all = Planes::new(DPtr(0x1000), DPtr(0x2000), 64).with_f16(DPtr(0x3000));
        let kept = |p: Planes| (!p.hi.is_null(), !p.lo.is_null(), !p.f16.is_null());
        assert_eq!(
            kept(all.for_precision(Precision::Fast)),
            (true, false, false)
        );
        assert_eq!(
            kept(all.for_precision(Precision::Split)),
            (true, true, false)
        );
        assert_eq!(
            kept(all.for_precision(Precision::Half)),
            (false, false, true)
        );
        // the MoE's x̂ in half: the router and the shared gate split, the experts half
        let both = all.for_readers([Precision::Split, Precision::Half, Precision::Half]);
        assert_eq!(kept(both), (true, true, true));
        assert_eq!(
            (both.hi.0, both.lo.0, both.f16.0, both.ld),
            (0x1000, 0x2000, 0x3000, 64)
        );
        assert_eq!(
            kept(all.for_readers([Precision::Fast, Precision::Half])),
            (true, false, true)
        );
        assert_eq!(kept(all.for_readers([])), (false, false, false));
    }
}
