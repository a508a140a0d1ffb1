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
pub const ATTENTION: KernelSource = kernel_source!("attention");
pub const MOE: KernelSource = kernel_source!("moe");
pub const SELECT: KernelSource = kernel_source!("select");
pub const FILL: KernelSource = kernel_source!("fill");

/// Every module, in load order.
pub const ALL: &[&KernelSource] = &[
    &MATVEC,
    &DELTANET,
    &ATTENTION,
    &MOE,
    &SELECT,
    &FILL,
];
