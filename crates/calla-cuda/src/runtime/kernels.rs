//! The kernel sources, embedded in the binary (one source of truth: `src/ops/*.cu`, and
//! `src/fill.cu` beside the synthetic models that use it).

/// One NVRTC program: a kernel family's `.cu`, compiled after `common.cuh`.
pub struct KernelSource {
    /// module name (cache file names, logs)
    pub name: &'static str,
    /// file name, for compiler messages
    pub file: &'static str,
    pub source: &'static str,
}

/// Compiled before every kernel family, in this order: number formats, loads and reductions
/// (common.cuh), the decode dot products and counter waits (dot.cuh), the selection's result
/// (selection.cuh), the decode launches' shared parameters (decode_params.cuh), the MoE routing
/// (routing.cuh).
pub const COMMON_HEADER: &str = concat!(
    include_str!("../ops/common.cuh"),
    "#line 1 \"dot.cuh\"\n",
    include_str!("../ops/dot.cuh"),
    "#line 1 \"selection.cuh\"\n",
    include_str!("../ops/selection.cuh"),
    "#line 1 \"decode_params.cuh\"\n",
    include_str!("../ops/decode_params.cuh"),
    "#line 1 \"routing.cuh\"\n",
    include_str!("../ops/routing.cuh")
);

macro_rules! kernel_source {
    ($name:literal) => {
        KernelSource {
            name: $name,
            file: concat!($name, ".cu"),
            source: include_str!(concat!("../ops/", $name, ".cu")),
        }
    };
}

pub const MATVEC: KernelSource = kernel_source!("matvec");
pub const DELTANET: KernelSource = kernel_source!("deltanet");
/// DeltaNet head dims the compiled kernels do not cover (deltanet_general.rs).
pub const DELTANET_GENERAL: KernelSource = kernel_source!("deltanet_general");
pub const MOE: KernelSource = kernel_source!("moe");
/// The token selection: its parameters, Philox and the radix select, then sampling, then the
/// kernels.
pub const SELECT: KernelSource = KernelSource {
    name: "select",
    file: "select.cu",
    source: concat!(
        "#line 1 \"select_rules.cuh\"\n",
        include_str!("../ops/select_rules.cuh"),
        "#line 1 \"select_sampling.cuh\"\n",
        include_str!("../ops/select_sampling.cuh"),
        "#line 1 \"select.cu\"\n",
        include_str!("../ops/select.cu")
    ),
};
pub const FILL: KernelSource = KernelSource {
    name: "fill",
    file: "fill.cu",
    source: include_str!("../fill.cu"),
};

// The modules that use the tensor cores (the prompt path, decode attention): mma.cuh (tensor-core
// and cp.async helpers) is prepended to each.
macro_rules! mma_kernel_source {
    ($name:literal) => {
        KernelSource {
            name: $name,
            file: concat!($name, ".cu"),
            source: concat!(
                "#line 1 \"mma.cuh\"\n",
                include_str!("../ops/mma.cuh"),
                "\n#line 1 \"",
                $name,
                ".cu\"\n",
                include_str!(concat!("../ops/", $name, ".cu"))
            ),
        }
    };
}

// The q4 decode products on the tensor cores: mma.cuh, then their shared body matvec_tc.cuh.
macro_rules! tc_kernel_source {
    ($name:literal) => {
        KernelSource {
            name: $name,
            file: concat!($name, ".cu"),
            source: concat!(
                "#line 1 \"mma.cuh\"\n",
                include_str!("../ops/mma.cuh"),
                "\n#line 1 \"matvec_tc.cuh\"\n",
                include_str!("../ops/matvec_tc.cuh"),
                "\n#line 1 \"",
                $name,
                ".cu\"\n",
                include_str!(concat!("../ops/", $name, ".cu"))
            ),
        }
    };
}

pub const ATTENTION: KernelSource = mma_kernel_source!("attention");
pub const MATVEC_TC: KernelSource = tc_kernel_source!("matvec_tc");
pub const MOE_TC: KernelSource = tc_kernel_source!("moe_tc");
pub const GEMM: KernelSource = mma_kernel_source!("gemm");
pub const DELTANET_PREFILL: KernelSource = mma_kernel_source!("deltanet_prefill");
pub const ATTENTION_PREFILL: KernelSource = mma_kernel_source!("attention_prefill");
pub const MOE_PREFILL: KernelSource = mma_kernel_source!("moe_prefill");

/// The modules every engine loads at start-up, in load order.
pub const ALL: &[&KernelSource] = &[
    &MATVEC,
    &MATVEC_TC,
    &MOE_TC,
    &DELTANET,
    &DELTANET_GENERAL,
    &ATTENTION,
    &MOE,
    &SELECT,
    &FILL,
    &GEMM,
    &DELTANET_PREFILL,
    &ATTENTION_PREFILL,
    &MOE_PREFILL,
];
