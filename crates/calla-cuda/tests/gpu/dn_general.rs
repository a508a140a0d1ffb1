//! The general DeltaNet path (deltanet_general.cu, src/deltanet_general.rs) for head dims
//! the compiled kernels do not cover, against the CPU: the decode kernels alone on random inputs
//! (random state and conv ring, never zeros), the DeltaNet layer over several decode steps, and the
//! whole engine (prompt of several 64-token chunks, in one and in several prefill calls, then greedy
//! decode) against the CPU engine. Every test name starts with `dn_general`.

use calla_cpu::deltanet::{deltanet_decode_step, DeltaNet, DeltaNetState, Rule};
use calla_cpu::norm::{l2_norm, sigmoid, silu};
use calla_cpu::CpuBackend;
use calla_cuda::engine::backend::Cursor;
use calla_cuda::engine::decode;
use calla_cuda::engine::sequence::CudaSequence;
use calla_cuda::ops::deltanet::{self, DeltaNetIo};
use calla_cuda::ops::deltanet_general;
use calla_cuda::runtime::pool::Arena;
use calla_cuda::{CudaBackend, CudaOptions, KvDtype};
use calla_engine::Backend;
use calla_model::load::Quant;
use calla_model::{Family, LayerKind, MixerWeights, ModelSpec, Weights};

use crate::support::*;

/// The tiny spec ([DN, DN, DN, Attn], hidden 128) with these DeltaNet heads and conv taps.
fn dims_spec(hk: usize, hv: usize, dk: usize, dv: usize, taps: usize) -> ModelSpec {
    let mut s = tiny_spec(Family::Qwen35Moe);
    s.linear_num_key_heads = hk;
    s.linear_num_value_heads = hv;
    s.linear_key_head_dim = dk;
    s.linear_value_head_dim = dv;
    s.linear_conv_kernel_dim = taps;
    s
}

fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// One decode step of the DeltaNet core (conv, norms, gates, rule, gated norm or its parts) on
/// random device inputs through the engine's launcher (`deltanet::decode` / `decode_parts`, which
/// must pick a `dngen_` kernel), against calla_cpu's `deltanet_decode_step`.
fn kernel_case(
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
    taps: usize,
    pos: usize,
    parts: bool,
) -> bool {
    let gpu = gpu();
    let spec = dims_spec(hk, hv, dk, dv, taps);
    assert!(deltanet_general::decode_is_general(&spec));
    let (c, k) = (spec.linear_conv_dim(), taps);
    let split = deltanet::SPLIT as usize;
    let mut rng = Rng::new((hk * 1000 + hv * 100 + dk * 10 + dv + pos) as u64);
    let qkv = rng.normal_vec(c, 1.0);
    let z = rng.normal_vec(hv * dv, 1.0);
    let b = rng.normal_vec(hv, 1.0);
    let a = rng.normal_vec(hv, 1.0);
    let conv_w = rng.normal_vec(c * k, 0.5);
    let a_log: Vec<f32> = rng.normal_vec(hv, 0.5).iter().map(|x| x + 1.0).collect();
    let dt_bias = rng.normal_vec(hv, 0.5);
    let norm_w: Vec<f32> = rng.normal_vec(dv, 0.1).iter().map(|x| x + 1.0).collect();
    let ring = rng.normal_vec(k * c, 1.0); // [K, C]
    let s_gpu = rng.normal_vec(hv * dv * dk, 0.2); // [Hv, Dv, Dk]

    let mut arena = Arena::new(&gpu, 16 << 20);
    let mut state = ring.clone();
    state.extend_from_slice(&s_gpu);
    let state_d = arena.upload(&state).unwrap();
    let cursor = Cursor {
        state_base: state_d.0,
        pos: pos as i32,
        token: 0,
    };
    let up = |arena: &mut Arena, v: &[f32]| arena.upload(v).unwrap();
    let io = DeltaNetIo {
        qkv: up(&mut arena, &qkv),
        z: up(&mut arena, &z),
        b: up(&mut arena, &b),
        a: up(&mut arena, &a),
        conv_w: up(&mut arena, &conv_w),
        a_log: up(&mut arena, &a_log),
        dt_bias: up(&mut arena, &dt_bias),
        norm_w: up(&mut arena, &norm_w),
        cursor: arena.upload(&[cursor]).unwrap(),
        conv_off: 0,
        state_off: k * c * 4,
        y: arena.alloc_zeroed((hv * dv + hv * split) * 4).unwrap(),
    };
    let launch = if parts {
        deltanet::decode_parts(&gpu, &spec, &io)
    } else {
        deltanet::decode(&gpu, &spec, &io)
    }
    .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(
        launch.name.starts_with("dngen_decode"),
        "Dk {dk} Dv {dv}: the launcher picked {}",
        launch.name
    );
    launch.run(&gpu).unwrap();
    gpu.sync().unwrap();
    let y = download(&gpu, io.y, hv * dv + hv * split);
    let state_got = download(&gpu, state_d, state.len());

    // CPU: conv over the ring's K−1 older slots and the new input, silu, L2 norms, the rule.
    let slot = |p: i64| p.rem_euclid(k as i64) as usize;
    let mut u = vec![0f32; c];
    for (ch, out) in u.iter_mut().enumerate() {
        let mut acc = 0f32;
        for t in 0..k - 1 {
            let p = pos as i64 - (k as i64 - 1) + t as i64;
            acc += conv_w[ch * k + t] * ring[slot(p) * c + ch];
        }
        acc += conv_w[ch * k + k - 1] * qkv[ch];
        *out = silu(acc);
    }
    let key_dim = hk * dk;
    let mut q = u[..key_dim].to_vec();
    let mut kk = u[key_dim..2 * key_dim].to_vec();
    l2_norm(&mut q, dk);
    l2_norm(&mut kk, dk);
    let q_scale = (dk as f32).powf(-0.5);
    q.iter_mut().for_each(|x| *x *= q_scale);
    let mut y_want = vec![0f32; hv * dv];
    let mut sumsq_want = vec![0f32; hv];
    let mut s_want = s_gpu.clone();
    for h in 0..hv {
        let kh = h / (hv / hk);
        let mut s_cpu = vec![0f32; dk * dv]; // [Dk, Dv]
        for j in 0..dv {
            for i in 0..dk {
                s_cpu[i * dv + j] = s_gpu[(h * dv + j) * dk + i];
            }
        }
        let g = -a_log[h].exp() * softplus(a[h] + dt_bias[h]);
        let v = &u[2 * key_dim + h * dv..2 * key_dim + (h + 1) * dv];
        let mut o = vec![0f32; dv];
        deltanet_decode_step(
            &mut s_cpu,
            &q[kh * dk..(kh + 1) * dk],
            &kk[kh * dk..(kh + 1) * dk],
            v,
            g,
            sigmoid(b[h]),
            &mut o,
        );
        for j in 0..dv {
            for i in 0..dk {
                s_want[(h * dv + j) * dk + i] = s_cpu[i * dv + j];
            }
        }
        let ss: f32 = o.iter().map(|x| x * x).sum();
        sumsq_want[h] = ss;
        let inv = 1.0 / (ss / dv as f32 + spec.rms_norm_eps).sqrt();
        for j in 0..dv {
            let zj = silu(z[h * dv + j]);
            y_want[h * dv + j] = if parts {
                norm_w[j] * o[j] * zj
            } else {
                norm_w[j] * (o[j] * inv) * zj
            };
        }
    }
    let mut ring_want = ring.clone();
    ring_want[slot(pos as i64) * c..(slot(pos as i64) + 1) * c].copy_from_slice(&qkv);

    let shape = format!("Hk{hk} Hv{hv} Dk{dk} Dv{dv} K{k} pos{pos}");
    let kind = if parts { "parts" } else { "normed" };
    let mut ok = check(
        &format!("dn_general decode kernel {kind}: y"),
        &shape,
        &y[..hv * dv],
        &y_want,
        1e-4,
        1e-4,
    );
    if parts {
        // a head's SPLIT parts add up to its Σo²
        let sums: Vec<f32> = (0..hv)
            .map(|h| {
                y[hv * dv + h * split..hv * dv + (h + 1) * split]
                    .iter()
                    .sum()
            })
            .collect();
        ok &= check(
            &format!("dn_general decode kernel {kind}: Σo² parts"),
            &shape,
            &sums,
            &sumsq_want,
            1e-4,
            1e-4,
        );
    }
    ok &= check(
        &format!("dn_general decode kernel {kind}: state S"),
        &shape,
        &state_got[k * c..],
        &s_want,
        1e-5,
        1e-5,
    );
    ok &= check(
        &format!("dn_general decode kernel {kind}: conv ring"),
        &shape,
        &state_got[..k * c],
        &ring_want,
        0.0,
        0.0,
    );
    ok
}

