//! Launcher for moe.cu: router + top-k on the device, routed and shared gate/up, down with
//! the weighted combine and the residual add. Also the dense SwiGLU MLP (one "shared" slot).

use anyhow::{ensure, Result};

use crate::ops::matvec::tensor_core_format;
use crate::ops::weights::Format;
use crate::ops::weights::{DevMatrix, MatrixRef};
use crate::runtime::choices::{DotEngine, KernelChoices, RouterPlacement};
use crate::runtime::gpu::{DPtr, Gpu, Launch};

pub const THREADS: u32 = 256;
pub const MAX_EXPERTS: usize = 1024;
pub const MAX_ACTIVE: usize = 32;
/// Router rows per lane group (moe.cu ROUTER_ROWS).
const ROUTER_ROWS: usize = 2;
/// Output rows per warp in the down kernel (moe.cu DOWN_ROWS).
const DOWN_ROWS: usize = 2;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RouterParams {
    pub h: u64,
    pub norm_gain: u64,
    pub router: MatrixRef,
    pub shared_gate: u64,
    pub xn: u64,
    pub logits: u64,
    pub topk_ids: u64,
    pub topk_w: u64,
    pub shared_w: u64,
    pub counter: u64,
    pub d: i32,
    pub e: i32,
    pub a: i32,
    pub norm_topk: i32,
    pub group_size: i32,
    pub eps: f32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct GateUpParams {
    pub x: u64,
    pub norm_gain: u64,
    pub experts: MatrixRef,
    pub shared: MatrixRef,
    pub topk_ids: u64,
    pub act: u64,
    pub d: i32,
    pub i: i32,
    pub is: i32,
    pub a: i32,
    pub group_size: i32,
    pub act_stride: i32,
    pub slot_offset: i32,
    pub eps: f32,
}

/// Where a router selection goes (common.cuh RouteParams).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteParams {
    pub logits: u64,
    pub topk_ids: u64,
    pub topk_w: u64,
    pub shared_w: u64,
    pub e: i32,
    pub a: i32,
    pub norm_topk: i32,
    pub shared_gate: i32,
    /// 1: `logits` are the fused routing's accumulators, normalised by their Σh² (`d`, `eps`)
    pub fixed: i32,
    pub d: i32,
    pub eps: f32,
    pub pad: i32,
}

/// Accumulator copies of the fused routing (common.cuh ROUTE_COPIES; fewer copies would leave the
/// other copies at zero). The down kernel clears them all on every layer.
pub const ROUTE_COPIES: usize = 4;

/// i64 words of the fused routing's accumulators for `e` experts (common.cuh route_acc_stride):
/// per copy, E logits, the shared-expert gate, Σh².
pub fn route_acc_words(e: usize) -> usize {
    ROUTE_COPIES * (e + 2).next_multiple_of(16)
}

pub use crate::ops::matvec::RouteTail;

/// The tensor-core gate/up's parameters (moe_tc.cu TcGateUpParams): with `route.logits` set,
/// every block selects the top-k itself and the router runs without its ticket.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct TcGateUpParams {
    pub g: GateUpParams,
    pub route: RouteParams,
    /// the down launch's routed and shared matrices (asked of L2 once the experts are selected), or
    /// zero
    pub down_experts: MatrixRef,
    pub down_shared: MatrixRef,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DownParams {
    pub act: u64,
    pub experts: MatrixRef,
    pub shared: MatrixRef,
    pub topk_ids: u64,
    pub topk_w: u64,
    pub shared_w: u64,
    pub h: u64,
    pub d: i32,
    pub i: i32,
    pub is: i32,
    pub a: i32,
    pub group_size: i32,
    pub act_stride: i32,
    pub slot_begin: i32,
    pub slot_end: i32,
    /// the fused routing's accumulators, zeroed by this launch (or 0), and their i64 words
    pub route_acc: u64,
    pub route_acc_len: i32,
    pub pad: i32,
}

