//! Launcher for kernels/lab_stream.cu (lab only): a kernel that does nothing but stream N bytes,
//! the floor each decode kernel's time is compared with (tests/gpu/stream_floor.rs).

use anyhow::{ensure, Result};

use crate::gpu::{DPtr, Gpu, Launch};

pub const THREADS: u32 = 256;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct StreamParams {
    pub src: u64,
    pub bytes: u64,
    pub out: u64,
}

/// Read `bytes` (a multiple of 16) from `src` with `grid` blocks, `in_flight` (1, 2, 4 or 8)
/// 16-byte loads per thread; `out` is a u32 that is never written in practice.
pub fn stream_read(
    gpu: &Gpu,
    src: DPtr,
    bytes: usize,
    out: DPtr,
    grid: u32,
    in_flight: usize,
) -> Result<Launch> {
    ensure!(
        bytes.is_multiple_of(16),
        "stream_read: {bytes} bytes is not whole 16-byte chunks"
    );
    ensure!(
        matches!(in_flight, 1 | 2 | 4 | 8),
        "stream_read: {in_flight} loads in flight (1, 2, 4 or 8)"
    );
    let p = StreamParams {
        src: src.0,
        bytes: bytes as u64,
        out: out.0,
    };
    Launch::new(
        gpu,
        &format!("stream_read_u{in_flight}"),
        (grid.max(1), 1, 1),
        THREADS,
        0,
        &p,
    )
}