#[test]
#[ignore = "needs CUDA"]
fn dn_general_decode_kernel_against_cpu() {
    let mut all = true;
    // (Hk, Hv, Dk, Dv, conv taps, position)
    for (hk, hv, dk, dv, taps, pos) in [
        (2, 4, 24, 20, 4, 5),
        (1, 3, 20, 48, 4, 0),
        (2, 2, 16, 16, 3, 1),
        (1, 2, 96, 96, 4, 7),
        (2, 4, 48, 24, 4, 2),
        (2, 4, 18, 30, 2, 3),
        (1, 2, 48, 300, 4, 9), // Dv > 256
        (1, 2, 512, 40, 4, 2), // the largest Dk
        (2, 4, 100, 6, 4, 11), // Dv 6 < the 8 blocks of the parts kernel
        (1, 2, 1, 3, 1, 0),    // one key entry, one conv tap
    ] {
        for parts in [false, true] {
            all &= kernel_case(hk, hv, dk, dv, taps, pos, parts);
        }
    }
    assert!(all);
}

/// A backend over `w` with no graphs (launches run one by one), sized for `ctx` positions.
fn rig(
    spec: &ModelSpec,
    w: &Weights,
    ctx: usize,
) -> (CudaBackend, Box<dyn calla_engine::Sequence>) {
    let mut be = CudaBackend::new(
        spec,
        w,
        &CudaOptions {
            max_context: Some(ctx),
            kv_cache: KvDtype::F32,
            use_graphs: false,
            ..Default::default()
        },
    )
    .unwrap();
    let seq = be.new_sequence().unwrap();
    (be, seq)
}

/// `steps` decode steps of the first DeltaNet layer (norm, in-projection, the DeltaNet step, the
/// out-projection, as the engine launches them) against the CPU layer (Rule::Recurrent); the mixer's
/// DeltaNet launch must be `want_kernel` (a name ending in `*`: a prefix).
fn layer_case(
    name: &str,
    spec: &ModelSpec,
    w: &Weights,
    steps: usize,
    atol: f32,
    want_kernel: &str,
) -> bool {
    let (mut be, seq) = rig(spec, w, steps + 4);
    let gpu = be.gpu().clone();
    let layer = 0;
    assert_eq!(spec.layers[layer], LayerKind::DeltaNet);
    let MixerWeights::DeltaNet(dw) = &w.layers[layer].mixer else {
        unreachable!()
    };
    let cpu = DeltaNet::new(spec, dw, layer).unwrap();
    let mut state = DeltaNetState::new(spec);
    let mut rng = Rng::new(21);
    let d = spec.hidden_size;
    let (mut got_all, mut want_all) = (Vec::new(), Vec::new());
    let cs = seq.as_any().downcast_ref::<CudaSequence>().unwrap();
    for pos in 0..steps {
        let x = rng.normal_vec(d, 1.0);
        gpu.htod(be.scratch.h, &x).unwrap();
        be.set_cursor(cs, pos, 0).unwrap();
        let launches =
            decode::mixer_launches(&gpu, spec, &be.model, &be.layout, &be.scratch, layer).unwrap();
        let names: Vec<&str> = launches.iter().map(|l| l.name.as_str()).collect();
        let picked = |n: &&str| match want_kernel.strip_suffix('*') {
            Some(prefix) => n.starts_with(prefix),
            None => *n == want_kernel,
        };
        assert!(
            names.iter().any(picked),
            "{name}: expected {want_kernel} among {names:?}"
        );
        for l in &launches {
            l.run(&gpu).unwrap();
        }
        got_all.extend(download(&gpu, be.scratch.h, d));
        let xn = norm(&x, &w.layers[layer].input_layernorm, spec.rms_norm_eps);
        let mut out = vec![0f32; d];
        cpu.forward(&xn, 1, &mut state, Rule::Recurrent, &mut out);
        want_all.extend(x.iter().zip(&out).map(|(a, b)| a + b));
    }
    let shape = format!(
        "Hk{} Hv{} Dk{} Dv{} ×{steps} {want_kernel}",
        spec.linear_num_key_heads,
        spec.linear_num_value_heads,
        spec.linear_key_head_dim,
        spec.linear_value_head_dim,
    );
    check(name, &shape, &got_all, &want_all, atol, atol)
}

