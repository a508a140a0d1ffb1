//! Launcher for matvec.cu: decode matrix-vector products (with the fused input RMSNorm and
//! residual-add epilogue) and the embedding gather.

use anyhow::{ensure, Result};

use crate::ops::weights::{DevMatrix, Format, MatrixRef};
pub use crate::runtime::choices::DotEngine;
use crate::runtime::gpu::{DPtr, Gpu, Launch};

pub const THREADS: u32 = 256;
const MAX_SEGMENTS: usize = 4;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct MatvecSegment {
    pub m: MatrixRef,
    pub out: u64,
    pub rows: i32,
    pub pad: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct MatvecParams {
    pub x: u64,
    pub norm_gain: u64,
    pub seg: [MatvecSegment; MAX_SEGMENTS],
    pub k: i32,
    pub nseg: i32,
    pub group_size: i32,
    pub eps: f32,
    pub accumulate: i32,
    pub total_rows: i32,
}

/// Floats of an activation vector of `n` in the padded shared-memory layout (common.cuh `xpad_len`:
/// 4 pad floats after every 32).
pub fn xpad_len(n: usize) -> usize {
    n + n.div_ceil(32) * 4
}

/// Shared memory of a kernel that holds x̂ [k] (padded) and Σx̂ per 16-byte unit of `format`.
pub fn input_smem_bytes(k: usize, format: Format) -> u32 {
    ((xpad_len(k) + k / format.per_unit()) * 4) as u32
}

/// What common.cuh `stage_input` needs: whole 8-float chunks, and with the norm every chunk of x in
/// one batch of STAGE_BATCH chunks per thread (K ≤ 8,192 at 256 threads).
pub fn check_staged_input(k: usize, normalised: bool) -> Result<()> {
    ensure!(
        k.is_multiple_of(8),
        "decode kernels need input widths divisible by 8, got {k}"
    );
    ensure!(
        !normalised || k <= 8 * STAGE_BATCH * THREADS as usize,
        "the fused RMSNorm supports widths up to {}, got {k}",
        8 * STAGE_BATCH * THREADS as usize
    );
    Ok(())
}

/// common.cuh STAGE_BATCH: 8-float chunks of the input each thread loads at once.
const STAGE_BATCH: usize = 4;

/// The dot-product engine's shape (common.cuh `rows_dot`) for rows of `units` 16-byte units read by
/// `width` lanes: "_r4" (4 rows × 2 units in flight per lane) when a lane has at most 2 units per
/// row, else "_r2" (2 rows × 4 units). Returns (kernel suffix, rows per lane group).
pub fn row_shape(units: usize, width: usize) -> (&'static str, usize) {
    if units <= 2 * width {
        ("_r4", 4)
    } else {
        ("_r2", 2)
    }
}

/// Lanes that share one row (common.cuh `lanes_per_row`).
pub fn lanes_per_row(units: usize) -> usize {
    let mut w = 1;
    while w * 2 <= units && w < 32 {
        w *= 2;
    }
    w
}

/// `out_i (+)= W_i · x̂` for every segment (W_i, out_i), where x̂ = rmsnorm₀(x)·gain when `norm` is
/// given. Segments that share a format go into one launch (at most 4 per launch).
/// Shapes: x [K]; W_i [rows_i, K]; out_i [rows_i] (f32).
pub fn matvec(
    gpu: &Gpu,
    x: DPtr,
    k: usize,
    norm: Option<(DPtr, f32)>,
    segments: &[(DevMatrix, DPtr)],
    accumulate: bool,
) -> Result<Vec<Launch>> {
    matvec_on(
        gpu,
        x,
        k,
        norm,
        segments,
        accumulate,
        gpu.choices().dot_engine,
    )
}

/// [`matvec`] on a chosen dot-product engine (q4 launches the tensor-core kernel cannot take fall
/// back to the CUDA-core one).
pub fn matvec_on(
    gpu: &Gpu,
    x: DPtr,
    k: usize,
    norm: Option<(DPtr, f32)>,
    segments: &[(DevMatrix, DPtr)],
    accumulate: bool,
    engine: DotEngine,
) -> Result<Vec<Launch>> {
    let mut launches = Vec::new();
    let mut remaining: Vec<&(DevMatrix, DPtr)> = segments.iter().collect();
    while !remaining.is_empty() {
        let first = remaining[0].0;
        let key = (first.format, first.group_size);
        let (same, rest): (Vec<_>, Vec<_>) = remaining
            .iter()
            .partition(|(m, _)| (m.format, m.group_size) == key);
        remaining = rest;
        for chunk in same.chunks(MAX_SEGMENTS) {
            launches.push(matvec_one(gpu, x, k, norm, chunk, accumulate, engine)?);
        }
    }
    Ok(launches)
}

/// The fused routing's producer side (matvec_tc.cu RouteTail): the router's rows, applied by the
/// out-projection's blocks to the rows of h they finish (`matvec_tc_*route_q4_c*`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteTail {
    pub router: MatrixRef,
    pub gain: u64,
    pub shared_gate: u64,
    pub acc: u64,
    pub e: i32,
    pub bits: i32,
    pub group_size: i32,
    pub pad: i32,
}