/// Device buffers of one MoE (or dense MLP) step.
pub struct MoeIo {
    /// residual stream [D] (read, then += the block's output)
    pub h: DPtr,
    /// post-attention norm gain [D]
    pub norm_gain: DPtr,
    pub eps: f32,
    /// scratch: x̂ [D], logits [E + 1], top ids [A] i32, weights [A], shared weight [1], ticket u32,
    /// act [A + 1, act_stride]
    pub xn: DPtr,
    pub logits: DPtr,
    pub topk_ids: DPtr,
    pub topk_w: DPtr,
    pub shared_w: DPtr,
    pub counter: DPtr,
    pub act: DPtr,
    pub act_stride: usize,
    /// a device 1.0 (the dense MLP's slot weight)
    pub one: DPtr,
}

/// Routed experts: router [E, D], gate/up [E·2I, D], down [E·D, I].
pub struct MoeWeightsRef<'a> {
    pub router: &'a DevMatrix,
    pub gate_up: &'a DevMatrix,
    pub down: &'a DevMatrix,
    pub experts: usize,
    pub top_k: usize,
    pub norm_topk: bool,
    /// shared expert [2Is, D], [D, Is]
    pub shared: Option<(&'a DevMatrix, &'a DevMatrix)>,
    /// sigmoid gate of the shared expert [D] f32
    pub shared_gate: Option<DPtr>,
}

#[allow(clippy::too_many_arguments)]
fn gate_up_launch(
    gpu: &Gpu,
    io: &MoeIo,
    x: DPtr,
    norm: bool,
    routed: Option<(&DevMatrix, usize, usize)>,
    shared: Option<&DevMatrix>,
    slots: (usize, usize),
    engine: DotEngine,
    route: Option<RouteParams>,
    down: (MatrixRef, MatrixRef),
) -> Result<Launch> {
    let fmt = routed.map(|r| r.0).or(shared).expect("a slot").format;
    let d = routed
        .map(|r| r.0.cols)
        .or(shared.map(|s| s.cols))
        .unwrap_or(0);
    crate::ops::matvec::check_staged_input(d, norm)?;
    let (i, a) = routed.map(|r| (r.1, r.2)).unwrap_or((0, 0));
    let is = shared.map(|s| s.rows / 2).unwrap_or(0);
    let p = GateUpParams {
        x: x.0,
        norm_gain: if norm { io.norm_gain.0 } else { 0 },
        experts: routed.map(|r| r.0.kref()).unwrap_or_default(),
        shared: shared.map(|s| s.kref()).unwrap_or_default(),
        topk_ids: io.topk_ids.0,
        act: io.act.0,
        d: d as i32,
        i: i as i32,
        is: is as i32,
        a: a as i32,
        group_size: routed
            .map(|r| r.0)
            .or(shared)
            .map(|m| m.group_size.max(1))
            .unwrap_or(1) as i32,
        act_stride: io.act_stride as i32,
        slot_offset: slots.0 as i32,
        eps: io.eps,
    };
    let nslots = slots.1 - slots.0;
    let n = i.max(is);
    if tensor_core_gate_up(engine, d, routed.map(|r| r.0), shared) {
        // moe_tc.cu: tiles of 8 (gate, up) row pairs, spread over a grid of about the
        // blocks that fit at once
        let name = gate_up_kernel(gpu.choices().compiled_copies, d, i, is, a, route.as_ref());
        let smem = (4 * d + d / 16) as u32;
        let resident = gpu.sm_count as usize * gpu.resident_blocks(&name, THREADS, smem)?;
        let tiles = n.div_ceil(8) * nslots;
        let grid_x = (tiles.min(resident) / nslots).max(1);
        let tp = TcGateUpParams {
            g: p,
            route: route.unwrap_or_default(),
            down_experts: down.0,
            down_shared: down.1,
        };
        return Launch::new(
            gpu,
            &name,
            (grid_x as u32, nslots as u32, 1),
            THREADS,
            smem,
            &tp,
        );
    }
    ensure!(
        route.is_none(),
        "moe gate/up: only the tensor-core kernel selects the experts itself"
    );
    let width = crate::ops::matvec::lanes_per_row(d / fmt.per_unit());
    // a lane group takes two (gate, up) row pairs
    let pairs_per_pass = THREADS as usize / width * 2;
    let grid_x = n.div_ceil(pairs_per_pass).max(1);
    Launch::new(
        gpu,
        &format!("moe_gate_up_{}", fmt.suffix()),
        (grid_x as u32, (slots.1 - slots.0) as u32, 1),
        THREADS,
        crate::ops::matvec::input_smem_bytes(d, fmt),
        &p,
    )
}

