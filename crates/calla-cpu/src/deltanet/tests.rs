use super::*;
use crate::random::{random_weights, tiny_spec, Rng};
use calla_model::{Family, MixerWeights};

/// Largest |a − b| and where it occurs.
fn max_diff(a: &[f32], b: &[f32]) -> (f32, usize) {
    a.iter()
        .zip(b)
        .enumerate()
        .map(|(i, (x, y))| ((x - y).abs(), i))
        .fold((0.0, 0), |m, d| if d.0 > m.0 { d } else { m })
}

struct RuleInputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    state: Vec<f32>,
}

fn rule_inputs(rng: &mut Rng, t: usize, dk: usize, dv: usize) -> RuleInputs {
    let mut q = rng.normal_vec(t * dk, 1.0);
    let mut k = rng.normal_vec(t * dk, 1.0);
    l2_norm(&mut q, dk);
    l2_norm(&mut k, dk);
    for x in &mut q {
        *x *= (dk as f32).powf(-0.5);
    }
    RuleInputs {
        q,
        k,
        v: rng.normal_vec(t * dv, 1.0),
        // log decays from mild to strong, as -exp(A_log)·softplus(·) produces
        g: (0..t).map(|_| -rng.range(0.001, 1.5)).collect(),
        beta: (0..t).map(|_| rng.uniform()).collect(),
        state: rng.normal_vec(dk * dv, 0.5),
    }
}

#[test]
fn chunked_rule_equals_recurrent_rule() {
    let mut rng = Rng::new(42);
    for (dk, dv) in [(32, 16), (128, 128)] {
        for t in [1, 7, 63, 64, 65, 150] {
            let x = rule_inputs(&mut rng, t, dk, dv);
            let mut s_rec = x.state.clone();
            let mut o_rec = vec![0f32; t * dv];
            for i in 0..t {
                deltanet_decode_step(
                    &mut s_rec,
                    &x.q[i * dk..(i + 1) * dk],
                    &x.k[i * dk..(i + 1) * dk],
                    &x.v[i * dv..(i + 1) * dv],
                    x.g[i],
                    x.beta[i],
                    &mut o_rec[i * dv..(i + 1) * dv],
                );
            }
            let mut s_chunk = x.state.clone();
            let mut o_chunk = vec![0f32; t * dv];
            deltanet_chunked(
                &mut s_chunk,
                &x.q,
                &x.k,
                &x.v,
                &x.g,
                &x.beta,
                &mut o_chunk,
                dk,
                dv,
            );
            let (d_out, at_out) = max_diff(&o_rec, &o_chunk);
            let (d_state, at_state) = max_diff(&s_rec, &s_chunk);
            assert!(
                d_out < 1e-4 && d_state < 1e-4,
                "Dk={dk} Dv={dv} T={t}: max |Δout| {d_out:e} at {at_out} ({} vs {}), max |Δstate| {d_state:e} at {at_state}",
                o_rec[at_out],
                o_chunk[at_out]
            );
            assert!(
                o_rec.iter().any(|v| v.abs() > 1e-2),
                "outputs are not trivially small"
            );
        }
    }
}

/// The recurrent rule against its formula written out in f64 (α S, then k δᵀ, then Sᵀq).
#[test]
fn decode_step_matches_formula_in_f64() {
    let mut rng = Rng::new(5);
    let (dk, dv) = (7, 5);
    let x = rule_inputs(&mut rng, 1, dk, dv);
    let mut s = x.state.clone();
    let mut out = vec![0f32; dv];
    deltanet_decode_step(&mut s, &x.q, &x.k, &x.v, x.g[0], x.beta[0], &mut out);
    let alpha = (x.g[0] as f64).exp();
    let s0: Vec<f64> = x.state.iter().map(|v| *v as f64 * alpha).collect();
    for j in 0..dv {
        let mem: f64 = (0..dk).map(|i| s0[i * dv + j] * x.k[i] as f64).sum();
        let delta = (x.v[j] as f64 - mem) * x.beta[0] as f64;
        let mut o = 0.0;
        for i in 0..dk {
            let s_new = s0[i * dv + j] + x.k[i] as f64 * delta;
            assert!((s_new - s[i * dv + j] as f64).abs() < 1e-5);
            o += s_new * x.q[i] as f64;
        }
        assert!(
            (o - out[j] as f64).abs() < 1e-5,
            "out[{j}]: {} vs {o}",
            out[j]
        );
    }
}

