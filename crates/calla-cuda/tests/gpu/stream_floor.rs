//! Lab (prints INFO rows, asserts nothing about speed): how long the decode matvec takes against a
//! kernel that only streams the same bytes, both replayed in a CUDA graph over 20 distinct copies
//! (so every launch reads cold weights from DRAM, as a decode step does). The gap between the two is
//! what the matvec's design costs beyond its bytes (docs/performance.md, "Session 5").

use std::sync::Arc;

use calla_cuda::bench::lab_stamp_intervals;
use calla_cuda::gpu::{DPtr, Gpu, Launch};
use calla_cuda::graph::StepGraph;
use calla_cuda::lab_stream::stream_read;
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