#[test]
#[ignore = "needs CUDA"]
fn dn_general_decode_layer_against_cpu() {
    let mut all = true;
    // (Hk, Hv, Dk, Dv, weights, the DeltaNet kernel the engine picks, tolerance)
    for (hk, hv, dk, dv, quant, kernel, atol) in [
        (2, 4, 24, 16, None, "dngen_decode", 1e-4),
        (2, 8, 20, 24, None, "dngen_decode", 1e-4),
        (1, 2, 48, 96, None, "dngen_decode", 1e-4),
        (2, 4, 16, 16, Some(Quant::Bf16), "dngen_decode", 1e-4),
        (1, 2, 96, 96, Some(Quant::Q4), "dngen_decode", 2e-4),
        (2, 4, 18, 16, None, "dngen_decode", 1e-4),
        (1, 1, 20, 320, None, "dngen_decode", 1e-4),
        // q4 out-projection of K 1024 with heads of 128: the norm moves to the out-projection
        (2, 8, 24, 128, Some(Quant::Q4), "dngen_decode_parts", 2e-4),
        // the family's Dk 256 keeps its compiled kernel next to an odd Dv of 64
        (1, 2, 256, 64, None, "deltanet_decode_kpl8*", 1e-4),
    ] {
        let spec = dims_spec(hk, hv, dk, dv, 4);
        let w = random_weights(&spec, quant, 61 + dk as u64);
        all &= layer_case(
            &format!("dn_general layer {quant:?}"),
            &spec,
            &w,
            7,
            atol,
            kernel,
        );
    }
    assert!(all);
}

