//! Lab (prints INFO rows, asserts nothing about speed): how long the decode matvec takes against a
//! kernel that only streams the same bytes, both replayed in a CUDA graph over 20 distinct copies
//! (so every launch reads cold weights from DRAM, as a decode step does). The gap between the two is
//! what the matvec's design costs beyond its bytes (docs/performance.md, "Session 5").

use std::sync::Arc;

use calla_cuda::bench::lab_stamp_intervals;
use calla_cuda::gpu::{DPtr, Gpu, Launch};
use calla_cuda::graph::StepGraph;
use calla_cuda::lab_stream::{
    chain_link, chain_persistent, red_link, stream_read, ChainMode, RedMode,
};
use calla_cuda::matvec::{matvec_on, DotEngine};
use calla_cuda::pool::Arena;
use calla_cuda::synthetic::Filler;
use calla_cuda::weights::{DevMatrix, Format};
use cudarc::driver::sys::CUevent_flags;

use crate::support::*;

const COPIES: usize = 20;

/// µs per launch: the launches captured as one graph, replayed 7 times between events; the median.
fn graph_us(gpu: &Arc<Gpu>, launches: &[Launch]) -> f64 {
    let graph = StepGraph::capture(gpu, launches).unwrap();
    graph.replay(gpu).unwrap(); // warm-up
    let event = || {
        gpu.ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap()
    };
    let (start, stop) = (event(), event());
    let mut times: Vec<f64> = (0..7)
        .map(|_| {
            start.record(&gpu.stream).unwrap();
            graph.replay(gpu).unwrap();
            stop.record(&gpu.stream).unwrap();
            gpu.sync().unwrap();
            start.elapsed_ms(&stop).unwrap() as f64 * 1e3 / launches.len() as f64
        })
        .collect();
    times.sort_by(|a, b| a.total_cmp(b));
    times[times.len() / 2]
}

fn row(what: &str, shape: &str, us: f64, bytes: usize) {
    println!(
        "| {what:<46} | {shape:<26} | {us:>8.2} µs | {:>6.0} GB/s | | INFO |",
        bytes as f64 / us / 1e3
    );
}

