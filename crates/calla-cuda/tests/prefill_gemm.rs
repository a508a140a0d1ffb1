//! gemm.cu against the CPU reference: every weight format in both precisions at odd prompt sizes,
//! the epilogues (accumulate, SwiGLU → planes, gather, per-row scale), the RMSNorm/embedding row
//! kernels, and the real layer shapes. Run on a GPU: `cargo test --release -p calla-cuda --test
//! prefill_gemm -- --ignored --nocapture` (scripts/gpu-parity.sh runs it).

mod prefill_support;

use calla_cpu::linear::Linear;
use calla_cpu::random::Rng;
use calla_cuda::ops::gemm::{self, Gemm, GemmOut, Planes, Precision, TensorCores};
use calla_cuda::ops::weights::DevMatrix;
use calla_cuda::runtime::gpu::Gpu;
use calla_cuda::runtime::pool::Arena;
use prefill_support::*;

/// Y = X·Wᵀ in f64 from the dequantised weights.
fn reference(x: &[f32], t: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0f32; t * n];
    for i in 0..t {
        for r in 0..n {
            let mut acc = 0f64;
            for c in 0..k {
                acc += x[i * k + c] as f64 * w[r * k + c] as f64;
            }
            y[i * n + r] = acc as f32;
        }
    }
    y
}

/// `X·Wᵀ` of `t` rows into a fresh f32 output (no gather, scale or SwiGLU), downloaded.
#[allow(clippy::too_many_arguments)]
fn plain_product(
    gpu: &Gpu,
    arena: &mut Arena,
    planes: Planes,
    t: usize,
    w: &DevMatrix,
    n: usize,
    precision: Precision,
    cores: TensorCores,
) -> Vec<f32> {
    let y = arena.alloc_zeroed(t * n * 4).unwrap();
    let g = Gemm {
        a: planes.for_precision(precision),
        gather: None,
        m: t,
        w,
        n,
        swiglu: false,
        out: GemmOut::F32 {
            ptr: y,
            ld: n,
            accumulate: false,
        },
        row_scale: None,
        precision,
        grouped: None,
    };
    run(gpu, &[gemm::gemm_on(gpu, &g, cores).unwrap()]);
    download_f32(gpu, y, t * n)
}

/// One GEMM (no normalisation downstream): bf16 products give rms errors ~3e-3 (5e-3 after SwiGLU);
/// split ~3e-6.
fn tolerance(p: Precision) -> Tol {
    match p {
        Precision::Fast => Tol {
            atol_rms: 0.05,
            rtol: 0.02,
            rms_rel: 8e-3,
        },
        Precision::Split => Tol {
            atol_rms: 1e-4,
            rtol: 1e-4,
            rms_rel: 3e-5,
        },
        // each operand rounded to f16 (11 bits): ~2e-4 rms per product
        Precision::Half => Tol {
            atol_rms: 5e-3,
            rtol: 5e-3,
            rms_rel: 8e-4,
        },
    }
}

/// The precisions `gemm` runs over `fmt` here: half only for q4 on wgmma.
fn precisions(gpu: &Gpu, fmt: WFmt) -> Vec<Precision> {
    let mut p = vec![Precision::Fast, Precision::Split];
    if fmt == WFmt::Q4 && TensorCores::for_gpu(gpu) == TensorCores::Wgmma {
        p.push(Precision::Half);
    }
    p
}