/// The prompt's log-probabilities and a greedy run on both engines (CUDA with prompts in chunks of
/// `prompt_chunk` tokens, 0 = token by token; None = the default); tokens must be equal and the
/// log-probs within `tol` (the fixture test's tolerance).
fn compare_engines(
    name: &str,
    spec: &ModelSpec,
    w: &Weights,
    prompt: &[u32],
    steps: usize,
    prompt_chunk: Option<usize>,
    tol: f32,
) -> bool {
    let mut cpu = CpuBackend::new(spec.clone(), w.clone()).unwrap();
    let mut opts = CudaOptions {
        max_context: Some(prompt.len() + steps + 8),
        kv_cache: KvDtype::F32,
        ..Default::default()
    };
    if let Some(n) = prompt_chunk {
        opts.prompt_chunk = n;
    }
    let mut gpu = CudaBackend::new(spec, w, &opts).unwrap_or_else(|e| panic!("{name}: {e:#}"));
    let shape = format!(
        "Hk{} Hv{} Dk{} Dv{}, {} tokens, chunk {}",
        spec.linear_num_key_heads,
        spec.linear_num_value_heads,
        spec.linear_key_head_dim,
        spec.linear_value_head_dim,
        prompt.len(),
        opts.prompt_chunk
    );
    let mut sc = cpu.new_sequence().unwrap();
    let mut sg = gpu.new_sequence().unwrap();
    let lc = log_softmax(&cpu.forward_logits(sc.as_mut(), prompt).unwrap());
    let lg = log_softmax(&gpu.forward_logits(sg.as_mut(), prompt).unwrap());
    let mut pass = check(
        &format!("{name}: prefill logprobs"),
        &shape,
        &lg,
        &lc,
        tol,
        0.0,
    );

    let c = greedy(&mut cpu, prompt, steps);
    let g = greedy(&mut gpu, prompt, steps);
    let same = c
        .iter()
        .zip(&g)
        .take_while(|(a, b)| a.token == b.token)
        .count();
    let worst =
        c.iter()
            .zip(&g)
            .take(same)
            .flat_map(|(a, b)| {
                std::iter::once((a.logprob - b.logprob).abs()).chain(b.top.iter().filter_map(
                    |(id, lp)| a.top.iter().find(|x| x.0 == *id).map(|x| (x.1 - lp).abs()),
                ))
            })
            .fold(0f32, f32::max);
    pass &= check_count(
        &format!("{name}: greedy tokens"),
        &format!("{shape}, {steps} steps"),
        same,
        steps,
        &format!("Δlp {worst:.1e}"),
    );
    pass &= worst <= tol;
    if same < steps {
        eprintln!(
            "{name}: first difference at step {same}: cpu {:?} cuda {:?}",
            c.get(same).map(|x| (&x.token, &x.top)),
            g.get(same).map(|x| (&x.token, &x.top))
        );
    }
    pass
}

/// The whole engine at head dims without compiled copies: a 150-token prompt (three 64-token
/// DeltaNet chunks) in one prefill call, in 64-token prefill calls (the state carried between them)
/// and token by token, then 24 greedy steps, against the CPU engine.
#[test]
#[ignore = "needs CUDA"]
fn dn_general_engine_matches_cpu() {
    let _ = gpu();
    let mut all = true;
    // (Hk, Hv, Dk, Dv): decode always general here but for Dk 256; the prompt path on the chunked
    // kernels (tensor cores: Dk 16, 48, 96; CUDA cores: Dk 20, 24) or the general scan (Dk 18 and 256,
    // Dv 320).
    let dims = [
        (2, 4, 24, 16),
        (2, 8, 20, 24),
        (2, 4, 16, 16),
        (1, 2, 48, 96),
        (1, 2, 96, 96),
        (2, 4, 18, 16),
        (1, 2, 256, 64),
        (1, 1, 20, 320),
        (2, 8, 24, 128),
    ];
    let mut rng = Rng::new(93);
    for (i, (hk, hv, dk, dv)) in dims.into_iter().enumerate() {
        let spec = dims_spec(hk, hv, dk, dv, 4);
        let prompt: Vec<u32> = (0..150)
            .map(|_| rng.below(spec.vocab_size) as u32)
            .collect();
        let q4 = random_weights(&spec, Some(Quant::Q4), 94 + i as u64);
        let name = format!("dn_general engine q4 Dk{dk} Dv{dv}");
        all &= compare_engines(&name, &spec, &q4, &prompt, 24, None, 2e-2);
        all &= compare_engines(&name, &spec, &q4, &prompt, 24, Some(64), 2e-2);
        if i % 3 == 0 {
            all &= compare_engines(&name, &spec, &q4, &prompt[..40], 8, Some(0), 2e-2);
            let bf16 = random_weights(&spec, Some(Quant::Bf16), 194 + i as u64);
            let name = format!("dn_general engine bf16 Dk{dk} Dv{dv}");
            all &= compare_engines(&name, &spec, &bf16, &prompt, 24, None, 2e-2);
        }
    }
    assert!(
        all,
        "engine parity failures at general DeltaNet dims (see the table)"
    );
}