#[test]
#[ignore = "needs CUDA"]
fn decode_matvec_against_the_streaming_floor() {
    let gpu = gpu();
    let sms = gpu.sm_count as u32;
    let mut arena = Arena::new(&gpu, 64 << 20);
    let sink = arena.alloc_zeroed(4).unwrap();

    // The decode step's matvec shapes (q4, group 64): the DeltaNet in-projection (qkv, z, b, a
    // stacked, with the input RMSNorm) and the out-projection (r2 shape, accumulating).
    for (name, rows, k, norm) in [
        ("in-projection", 12_352usize, 2048usize, true),
        ("out-projection", 2048, 4096, false),
    ] {
        let (mats, x, gain, out): (Vec<DevMatrix>, DPtr, DPtr, DPtr) = {
            let mut f = Filler::new(&gpu, &mut arena, 0x5eed + rows as u64);
            let mats = (0..COPIES)
                .map(|_| {
                    f.matrix(rows, k, Format::Q4, 1.0 / (k as f32).sqrt())
                        .unwrap()
                })
                .collect();
            let x = f.vector(k, -1.0, 1.0).unwrap();
            let gain = f.vector(k, 0.5, 1.5).unwrap();
            let out = f.vector(rows, -1.0, 1.0).unwrap();
            (mats, x, gain, out)
        };
        gpu.sync().unwrap();
        let bytes = mats[0].bytes();
        let shape = format!("{rows}×{k} q4, {:.1} MB", bytes as f64 / 1e6);
        let norm = norm.then_some((gain, 1e-6f32));
        for engine in [DotEngine::Rows, DotEngine::TensorCores] {
            let launches: Vec<Launch> = mats
                .iter()
                .map(|m| {
                    matvec_on(&gpu, x, k, norm, &[(*m, out)], norm.is_none(), engine)
                        .unwrap()
                        .remove(0)
                })
                .collect();
            let label = format!("{engine:?}, {} blocks", launches[0].grid.0);
            row(
                &format!("matvec {name} {label}, cold"),
                &shape,
                graph_us(&gpu, &launches),
                bytes,
            );
            let warm = vec![launches[0].clone(); COPIES];
            row(
                &format!("matvec {name} {label}, warm L2"),
                &shape,
                graph_us(&gpu, &warm),
                bytes,
            );
            if engine == DotEngine::TensorCores
                && std::env::var("CALLA_NVRTC_DEFINES").is_ok_and(|d| d.contains("LAB_STAMPS"))
            {
                // the last launch's stamps (a cold copy's, replayed in the graph above)
                let cold = StepGraph::capture(&gpu, &launches).unwrap();
                cold.replay(&gpu).unwrap();
                gpu.sync().unwrap();
                print_stamps(&gpu, "matvec_tc_lab_stamps", name);
            }
        }
        // The same bytes streamed: the codes and then the parameters of each copy, one launch each
        // region would double the launches; codes only (≥ 94% of the bytes) is the floor's bulk.
        for per_sm in [1u32, 2, 4, 8] {
            for in_flight in [1usize, 2, 4, 8] {
                let launches: Vec<Launch> = mats
                    .iter()
                    .map(|m| {
                        stream_read(
                            &gpu,
                            m.data,
                            m.rows * m.row_bytes(),
                            sink,
                            sms * per_sm,
                            in_flight,
                        )
                        .unwrap()
                    })
                    .collect();
                row(
                    &format!("stream codes: {per_sm}/SM × 256, {in_flight} loads/thread"),
                    &shape,
                    graph_us(&gpu, &launches),
                    mats[0].rows * mats[0].row_bytes(),
                );
            }
        }
    }

    // Streaming alone by size: where a kernel's fixed cost ends and its bytes begin.
    let region_max = 64usize << 20;
    let big = arena.alloc(region_max * COPIES).unwrap();
    calla_cuda::synthetic::fill_f32(&gpu, big, region_max * COPIES / 4, -1.0, 1.0, 7).unwrap();
    for mb in [0.25f64, 1.0, 4.0, 16.0, 64.0] {
        let bytes = ((mb * 1048576.0) as usize) / 16 * 16;
        for (per_sm, in_flight) in [(2u32, 4usize), (4, 4), (8, 2)] {
            let launches: Vec<Launch> = (0..COPIES)
                .map(|i| {
                    stream_read(
                        &gpu,
                        big.offset(i * region_max),
                        bytes,
                        sink,
                        sms * per_sm,
                        in_flight,
                    )
                    .unwrap()
                })
                .collect();
            row(
                &format!("stream {mb} MiB: {per_sm}/SM × 256, {in_flight} loads/thread"),
                "",
                graph_us(&gpu, &launches),
                bytes,
            );
        }
    }
}

/// Lab (CALLA_NVRTC_DEFINES=LAB_STAMPS): per-warp intervals between matvec_tc's stamps, median and
/// max over the warps of the last launch.
fn print_stamps(gpu: &Arc<Gpu>, kernel: &str, what: &str) {
    let names = [
        "entry → x in, weight loads issued",
        "loads issued → prologue done",
        "prologue done → first tile's codes",
        "first codes → first tile computed",
        "computed → block reduced",
        "reduced → kernel end",
    ];
    for (name, median, max, warps) in lab_stamp_intervals(gpu, kernel, &names).unwrap() {
        println!(
            "| stamps {what}: {name:<36} | median {median:6.2} µs | max {max:6.2} µs | {warps} warps | | INFO |"
        );
    }
}