/// The parameters of the tensor-core matvec with the DeltaNet head norm (matvec_tc.cu
/// TcMatvecParams, matvec_tc_headnorm_q4_c*): matvec.cu's and the [`HeadNorm`].
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct TcMatvecParams {
    pub m: MatvecParams,
    pub head_parts: u64,
    pub pad0: u64,
    pub head_dim: i32,
    pub nparts: i32,
    /// the fused routing (`matvec_tc_*route_q4_c*`), else unused
    pub route: RouteTail,
}

/// The end of the Gated DeltaNet's output norm, applied to the out-projection's input: the input
/// holds w·o·silu(z) for heads of `head_dim`, followed by `nparts` sums of o² per head
/// (deltanet.cu's `_parts` kernels); x̂ = x/√(Σ parts / head_dim + eps), applied per chunk of 128
/// columns to the chunk's products.
#[derive(Debug, Clone, Copy)]
pub struct HeadNorm {
    pub head_dim: usize,
    pub nparts: usize,
    pub eps: f32,
}

/// Whether [`matvec_head_norm`] takes an out-projection `m` of `k` inputs: the tensor-core kernel
/// (q4 in groups of 64, K 1024·{1, 2, 4}) and heads of a multiple of 128 (a chunk inside one head)
/// with ≤ 8 parts.
pub fn head_norm_applies(engine: DotEngine, k: usize, norm: HeadNorm, m: &DevMatrix) -> bool {
    engine == DotEngine::TensorCores
        && tensor_core_format(m)
        && m.cols == k
        && matches!(k, 1024 | 2048 | 4096)
        && norm.head_dim.is_multiple_of(128)
        && k.is_multiple_of(norm.head_dim)
        && (1..=8).contains(&norm.nparts)
}

/// `y (+)= W·x̂` on the tensor cores with the [`HeadNorm`] (see [`head_norm_applies`]); x holds `k`
/// values and then the parts. With `route`, y is the residual h (accumulate) and the blocks also run
/// the MoE router over it (the fused routing, moe.rs `fused_route_tail`).
pub fn matvec_head_norm(
    gpu: &Gpu,
    x: DPtr,
    k: usize,
    norm: HeadNorm,
    segment: &(DevMatrix, DPtr),
    accumulate: bool,
    route: Option<&RouteTail>,
) -> Result<Launch> {
    ensure!(
        head_norm_applies(DotEngine::TensorCores, k, norm, &segment.0),
        "matvec with the head norm: the tensor-core kernel does not take K {k}, {norm:?}, {:?}",
        segment.0.format
    );
    let mut p = params(x, k, None, &[segment], accumulate)?;
    p.eps = norm.eps;
    let tp = TcMatvecParams {
        m: p,
        head_parts: x.offset(4 * k).0,
        pad0: 0,
        head_dim: norm.head_dim as i32,
        nparts: norm.nparts as i32,
        route: route.copied().unwrap_or_default(),
    };
    ensure!(
        route.is_none() || accumulate,
        "the fused routing runs on the residual (an accumulating product)"
    );
    let name = match route {
        Some(route) => routed_kernel(gpu.choices().compiled_copies, k, route, Some(&norm)),
        None => format!("matvec_tc_headnorm_q4_c{}", k / 1024),
    };
    tensor_core_launch(gpu, &name, k, p.total_rows as usize, &tp)
}

