//! The delta rule against transformers' own `torch_chunk_gated_delta_rule` and
//! `torch_recurrent_gated_delta_rule` (tests/fixtures/goldens/deltanet_ref.json, made by tools/fixtures).

use calla_cpu::deltanet::{deltanet_chunked, deltanet_decode_step};
use calla_cpu::norm::l2_norm;
use serde_json::Value;

fn flat(v: &Value) -> Vec<f32> {
    match v {
        Value::Array(items) => items.iter().flat_map(flat).collect(),
        Value::Number(n) => vec![n.as_f64().expect("a number") as f32],
        other => panic!("unexpected {other}"),
    }
}

/// `[T][H][X]` → head h's `[T, X]`.
fn head(values: &[f32], t: usize, heads: usize, x: usize, h: usize) -> Vec<f32> {
    (0..t)
        .flat_map(|i| values[(i * heads + h) * x..(i * heads + h + 1) * x].to_vec())
        .collect()
}

#[test]
fn both_forms_match_transformers() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/goldens/deltanet_ref.json"
    );
    let text = std::fs::read_to_string(path).expect("deltanet_ref.json is committed");
    let g: Value = serde_json::from_str(&text).unwrap();
    let n = |k: &str| g[k].as_u64().unwrap() as usize;
    let (t, heads, dk, dv) = (n("T"), n("num_heads"), n("k_head_dim"), n("v_head_dim"));
    let (q, k, v) = (flat(&g["q"]), flat(&g["k"]), flat(&g["v"]));
    let (gate, beta) = (flat(&g["g"]), flat(&g["beta"]));
    let init = flat(&g["initial_state"]);
    let (want_out, want_state) = (flat(&g["out_chunk"]), flat(&g["final_state_chunk"]));
    let (want_out_rec, want_state_rec) =
        (flat(&g["out_recurrent"]), flat(&g["final_state_recurrent"]));

    let mut worst = 0f32;
    for h in 0..heads {
        let mut qh = head(&q, t, heads, dk, h);
        let mut kh = head(&k, t, heads, dk, h);
        l2_norm(&mut qh, dk);
        l2_norm(&mut kh, dk);
        qh.iter_mut().for_each(|x| *x *= (dk as f32).powf(-0.5));
        let vh = head(&v, t, heads, dv, h);
        let gh = head(&gate, t, heads, 1, h);
        let bh = head(&beta, t, heads, 1, h);
        let s0 = &init[h * dk * dv..(h + 1) * dk * dv];

        let mut s_chunk = s0.to_vec();
        let mut o_chunk = vec![0f32; t * dv];
        deltanet_chunked(&mut s_chunk, &qh, &kh, &vh, &gh, &bh, &mut o_chunk, dk, dv);
        let mut s_rec = s0.to_vec();
        let mut o_rec = vec![0f32; t * dv];
        for i in 0..t {
            let (qi, ki) = (&qh[i * dk..(i + 1) * dk], &kh[i * dk..(i + 1) * dk]);
            deltanet_decode_step(
                &mut s_rec,
                qi,
                ki,
                &vh[i * dv..(i + 1) * dv],
                gh[i],
                bh[i],
                &mut o_rec[i * dv..(i + 1) * dv],
            );
        }
        for (name, got, want) in [
            ("chunked out", &o_chunk, head(&want_out, t, heads, dv, h)),
            (
                "recurrent out",
                &o_rec,
                head(&want_out_rec, t, heads, dv, h),
            ),
            (
                "chunked state",
                &s_chunk,
                want_state[h * dk * dv..(h + 1) * dk * dv].to_vec(),
            ),
            (
                "recurrent state",
                &s_rec,
                want_state_rec[h * dk * dv..(h + 1) * dk * dv].to_vec(),
            ),
        ] {
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                let err = (a - b).abs();
                worst = worst.max(err / (1e-4 + 1e-4 * b.abs()));
                assert!(
                    err <= 1e-4 + 1e-4 * b.abs(),
                    "head {h} {name}[{i}]: {a} vs transformers {b}"
                );
            }
        }
    }
    println!(
        "worst error: {:.1}% of the tolerance (1e-4 + 1e-4·|ref|)",
        worst * 100.0
    );
}