/// The decode step at 4K as links (kind, bytes, grid): the real shape's bytes per kernel and the
/// real kernels' grids (docs/performance.md, "Session 7").
fn decode_step_links(sms: u32) -> Vec<(&'static str, usize, u32)> {
    let q4 = |rows: usize, cols: usize| rows * cols * 9 / 16; // 4 bits + (scale, bias) per 64
    let mut links: Vec<(&'static str, usize, u32)> = vec![("embed", 16 << 10, 1)];
    for layer in 0..40 {
        if layer % 4 == 3 {
            links.push(("attention in-projection", q4(9216, 2048), 2 * sms));
            links.push(("attention, K and V at 4K", 4096 * 2 * 2 * 256 * 2, 128));
            links.push(("attention out-projection", q4(2048, 4096), 128));
        } else {
            links.push(("DeltaNet in-projection", q4(12_352, 2048), 2 * sms));
            links.push((
                "DeltaNet state, read and written",
                32 * 128 * 128 * 4 * 2,
                256,
            ));
            links.push(("DeltaNet out-projection", q4(2048, 4096), 128));
        }
        links.push(("router (q8)", 256 * 2048 * 17 / 16, 17));
        links.push(("MoE gate/up, 8 + shared", q4(9 * 1024, 2048), 261));
        links.push(("MoE down, 8 + shared", q4(2048, 9 * 512), 128));
    }
    links.push(("lm_head", q4(248_320, 2048), 2 * sms));
    links.push(("token selection", 248_320 * 4, 64));
    links
}

/// Lab (prints INFO rows, asserts nothing about speed): the floor of the decode step's structure.
/// The 243 launches of one step at 4K context (Qwen3.6-35B-A3B, q4: their bytes and grids as
/// `calla bench --profile` shows them) replaced by links that only stream their bytes, each
/// reading the previous link's 8 KB output first as a decode kernel reads its input
/// (lab_stream.cu stream_chain_link), captured as one graph. What the real step costs beyond this
/// is its kernels' own work; what this costs beyond the bytes is the chain (docs/performance.md,
/// "Session 7").
#[test]
#[ignore = "needs CUDA"]
fn decode_chain_against_its_floor() {
    let gpu = gpu();
    let sms = gpu.sm_count as u32;
    let links = decode_step_links(sms);
    let total: usize = links.iter().map(|l| l.1.div_ceil(16) * 16).sum();

    let mut arena = Arena::new(&gpu, total + (1 << 20));
    let weights = arena.alloc(total).unwrap();
    calla_cuda::synthetic::fill_f32(&gpu, weights, total / 4, -1.0, 1.0, 11).unwrap();
    let xn = 2048;
    let xs = [arena.alloc(xn * 4).unwrap(), arena.alloc(xn * 4).unwrap()];
    for (i, x) in xs.iter().enumerate() {
        calla_cuda::synthetic::fill_f32(&gpu, *x, xn, -1.0, 1.0, 12 + i as u64).unwrap();
    }
    let sink = arena.alloc_zeroed(4).unwrap();
    gpu.sync().unwrap();

    // a third input that no link writes: x read without a dependency on the previous link
    let x_static = arena.alloc(xn * 4).unwrap();
    calla_cuda::synthetic::fill_f32(&gpu, x_static, xn, -1.0, 1.0, 15).unwrap();
    gpu.sync().unwrap();
    // a link's streamed bytes are bytes_of(its kind, its bytes)
    let chain_with = |mode: ChainMode,
                      bytes_of: &dyn Fn(&str, usize) -> usize,
                      input: Option<DPtr>,
                      n_in: usize|
     -> Vec<Launch> {
        let mut offset = 0;
        links
            .iter()
            .enumerate()
            .map(|(i, &(kind, bytes, grid))| {
                let src = weights.offset(offset);
                offset += bytes.div_ceil(16) * 16;
                chain_link(
                    &gpu,
                    src,
                    bytes_of(kind, bytes).div_ceil(16) * 16,
                    input.unwrap_or(xs[i % 2]),
                    xs[(i + 1) % 2],
                    n_in,
                    sink,
                    grid,
                    mode,
                )
                .unwrap()
            })
            .collect()
    };
    let chain = |mode: ChainMode, bytes_of: &dyn Fn(usize) -> usize| {
        chain_with(mode, &|_, b| bytes_of(b), None, xn)
    };
    let step = |what: &str, launches: &[Launch], bytes: usize| {
        let us = graph_us(&gpu, launches) * launches.len() as f64;
        println!(
            "| chain of {} links: {what:<52} | {:>7.1} µs per step | {:>6.1} tok/s | {:>5.0} GB/s | | INFO |",
            launches.len(),
            us,
            1e6 / us,
            bytes as f64 / us / 1e3
        );
    };
    step(
        "launches only (16 bytes each)",
        &chain(ChainMode::StreamOnly, &|_| 16),
        0,
    );
    step(
        "x first, launches only (16 bytes each)",
        &chain(ChainMode::InputFirst, &|_| 16),
        0,
    );
    step(
        "the step's bytes, streamed",
        &chain(ChainMode::StreamOnly, &|b| b),
        total,
    );
    step(
        "x read and summed, then the bytes",
        &chain(ChainMode::InputFirst, &|b| b),
        total,
    );
    step(
        "x requested, the bytes behind it",
        &chain(ChainMode::InputWithStream, &|b| b),
        total,
    );
    // The bytes into shared memory by bulk copies (the TMA engine) instead of loads into registers:
    // does x's read wait behind copies issued at entry, as it waits behind loads (session 5) and L2
    // prefetches (session 12)? (Added in session 12, not yet run.)
    step(
        "bulk copies into shared memory only",
        &chain(ChainMode::BulkOnly, &|b| b),
        total,
    );
    step(
        "x read and summed, then bulk copies",
        &chain(ChainMode::BulkAfterInput, &|b| b),
        total,
    );
    step(
        "bulk copies issued at entry, x read meanwhile",
        &chain(ChainMode::BulkAtEntry, &|b| b),
        total,
    );
    // What the input costs: the same 8 KB from a buffer no link writes (no dependency), and 32 bytes
    // of the previous link's output (the dependency without the volume)
    step(
        "x first, from a buffer no link writes",
        &chain_with(ChainMode::InputFirst, &|_, b| b, Some(x_static), xn),
        total,
    );
    step(
        "x first, 32 bytes of it",
        &chain_with(ChainMode::InputFirst, &|_, b| b, None, 8),
        total,
    );
    step(
        "x first, from a buffer no link writes, no bytes",
        &chain_with(ChainMode::InputFirst, &|_, _| 16, Some(x_static), xn),
        0,
    );
    step(
        "x first, 32 bytes of it, no bytes",
        &chain_with(ChainMode::InputFirst, &|_, _| 16, None, 8),
        0,
    );
    // hot lines or volume: every block its own copy of a buffer no link writes (all in L2)
    let copies = arena.alloc(xn * 4 * 4 * sms as usize).unwrap();
    calla_cuda::synthetic::fill_f32(&gpu, copies, xn * 4 * sms as usize, -1.0, 1.0, 16).unwrap();
    gpu.sync().unwrap();
    step(
        "x first, no link writes it, each block its own copy",
        &chain_with(ChainMode::InputFirstOwnCopy, &|_, b| b, Some(copies), xn),
        total,
    );
    step(
        "x first, no link writes it, own copies, no bytes",
        &chain_with(ChainMode::InputFirstOwnCopy, &|_, _| 16, Some(copies), xn),
        0,
    );
    // The same links as phases of one resident grid, separated by grid barriers.
    {
        let mut offset = 0;
        let mut pairs: Vec<u64> = Vec::new();
        for &(_, bytes, _) in &links {
            pairs.push(weights.offset(offset).0);
            pairs.push((bytes.div_ceil(16) * 16) as u64);
            offset += bytes.div_ceil(16) * 16;
        }
        let table = arena.upload(&pairs).unwrap();
        let x2 = arena.alloc(2 * xn * 4).unwrap();
        calla_cuda::synthetic::fill_f32(&gpu, x2, 2 * xn, -1.0, 1.0, 14).unwrap();
        let fits = gpu
            .resident_blocks(
                "stream_chain_persistent",
                calla_cuda::lab_stream::THREADS,
                0,
            )
            .unwrap();
        for per_sm in [1usize, 2, 4].into_iter().filter(|&n| n <= fits) {
            for prefetch in [false, true] {
                // a fresh counter per grid size: a barrier's target assumes the count is a
                // multiple of the grid's blocks
                let sync = arena.alloc_zeroed(16).unwrap();
                let launch = chain_persistent(
                    &gpu,
                    table,
                    links.len(),
                    x2,
                    xn,
                    sync,
                    sink,
                    sms * per_sm as u32,
                    prefetch,
                )
                .unwrap();
                let us = graph_us(&gpu, &[launch]);
                println!(
                    "| one persistent grid ({per_sm}/SM), {} phases: x first{:<28} | {us:>7.1} µs per step | {:>6.1} tok/s | {:>5.0} GB/s | | INFO |",
                    links.len(),
                    if prefetch { ", next phase's loads before the barrier" } else { "" },
                    1e6 / us,
                    total as f64 / us / 1e3
                );
            }
        }
    }
    // Fewer dependent links: the same bytes, a link of each named kind merged into the one after it
    // (the floor of a design that fuses them, whatever the fusion costs in itself).
    let merges: [(&str, &[&str]); 3] = [
        ("router into gate/up", &["router (q8)"]),
        (
            "+ in-projections into their mixers",
            &[
                "router (q8)",
                "DeltaNet in-projection",
                "attention in-projection",
            ],
        ),
        (
            "+ out-projections into the MoE's first",
            &[
                "router (q8)",
                "DeltaNet in-projection",
                "attention in-projection",
                "DeltaNet out-projection",
                "attention out-projection",
            ],
        ),
    ];
    for (what, kinds) in merges {
        let mut merged: Vec<(usize, usize, u32)> = Vec::new(); // (offset, bytes, grid)
        let mut offset = 0;
        let mut open = false; // the last merged link takes the next one too
        for &(name, bytes, grid) in &links {
            let b = bytes.div_ceil(16) * 16;
            match merged.last_mut() {
                Some(last) if open => {
                    last.1 += b;
                    last.2 = last.2.max(grid);
                }
                _ => merged.push((offset, b, grid)),
            }
            open = kinds.contains(&name);
            offset += b;
        }
        let launches: Vec<Launch> = merged
            .iter()
            .enumerate()
            .map(|(i, &(off, bytes, grid))| {
                chain_link(
                    &gpu,
                    weights.offset(off),
                    bytes,
                    xs[i % 2],
                    xs[(i + 1) % 2],
                    xn,
                    sink,
                    grid,
                    ChainMode::InputFirst,
                )
                .unwrap()
            })
            .collect();
        step(&format!("x first, {what}"), &launches, total);
    }
    // per kind of link: the same chain, one kind's bytes only (the others' launches stay)
    let mut kinds: Vec<&str> = Vec::new();
    for &(kind, _, _) in &links {
        if !kinds.contains(&kind) {
            kinds.push(kind);
        }
    }
    for kind in kinds {
        let launches = chain_with(
            ChainMode::InputFirst,
            &|k, b| if k == kind { b } else { 16 },
            None,
            xn,
        );
        let of_kind = links.iter().filter(|l| l.0 == kind);
        let (count, bytes) = (of_kind.clone().count(), of_kind.map(|l| l.1).sum::<usize>());
        step(
            &format!("x first, only {kind} ({count}) streamed"),
            &launches,
            bytes,
        );
    }
}

/// Lab (prints INFO rows, asserts nothing about speed): the decode step's links as one persistent
/// grid of one block per SM whose last warp streams every link's bytes into shared memory ahead of
/// the links' grid barriers (lab_stream.cu stream_chain_producer), against the chain of launches
/// above. The links are today's 203 (the router's rows in the out-projection's link); the routed
/// experts' bytes (gate/up, down) wait for the routing link's barrier unless said. Rows by ring depth
/// and by the arithmetic per word (docs/performance.md, "Session 16").
#[test]
#[ignore = "needs CUDA"]
fn decode_chain_with_a_producer_warp() {
    use calla_cuda::lab_stream::{chain_producer, ProducerLink};
    let gpu = gpu();
    let sms = gpu.sm_count as u32;
    // today's 203 links: the router's rows go with the out-projection before them
    let mut links: Vec<(&str, usize)> = Vec::new();
    for (kind, bytes, _) in decode_step_links(sms) {
        match (kind, links.last_mut()) {
            ("router (q8)", Some(last)) => last.1 += bytes.div_ceil(16) * 16,
            _ => links.push((kind, bytes.div_ceil(16) * 16)),
        }
    }
    let total: usize = links.iter().map(|l| l.1).sum();
    let mut arena = Arena::new(&gpu, total + (4 << 20));
    let weights = arena.alloc(total).unwrap();
    calla_cuda::synthetic::fill_f32(&gpu, weights, total / 4, -1.0, 1.0, 21).unwrap();
    let xn = 2048;
    let x2 = arena.alloc(2 * xn * 4).unwrap();
    calla_cuda::synthetic::fill_f32(&gpu, x2, 2 * xn, -1.0, 1.0, 22).unwrap();
    let sink = arena.alloc_zeroed(4).unwrap();
    let stamps = arena
        .alloc_zeroed((6 + sms as usize) * 8 * links.len())
        .unwrap();
    gpu.sync().unwrap();
    let mut table = |routed_wait: bool, no_bytes: bool| -> DPtr {
        let mut offset = 0;
        let mut routing = -1i32; // the link whose barrier makes the experts known
        let rows: Vec<ProducerLink> = links
            .iter()
            .enumerate()
            .map(|(i, &(kind, bytes))| {
                let routed = kind.starts_with("MoE");
                if kind.ends_with("out-projection") {
                    routing = i as i32;
                }
                let link = ProducerLink {
                    src: weights.offset(offset).0,
                    bytes: if no_bytes { 16 } else { bytes as u64 },
                    dep: if routed && routed_wait { routing } else { -1 },
                    pad: 0,
                };
                offset += bytes;
                link
            })
            .collect();
        arena.upload(&rows).unwrap()
    };
    let (waiting, free, empty) = (table(true, false), table(false, false), table(false, true));
    gpu.sync().unwrap();
    // the same bytes by one kernel of loads (2 blocks per SM, 4 loads in flight): the read bandwidth
    let read = stream_read(&gpu, weights, total, sink, 2 * sms, 4).unwrap();
    let us = graph_us(&gpu, &[read]);
    println!(
        "| one kernel of loads, the step's bytes at once{:<40} | {us:>7.1} µs | | {:>5.0} GB/s | | INFO |",
        "",
        total as f64 / us / 1e3
    );
    // work: 2 FMAs per word cost about what a q4 product's dequantising costs (the FMA and two
    // logic operations each: 6 instructions per 32-bit word). Rings: (stages, bytes per stage).
    const K16: u32 = 16384;
    let ring = [(13, K16)];
    for (what, table, works, chain, poll_sleep) in [
        ("the stream alone", free, &[0u32][..], false, false),
        ("no bytes (16 each)", empty, &[0][..], true, false),
        ("experts after routing", waiting, &[0, 2][..], true, false),
        ("no waits", free, &[0][..], true, false),
        ("no waits, polls sleep", free, &[0][..], true, true),
        ("no bytes, polls sleep", empty, &[0][..], true, true),
    ] {
        for &(stages, chunk) in &ring {
            for &work in works {
                let sync = arena.alloc_zeroed(16).unwrap();
                let launch = chain_producer(
                    &gpu,
                    table,
                    links.len(),
                    x2,
                    xn,
                    sync,
                    sink,
                    Some(stamps),
                    sms,
                    stages,
                    chunk,
                    work,
                    chain,
                    poll_sleep,
                )
                .unwrap();
                let us = graph_us(&gpu, &[launch]);
                println!(
                    "| producer warp, {} links, {what:<22}, ring {stages:>2} × {:>2} KB, {work} FMA/word | {us:>7.1} µs per step | {:>6.1} tok/s | {:>5.0} GB/s | | INFO |",
                    links.len(),
                    chunk / 1024,
                    1e6 / us,
                    total as f64 / us / 1e3
                );
                // block 0's phases of the last replay, medians over the links (µs); the
                // producer's lead: how long before the link's start it issued its first / last chunk
                let mut t = vec![0u64; (6 + sms as usize) * links.len()];
                gpu.dtoh(stamps, &mut t).unwrap();
                // every block's arrival at link l's barrier: the last one, against block 0's
                let arrivals = |l: usize| &t[6 * links.len() + l * sms as usize..][..sms as usize];
                let median = |f: &dyn Fn(usize) -> f64| {
                    let mut d: Vec<f64> = (0..links.len()).map(f).collect();
                    d.sort_by(|a, b| a.total_cmp(b));
                    d[d.len() / 2]
                };
                let gap = |l: usize, a: usize, b: usize| {
                    (t[6 * l + b] as f64 - t[6 * l + a] as f64) / 1e3
                };
                println!(
                    "|   block 0, median per link: x read and summed {:.2} µs, chunks folded {:.2}, grid barrier {:.2} (last block's arrival after block 0's {:.2}, block 0 passed {:.2} after it); first chunk issued {:.2} µs before the link's start, last {:.2} | | | | | INFO |",
                    median(&|l| gap(l, 0, 1)),
                    median(&|l| gap(l, 1, 2)),
                    median(&|l| gap(l, 2, 3)),
                    median(&|l| (*arrivals(l).iter().max().unwrap() as f64
                        - arrivals(l)[0] as f64)
                        / 1e3),
                    median(&|l| (t[6 * l + 3] as f64
                        - *arrivals(l).iter().max().unwrap() as f64)
                        / 1e3),
                    median(&|l| gap(l, 4, 0)),
                    median(&|l| gap(l, 5, 0)),
                );
            }
        }
    }
}

/// Lab (prints INFO rows, asserts nothing about speed): what a fused MoE link would pay for adding
/// its split-K down partials into h with atomics. 40 layers' MoE as one link each (16 MB streamed,
/// then every block adds 2,048 values), against today's two links (gate/up 10.6 MB on 261 blocks,
/// down 5.3 MB on 128), by grid, reduction type and accumulator copies (lab_stream.cu
/// stream_red_link; docs/performance.md, "Session 9").
#[test]
#[ignore = "needs CUDA"]
fn moe_link_with_reductions() {
    let gpu = gpu();
    let q4 = |rows: usize, cols: usize| (rows * cols * 9 / 16).div_ceil(16) * 16;
    let (gate_up, down) = (q4(9 * 1024, 2048), q4(2048, 9 * 512));
    let layers = 40;
    let mut arena = Arena::new(&gpu, layers * (gate_up + down) + (4 << 20));
    let weights = arena.alloc(layers * (gate_up + down)).unwrap();
    calla_cuda::synthetic::fill_f32(&gpu, weights, layers * (gate_up + down) / 4, -1.0, 1.0, 21)
        .unwrap();
    let xs = [
        arena.alloc(2048 * 4).unwrap(),
        arena.alloc(2048 * 4).unwrap(),
    ];
    for (i, x) in xs.iter().enumerate() {
        calla_cuda::synthetic::fill_f32(&gpu, *x, 2048, -1.0, 1.0, 22 + i as u64).unwrap();
    }
    let acc = arena.alloc_zeroed(8 * 2048 * 8).unwrap();
    let sink = arena.alloc_zeroed(4).unwrap();
    gpu.sync().unwrap();
    let per_layer = |what: &str, launches: &[Launch]| {
        let us = graph_us(&gpu, launches) * launches.len() as f64 / layers as f64;
        println!("| MoE per layer: {what:<58} | {us:>7.2} µs | | INFO |");
    };
    let two: Vec<Launch> = (0..layers)
        .flat_map(|l| {
            let base = weights.offset(l * (gate_up + down));
            [
                chain_link(
                    &gpu,
                    base,
                    gate_up,
                    xs[0],
                    xs[1],
                    2048,
                    sink,
                    261,
                    ChainMode::InputFirst,
                )
                .unwrap(),
                chain_link(
                    &gpu,
                    base.offset(gate_up),
                    down,
                    xs[1],
                    xs[0],
                    2048,
                    sink,
                    128,
                    ChainMode::InputFirst,
                )
                .unwrap(),
            ]
        })
        .collect();
    per_layer(
        "two links (gate/up on 261, down on 128), today's floor",
        &two,
    );
    for grid in [72u32, 144, 264, 288] {
        for (mode, copies, name) in [
            (RedMode::None, 1, "no reductions"),
            (RedMode::FixedI64, 1, "2,048 red.add.u64 per block"),
            (
                RedMode::FixedI64,
                4,
                "2,048 red.add.u64 per block, 4 copies",
            ),
            (RedMode::F32, 1, "2,048 red.add.f32 per block"),
            (RedMode::F32x4, 1, "512 red.add.v4.f32 per block"),
        ] {
            let launches: Vec<Launch> = (0..layers)
                .map(|l| {
                    red_link(
                        &gpu,
                        weights.offset(l * (gate_up + down)),
                        gate_up + down,
                        xs[l % 2],
                        xs[(l + 1) % 2],
                        acc,
                        2048,
                        copies,
                        mode,
                        sink,
                        grid,
                    )
                    .unwrap()
                })
                .collect();
            per_layer(&format!("one link on {grid}: {name}"), &launches);
        }
    }
}
