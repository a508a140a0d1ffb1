//! Allocations up front: a bump arena over large device blocks. Weights, scratch buffers and each
//! sequence's state are carved from arenas when the backend or the sequence is made; nothing is
//! allocated while a step runs, so the step can be captured as a graph.

use std::sync::Arc;

use anyhow::Result;

use crate::gpu::{DPtr, DeviceBuffer, Gpu};

/// Alignment of every region: 256 bytes (16-byte vector loads, coalesced segments).
pub const ALIGN: usize = 256;

pub struct Arena {
    gpu: Arc<Gpu>,
    blocks: Vec<DeviceBuffer>,
    used_in_last: usize,
    block_bytes: usize,
    /// bytes handed out (after alignment)
    pub used: usize,
}

impl Arena {
    /// An arena that grows by blocks of `block_bytes` (larger requests get their own block).
    pub fn new(gpu: &Arc<Gpu>, block_bytes: usize) -> Arena {
        Arena {
            gpu: gpu.clone(),
            blocks: Vec::new(),
            used_in_last: 0,
            block_bytes,
            used: 0,
        }
    }

    pub fn alloc(&mut self, bytes: usize) -> Result<DPtr> {
        let bytes = bytes.max(1).div_ceil(ALIGN) * ALIGN;
        let fits = self
            .blocks
            .last()
            .map(|b| self.used_in_last + bytes <= b.bytes)
            .unwrap_or(false);
        if !fits {
            let block = self.gpu.alloc(bytes.max(self.block_bytes))?;
            self.blocks.push(block);
            self.used_in_last = 0;
        }
        let last = self.blocks.last().expect("a block was just ensured");
        let ptr = last.ptr.offset(self.used_in_last);
        self.used_in_last += bytes;
        self.used += bytes;
        Ok(ptr)
    }

    /// A zeroed region.
    pub fn alloc_zeroed(&mut self, bytes: usize) -> Result<DPtr> {
        let p = self.alloc(bytes)?;
        self.gpu.memset_zero(p, bytes)?;
        Ok(p)
    }

    /// A region holding `values`.
    pub fn upload<T: Copy>(&mut self, values: &[T]) -> Result<DPtr> {
        let p = self.alloc(std::mem::size_of_val(values))?;
        self.gpu.htod(p, values)?;
        Ok(p)
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Bytes reserved from the device (≥ used).
    pub fn reserved(&self) -> usize {
        self.blocks.iter().map(|b| b.bytes).sum()
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // Work that reads the arena must finish before its memory goes back.
        let _ = self.gpu.sync();
    }
}
