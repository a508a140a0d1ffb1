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

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ChainParams {
    pub src: u64,
    pub bytes: u64,
    pub x_in: u64,
    pub x_out: u64,
    pub out: u64,
    pub xn: i32,
    pub mode: i32,
}

/// How a link of the synthetic decode chain treats its input and brings in its bytes (lab_stream.cu
/// stream_chain_link: 16-byte loads into registers; stream_chain_bulk: bulk copies into shared
/// memory by the TMA engine, sm_90).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainMode {
    /// the stream only
    StreamOnly,
    /// x read and summed over the block, then the stream (the decode kernels' order)
    InputFirst,
    /// x requested and the stream issued behind it at once
    InputWithStream,
    /// as InputFirst, block b reading its own copy at x_in + b·xn
    InputFirstOwnCopy,
    /// bulk copies only
    BulkOnly,
    /// x read and summed, then the bulk copies issued
    BulkAfterInput,
    /// the bulk copies issued at entry, x read and summed while they land
    BulkAtEntry,
}

/// Shared memory of stream_chain_bulk's ring (BULK_STAGES × BULK_CHUNK).
const BULK_RING_BYTES: u32 = 4 * 16384;

/// One link of the synthetic decode chain: stream `bytes` from `src` with `grid` blocks, read
/// `x_in` and write `x_out` (`xn` f32 each) as `mode` says.
#[allow(clippy::too_many_arguments)]
pub fn chain_link(
    gpu: &Gpu,
    src: DPtr,
    bytes: usize,
    x_in: DPtr,
    x_out: DPtr,
    xn: usize,
    out: DPtr,
    grid: u32,
    mode: ChainMode,
) -> Result<Launch> {
    ensure!(
        bytes.is_multiple_of(16) && src.0.is_multiple_of(16),
        "chain_link: {bytes} bytes at {:#x}: whole 16-byte chunks from a 16-byte boundary",
        src.0
    );
    ensure!(
        xn.is_multiple_of(4) && xn <= 8 * THREADS as usize,
        "chain_link: an input of {xn} floats (whole float4, at most 2 per thread)"
    );
    // the kernel, its mode number and its shared memory
    let (kernel, kmode, smem) = match mode {
        ChainMode::StreamOnly => ("stream_chain_link", 0, 0),
        ChainMode::InputFirst => ("stream_chain_link", 1, 0),
        ChainMode::InputWithStream => ("stream_chain_link", 2, 0),
        ChainMode::InputFirstOwnCopy => ("stream_chain_link", 3, 0),
        ChainMode::BulkOnly => ("stream_chain_bulk", 0, BULK_RING_BYTES),
        ChainMode::BulkAfterInput => ("stream_chain_bulk", 1, BULK_RING_BYTES),
        ChainMode::BulkAtEntry => ("stream_chain_bulk", 2, BULK_RING_BYTES),
    };
    let p = ChainParams {
        src: src.0,
        bytes: bytes as u64,
        x_in: x_in.0,
        x_out: x_out.0,
        out: out.0,
        xn: xn as i32,
        mode: kmode,
    };
    Launch::new(gpu, kernel, (grid.max(1), 1, 1), THREADS, smem, &p)
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct PersistentChainParams {
    pub links: u64,
    pub x: u64,
    pub sync_counter: u64,
    pub sync_opened: u64,
    pub out: u64,
    pub nlinks: i32,
    pub xn: i32,
    pub mode: i32,
    pub pad: i32,
}

/// The synthetic decode chain as one persistent launch (lab_stream.cu stream_chain_persistent):
/// `links` holds (src, bytes) pairs (u64 each), `x` two buffers of `xn` f32, `sync` two zeroed u64
/// (the grid barrier's counter, never reset: it counts on across launches). `prefetch`: each phase
/// requests the next one's first loads before its barrier. `blocks` must all be resident.
#[allow(clippy::too_many_arguments)]
pub fn chain_persistent(
    gpu: &Gpu,
    links: DPtr,
    nlinks: usize,
    x: DPtr,
    xn: usize,
    sync: DPtr,
    out: DPtr,
    blocks: u32,
    prefetch: bool,
) -> Result<Launch> {
    let p = PersistentChainParams {
        links: links.0,
        x: x.0,
        sync_counter: sync.0,
        sync_opened: sync.0 + 8,
        out: out.0,
        nlinks: nlinks as i32,
        xn: xn as i32,
        mode: if prefetch { 3 } else { 1 },
        pad: 0,
    };
    Launch::new(
        gpu,
        "stream_chain_persistent",
        (blocks.max(1), 1, 1),
        THREADS,
        0,
        &p,
    )
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RedLinkParams {
    pub src: u64,
    pub bytes: u64,
    pub x_in: u64,
    pub x_out: u64,
    pub acc: u64,
    pub out: u64,
    pub xn: i32,
    pub nred: i32,
    pub mode: i32,
    pub copies: i32,
}

/// How a [`red_link`] adds its values (lab_stream.cu stream_red_link).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedMode {
    None = 0,
    FixedI64 = 1,
    F32 = 2,
    F32x4 = 3,
}

/// A chain link (x read and summed, then `bytes` streamed) whose every block then adds `nred`
/// values into copy `block % copies` of `acc` ([copies][nred] 8-byte or 4-byte words).
#[allow(clippy::too_many_arguments)]
pub fn red_link(
    gpu: &Gpu,
    src: DPtr,
    bytes: usize,
    x_in: DPtr,
    x_out: DPtr,
    acc: DPtr,
    nred: usize,
    copies: usize,
    mode: RedMode,
    out: DPtr,
    grid: u32,
) -> Result<Launch> {
    ensure!(
        bytes.is_multiple_of(16) && nred.is_multiple_of(4) && copies >= 1,
        "red_link: {bytes} bytes, {nred} values, {copies} copies"
    );
    let p = RedLinkParams {
        src: src.0,
        bytes: bytes as u64,
        x_in: x_in.0,
        x_out: x_out.0,
        acc: acc.0,
        out: out.0,
        xn: 2048,
        nred: nred as i32,
        mode: mode as i32,
        copies: copies as i32,
    };
    Launch::new(gpu, "stream_red_link", (grid.max(1), 1, 1), THREADS, 0, &p)
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ProducerLink {
    pub src: u64,
    pub bytes: u64,
    pub dep: i32,
    pub pad: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ProducerChainParams {
    pub links: u64,
    pub x: u64,
    pub sync_counter: u64,
    pub sync_opened: u64,
    pub out: u64,
    pub stamps: u64,
    pub nlinks: i32,
    pub xn: i32,
    pub stages: i32,
    pub work: i32,
    pub chunk: i32,
    pub flags: i32,
}

/// stream_chain_producer's most stages, and the most shared memory its ring may take.
pub const PRODUCER_MAX_STAGES: u32 = 16;
pub const PRODUCER_MAX_RING: u32 = 13 * 16384;
/// Threads per block of stream_chain_producer: 8 warps run the links, one streams.
pub const PRODUCER_THREADS: u32 = 288;

/// The synthetic decode chain as one persistent grid of one block per SM with a producer warp
/// (lab_stream.cu stream_chain_producer): `links` holds [`ProducerLink`]s, `x` two buffers of `xn`
/// f32, `sync` two zeroed u64 (a grid barrier's counter; never reset). The producer streams every
/// link's bytes through `stages` × `chunk` bytes of shared memory, ahead of the links' barriers
/// except where a link names a `dep`; the links fold them with `work` FMAs per 32-bit word
/// (`chain` false: and do nothing else, no x and no barriers: the stream alone). One block per SM:
/// `blocks` must be the SM count (all resident). `stamps`: None, or u64 [nlinks][6] for block 0's
/// %globaltimer at each link's start, x summed, chunks folded and barrier passed, and when its
/// producer issued the link's first and last chunk. `poll_sleep`: the barrier's poll sleeps 100 ns
/// between loads.
#[allow(clippy::too_many_arguments)]
pub fn chain_producer(
    gpu: &Gpu,
    links: DPtr,
    nlinks: usize,
    x: DPtr,
    xn: usize,
    sync: DPtr,
    out: DPtr,
    stamps: Option<DPtr>,
    blocks: u32,
    stages: u32,
    chunk: u32,
    work: u32,
    chain: bool,
    poll_sleep: bool,
) -> Result<Launch> {
    let smem = stages * chunk;
    ensure!(
        (1..=PRODUCER_MAX_STAGES).contains(&stages)
            && chunk.is_multiple_of(16)
            && chunk > 0
            && smem <= PRODUCER_MAX_RING,
        "chain_producer: {stages} stages of {chunk} bytes (1..={PRODUCER_MAX_STAGES} stages, \
         whole 16-byte words, at most {PRODUCER_MAX_RING} bytes)"
    );
    ensure!(
        gpu.resident_blocks("stream_chain_producer", PRODUCER_THREADS, smem)? >= 1,
        "chain_producer: a block of {smem} bytes of shared memory does not fit an SM"
    );
    let p = ProducerChainParams {
        links: links.0,
        x: x.0,
        sync_counter: sync.0,
        sync_opened: sync.0 + 8,
        out: out.0,
        stamps: stamps.map_or(0, |s| s.0),
        nlinks: nlinks as i32,
        xn: xn as i32,
        stages: stages as i32,
        work: work as i32,
        chunk: chunk as i32,
        flags: if chain { 0 } else { 1 } | if poll_sleep { 2 } else { 0 },
    };
    Launch::new(
        gpu,
        "stream_chain_producer",
        (blocks.max(1), 1, 1),
        PRODUCER_THREADS,
        smem,
        &p,
    )
}
