//! Token selection on the device against calla_engine::sampling::select_token.

use calla_cuda::engine::backend::Cursor;
use calla_cuda::ops::matvec;
use calla_cuda::ops::select::Selector;
use calla_cuda::runtime::pool::Arena;
use calla_engine::sampling::{select_token, SamplingParams};
use calla_engine::Selection;

use crate::support::*;

fn logits(rng: &mut Rng, v: usize, spread: f32) -> Vec<f32> {
    rng.normal_vec(v, spread)
}

#[test]
#[ignore = "needs CUDA"]
fn selection_matches_the_reference_sampler() {
    let gpu = gpu();
    let mut rng = Rng::new(81);
    let mut all = true;
    // 1,000 and 248,320: the grid draw (one block; 61 blocks); 100 and 300,000: the last block
    // draws alone (no subtree of 256 to 4,096 ids fits those vocabularies and their blocks)
    for v in [1000usize, 248_320, 100, 300_000] {
        let mut arena = Arena::new(&gpu, 64 << 20);
        let mut sel_dev = Selector::new(&mut arena, v, 4096).unwrap();
        let logits_d = arena.alloc_zeroed(v * 4).unwrap();
        let cursor = arena.alloc_zeroed(16).unwrap();
        let launch = sel_dev.launch(&gpu, logits_d, cursor, false, None).unwrap();
        let base = SamplingParams::default();
        let cases: Vec<(&str, SamplingParams, usize, f32)> = vec![
            ("greedy", base.clone(), 0, 3.0),
            ("greedy + 20 logprobs", base.clone(), 20, 3.0),
            (
                "T0.8 top-k 20 top-p 0.95",
                SamplingParams {
                    temperature: 0.8,
                    top_k: 20,
                    top_p: 0.95,
                    ..base.clone()
                },
                5,
                3.0,
            ),
            (
                "T1 full vocabulary",
                SamplingParams {
                    temperature: 1.0,
                    ..base.clone()
                },
                0,
                3.0,
            ),
            (
                "T1 top-p 0.9 (large nucleus)",
                SamplingParams {
                    temperature: 1.0,
                    top_p: 0.9,
                    ..base.clone()
                },
                0,
                1.0,
            ),
            (
                "T0.7 top-p 0.5 (small nucleus)",
                SamplingParams {
                    temperature: 0.7,
                    top_p: 0.5,
                    ..base.clone()
                },
                0,
                4.0,
            ),
            (
                "T1 min-p 0.05",
                SamplingParams {
                    temperature: 1.0,
                    min_p: 0.05,
                    ..base.clone()
                },
                0,
                3.0,
            ),
            (
                "T1 top-k 64 min-p 0.1",
                SamplingParams {
                    temperature: 1.0,
                    top_k: 64,
                    min_p: 0.1,
                    ..base.clone()
                },
                3,
                2.0,
            ),
            (
                "penalties + bias, greedy",
                SamplingParams {
                    repetition_penalty: 1.3,
                    presence_penalty: 0.5,
                    frequency_penalty: 0.2,
                    logit_bias: vec![(3, 5.0), (17, -100.0)],
                    ..base.clone()
                },
                4,
                2.0,
            ),
            (
                "penalties, T0.9 top-k 40",
                SamplingParams {
                    temperature: 0.9,
                    top_k: 40,
                    repetition_penalty: 1.2,
                    presence_penalty: 1.5,
                    ..base.clone()
                },
                0,
                2.0,
            ),
        ];
        // The reference's log-sum-exp is a sequential f32 sum: at V = 248k with spread-3 logits it is
        // off by ~4e-4 (measured against f64); the device's blocked sum is closer to exact.
        let lp_tol = if v > 10_000 { 2e-3 } else { 1e-4 };
        for (name, mut params, n_logprobs, spread) in cases {
            let (mut equal, mut total, mut worst_lp) = (0usize, 0usize, 0f32);
            let mut tops_equal = true;
            for round in 0..12u64 {
                params.seed = 1000 + round * 7919;
                let mut l = logits(&mut rng, v, spread);
                if round % 4 == 1 {
                    // exact ties: the lowest id must win everywhere
                    let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    l[v / 3] = m;
                    l[v / 2] = m;
                }
                if round % 4 == 3 && name.starts_with("greedy") {
                    // non-finite logits: NaN counts as −∞, and a leading run of −∞ covers whole
                    // blocks' chunks (4,096 ids each at V = 248,320)
                    for x in l.iter_mut().take(9000.min(v / 2)) {
                        *x = f32::NEG_INFINITY;
                    }
                    l[v / 5] = f32::NAN;
                    l[v - 1] = f32::NAN;
                }
                let prompt: Vec<u32> = (0..50).map(|_| rng.below(v) as u32).collect();
                let generated: Vec<u32> = (0..(round as usize % 5))
                    .map(|_| rng.below(v) as u32)
                    .collect();
                let sel = Selection {
                    params: &params,
                    prompt: &prompt,
                    generated: &generated,
                    step: round * 3,
                    top_logprobs: n_logprobs,
                };
                gpu.htod(logits_d, &l).unwrap();
                sel_dev.prepare(&gpu, &sel).unwrap();
                launch.run(&gpu).unwrap();
                let got = sel_dev.finish(&gpu).unwrap();
                let want = select_token(&l, &sel);
                total += 1;
                equal += (got.token == want.token) as usize;
                if got.token == want.token {
                    worst_lp = worst_lp.max((got.logprob - want.logprob).abs());
                }
                tops_equal &= got.top.len() == want.top.len()
                    && got
                        .top
                        .iter()
                        .zip(&want.top)
                        .all(|(a, b)| a.0 == b.0 && (a.1 - b.1).abs() < lp_tol);
                if got.token != want.token {
                    eprintln!(
                        "{name} V={v} round {round}: device {} vs reference {}",
                        got.token, want.token
                    );
                }
            }
            let detail = format!(
                "Δlp {worst_lp:.1e}{}",
                if tops_equal { "" } else { " TOP≠" }
            );
            // Top-p without top-k whose nucleus exceeds the 64 ranked candidates: the device finds
            // the nucleus by exact mass (bisection), the reference by a sequential f32 cumulative
            // sum in rank order whose rounding drifts by ~1e-4 over 10⁵ terms, so the boundary id
            // (and with it a draw) can differ. Known, documented in docs/cuda-parity.md.
            // The drift grows with the terms summed: at V = 300,000 (spread-1 logits, ~270K ids in
            // the nucleus) 7 of 12 draws agreed, the others landing within a few ids of the
            // reference's; at 248,320, 9 or more.
            let approximate = name.contains("large nucleus") && v > 10_000;
            let required = if !approximate {
                total
            } else if v > 262_144 {
                total / 2
            } else {
                total - total / 4
            };
            let row = if approximate {
                format!("select: {name} ≈")
            } else {
                format!("select: {name}")
            };
            all &= check_count_at_least(&row, &format!("V={v}"), equal, total, required, &detail);
            // logprobs concern the drawn token; compare them only where the draws agree
            all &= tops_equal && worst_lp < lp_tol;
        }
    }
    assert!(all);
}

