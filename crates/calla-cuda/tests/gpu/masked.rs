//! Constrained decoding on the device: `step_masked` (the token mask in the selection's bias table,
//! select.rs `prepare_masked`) against the CPU engine's `step_masked` (the reference's "−∞ after
//! the adjustments"), on the same random weights, greedy and sampled, with logit bias and a
//! repetition penalty, masks of 1, 3 and 40 random tokens, and unmasked steps in between (the bias
//! table must go back to the request's own).

use calla_cpu::CpuBackend;
use calla_cuda::{CudaBackend, CudaOptions};
use calla_engine::constraint::TokenMask;
use calla_engine::sampling::SamplingParams;
use calla_engine::{Backend, Selection};

use crate::support::*;

#[test]
#[ignore = "needs CUDA"]
fn masked_selection_matches_the_cpu_engine() {
    let _ = gpu();
    let spec = calla_model::synthetic::preset("tiny").expect("the tiny preset");
    let w = random_weights(&spec, None, 131);
    let v = spec.vocab_size;
    let mut all = true;
    for (name, params) in [
        ("greedy", SamplingParams::greedy()),
        (
            "T1, bias, repetition 1.3",
            SamplingParams {
                temperature: 1.0,
                repetition_penalty: 1.3,
                logit_bias: vec![(3, 2.0), (7, -1.5)],
                seed: 99,
                ..SamplingParams::default()
            },
        ),
    ] {
        let mut cpu = CpuBackend::new(spec.clone(), w.clone()).unwrap();
        let steps = 24;
        let prompt: Vec<u32> = (0..12).map(|i| (i * 37 % v) as u32).collect();
        let opts = CudaOptions {
            max_context: Some(prompt.len() + steps + 8),
            ..Default::default()
        };
        let mut cuda = CudaBackend::new(&spec, &w, &opts).unwrap();
        let (mut sc, mut sg) = (cpu.new_sequence().unwrap(), cuda.new_sequence().unwrap());
        let mut rng = Rng::new(7);
        let mut generated: Vec<u32> = Vec::new();
        let (mut same, mut allowed_ok) = (0, true);
        for step in 0..steps {
            let tokens: Vec<u32> = if step == 0 {
                prompt.clone()
            } else {
                vec![*generated.last().unwrap()]
            };
            let sel = Selection {
                params: &params,
                prompt: &prompt,
                generated: &generated,
                step: step as u64,
                top_logprobs: 0,
            };
            // every fourth step unmasked; the others allow 1, 3 or 40 random ids
            let mask = (step % 4 != 3).then(|| {
                let mut m = TokenMask::none(v);
                for _ in 0..[1, 3, 40][step % 3] {
                    m.allow(rng.below(v) as u32);
                }
                m
            });
            let (c, g) = match &mask {
                Some(m) => (
                    cpu.step_masked(sc.as_mut(), &tokens, &sel, m).unwrap(),
                    cuda.step_masked(sg.as_mut(), &tokens, &sel, m).unwrap(),
                ),
                None => (
                    cpu.step(sc.as_mut(), &tokens, &sel).unwrap(),
                    cuda.step(sg.as_mut(), &tokens, &sel).unwrap(),
                ),
            };
            allowed_ok &= mask.as_ref().is_none_or(|m| m.allows(g.token));
            same += (c.token == g.token) as usize;
            generated.push(c.token); // both go on with the reference's token
        }
        all &= check_count(
            &format!("masked selection vs CPU: {name}"),
            &format!("tiny, {steps} steps"),
            same,
            steps,
            if allowed_ok {
                "allowed"
            } else {
                "DISALLOWED TOKEN"
            },
        ) && allowed_ok;
    }
    assert!(
        all,
        "masked selection differs from the CPU engine (see the table)"
    );
}
