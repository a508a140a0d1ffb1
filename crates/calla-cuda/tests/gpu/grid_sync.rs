//! The grid-wide barrier (kernels/grid_sync.cu) holds, and what it costs: the number the persistent
//! decode kernel's plan rests on (docs/persistent-decode.md).

use calla_cuda::grid_sync::GridSyncCheck;
use calla_cuda::pool::Arena;
use cudarc::driver::sys::CUevent_flags;

use crate::support::*;

#[test]
#[ignore = "needs CUDA"]
fn grid_barrier_holds_and_its_cost() {
    let gpu = gpu();
    let mut all = true;
    let fits = gpu
        .resident_blocks("grid_sync_check", calla_cuda::grid_sync::THREADS, 0)
        .unwrap();
    for per_sm in [1, fits.min(2)] {
        let mut arena = Arena::new(&gpu, 1 << 20);
        let check = GridSyncCheck::new(&gpu, &mut arena, per_sm).unwrap();
        let phases = 500;
        let launch = check.launch(&gpu, phases).unwrap();
        launch.run(&gpu).unwrap(); // warm-up, and the first check
        let event = || {
            gpu.ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .unwrap()
        };
        let (start, stop) = (event(), event());
        start.record(&gpu.stream).unwrap();
        launch.run(&gpu).unwrap();
        stop.record(&gpu.stream).unwrap();
        gpu.sync().unwrap();
        let us = start.elapsed_ms(&stop).unwrap() as f64 * 1e3 / (2 * phases) as f64;
        let errors = download_u32(&gpu, check.errors);
        let checks = 2 * phases * check.blocks * check.blocks; // 2 launches × phases × blocks × slots
        all &= check_count(
            "grid barrier: every block sees every slot",
            &format!("{} blocks ({per_sm}/SM)", check.blocks),
            checks - errors as usize,
            checks,
            &format!("{us:.2} µs per barrier"),
        );
    }
    assert!(all, "the grid barrier let a block through early");
}

fn download_u32(gpu: &calla_cuda::gpu::Gpu, ptr: calla_cuda::gpu::DPtr) -> u32 {
    let mut v = [0u32; 1];
    gpu.dtoh(ptr, &mut v).unwrap();
    v[0]
}

/// The floor of one launch inside a CUDA graph, by grid size: an empty kernel (the barrier check
/// with no phases) of 1 block and of 1 or 2 blocks per SM, captured 20 times and replayed between
/// events — what a decode kernel costs before it does anything (docs/performance.md, "Session 3").
#[test]
#[ignore = "needs CUDA"]
fn launch_floor_by_grid() {
    let gpu = gpu();
    let fits = gpu
        .resident_blocks("grid_sync_check", calla_cuda::grid_sync::THREADS, 0)
        .unwrap();
    let mut arena = Arena::new(&gpu, 1 << 20);
    let mut shapes = vec![(1usize, "1 block".to_string())];
    for per_sm in [1, 2, 3].into_iter().filter(|&n| n <= fits) {
        shapes.push((per_sm, format!("{per_sm}/SM")));
    }
    for (i, (per_sm, label)) in shapes.iter().enumerate() {
        let check = GridSyncCheck::new(&gpu, &mut arena, *per_sm).unwrap();
        let mut launch = check.launch(&gpu, 0).unwrap();
        if i == 0 {
            launch.grid = (1, 1, 1);
        }
        let reps = vec![launch; 20];
        let graph = calla_cuda::graph::StepGraph::capture(&gpu, &reps).unwrap();
        graph.replay(&gpu).unwrap();
        let event = || {
            gpu.ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .unwrap()
        };
        let (start, stop) = (event(), event());
        let mut best = f64::MAX;
        for _ in 0..5 {
            start.record(&gpu.stream).unwrap();
            graph.replay(&gpu).unwrap();
            stop.record(&gpu.stream).unwrap();
            gpu.sync().unwrap();
            best = best.min(start.elapsed_ms(&stop).unwrap() as f64 * 1e3 / 20.0);
        }
        let blocks = if i == 0 { 1 } else { check.blocks };
        println!("| empty kernel in a graph: {label:<22} | {blocks} blocks × 256 | {best:.2} µs per launch | | | INFO |");
    }
}