/// lm_head with plain greedy fused in (matvec_tc.cu `matvec_tc_q4_c2_s1_greedy`) against lm_head
/// (`matvec_tc_q4_c2_s1`) then the selection kernel, on random q4 heads of K 2048: the same logits to
/// the bit, the same token (also the reference sampler's on those logits), the log-probability within
/// rounding (another summation order), the cursor advanced. One round plants an exact tie at the
/// maximum (the argmax row's codes and parameters copied to a lower row), which the lower id must
/// win; 160 rows leave most of the blocks' lanes without rows.
#[test]
#[ignore = "needs CUDA"]
fn greedy_head_matches_lm_head_then_select() {
    let gpu = gpu();
    let mut rng = Rng::new(83);
    let k = 2048;
    let mut all = true;
    for rows in [160usize, 16_400, 65_536] {
        let mut arena = Arena::new(&gpu, 64 << 20);
        let m = {
            let values = rng.normal_vec(rows * k, 1.0 / (k as f32).sqrt());
            calla_cpu::random::quantise_affine(rows, k, &values, 4, 64)
        };
        let dm = upload_matrix(&gpu, &mut arena, "lm_head", &m);
        let logits_plain = arena.alloc_zeroed(rows * 4).unwrap();
        let logits_fused = arena.alloc_zeroed(rows * 4).unwrap();
        let cursor = arena.alloc_zeroed(16).unwrap();
        let (xd, gd) = (arena.alloc(k * 4).unwrap(), arena.alloc(k * 4).unwrap());
        let mut sel = Selector::new(&mut arena, rows, 16).unwrap();
        let norm = Some((gd, 1e-6f32));
        let plain = matvec::matvec(&gpu, xd, k, norm, &[(dm, logits_plain)], false).unwrap();
        let select = sel.launch(&gpu, logits_plain, cursor, false, None).unwrap();
        let fused = matvec::head_greedy(
            &gpu,
            xd,
            k,
            norm,
            &(dm, logits_fused),
            &sel,
            sel.token_out(cursor, true, None),
        )
        .unwrap()
        .expect("a q4 head of K 2048 and whole tiles takes the fused kernel");
        let params = SamplingParams::default();
        let (mut same, mut total, mut worst_lp) = (0usize, 0usize, 0f32);
        for round in 0..6usize {
            let x = rng.normal_vec(k, 1.5);
            let gain: Vec<f32> = rng.normal_vec(k, 0.2).iter().map(|v| 1.0 + v).collect();
            gpu.htod(xd, &x).unwrap();
            gpu.htod(gd, &gain).unwrap();
            let sel_now = Selection {
                params: &params,
                prompt: &[],
                generated: &[],
                step: round as u64,
                top_logprobs: 0,
            };
            sel.prepare(&gpu, &sel_now).unwrap();
            assert!(sel.plain_greedy());
            let run_plain = |sel: &mut Selector| {
                for l in &plain {
                    l.run(&gpu).unwrap();
                }
                select.run(&gpu).unwrap();
                sel.finish(&gpu).unwrap()
            };
            let mut tie = None;
            if round == 3 {
                // copy the argmax row over a lower one: an exact tie at the maximum
                let hi = run_plain(&mut sel).token as usize;
                let lo = hi / 2;
                if lo < hi {
                    let (rb, pb) = (dm.row_bytes(), dm.groups_per_row() * 4);
                    let mut codes = vec![0u8; rb];
                    let mut prm = vec![0u8; pb];
                    gpu.dtoh(dm.data.offset(hi * rb), &mut codes).unwrap();
                    gpu.dtoh(dm.params.offset(hi * pb), &mut prm).unwrap();
                    gpu.htod(dm.data.offset(lo * rb), &codes).unwrap();
                    gpu.htod(dm.params.offset(lo * pb), &prm).unwrap();
                    tie = Some((lo, hi));
                }
            }
            let want = run_plain(&mut sel);
            let start = Cursor {
                state_base: 0,
                pos: 7 + round as i32,
                token: -1,
            };
            gpu.htod(cursor, std::slice::from_ref(&start)).unwrap();
            fused.run(&gpu).unwrap();
            let got = sel.finish(&gpu).unwrap();
            let (lp, lf) = (
                download(&gpu, logits_plain, rows),
                download(&gpu, logits_fused, rows),
            );
            let reference = select_token(&lp, &sel_now);
            let mut after = [Cursor::default()];
            gpu.dtoh(cursor, &mut after).unwrap();
            let bits_equal = lp.iter().zip(&lf).all(|(a, b)| a.to_bits() == b.to_bits());
            let ok = bits_equal
                && got.token == want.token
                && got.token == reference.token
                && after[0].token == got.token as i32
                && after[0].pos == start.pos + 1;
            if !ok {
                eprintln!(
                    "greedy head rows {rows} round {round}: fused {} lm_head+select {} reference {} \
                     logits bit-equal {bits_equal} cursor {:?}",
                    got.token, want.token, reference.token, after[0]
                );
            }
            if let Some((lo, hi)) = tie {
                assert!(
                    lp[lo] == lp[hi] && want.token as usize == lo,
                    "rows {rows}: the planted tie ({lo}, {hi}) did not tie at the maximum"
                );
            }
            total += 1;
            same += ok as usize;
            worst_lp = worst_lp.max((got.logprob - want.logprob).abs());
        }
        all &= check_count(
            "greedy head vs lm_head + select",
            &format!("V={rows} K={k} q4"),
            same,
            total,
            &format!("Δlp {worst_lp:.1e}"),
        ) && worst_lp < 1e-4;
    }
    assert!(all);
}