/// The tensor-core gate/up kernel: a copy compiled for Qwen3.5/3.6's MoE (D 2048, 256 experts, top-8,
/// intermediate 512 for the experts and the shared expert, selecting in every block; its selection
/// loops and tile arithmetic fold), else the one that reads the dims from its parameters.
pub fn gate_up_kernel(
    compiled_copies: bool,
    d: usize,
    i: usize,
    is: usize,
    a: usize,
    route: Option<&RouteParams>,
) -> String {
    let qwen35 = d == 2048
        && i == 512
        && is == 512
        && a == 8
        && route.is_some_and(|r| r.e == 256 && r.a == 8);
    if qwen35 && compiled_copies {
        "matvec_tc_gate_up_q4_c2_e256_a8_i512".to_string()
    } else {
        format!("matvec_tc_gate_up_q4_c{}", d / 1024)
    }
}

/// The tensor-core down kernel for D `d`, top-`a` and the experts' and shared expert's intermediate
/// sizes (None: no such slot): a copy compiled for Qwen3.5/3.6's MoE (D 2048, top-8, 512; its chunk →
/// slot arithmetic folds), else the one that reads them from its parameters (always without
/// `compiled_copies`).
pub fn down_kernel(
    compiled_copies: bool,
    d: usize,
    a: usize,
    i: Option<usize>,
    is: Option<usize>,
) -> &'static str {
    let qwen35 = d == 2048 && a == 8 && i.is_none_or(|i| i == 512) && is.is_none_or(|is| is == 512);
    if qwen35 && compiled_copies {
        "matvec_tc_down_q4_a8_i512_d2048"
    } else {
        "matvec_tc_down_q4"
    }
}

/// Whether the gate/up products run on moe_tc.cu (q4 in groups of 64, D 1024·{1, 2, 4}).
fn tensor_core_gate_up(
    engine: DotEngine,
    d: usize,
    routed: Option<&DevMatrix>,
    shared: Option<&DevMatrix>,
) -> bool {
    engine == DotEngine::TensorCores
        && matches!(d, 1024 | 2048 | 4096)
        && routed.is_none_or(tensor_core_format)
        && shared.is_none_or(tensor_core_format)
}

/// Chunks of 128 columns the tensor-core down kernel takes (moe_tc.cu: 8 warps ×
/// MTC_DOWN_CHUNKS).
const TC_DOWN_CHUNKS: usize = 40;

