//! Launcher for kernels/grid_sync.cu: the grid-wide barrier a persistent decode kernel will use
//! between its phases (docs/persistent-decode.md), with a check that it holds and a measurement of
//! its cost.

use anyhow::{ensure, Result};

use crate::gpu::{DPtr, Gpu, Launch};
use crate::pool::Arena;

pub const THREADS: u32 = 256;

/// Device state of one barrier (kernels/grid_sync.cu `GridSync`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct GridSync {
    /// u64 arrivals, zeroed once
    pub counter: u64,
    /// u64 target of the last barrier opened by grid_open, zeroed once
    pub opened: u64,
}

impl GridSync {
    /// A barrier's two zeroed device words.
    pub fn new(arena: &mut Arena) -> Result<GridSync> {
        Ok(GridSync {
            counter: arena.alloc_zeroed(8)?.0,
            opened: arena.alloc_zeroed(8)?.0,
        })
    }
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct GridSyncCheckParams {
    pub sync: GridSync,
    pub slots: u64,
    pub errors: u64,
    pub phases: i32,
    pub pad: i32,
}

/// Buffers of the barrier check.
pub struct GridSyncCheck {
    pub sync: GridSync,
    pub slots: DPtr,
    pub errors: DPtr,
    /// blocks in the grid: all resident at once
    pub blocks: usize,
}

impl GridSyncCheck {
    /// `per_sm` blocks on every SM, capped by what fits (the barrier deadlocks otherwise).
    pub fn new(gpu: &Gpu, arena: &mut Arena, per_sm: usize) -> Result<GridSyncCheck> {
        let fits = gpu.resident_blocks("grid_sync_check", THREADS, 0)?;
        ensure!(
            per_sm <= fits,
            "{per_sm} blocks per SM requested, {fits} fit"
        );
        let blocks = gpu.sm_count as usize * per_sm;
        Ok(GridSyncCheck {
            sync: GridSync::new(arena)?,
            slots: arena.alloc_zeroed(blocks * 4)?,
            errors: arena.alloc_zeroed(4)?,
            blocks,
        })
    }

    /// One launch running `phases` × 2 barriers (each phase: write, barrier, check, barrier).
    pub fn launch(&self, gpu: &Gpu, phases: usize) -> Result<Launch> {
        let p = GridSyncCheckParams {
            sync: self.sync,
            slots: self.slots.0,
            errors: self.errors.0,
            phases: phases as i32,
            pad: 0,
        };
        Launch::new(
            gpu,
            "grid_sync_check",
            (self.blocks as u32, 1, 1),
            THREADS,
            0,
            &p,
        )
    }
}