fn deltanet_layer(seed: u64) -> (ModelSpec, DeltaNet) {
    let spec = tiny_spec(Family::Qwen35Moe, 1);
    let weights = random_weights(&spec, seed);
    let MixerWeights::DeltaNet(w) = &weights.layers[0].mixer else {
        panic!("layer 0 of the tiny spec is a DeltaNet layer")
    };
    let layer = DeltaNet::new(&spec, w, 0).unwrap();
    (spec, layer)
}

/// The layer over a whole prompt (chunked), token by token (recurrent), and in uneven pieces that
/// cross conv-state and chunk boundaries, starting from a non-empty state: all agree.
#[test]
fn layer_prefill_equals_token_by_token_and_pieces() {
    let (spec, layer) = deltanet_layer(9);
    let d = spec.hidden_size;
    let mut rng = Rng::new(10);
    let t = 150;
    let x = rng.normal_vec(t * d, 1.0);
    let warm = rng.normal_vec(3 * d, 1.0);

    let run = |pieces: &[usize], rule: Rule| {
        let mut state = DeltaNetState::new(&spec);
        let mut scratch = vec![0f32; 3 * d];
        layer.forward(&warm, 3, &mut state, Rule::Recurrent, &mut scratch);
        let mut out = vec![0f32; t * d];
        let mut start = 0;
        for &n in pieces {
            layer.forward(
                &x[start * d..(start + n) * d],
                n,
                &mut state,
                rule,
                &mut out[start * d..(start + n) * d],
            );
            start += n;
        }
        assert_eq!(start, t);
        (out, state)
    };
    let (whole, s_whole) = run(&[150], Rule::Chunked);
    let (steps, s_steps) = run(&[1; 150], Rule::Recurrent);
    let (pieces, s_pieces) = run(&[1, 2, 7, 63, 64, 13], Rule::Chunked);
    for (name, out, st) in [
        ("token by token", &steps, &s_steps),
        ("pieces", &pieces, &s_pieces),
    ] {
        let (d_out, at) = max_diff(&whole, out);
        let (d_rec, _) = max_diff(&s_whole.recurrent, &st.recurrent);
        let (d_conv, _) = max_diff(&s_whole.conv, &st.conv);
        assert!(
            d_out < 1e-4 && d_rec < 1e-4 && d_conv < 1e-5,
            "{name}: |Δout| {d_out:e} at {at}, |Δstate| {d_rec:e}, |Δconv| {d_conv:e}"
        );
    }
}

/// The conv against its definition: zero history, out_t = silu(Σ_tap w[c][tap]·x[t−(K−1)+tap][c]).
#[test]
fn conv_is_causal_with_zero_history_and_keeps_pre_conv_inputs() {
    let (spec, layer) = deltanet_layer(2);
    let c = spec.linear_conv_dim();
    let kk = spec.linear_conv_kernel_dim;
    let mut rng = Rng::new(4);
    let t = 5;
    let x = rng.normal_vec(t * c, 1.0);
    let mut y = x.clone();
    let mut state = DeltaNetState::new(&spec);
    layer.conv(&mut y, t, &mut state.conv);
    for i in 0..t {
        for ch in [0, 1, c / 2, c - 1] {
            let mut acc = 0f64;
            for tap in 0..kk {
                let src = i as isize - (kk as isize - 1) + tap as isize;
                if src >= 0 {
                    acc += layer.conv1d[ch * kk + tap] as f64 * x[src as usize * c + ch] as f64;
                }
            }
            let want = acc / (1.0 + (-acc).exp());
            assert!((y[i * c + ch] as f64 - want).abs() < 1e-5, "t={i} ch={ch}");
        }
    }
    assert_eq!(
        state.conv,
        x[(t - (kk - 1)) * c..],
        "state holds the last K−1 pre-conv rows"
    );
}