/// `h += W·x` on the tensor cores, with the MoE router run over the new h by the same blocks (the
/// fused routing, moe.rs `fused_route_tail`, which checks that it applies).
pub fn matvec_routed(
    gpu: &Gpu,
    x: DPtr,
    k: usize,
    segment: &(DevMatrix, DPtr),
    route: &RouteTail,
) -> Result<Launch> {
    ensure!(
        tensor_core_chunks(k, &[segment]).is_some(),
        "fused routing: the tensor-core matvec does not take K {k}, {:?}",
        segment.0.format
    );
    let tp = TcMatvecParams {
        m: params(x, k, None, &[segment], true)?,
        route: *route,
        ..Default::default()
    };
    let name = routed_kernel(gpu.choices().compiled_copies, k, route, None);
    tensor_core_launch(gpu, &name, k, tp.m.total_rows as usize, &tp)
}

/// The tensor-core kernel for a product of K = 1024·`chunks` over stacked segments of `rows` rows: a
/// copy with the segments compiled in where they match, K 2048: Qwen3.5/3.6's in-projections (the
/// DeltaNet's q|k|v, z, b, a and attention's q+gate, k, v) and any one segment of whole tiles of 16
/// rows (lm_head) — matvec_tc.cu `matvec_tc_q4_c2_s*` — else the one that searches its
/// parameters for a row's segment (always without `compiled_copies`).
pub fn fixed_rows_kernel(compiled_copies: bool, chunks: usize, rows: &[usize]) -> String {
    let layout = match (chunks, rows) {
        (2, [8192, 4096, 32, 32]) => Some("_s8192_4096_32_32"),
        (2, [8192, 512, 512]) => Some("_s8192_512_512"),
        (2, [r]) if r % 16 == 0 => Some("_s1"),
        _ => None,
    };
    match layout {
        Some(l) if compiled_copies => {
            format!("matvec_tc_q4_c{chunks}{l}")
        }
        _ => format!("matvec_tc_q4_c{chunks}"),
    }
}

/// The parameters of lm_head with plain greedy selection fused in (matvec_tc.cu GreedyHeadParams).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct GreedyHeadParams {
    pub m: MatvecParams,
    pub out: crate::ops::select::TokenOut,
    /// f32 max, f32 Σexp, f32 best value, i32 best id, each [select::GREEDY_HEAD_MAX_BLOCKS]
    pub partials: u64,
    /// u32 ticket, zero between launches
    pub counter: u64,
}

