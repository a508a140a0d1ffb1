//! A sequence's state on the device: conv rings and recurrent states of the DeltaNet layers, K/V
//! caches of the attention layers (layout: forward::StateLayout), in one allocation. A snapshot is
//! a device-to-device copy.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Result;
use calla_engine::Sequence;

use std::sync::Arc;

use calla_model::LayerKind;

use crate::engine::decode::StateLayout;
use crate::runtime::gpu::{DPtr, DeviceBuffer};

pub struct CudaSequence {
    pub(crate) state: DeviceBuffer,
    /// the full layout (the backend's), and whether `state` is compact (`StateLayout::regions`
    /// for `len` positions, back to back) rather than full
    layout: Arc<(StateLayout, Vec<LayerKind>)>,
    compact: bool,
    pub(crate) len: usize,
    /// unique per sequence made (a dropped sequence's memory may come back for a new one): what a
    /// step started ahead is matched on
    pub(crate) id: u64,
    /// a step on this sequence was started ahead (`step_pipelined`) and its token has not been
    /// taken by a call on this sequence: only that call may come next
    pub(crate) ran_ahead: bool,
}

fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl CudaSequence {
    pub fn base(&self) -> DPtr {
        self.state.ptr
    }

    pub(crate) fn new(
        state: DeviceBuffer,
        layout: Arc<(StateLayout, Vec<LayerKind>)>,
    ) -> Result<CudaSequence> {
        state.gpu().memset_zero(state.ptr, state.bytes)?;
        Ok(CudaSequence {
            state,
            layout,
            compact: false,
            len: 0,
            id: next_id(),
            ran_ahead: false,
        })
    }

    /// Whether the state is a compact snapshot (only `step` on a full one).
    pub fn is_compact(&self) -> bool {
        self.compact
    }

    /// The copy: compact from a full state, full from a compact one.
    fn try_snapshot(&self) -> Result<CudaSequence> {
        let gpu = self.state.gpu().clone();
        let (layout, kinds) = &*self.layout;
        let regions = layout.regions(kinds, self.len);
        let copy = if self.compact {
            let full = gpu.alloc(layout.bytes)?;
            gpu.memset_zero(full.ptr, full.bytes)?;
            for &(f, c, n) in &regions {
                gpu.dtod(full.ptr.offset(f), self.state.ptr.offset(c), n)?;
            }
            full
        } else {
            let bytes = regions.iter().map(|r| r.2).sum::<usize>();
            let compact = gpu.alloc(bytes)?;
            for &(f, c, n) in &regions {
                gpu.dtod(compact.ptr.offset(c), self.state.ptr.offset(f), n)?;
            }
            compact
        };
        gpu.sync()?;
        Ok(CudaSequence {
            state: copy,
            layout: self.layout.clone(),
            compact: !self.compact,
            len: self.len,
            id: next_id(),
            ran_ahead: self.ran_ahead,
        })
    }

    /// Make a compact state full in place (the backend steps full states only).
    pub(crate) fn make_full(&mut self) -> Result<()> {
        if self.compact {
            let mut full = self.try_snapshot()?;
            std::mem::swap(&mut self.state, &mut full.state);
            self.compact = false;
            // `full` now holds the compact buffer and is dropped (after a stream sync) here
        }
        Ok(())
    }
}

impl Drop for CudaSequence {
    fn drop(&mut self) {
        // A step started ahead may still write this state (a request that stopped at its stop
        // token): let the stream pass it before the memory is freed.
        let _ = self.state.gpu().sync();
    }
}

impl Sequence for CudaSequence {
    fn len(&self) -> usize {
        self.len
    }
    fn snapshot(&self) -> Box<dyn Sequence> {
        // The trait cannot return an error: running out of GPU memory here is reported loudly and
        // leaves an empty sequence, which the backend refuses to use (len mismatch is impossible
        // to hide: its state is zero and its length 0).
        match self.try_snapshot() {
            Ok(s) => Box::new(s),
            Err(e) => {
                tracing::error!("cuda sequence snapshot failed: {e:#}");
                Box::new(FailedSnapshot(format!("{e:#}")))
            }
        }
    }
    fn byte_size(&self) -> usize {
        self.state.bytes
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// What a snapshot that could not be made turns into: every backend call on it fails with the
/// original error.
pub struct FailedSnapshot(pub String);

impl Sequence for FailedSnapshot {
    fn len(&self) -> usize {
        0
    }
    fn snapshot(&self) -> Box<dyn Sequence> {
        Box::new(FailedSnapshot(self.0.clone()))
    }
    fn byte_size(&self) -> usize {
        0
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
