//! The decode kernels compiled for Qwen3.5/3.6's dims (docs/experiments.md): the
//! launchers pick each copy for the real model's spec and the general kernel for other dims, and
//! every name they pick for the real model is a kernel its .cu file defines (a renamed or removed
//! copy would otherwise surface only when a GPU loads the module). That a copy computes what its
//! general kernel computes is checked on the GPU: the real-shape digests are the same with and
//! without `KernelChoices::compiled_copies`, and every kernel test runs against the CPU reference.

use calla_cuda::ops::matvec::HeadNorm;
use calla_cuda::ops::moe::{RouteParams, RouteTail};
use calla_cuda::ops::{attention, deltanet, matvec, moe};
use calla_cuda::runtime::kernels::{KernelSource, ATTENTION, DELTANET, MATVEC_TC, MOE_TC};
use calla_model::synthetic::preset;

/// Whether `src` defines `extern "C" __global__ … name(`.
fn defines(src: &KernelSource, name: &str) -> bool {
    let call = format!(" {name}(");
    let mut after_global = false;
    for line in src.source.lines() {
        if line.contains("extern \"C\" __global__") {
            after_global = true;
        }
        // the name may sit on the line after `extern "C" __global__ … __launch_bounds__(…)`
        if after_global && line.contains(&call) {
            return true;
        }
        if line.contains('{') {
            after_global = false;
        }
    }
    false
}

fn route(e: i32, a: i32) -> RouteParams {
    RouteParams {
        e,
        a,
        ..Default::default()
    }
}

fn tail(e: i32, bits: i32) -> RouteTail {
    RouteTail {
        e,
        bits,
        ..Default::default()
    }
}

const DN_NORM: HeadNorm = HeadNorm {
    head_dim: 128,
    nparts: 8,
    eps: 1e-6,
};

/// The DeltaNet in-projection's segments as engine/decode.rs stacks them: q|k|v (the conv channels), z, b, a.
fn deltanet_in_rows(spec: &calla_model::ModelSpec) -> Vec<usize> {
    let hv = spec.linear_num_value_heads;
    vec![spec.linear_conv_dim(), spec.linear_value_dim(), hv, hv]
}

/// Attention's in-projection segments: q with its gate, k, v.
fn attention_in_rows(spec: &calla_model::ModelSpec) -> Vec<usize> {
    let kv = spec.num_key_value_heads * spec.head_dim;
    vec![2 * spec.num_attention_heads * spec.head_dim, kv, kv]
}

#[test]
fn the_real_model_gets_the_compiled_copies_and_they_exist() {
    let spec = preset("qwen3.6-35b-a3b").expect("the real model's preset");
    let picks = [
        (
            &ATTENTION,
            attention::barrier_kernel(true, &spec).to_string(),
        ),
        (&DELTANET, deltanet::parts_kernel(true, &spec)),
        (
            &MOE_TC,
            moe::gate_up_kernel(true, 2048, 512, 512, 8, Some(&route(256, 8))),
        ),
        (
            &MOE_TC,
            moe::down_kernel(true, 2048, 8, Some(512), Some(512)).to_string(),
        ),
        (
            &MATVEC_TC,
            matvec::routed_kernel(true, 4096, &tail(256, 8), Some(&DN_NORM)),
        ),
        (
            &MATVEC_TC,
            matvec::routed_kernel(true, 4096, &tail(256, 8), None),
        ),
        (
            &MATVEC_TC,
            matvec::fixed_rows_kernel(true, 2, &deltanet_in_rows(&spec)),
        ),
        (
            &MATVEC_TC,
            matvec::fixed_rows_kernel(true, 2, &attention_in_rows(&spec)),
        ),
        (
            &MATVEC_TC,
            matvec::fixed_rows_kernel(true, 2, &[spec.vocab_size]),
        ),
    ];
    let expected = [
        "attn_decode_bf16_bar_dh256_g8",
        "deltanet_decode_kpl4_split8_parts_k4_v128_r2",
        "matvec_tc_gate_up_q4_c2_e256_a8_i512",
        "matvec_tc_down_q4_a8_i512_d2048",
        "matvec_tc_headnorm_route_q4_c4_e256_q8_hd128",
        "matvec_tc_route_q4_c4_e256_q8",
        "matvec_tc_q4_c2_s8192_4096_32_32",
        "matvec_tc_q4_c2_s8192_512_512",
        "matvec_tc_q4_c2_s1",
    ];
    for ((src, name), want) in picks.iter().zip(expected) {
        assert_eq!(name, want, "the launcher's pick for the real model");
        assert!(defines(src, name), "{} defines no kernel {name}", src.file);
    }
    // the check finds definitions, not mentions: these names occur in comments or not at all
    assert!(!defines(&MOE_TC, "matvec_tc_gate_up_q4_c2_e256_a8_i1024"));
    assert!(!defines(&MATVEC_TC, "tc_body"));
}