fn down_launch(
    gpu: &Gpu,
    io: &MoeIo,
    routed: Option<(&DevMatrix, usize)>,
    shared: Option<(&DevMatrix, DPtr)>,
    a: usize,
    slots: (usize, usize),
    engine: DotEngine,
    clear: Option<(DPtr, usize)>,
) -> Result<Launch> {
    let m = routed.map(|r| r.0).or(shared.map(|s| s.0)).expect("a slot");
    ensure!(
        io.act_stride.is_multiple_of(32),
        "moe down: activation stride {} is not a multiple of 32",
        io.act_stride
    );
    let d = routed.map(|r| r.1).unwrap_or(m.rows);
    let p = DownParams {
        act: io.act.0,
        experts: routed.map(|r| r.0.kref()).unwrap_or_default(),
        shared: shared.map(|s| s.0.kref()).unwrap_or_default(),
        topk_ids: io.topk_ids.0,
        topk_w: io.topk_w.0,
        shared_w: shared.map(|s| s.1).unwrap_or(io.shared_w).0,
        h: io.h.0,
        d: d as i32,
        i: routed.map(|r| r.0.cols).unwrap_or(0) as i32,
        is: shared.map(|s| s.0.cols).unwrap_or(0) as i32,
        a: a as i32,
        group_size: m.group_size.max(1) as i32,
        act_stride: io.act_stride as i32,
        slot_begin: slots.0 as i32,
        slot_end: slots.1 as i32,
        route_acc: clear.map(|c| c.0 .0).unwrap_or(0),
        route_acc_len: clear.map(|c| c.1).unwrap_or(0) as i32,
        pad: 0,
    };
    // moe_tc.cu: the slots' rows as one virtual row of chunks of 128 columns, at most
    // TC_DOWN_CHUNKS of them (9 slots of 512 in the real model: 36)
    let q4_tc = |m: &DevMatrix| tensor_core_format(m) && m.cols.is_multiple_of(128);
    let n_routed = a.min(slots.1).saturating_sub(slots.0);
    let chunks = routed.map(|r| n_routed * r.0.cols / 128).unwrap_or(0)
        + shared
            .filter(|_| slots.1 > a)
            .map(|s| s.0.cols / 128)
            .unwrap_or(0);
    if engine == DotEngine::TensorCores
        && routed.is_none_or(|r| q4_tc(r.0))
        && shared.is_none_or(|s| q4_tc(s.0))
        && chunks <= TC_DOWN_CHUNKS
    {
        let name = down_kernel(
            gpu.choices().compiled_copies,
            d,
            a,
            routed.map(|r| r.0.cols),
            shared.map(|s| s.0.cols),
        );
        return Launch::new(
            gpu,
            name,
            (d.div_ceil(16) as u32, 1, 1),
            THREADS,
            (chunks * (512 + 8)) as u32, // B registers + Σ per group
            &p,
        );
    }
    // a warp takes DOWN_ROWS output rows; shared memory holds the slots' activations (padded) and
    // their sums per 16-byte unit
    let rows_per_block = THREADS as usize / 32 * DOWN_ROWS;
    let smem = (slots.1 - slots.0)
        * (crate::ops::matvec::xpad_len(io.act_stride) + io.act_stride / m.format.per_unit())
        * 4;
    Launch::new(
        gpu,
        &format!("moe_down_{}", m.format.suffix()),
        (d.div_ceil(rows_per_block) as u32, 1, 1),
        THREADS,
        smem as u32,
        &p,
    )
}

/// The router launch's parameters; `selects` false: no ticket, the router only leaves the logits (the
/// tensor-core gate/up selects).
fn router_params_selecting(w: &MoeWeightsRef, io: &MoeIo, selects: bool) -> RouterParams {
    RouterParams {
        h: io.h.0,
        norm_gain: io.norm_gain.0,
        router: w.router.kref(),
        shared_gate: w.shared_gate.map(|g| g.0).unwrap_or(0),
        xn: io.xn.0,
        logits: io.logits.0,
        topk_ids: io.topk_ids.0,
        topk_w: io.topk_w.0,
        shared_w: io.shared_w.0,
        counter: if selects { io.counter.0 } else { 0 },
        d: w.router.cols as i32,
        e: w.experts as i32,
        a: w.top_k as i32,
        norm_topk: w.norm_topk as i32,
        group_size: w.router.group_size.max(1) as i32,
        eps: io.eps,
    }
}

/// The router launch: logits into `io.logits` and x̂ into `io.xn`; with `selects`, also the top-k
/// and combine weights (its last block, after an atomic ticket), else the gate/up kernel takes them.
pub fn router_launch(gpu: &Gpu, w: &MoeWeightsRef, io: &MoeIo, selects: bool) -> Result<Launch> {
    let d = w.router.cols;
    let width = crate::ops::matvec::lanes_per_row(d / w.router.format.per_unit());
    // Without the ticket the router is its rows only: blocks of 128 threads spread them over twice
    // the blocks (33 instead of 17 at the real shape: 5.2 → 5.0 µs per launch; 64 threads were
    // slower, 5.5; docs/experiments.md). The staged input then holds ≤ 8·4·128 columns
    // (common.cuh stage_input); the selecting router's last block needs all 256 threads.
    let threads = if !selects && d <= 8 * 4 * 128 && width <= 128 {
        128
    } else {
        THREADS
    };
    let rows_per_block = threads as usize / width * ROUTER_ROWS;
    // one more block computes the shared-expert gate row
    let grid = w.experts.div_ceil(rows_per_block) + w.shared_gate.is_some() as usize;
    Launch::new(
        gpu,
        &format!("moe_router_{}", w.router.format.suffix()),
        (grid as u32, 1, 1),
        threads,
        crate::ops::matvec::input_smem_bytes(d, w.router.format),
        &router_params_selecting(w, io, selects),
    )
}

