//! The #[repr(C)] parameter structs have the sizes the kernels' `static_assert`s state (the .cu
//! files check the same numbers at NVRTC compile time), so both sides agree on every layout.

use std::mem::size_of;

#[test]
fn parameter_structs_match_the_kernels() {
    use calla_cuda::engine::backend;
    use calla_cuda::ops::*;
    use calla_cuda::synthetic;
    let sizes = [
        ("MatrixRef", size_of::<weights::MatrixRef>(), 32),
        ("MatvecParams", size_of::<matvec::MatvecParams>(), 232),
        ("TcMatvecParams", size_of::<matvec::TcMatvecParams>(), 328),
        (
            "GreedyHeadParams",
            size_of::<matvec::GreedyHeadParams>(),
            304,
        ),
        ("TokenOut", size_of::<select::TokenOut>(), 56),
        ("EmbedParams", size_of::<matvec::EmbedParams>(), 64),
        ("DeltaNetParams", size_of::<deltanet::DeltaNetParams>(), 128),
        (
            "AttnDecodeParams",
            size_of::<attention::AttnDecodeParams>(),
            152,
        ),
        ("RouterParams", size_of::<moe::RouterParams>(), 128),
        ("GateUpParams", size_of::<moe::GateUpParams>(), 128),
        ("RouteParams", size_of::<moe::RouteParams>(), 64),
        ("TcGateUpParams", size_of::<moe::TcGateUpParams>(), 256),
        ("DownParams", size_of::<moe::DownParams>(), 152),
        ("SelectConfig", size_of::<select::SelectConfig>(), 64),
        ("SelectResult", size_of::<select::SelectResult>(), 176),
        ("SelectParams", size_of::<select::SelectParams>(), 104),
        ("PenaltyParams", size_of::<select::PenaltyParams>(), 48),
        ("FillParams", size_of::<synthetic::FillParams>(), 40),
        ("Cursor", size_of::<backend::Cursor>(), 16),
    ];
    for (name, got, want) in sizes {
        assert_eq!(got, want, "{name}");
    }
}