/// lm_head (`out = W·rmsnorm(x)·gain`, one segment) that also chooses the next token by plain greedy
/// and publishes it into `token` as the selection kernel would, with `selector`'s partials and ticket
/// (matvec_tc.cu `matvec_tc_q4_c2_s1_greedy`), where that kernel takes the matrix: q4 on the tensor cores, K 2048,
/// rows a multiple of 16, with `KernelChoices::greedy_head`. Else None, and the
/// decode step keeps the selection launch for plain greedy as for every other mode.
pub fn head_greedy(
    gpu: &Gpu,
    x: DPtr,
    k: usize,
    norm: Option<(DPtr, f32)>,
    head: &(DevMatrix, DPtr),
    selector: &crate::ops::select::Selector,
    token: crate::ops::select::TokenOut,
) -> Result<Option<Launch>> {
    let segments = [head];
    let choices = gpu.choices();
    if choices.dot_engine != DotEngine::TensorCores
        || tensor_core_chunks(k, &segments) != Some(2)
        || fixed_rows_kernel(choices.compiled_copies, 2, &[head.0.rows]) != "matvec_tc_q4_c2_s1"
        || !choices.greedy_head
    {
        return Ok(None);
    }
    let p = GreedyHeadParams {
        m: params(x, k, norm, &segments, false)?,
        out: token,
        partials: selector.greedy_partials.0,
        counter: selector.greedy_counter.0,
    };
    let l = tensor_core_launch(gpu, "matvec_tc_q4_c2_s1_greedy", k, head.0.rows, &p)?;
    ensure!(
        l.grid.0 as usize <= crate::ops::select::GREEDY_HEAD_MAX_BLOCKS,
        "lm_head with greedy fused in: {} blocks, at most {}",
        l.grid.0,
        crate::ops::select::GREEDY_HEAD_MAX_BLOCKS
    );
    Ok(Some(l))
}

/// The out-projection kernel with the fused routing `route` over K `k` inputs, with the DeltaNet head
/// norm `norm` or without: a copy compiled for Qwen3.5/3.6 where it applies (K 4096, a q8 router over
/// 256 experts, heads of 128 with 8 parts: matvec_tc.cu `*_e256_q8*`), else the one that
/// reads them from its parameters (always without `compiled_copies`).
pub fn routed_kernel(
    compiled_copies: bool,
    k: usize,
    route: &RouteTail,
    norm: Option<&HeadNorm>,
) -> String {
    let kind = if norm.is_some() {
        "headnorm_route"
    } else {
        "route"
    };
    let qwen35 = k == 4096
        && route.e == 256
        && route.bits == 8
        && norm.is_none_or(|n| n.head_dim == 128 && n.nparts == 8);
    if qwen35 && compiled_copies {
        let hd = if norm.is_some() { "_hd128" } else { "" };
        format!("matvec_tc_{kind}_q4_c4_e256_q8{hd}")
    } else {
        format!("matvec_tc_{kind}_q4_c{}", k / 1024)
    }
}

/// The dynamic shared memory of a matvec_tc.cu matvec: x̂'s B fragments (hi, lo) and Σx̂ per
/// group.
fn tensor_core_smem(k: usize) -> usize {
    4 * k + k / 16
}

/// A matvec_tc.cu matvec launch: 16-row tiles over a grid of at most the blocks that fit at
/// once (each block pays the x̂ prologue once).
fn tensor_core_launch<P: Copy>(
    gpu: &Gpu,
    name: &str,
    k: usize,
    rows: usize,
    params: &P,
) -> Result<Launch> {
    let smem = tensor_core_smem(k) as u32;
    let resident = gpu.resident_blocks(name, THREADS, smem)?;
    let grid = rows
        .div_ceil(16)
        .min(gpu.sm_count as usize * resident)
        .max(1);
    Launch::new(gpu, name, (grid as u32, 1, 1), THREADS, smem, params)
}

/// Whether matvec_tc.cu reads `m`: q4 codes in groups of 64 with bf16 (scale, bias).
pub fn tensor_core_format(m: &DevMatrix) -> bool {
    m.format == Format::Q4 && m.group_size == 64 && !m.param_f32
}

/// The tensor-core kernel's chunks of 128 columns per warp (K / 1024), when it takes `segments`.
fn tensor_core_chunks(k: usize, segments: &[&(DevMatrix, DPtr)]) -> Option<usize> {
    let takes = segments.iter().all(|(m, _)| tensor_core_format(m));
    match (takes, k) {
        (true, 1024 | 2048 | 4096) => Some(k / 1024),
        _ => None,
    }
}