/// The sparse MoE block: router+top-k, gate/up, down+combine+residual (3 launches when the shared
/// expert has the routed experts' format; 5 otherwise).
pub fn moe(gpu: &Gpu, w: &MoeWeightsRef, io: &MoeIo) -> Result<Vec<Launch>> {
    moe_on(gpu, w, io, gpu.choices().dot_engine, None)
}

/// The MoE block after an out-projection that ran the router ([`fused_route_tail`] with the same
/// `acc`): no router launch; gate/up selects from the accumulators and normalises h itself, and
/// down clears the accumulators for the next layer.
pub fn moe_after_fused_routing(
    gpu: &Gpu,
    w: &MoeWeightsRef,
    io: &MoeIo,
    acc: DPtr,
) -> Result<Vec<Launch>> {
    moe_on(gpu, w, io, gpu.choices().dot_engine, Some(acc))
}

/// The fused routing for layer weights `w` after an out-projection `out_proj` of `k` inputs, when it
/// applies: the out-projection on the tensor-core kernel (q4, K 1024·{1, 2, 4}, one segment of D
/// rows, D % 16 == 0), a q8 or q4 router with bf16 parameters in groups of a multiple of 16, and
/// gate/up selecting on the tensor cores. `acc`: [`route_acc_words`] zeroed i64 words.
pub fn fused_route_tail(
    choices: KernelChoices,
    w: &MoeWeightsRef,
    io: &MoeIo,
    out_proj: &DevMatrix,
    k: usize,
    acc: DPtr,
) -> Option<RouteTail> {
    let engine = choices.dot_engine;
    let d = w.router.cols;
    let r = w.router;
    let applies = choices.router == RouterPlacement::Fused
        && engine == DotEngine::TensorCores
        && tensor_core_format(out_proj)
        && matches!(k, 1024 | 2048 | 4096)
        && out_proj.cols == k
        && out_proj.rows == d
        && d.is_multiple_of(16)
        && matches!(r.format, Format::Q8 | Format::Q4)
        && !r.param_f32
        && r.group_size >= 16
        && r.group_size.is_multiple_of(16)
        && gate_up_selects(w, engine, choices.router);
    applies.then(|| RouteTail {
        router: r.kref(),
        gain: io.norm_gain.0,
        shared_gate: w.shared_gate.map(|g| g.0).unwrap_or(0),
        acc: acc.0,
        e: w.experts as i32,
        bits: if r.format == Format::Q8 { 8 } else { 4 },
        group_size: r.group_size as i32,
        pad: 0,
    })
}

/// Whether the shared expert has the routed experts' formats (one gate/up and one down launch).
fn shared_same_format(w: &MoeWeightsRef) -> Option<bool> {
    w.shared.map(|(gu, dn)| {
        (gu.format, gu.group_size) == (w.gate_up.format, w.gate_up.group_size)
            && (dn.format, dn.group_size) == (w.down.format, w.down.group_size)
    })
}

/// Whether the top-k is taken in every block of the tensor-core gate/up (it runs the routed experts;
/// the router then needs no ticket: docs/experiments.md), not in the router's last block.
fn gate_up_selects(w: &MoeWeightsRef, engine: DotEngine, router: RouterPlacement) -> bool {
    let first_shared = w
        .shared
        .filter(|_| shared_same_format(w) == Some(true))
        .map(|s| s.0);
    router != RouterPlacement::Ticket
        && tensor_core_gate_up(engine, w.router.cols, Some(w.gate_up), first_shared)
}