#[test]
fn other_dims_get_the_general_kernels() {
    let tiny = preset("tiny").expect("the tiny preset");
    assert_eq!(
        attention::barrier_kernel(true, &tiny),
        "attn_decode_bf16_bar"
    );
    assert!(defines(&ATTENTION, "attn_decode_bf16_bar"));
    assert!(!deltanet::parts_kernel(true, &tiny).ends_with("_k4_v128_r2"));
    // one dim off is enough to fall back
    assert_eq!(
        moe::gate_up_kernel(true, 2048, 512, 512, 8, Some(&route(128, 8))),
        "matvec_tc_gate_up_q4_c2"
    );
    assert_eq!(
        moe::gate_up_kernel(true, 2048, 768, 512, 8, Some(&route(256, 8))),
        "matvec_tc_gate_up_q4_c2"
    );
    assert_eq!(
        moe::gate_up_kernel(true, 2048, 512, 512, 8, None),
        "matvec_tc_gate_up_q4_c2"
    );
    assert_eq!(
        moe::down_kernel(true, 2048, 10, Some(512), Some(512)),
        "matvec_tc_down_q4"
    );
    assert_eq!(
        moe::down_kernel(true, 4096, 8, Some(512), Some(512)),
        "matvec_tc_down_q4"
    );
    assert_eq!(
        matvec::routed_kernel(true, 4096, &tail(256, 4), Some(&DN_NORM)),
        "matvec_tc_headnorm_route_q4_c4"
    );
    let wide_heads = HeadNorm {
        head_dim: 256,
        ..DN_NORM
    };
    assert_eq!(
        matvec::routed_kernel(true, 4096, &tail(256, 8), Some(&wide_heads)),
        "matvec_tc_headnorm_route_q4_c4"
    );
    assert_eq!(
        matvec::routed_kernel(true, 2048, &tail(256, 8), None),
        "matvec_tc_route_q4_c2"
    );
    assert_eq!(
        matvec::fixed_rows_kernel(true, 2, &deltanet_in_rows(&tiny)),
        "matvec_tc_q4_c2"
    );
    // the same rows at another K, or one segment's rows off, or lm_head's single segment
    assert_eq!(
        matvec::fixed_rows_kernel(true, 4, &[8192, 4096, 32, 32]),
        "matvec_tc_q4_c4"
    );
    assert_eq!(
        matvec::fixed_rows_kernel(true, 2, &[8192, 4096, 48, 32]),
        "matvec_tc_q4_c2"
    );
    assert_eq!(
        matvec::fixed_rows_kernel(true, 2, &[8192, 512, 256]),
        "matvec_tc_q4_c2"
    );
    // one segment: whole tiles only
    assert_eq!(
        matvec::fixed_rows_kernel(true, 2, &[248_328]),
        "matvec_tc_q4_c2"
    );
    assert_eq!(
        matvec::fixed_rows_kernel(true, 4, &[248_320]),
        "matvec_tc_q4_c4"
    );
}