fn matvec_one(
    gpu: &Gpu,
    x: DPtr,
    k: usize,
    norm: Option<(DPtr, f32)>,
    segments: &[&(DevMatrix, DPtr)],
    accumulate: bool,
    engine: DotEngine,
) -> Result<Launch> {
    let p = params(x, k, norm, segments, accumulate)?;
    if engine == DotEngine::TensorCores {
        if let Some(chunks) = tensor_core_chunks(k, segments) {
            let rows: Vec<usize> = segments.iter().map(|(m, _)| m.rows).collect();
            let name = fixed_rows_kernel(gpu.choices().compiled_copies, chunks, &rows);
            return tensor_core_launch(gpu, &name, k, p.total_rows as usize, &p);
        }
    }
    let format = segments[0].0.format;
    let total = p.total_rows as usize;
    let units = k / format.per_unit();
    let width = lanes_per_row(units);
    let (shape, rows_per_group) = row_shape(units, width);
    let rows_per_pass = THREADS as usize / width * rows_per_group;
    let name = format!("matvec_{}{shape}", format.suffix());
    let smem = input_smem_bytes(k, format);
    // One wave: every block resident at once, grid-striding over the rows, so each block pays the
    // x̂ prologue once however many rows it takes.
    let resident = gpu.resident_blocks(&name, THREADS, smem)?;
    let grid = total
        .div_ceil(rows_per_pass)
        .min(gpu.sm_count as usize * resident)
        .max(1);
    Launch::new(gpu, &name, (grid as u32, 1, 1), THREADS, smem, &p)
}

/// The parameters of one matvec launch over `segments` (one format, at most 4).
pub fn params(
    x: DPtr,
    k: usize,
    norm: Option<(DPtr, f32)>,
    segments: &[&(DevMatrix, DPtr)],
    accumulate: bool,
) -> Result<MatvecParams> {
    ensure!(
        !segments.is_empty() && segments.len() <= MAX_SEGMENTS,
        "matvec: {} segments in one launch (1 to {MAX_SEGMENTS})",
        segments.len()
    );
    let format = segments[0].0.format;
    check_staged_input(k, norm.is_some())?;
    let mut p = MatvecParams {
        x: x.0,
        norm_gain: norm.map(|n| n.0 .0).unwrap_or(0),
        k: k as i32,
        nseg: segments.len() as i32,
        group_size: segments[0].0.group_size.max(1) as i32,
        eps: norm.map(|n| n.1).unwrap_or(0.0),
        accumulate: accumulate as i32,
        ..Default::default()
    };
    let mut total = 0usize;
    for (i, (m, out)) in segments.iter().enumerate() {
        ensure!(
            m.cols == k,
            "matvec: matrix has {} columns, input has {k}",
            m.cols
        );
        ensure!(m.format == format, "matvec: mixed formats in one launch");
        p.seg[i] = MatvecSegment {
            m: m.kref(),
            out: out.0,
            rows: m.rows as i32,
            pad: 0,
        };
        total += m.rows;
    }
    p.total_rows = total as i32;
    Ok(p)
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct EmbedParams {
    pub m: MatrixRef,
    pub cursor: u64,
    pub out: u64,
    pub d: i32,
    pub group_size: i32,
    pub rows: i32,
    pub pad: i32,
}

/// `out = E[cursor.token]` (dequantised to f32). out [D].
pub fn embed(gpu: &Gpu, table: &DevMatrix, cursor: DPtr, out: DPtr) -> Result<Launch> {
    let p = EmbedParams {
        m: table.kref(),
        cursor: cursor.0,
        out: out.0,
        d: table.cols as i32,
        group_size: table.group_size.max(1) as i32,
        rows: table.rows as i32,
        pad: 0,
    };
    Launch::new(
        gpu,
        &format!("embed_{}", table.format.suffix()),
        (1, 1, 1),
        256,
        0,
        &p,
    )
}

/// The weight formats every launcher instantiates (for tests and the format check at load).
pub const FORMATS: [Format; 5] = [
    Format::F32,
    Format::Bf16,
    Format::F16,
    Format::Q4,
    Format::Q8,
];