/// [`moe`] with the gate/up products on a chosen dot-product engine (q4 experts in groups of 64 on
/// the tensor cores, when the shapes allow; the CUDA-core kernels otherwise), after the fused
/// routing when `fused` holds its accumulators.
fn moe_on(
    gpu: &Gpu,
    w: &MoeWeightsRef,
    io: &MoeIo,
    engine: DotEngine,
    fused: Option<DPtr>,
) -> Result<Vec<Launch>> {
    let d = w.router.cols;
    let (e, a) = (w.experts, w.top_k);
    ensure!(
        e <= MAX_EXPERTS && a <= MAX_ACTIVE && a <= e,
        "{e} experts, top {a}: the cuda router supports ≤ {MAX_EXPERTS} and top ≤ {MAX_ACTIVE}"
    );
    let i = w.gate_up.rows / (2 * e);
    ensure!(
        w.gate_up.rows == 2 * e * i && w.down.rows == e * d && w.down.cols == i,
        "expert shapes inconsistent"
    );
    crate::ops::matvec::check_staged_input(d, true)?;
    let same = shared_same_format(w);
    let selects = gate_up_selects(w, engine, gpu.choices().router);
    ensure!(
        fused.is_none() || selects,
        "fused routing needs the tensor-core gate/up to select"
    );
    let route = selects.then(|| RouteParams {
        logits: fused.unwrap_or(io.logits).0,
        topk_ids: io.topk_ids.0,
        topk_w: io.topk_w.0,
        shared_w: io.shared_w.0,
        e: e as i32,
        a: a as i32,
        norm_topk: w.norm_topk as i32,
        shared_gate: w.shared_gate.is_some() as i32,
        fixed: fused.is_some() as i32,
        d: d as i32,
        eps: io.eps,
        pad: 0,
    });
    // With the fused routing there is no router launch to leave x̂: gate/up normalises h itself.
    let (x, norm) = if fused.is_some() {
        (io.h, true)
    } else {
        (io.xn, false)
    };
    let mut launches = Vec::new();
    if fused.is_none() {
        launches.push(router_launch(gpu, w, io, !selects)?);
    }
    match (w.shared, same) {
        (Some((sgu, _)), Some(true)) => {
            launches.push(gate_up_launch(
                gpu,
                io,
                x,
                norm,
                Some((w.gate_up, i, a)),
                Some(sgu),
                (0, a + 1),
                engine,
                route,
                (
                    w.down.kref(),
                    w.shared.map(|s| s.1.kref()).unwrap_or_default(),
                ),
            )?);
        }
        (Some((sgu, _)), _) => {
            launches.push(gate_up_launch(
                gpu,
                io,
                x,
                norm,
                Some((w.gate_up, i, a)),
                None,
                (0, a),
                engine,
                route,
                Default::default(),
            )?);
            launches.push(gate_up_launch(
                gpu,
                io,
                x,
                norm,
                None,
                Some(sgu),
                (a, a + 1),
                engine,
                None,
                Default::default(),
            )?);
        }
        (None, _) => launches.push(gate_up_launch(
            gpu,
            io,
            x,
            norm,
            Some((w.gate_up, i, a)),
            None,
            (0, a),
            engine,
            route,
            Default::default(),
        )?),
    }
    // the last down launch clears the fused routing's accumulators
    let clear = fused.map(|acc| (acc, route_acc_words(e)));
    match (w.shared, same) {
        (Some((_, sdn)), Some(true)) => {
            launches.push(down_launch(
                gpu,
                io,
                Some((w.down, d)),
                Some((sdn, io.shared_w)),
                a,
                (0, a + 1),
                engine,
                clear,
            )?);
        }
        (Some((_, sdn)), _) => {
            launches.push(down_launch(
                gpu,
                io,
                Some((w.down, d)),
                None,
                a,
                (0, a),
                engine,
                None,
            )?);
            launches.push(down_launch(
                gpu,
                io,
                None,
                Some((sdn, io.shared_w)),
                a,
                (a, a + 1),
                engine,
                clear,
            )?);
        }
        (None, _) => launches.push(down_launch(
            gpu,
            io,
            Some((w.down, d)),
            None,
            a,
            (0, a),
            engine,
            clear,
        )?),
    }
    Ok(launches)
}

/// A dense SwiGLU MLP (gate/up [2I, D], down [D, I]) on h, normalised in the gate/up prologue.
pub fn dense_mlp(
    gpu: &Gpu,
    gate_up: &DevMatrix,
    down: &DevMatrix,
    io: &MoeIo,
) -> Result<Vec<Launch>> {
    Ok(vec![
        gate_up_launch(
            gpu,
            io,
            io.h,
            true,
            None,
            Some(gate_up),
            (0, 1),
            gpu.choices().dot_engine,
            None,
            Default::default(),
        )?,
        down_launch(
            gpu,
            io,
            None,
            Some((down, io.one)),
            0,
            (0, 1),
            gpu.choices().dot_engine,
            None,
        )?,
    ])
}
