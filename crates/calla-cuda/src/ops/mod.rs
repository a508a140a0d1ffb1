//! The kernel families, each a `.cu` file beside the launcher that sizes its grids and fills its
//! `#[repr(C)]` parameters: decode (`matvec`, `deltanet`, `attention`, `moe`, `select`) and the
//! prompt path (`gemm`, `deltanet_prefill`, `attention_prefill`, `moe_prefill`). `common.cuh`
//! (number formats, reductions, the fused routing, the selection's result) is compiled before
//! every family, `mma.cuh` (tensor-core and copy helpers) before those that use the tensor cores.
//! [`weights`] is the device layout of the weights the kernels read, [`prompt_precision`] which
//! products the prompt GEMMs run in.

pub mod attention;
pub mod attention_prefill;
pub mod deltanet;
pub mod deltanet_general;
pub mod deltanet_prefill;
pub mod gemm;
pub mod matvec;
pub mod moe;
pub mod moe_prefill;
pub mod prompt_precision;
pub mod select;
pub mod weights;
