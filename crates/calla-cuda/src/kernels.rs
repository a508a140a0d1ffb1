//! The kernel sources, embedded in the binary (one source of truth: `kernels/*.cu`).

/// One NVRTC program: a kernel family's `.cu`, compiled after `common.cuh`.
pub struct KernelSource {
    /// module name (cache file names, logs)
    pub name: &'static str,
    /// file name, for compiler messages
    pub file: &'static str,
    pub source: &'static str,
}

pub const COMMON_HEADER: &str = include_str!("../kernels/common.cuh");

macro_rules! kernel_source {
    ($name:literal) => {
        KernelSource {
            name: $name,
            file: concat!($name, ".cu"),
            source: include_str!(concat!("../kernels/", $name, ".cu")),
        }
    };
}

pub const MATVEC: KernelSource = kernel_source!("matvec");
pub const DELTANET: KernelSource = kernel_source!("deltanet");
/// DeltaNet head dims the compiled kernels do not cover (deltanet_general.rs); on demand.
pub const DELTANET_GENERAL: KernelSource = kernel_source!("deltanet_general");
pub const MOE: KernelSource = kernel_source!("moe");
pub const SELECT: KernelSource = kernel_source!("select");
pub const FILL: KernelSource = kernel_source!("fill");
pub const GRID_SYNC: KernelSource = kernel_source!("grid_sync");

// The modules that use the tensor cores (the prompt path, decode attention and the q4 decode
// matvec): kernels/mma.cuh
// (tensor-core and cp.async helpers) is prepended to each.
macro_rules! mma_kernel_source {
    ($name:literal) => {
        KernelSource {
            name: $name,
            file: concat!($name, ".cu"),
            source: concat!(
                "#line 1 \"mma.cuh\"\n",
                include_str!("../kernels/mma.cuh"),
                "\n#line 1 \"",
                $name,
                ".cu\"\n",
                include_str!(concat!("../kernels/", $name, ".cu"))
            ),
        }
    };
}

pub const ATTENTION: KernelSource = mma_kernel_source!("attention");
pub const MATVEC_TC: KernelSource = mma_kernel_source!("matvec_tc");
pub const GEMM: KernelSource = mma_kernel_source!("gemm");
pub const DELTANET_PREFILL: KernelSource = mma_kernel_source!("deltanet_prefill");
pub const ATTENTION_PREFILL: KernelSource = mma_kernel_source!("attention_prefill");
pub const MOE_PREFILL: KernelSource = mma_kernel_source!("moe_prefill");
/// Lab only: the streaming floor decode kernels are measured against (tests/gpu/stream_floor.rs);
/// mma.cuh for its mbarrier helpers (the bulk-copy chain link).
pub const LAB_STREAM: KernelSource = mma_kernel_source!("lab_stream");

/// The persistent decode layer (kernels/decode_layer.cu): its phases are the device functions of the
/// decode kernels, so their sources come first (with `#line` markers for compiler messages).
pub const DECODE_LAYER: KernelSource = KernelSource {
    name: "decode_layer",
    file: "decode_layer.cu",
    source: concat!(
        "#define PHASES_ONLY\n#line 1 \"matvec.cu\"\n",
        include_str!("../kernels/matvec.cu"),
        "\n#line 1 \"deltanet.cu\"\n",
        include_str!("../kernels/deltanet.cu"),
        "\n#line 1 \"moe.cu\"\n",
        include_str!("../kernels/moe.cu"),
        "\n#line 1 \"decode_layer.cu\"\n",
        include_str!("../kernels/decode_layer.cu")
    ),
};

/// The modules every engine loads at start-up, in load order.
pub const ALL: &[&KernelSource] = &[
    &MATVEC,
    &MATVEC_TC,
    &DELTANET,
    &ATTENTION,
    &MOE,
    &SELECT,
    &FILL,
    &GRID_SYNC,
    &GEMM,
    &DELTANET_PREFILL,
    &ATTENTION_PREFILL,
    &MOE_PREFILL,
];

/// Modules compiled and loaded the first time one of their kernels is asked for: the opt-in
/// persistent decode layer (CALLA_DECODE=layer), the lab's streaming floor and the DeltaNet kernels
/// for head dims without a compiled copy, so that start-up does not compile them for everyone.
pub const ON_DEMAND: &[&KernelSource] = &[&DECODE_LAYER, &LAB_STREAM, &DELTANET_GENERAL];

/// Whether a launcher may pick a kernel compiled for Qwen3.5/3.6's dims (docs/performance.md,
/// sessions 18–19) over the general one it was made from: yes unless the lab switch `switch`
/// (`CALLA_LAB_ATTN_GENERIC`, `_DN_`, `_GATE_UP_`, `_DOWN_`, `_OUT_`, `_SEGMENTS_GENERIC`) is set, which A/B runs
/// and the GPU test of the copies against the general kernels use.
pub fn compiled_copy_allowed(switch: &str) -> bool {
    std::env::var_os(switch).is_none()
}