#[test]
#[ignore = "needs CUDA"]
fn every_format_and_precision_matches_the_reference_at_odd_sizes() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::new(7);
    let (n, k) = (200, 192);
    let mut ok = true;
    for fmt in [WFmt::F32, WFmt::Bf16, WFmt::F16, WFmt::Q4, WFmt::Q8] {
        let mut arena = Arena::new(&gpu, 64 << 20);
        let m = matrix(&mut rng, n, k, 1.0 / (k as f32).sqrt(), fmt);
        let w_ref = m.to_f32();
        let dev = upload_matrix(&gpu, &mut arena, "w", &m);
        for t in TOKEN_COUNTS {
            let x = rng.normal_vec(t * k, 1.0);
            let want = reference(&x, t, &w_ref, n, k);
            let xd = upload_f32(&mut arena, &x);
            let planes = alloc_planes(&mut arena, t * k, k);
            // plain conversion (no gain) through the row kernel
            run(
                &gpu,
                &[gemm::rmsnorm_planes(&gpu, xd, None, 0.0, t, k, planes).unwrap()],
            );
            for prec in precisions(&gpu, fmt) {
                let got = plain_product(
                    &gpu,
                    &mut arena,
                    planes,
                    t,
                    &dev,
                    n,
                    prec,
                    TensorCores::for_gpu(&gpu),
                );
                let tol = tolerance(prec);
                ok &= check(
                    &format!("{fmt:?} {prec:?} T={t} [{n}x{k}]"),
                    &got,
                    &want,
                    tol,
                );
            }
        }
    }
    assert!(ok, "some GEMMs are out of tolerance (see above)");
}

#[test]
#[ignore = "needs CUDA"]
fn epilogues_accumulate_swiglu_gather_and_row_scale() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::new(8);
    let mut ok = true;
    let (k, i) = (128, 96); // gate/up: 2I rows
    for fmt in [WFmt::F32, WFmt::Q4] {
        let mut arena = Arena::new(&gpu, 64 << 20);
        let m = matrix(&mut rng, 2 * i, k, 1.0 / (k as f32).sqrt(), fmt);
        let w_ref = m.to_f32();
        let dev = upload_matrix(&gpu, &mut arena, "gate_up", &m);
        for t in [1usize, 65, 150] {
            let rows_src = t + 9; // gather from a larger table
            let x = rng.normal_vec(rows_src * k, 1.0);
            let gather: Vec<i32> = (0..t).map(|_| rng.below(rows_src) as i32).collect();
            let scale: Vec<f32> = (0..t).map(|_| rng.range(0.1, 1.0)).collect();
            let xg: Vec<f32> = gather
                .iter()
                .flat_map(|r| x[*r as usize * k..(*r as usize + 1) * k].to_vec())
                .collect();
            let full = reference(&xg, t, &w_ref, 2 * i, k);
            // SwiGLU: out[t, j] = silu(gate_j)·up_j · scale[t]
            let want: Vec<f32> = (0..t * i)
                .map(|idx| {
                    let (tt, j) = (idx / i, idx % i);
                    let (g, u) = (full[tt * 2 * i + j], full[tt * 2 * i + i + j]);
                    g / (1.0 + (-g).exp()) * u * scale[tt]
                })
                .collect();
            let xd = upload_f32(&mut arena, &x);
            let planes = alloc_planes(&mut arena, rows_src * k, k);
            run(
                &gpu,
                &[gemm::rmsnorm_planes(&gpu, xd, None, 0.0, rows_src, k, planes).unwrap()],
            );
            let gd = arena.upload(&gather).unwrap();
            let sd = upload_f32(&mut arena, &scale);
            for prec in precisions(&gpu, fmt) {
                // what a consumer of `prec` reads (half: the f16 plane alone)
                let out = alloc_planes(&mut arena, t * i, i).for_precision(prec);
                let g = Gemm {
                    a: planes.for_precision(prec),
                    gather: Some(gd),
                    m: t,
                    w: &dev,
                    n: 2 * i,
                    swiglu: true,
                    out: GemmOut::Planes(out),
                    row_scale: Some(sd),
                    precision: prec,
                    grouped: None,
                };
                run(&gpu, &[gemm::gemm(&gpu, &g).unwrap()]);
                let got = if prec == Precision::Half {
                    download_f16(&gpu, out, t * i)
                } else {
                    download_planes(&gpu, out, t * i)
                };
                let tol = tolerance(prec);
                ok &= check(
                    &format!("swiglu+gather+scale {fmt:?} {prec:?} T={t}"),
                    &got,
                    &want,
                    tol,
                );

                // accumulate: y = y0 + X·Wᵀ (the plain rows, no gather)
                let y0 = rng.normal_vec(t * 2 * i, 1.0);
                let y = upload_f32(&mut arena, &y0);
                let g = Gemm {
                    a: planes.for_precision(prec),
                    gather: None,
                    m: t,
                    w: &dev,
                    n: 2 * i,
                    swiglu: false,
                    out: GemmOut::F32 {
                        ptr: y,
                        ld: 2 * i,
                        accumulate: true,
                    },
                    row_scale: None,
                    precision: prec,
                    grouped: None,
                };
                run(&gpu, &[gemm::gemm(&gpu, &g).unwrap()]);
                let plain = reference(&x[..t * k], t, &w_ref, 2 * i, k);
                let want_acc: Vec<f32> = y0.iter().zip(&plain).map(|(a, b)| a + b).collect();
                let got = download_f32(&gpu, y, t * 2 * i);
                ok &= check(
                    &format!("accumulate {fmt:?} {prec:?} T={t}"),
                    &got,
                    &want_acc,
                    tol,
                );
            }
        }
    }
    assert!(ok, "some epilogues are out of tolerance (see above)");
}

