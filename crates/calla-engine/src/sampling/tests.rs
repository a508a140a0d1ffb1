use super::*;

/// SplitMix64 for test logits.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Logits spread like a model's: N(0, 3²)-ish via the sum of uniforms.
    fn logits(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let s: f32 = (0..4)
                    .map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32)
                    .sum();
                (s - 2.0) * 5.0
            })
            .collect()
    }
}

fn sel<'a>(params: &'a SamplingParams, step: u64) -> Selection<'a> {
    Selection {
        params,
        prompt: &[],
        generated: &[],
        step,
        top_logprobs: 0,
    }
}

fn sampling(temperature: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        seed,
        ..SamplingParams::default()
    }
}

#[test]
fn philox_matches_random123_known_answers() {
    assert_eq!(
        philox4x32_10([0; 4], [0; 2]),
        [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
    );
    assert_eq!(
        philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
        [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
    );
    assert_eq!(
        philox4x32_10(
            [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
            [0xa4093822, 0x299f31d0]
        ),
        [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
    );
}

#[test]
fn uniform_is_in_unit_interval_and_roughly_uniform() {
    let n = 20_000;
    let draws: Vec<f32> = (0..n).map(|step| uniform(1234, step)).collect();
    assert!(draws.iter().all(|u| (0.0..1.0).contains(u)));
    let mean = draws.iter().sum::<f32>() / n as f32;
    assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
    let low = draws.iter().filter(|u| **u < 0.1).count() as f32 / n as f32;
    assert!((low - 0.1).abs() < 0.01, "P(u < 0.1) = {low}");
    assert_ne!(uniform(1, 0), uniform(2, 0));
    assert_ne!(uniform(1, 0), uniform(1, 1));
    // the recipe: top 24 bits of the first word
    let r = philox4x32_10([7, 0, 0, 0], [99, 0])[0];
    assert_eq!(uniform(99, 7), (r >> 8) as f32 / 16_777_216.0);
}

#[test]
fn greedy_is_argmax_with_ties_to_lowest_id() {
    let mut rng = Rng(1);
    for _ in 0..50 {
        let logits = rng.logits(1000);
        let want = (0..1000)
            .max_by(|a, b| logits[*a].total_cmp(&logits[*b]).then(b.cmp(a)))
            .unwrap();
        let c = select_token(&logits, &sel(&SamplingParams::greedy(), 0));
        assert_eq!(c.token as usize, want);
    }
    let tied = [1.0, 3.0, -2.0, 3.0];
    assert_eq!(
        select_token(&tied, &sel(&SamplingParams::greedy(), 0)).token,
        1
    );
}

#[test]
fn same_seed_same_tokens_and_different_seeds_differ() {
    let mut rng = Rng(2);
    let logits: Vec<Vec<f32>> = (0..64)
        .map(|_| rng.logits(500).iter().map(|x| x * 0.2).collect())
        .collect();
    let draw = |seed: u64| -> Vec<u32> {
        let p = sampling(1.0, seed);
        logits
            .iter()
            .enumerate()
            .map(|(i, l)| select_token(l, &sel(&p, i as u64)).token)
            .collect()
    };
    assert_eq!(draw(7), draw(7));
    assert_ne!(draw(7), draw(8));
}

#[test]
fn top_k_one_and_tiny_top_p_equal_greedy() {
    let mut rng = Rng(3);
    for step in 0..30 {
        let logits = rng.logits(300);
        let greedy = select_token(&logits, &sel(&SamplingParams::greedy(), step)).token;
        let k1 = SamplingParams {
            top_k: 1,
            ..sampling(1.5, step)
        };
        assert_eq!(select_token(&logits, &sel(&k1, step)).token, greedy);
        let p_tiny = SamplingParams {
            top_p: 1e-6,
            ..sampling(1.5, step)
        };
        assert_eq!(select_token(&logits, &sel(&p_tiny, step)).token, greedy);
        let minp_one = SamplingParams {
            min_p: 1.0,
            ..sampling(1.5, step)
        };
        assert_eq!(select_token(&logits, &sel(&minp_one, step)).token, greedy);
    }
}

/// Draw frequencies follow softmax(z / T), and truncation removes exactly the tokens it should.
#[test]
fn frequencies_follow_the_truncated_softmax() {
    let logits = [1.0f32, 2.0, 0.5, 3.0, -1.0, 2.5];
    let n = 40_000;
    let freq = |p: &SamplingParams| {
        let mut counts = [0usize; 6];
        for step in 0..n {
            counts[select_token(&logits, &sel(p, step)).token as usize] += 1;
        }
        counts.map(|c| c as f64 / n as f64)
    };
    let softmax = |ids: &[usize], t: f64| {
        let z: f64 = ids.iter().map(|i| (logits[*i] as f64 / t).exp()).sum();
        let mut p = [0f64; 6];
        for i in ids {
            p[*i] = (logits[*i] as f64 / t).exp() / z;
        }
        p
    };
    let cases = [
        (sampling(1.0, 5), softmax(&[0, 1, 2, 3, 4, 5], 1.0)),
        (sampling(0.7, 6), softmax(&[0, 1, 2, 3, 4, 5], 0.7)),
        (
            SamplingParams {
                top_k: 3,
                ..sampling(1.0, 7)
            },
            softmax(&[1, 3, 5], 1.0),
        ),
        // p sorted: 3 (.43), 5 (.26), 1 (.16), 0 (.06)…: top_p .8 keeps 3, 5, 1
        (
            SamplingParams {
                top_p: 0.8,
                ..sampling(1.0, 8)
            },
            softmax(&[1, 3, 5], 1.0),
        ),
        // min_p .2 keeps p ≥ .2·p_max ⇔ z ≥ 3 + ln .2 = 1.39: ids 1, 3, 5
        (
            SamplingParams {
                min_p: 0.2,
                ..sampling(1.0, 9)
            },
            softmax(&[1, 3, 5], 1.0),
        ),
    ];
    for (params, want) in cases {
        let got = freq(&params);
        for i in 0..6 {
            assert!(
                (got[i] - want[i]).abs() < 0.012,
                "{params:?}: id {i} freq {} vs {}",
                got[i],
                want[i]
            );
            if want[i] == 0.0 {
                assert_eq!(got[i], 0.0, "{params:?}: id {i} must be cut");
            }
        }
    }
}

#[test]
fn penalties_change_exactly_the_right_tokens() {
    let logits = [2.0f32, -1.0, 0.5, 3.0, -0.5, 1.0];
    let params = SamplingParams {
        repetition_penalty: 2.0,
        presence_penalty: 0.25,
        frequency_penalty: 0.5,
        ..SamplingParams::default()
    };
    let s = Selection {
        params: &params,
        prompt: &[0, 1],
        generated: &[3, 3, 4],
        step: 0,
        top_logprobs: 0,
    };
    let z = adjusted_logits(&logits, &s);
    // 0, 1: prompt → repetition only; 3: output twice → repetition, presence, 2× frequency;
    // 4: output once; 2, 5: untouched.
    let want = [1.0, -2.0, 0.5, 1.5 - 0.25 - 1.0, -1.0 - 0.25 - 0.5, 1.0];
    for (g, w) in z.iter().zip(want) {
        assert!((g - w).abs() < 1e-6, "{z:?} vs {want:?}");
    }
}

#[test]
fn logit_bias_forces_a_token_and_logprobs_stay_raw() {
    let mut rng = Rng(4);
    let logits = rng.logits(200);
    let params = SamplingParams {
        logit_bias: vec![(17, 1000.0)],
        ..sampling(1.0, 3)
    };
    for step in 0..20 {
        let c = select_token(
            &logits,
            &Selection {
                top_logprobs: 5,
                ..sel(&params, step)
            },
        );
        assert_eq!(c.token, 17);
        // reported log-probabilities are of the raw logits, bias not included
        let lse = logits.iter().map(|x| (*x as f64).exp()).sum::<f64>().ln();
        assert!((c.logprob as f64 - (logits[17] as f64 - lse)).abs() < 1e-4);
        assert_eq!(c.top.len(), 5);
        assert!(c.top.windows(2).all(|w| w[0].1 >= w[1].1));
        let best = (0..200)
            .max_by(|a, b| logits[*a].total_cmp(&logits[*b]))
            .unwrap();
        assert_eq!(c.top[0].0 as usize, best);
    }
    let ban = SamplingParams {
        logit_bias: vec![(3, f32::NEG_INFINITY)],
        ..SamplingParams::greedy()
    };
    let mut l = logits.clone();
    l[3] = 100.0;
    assert_ne!(select_token(&l, &sel(&ban, 0)).token, 3);
}

/// On random logits, for random settings: the drawn token is always in the kept set, and its
/// reported logprob is the raw log-softmax.
#[test]
fn property_drawn_token_survives_truncation() {
    let mut rng = Rng(5);
    for case in 0..200u64 {
        let logits = rng.logits(257);
        let params = SamplingParams {
            temperature: 0.3 + (case % 7) as f32 * 0.3,
            top_k: [0, 1, 5, 40][(case % 4) as usize],
            top_p: [1.0, 0.9, 0.5][(case % 3) as usize],
            min_p: [0.0, 0.05, 0.3][(case % 5 % 3) as usize],
            seed: case,
            ..SamplingParams::default()
        };
        let c = select_token(&logits, &sel(&params, case));
        let rank = logits
            .iter()
            .filter(|x| **x > logits[c.token as usize])
            .count();
        if params.top_k > 0 {
            assert!(
                rank < params.top_k,
                "case {case}: rank {rank} with top_k {}",
                params.top_k
            );
        }
        let z_max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let ratio = ((logits[c.token as usize] - z_max) / params.temperature).exp();
        assert!(
            ratio >= params.min_p * 0.999,
            "case {case}: p/p_max {ratio} below min_p {}",
            params.min_p
        );
        let lse = logits.iter().map(|x| (*x as f64).exp()).sum::<f64>().ln();
        assert!((c.logprob as f64 - (logits[c.token as usize] as f64 - lse)).abs() < 1e-4);
    }
}

#[test]
fn weight_tree_draws_land_where_the_running_sum_says() {
    // Sparse kept ids over a non-power-of-two id space; weights of very different sizes.
    let n = 1000;
    let kept: Vec<u32> = vec![3, 4, 17, 255, 256, 511, 700, 999];
    let w = |i: u32| 0.5 + (i % 7) as f32 * 0.25 + if i == 256 { 40.0 } else { 0.0 };
    let tree = weight_tree(n, &kept, w);
    assert_eq!(tree[0].len(), 1024);
    assert_eq!(tree.last().unwrap().len(), 1);
    // every node is the sum of its children, exactly
    for l in 1..tree.len() {
        for (k, v) in tree[l].iter().enumerate() {
            assert_eq!(
                v.to_bits(),
                (tree[l - 1][2 * k] + tree[l - 1][2 * k + 1]).to_bits()
            );
        }
    }
    let total = tree.last().unwrap()[0];
    let exact: f64 = kept.iter().map(|i| w(*i) as f64).sum();
    assert!((total as f64 - exact).abs() < 1e-4 * exact);
    // Away from boundaries the draw is the first id whose running sum (f64) exceeds the target.
    let mut rng = Rng(11);
    for _ in 0..2000 {
        let u = (rng.next() >> 40) as f32 / (1u64 << 24) as f32;
        let target = u * total;
        let got = tree_draw(&tree, target);
        assert!(kept.contains(&got), "drew {got}, not kept");
        let mut run = 0f64;
        let want = kept
            .iter()
            .find(|i| {
                run += w(**i) as f64;
                run > target as f64
            })
            .copied()
            .unwrap_or(999);
        let near = kept.iter().scan(0f64, |r, i| {
            *r += w(*i) as f64;
            Some(*r)
        });
        let boundary = near
            .map(|b| (b - target as f64).abs())
            .fold(f64::MAX, f64::min);
        if boundary > 1e-3 {
            assert_eq!(got, want, "target {target}");
        }
    }
    // the last id is reachable and a target of 0 lands on the first kept id
    assert_eq!(tree_draw(&tree, 0.0), 3);
    assert_eq!(tree_draw(&tree, total * 0.999_999), 999);
}