#[test]
#[ignore = "needs CUDA"]
fn rmsnorm_planes_and_embedding_rows() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::new(9);
    let mut arena = Arena::new(&gpu, 64 << 20);
    let (t, d) = (150, 2048);
    let x = rng.normal_vec(t * d, 2.0);
    let w = rng.normal_vec(d, 0.1);
    let gain: Vec<f32> = w.iter().map(|v| 1.0 + v).collect();
    let mut want = vec![0f32; t * d];
    calla_cpu::norm::rms_norm_zero_centred_into(&x, &w, 1e-6, &mut want);
    let xd = upload_f32(&mut arena, &x);
    let gd = upload_f32(&mut arena, &gain);
    let planes = alloc_planes(&mut arena, t * d, d);
    run(
        &gpu,
        &[gemm::rmsnorm_planes(&gpu, xd, Some(gd), 1e-6, t, d, planes).unwrap()],
    );
    let got = download_planes(&gpu, planes, t * d);
    let mut ok = check(
        "rmsnorm → planes (hi+lo)",
        &got,
        &want,
        // hi + lo hold ~16 bits of mantissa: ~2.5e-6 rms measured
        Tol {
            atol_rms: 1e-5,
            rtol: 1e-5,
            rms_rel: 1e-5,
        },
    );
    let hi_only = download_planes(
        &gpu,
        Planes {
            lo: calla_cuda::runtime::gpu::DPtr::NULL,
            ..planes
        },
        t * d,
    );
    ok &= check(
        "rmsnorm → hi plane (bf16)",
        &hi_only,
        &want,
        Tol {
            atol_rms: 0.0,
            rtol: 8e-3,
            rms_rel: 3e-3,
        },
    );

    for fmt in [WFmt::F32, WFmt::Bf16, WFmt::Q4, WFmt::Q8] {
        let (v, d) = (300, 256);
        let table = matrix(&mut rng, v, d, 1.0, fmt);
        let dev = upload_matrix(&gpu, &mut arena, "embed", &table);
        let tokens: Vec<i32> = (0..77).map(|_| rng.below(v) as i32).collect();
        let td = arena.upload(&tokens).unwrap();
        let h = arena.alloc_zeroed(tokens.len() * d * 4).unwrap();
        run(
            &gpu,
            &[gemm::embed_rows(&gpu, &dev, td, tokens.len(), h).unwrap()],
        );
        let got = download_f32(&gpu, h, tokens.len() * d);
        let lin = Linear::new("embed", &table, v, d).unwrap();
        let mut want = vec![0f32; tokens.len() * d];
        for (row, tok) in want.chunks_exact_mut(d).zip(&tokens) {
            lin.decode_row(*tok as usize, row);
        }
        ok &= check(&format!("embed rows {fmt:?}"), &got, &want, EXACTISH);
    }
    assert!(ok);
}

#[test]
#[ignore = "needs CUDA"]
fn real_layer_shapes_q4_and_bf16() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::new(10);
    let mut ok = true;
    // (name, N, K, format, T): in_proj_qkv, out_proj, shared gate_up, o_proj in bf16
    for (name, n, k, fmt, t) in [
        ("in_proj_qkv q4", 8192, 2048, WFmt::Q4, 150),
        ("out_proj q4", 2048, 4096, WFmt::Q4, 65),
        ("shared gate_up q4", 1024, 2048, WFmt::Q4, 1000),
        ("o_proj bf16", 2048, 4096, WFmt::Bf16, 63),
    ] {
        let mut arena = Arena::new(&gpu, 256 << 20);
        let m = matrix(&mut rng, n, k, 1.0 / (k as f32).sqrt(), fmt);
        let lin = Linear::new(name, &m, n, k).unwrap();
        let dev = upload_matrix(&gpu, &mut arena, name, &m);
        let x = rng.normal_vec(t * k, 1.0);
        let mut want = vec![0f32; t * n];
        lin.matmul(&x, t, &mut want);
        let xd = upload_f32(&mut arena, &x);
        let planes = alloc_planes(&mut arena, t * k, k);
        run(
            &gpu,
            &[gemm::rmsnorm_planes(&gpu, xd, None, 0.0, t, k, planes).unwrap()],
        );
        for prec in precisions(&gpu, fmt) {
            let got = plain_product(
                &gpu,
                &mut arena,
                planes,
                t,
                &dev,
                n,
                prec,
                TensorCores::for_gpu(&gpu),
            );
            let tol = tolerance(prec);
            ok &= check(
                &format!("{name} {prec:?} T={t} [{n}x{k}]"),
                &got,
                &want,
                tol,
            );
        }
    }
    assert!(ok);
}

/// q4 in groups of 64, split precision, on Hopper's warpgroup MMA (`gemm_q4_wgx_split`) and on the
/// portable mma.sync kernel (`gemm_q4_splitx`), and in half precision (`gemm_q4_wgh`, f16 operands),
/// each against the f64 reference, at sizes that leave partial tiles in M, N and K-stages
/// (K = 64: one k-tile; 192: fewer k-tiles than pipeline stages + 1) and at real layer shapes.
#[test]
#[ignore = "needs CUDA"]
fn q4_on_wgmma_and_mma_sync_match_the_reference() {
    let Some(gpu) = gpu() else { return };
    if gpu.arch != "sm_90a" {
        println!("skipped: wgmma needs sm_90a ({})", gpu.arch);
        return;
    }
    let mut rng = Rng::new(11);
    let mut ok = true;
    for (n, k, t) in [
        (200, 192, 1),
        (200, 192, 130),
        (136, 64, 257),
        (72, 128, 7),
        (2048, 4096, 65),
        (8192, 2048, 300),
        (600, 512, 129), // half: a partial 256-row N tile after two full ones
    ] {
        let mut arena = Arena::new(&gpu, 256 << 20);
        let m = matrix(&mut rng, n, k, 1.0 / (k as f32).sqrt(), WFmt::Q4);
        let w_ref = m.to_f32();
        let dev = upload_matrix(&gpu, &mut arena, "w", &m);
        let x = rng.normal_vec(t * k, 1.0);
        let want = reference(&x, t, &w_ref, n, k);
        let xd = upload_f32(&mut arena, &x);
        let planes = alloc_planes(&mut arena, t * k, k);
        run(
            &gpu,
            &[gemm::rmsnorm_planes(&gpu, xd, None, 0.0, t, k, planes).unwrap()],
        );
        for (prec, cores) in [
            (Precision::Split, TensorCores::Wgmma),
            (Precision::Split, TensorCores::MmaSync),
            (Precision::Half, TensorCores::Wgmma),
        ] {
            {
                let got = plain_product(&gpu, &mut arena, planes, t, &dev, n, prec, cores);
                ok &= check(
                    &format!("q4 {cores:?} {prec:?} T={t} [{n}x{k}]"),
                    &got,
                    &want,
                    tolerance(prec),
                );
            }
        }
    }
    assert!(ok, "some q4 GEMMs are out of tolerance (see above)");
}
