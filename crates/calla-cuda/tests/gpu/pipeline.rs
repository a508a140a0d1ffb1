//! Two decode steps in flight (`Backend::step_pipelined`) against one step at a time, on the same
//! engine: the same kernels in the same order, so every choice (token, log-probability, the top
//! alternatives) must be identical to the bit, greedy and sampled with penalties and logprobs. And
//! the contract's edges: a stop mid-flight, another sequence stepping in between, a wrong next call.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Instant;

use calla_cuda::ops::select::SelectResult;
use calla_cuda::{CudaBackend, CudaOptions};
use calla_engine::generate::{generate_on, GenerateRequest};
use calla_engine::sampling::SamplingParams;
use calla_engine::{Backend, Selection, TokenChoice};
use calla_model::load::{load_model, LoadOptions};

use crate::support::*;

const STEPS: usize = 48;

fn fixture() -> PathBuf {
    let root = match std::env::var_os("CALLA_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
    };
    root.join("models/qwen35moe-causal-perexpert")
}

/// One step at a time through `step`, each selection built as the generation loop builds it. Every
/// choice (read from the mapped host slot the selection kernel writes) is checked against the
/// result the kernel leaves in device memory.
fn one_at_a_time(
    be: &mut CudaBackend,
    prompt: &[u32],
    params: &SamplingParams,
) -> Vec<TokenChoice> {
    let mut seq = be.new_sequence().unwrap();
    let mut out: Vec<TokenChoice> = Vec::new();
    let mut generated: Vec<u32> = Vec::new();
    for step in 0..STEPS {
        let tokens = if step == 0 {
            prompt.to_vec()
        } else {
            vec![*generated.last().unwrap()]
        };
        let sel = Selection {
            params,
            prompt,
            generated: &generated,
            step: step as u64,
            top_logprobs: 4,
        };
        let c = be.step(seq.as_mut(), &tokens, &sel).unwrap();
        let mut dev = [SelectResult::default()];
        be.gpu().dtoh(be.selector.result, &mut dev).unwrap();
        let d = dev[0];
        let n = d.n_top.max(0) as usize;
        assert!(
            d.token as u32 == c.token
                && d.logprob.to_bits() == c.logprob.to_bits()
                && n == c.top.len()
                && c.top.iter().enumerate().all(|(k, (id, lp))| {
                    d.top_ids[k] as u32 == *id && d.top_logprobs[k].to_bits() == lp.to_bits()
                }),
            "step {step}: the host slot's result differs from the device's"
        );
        generated.push(c.token);
        out.push(c);
    }
    out
}

/// The generation loop (two steps in flight), every token emitted (no stop ids).
fn pipelined(be: &mut CudaBackend, prompt: &[u32], params: &SamplingParams) -> Vec<TokenChoice> {
    let req = GenerateRequest {
        prompt: prompt.to_vec(),
        max_tokens: STEPS,
        sampling: params.clone(),
        stop_token_ids: vec![],
        ignore_eos: true,
        top_logprobs: 4,
    };
    let mut seq = be.new_sequence().unwrap();
    let out = generate_on(be, seq.as_mut(), &req, Instant::now(), |_| {
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(
        seq.len(),
        prompt.len() + STEPS - 1,
        "the last step runs nothing ahead"
    );
    out.choices
}

fn identical(a: &[TokenChoice], b: &[TokenChoice]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| {
            x.token == y.token
                && x.logprob.to_bits() == y.logprob.to_bits()
                && x.top.len() == y.top.len()
                && x.top
                    .iter()
                    .zip(&y.top)
                    .all(|(p, q)| p.0 == q.0 && p.1.to_bits() == q.1.to_bits())
        })
        .count()
}

#[test]
#[ignore = "needs CUDA"]
fn two_steps_in_flight_choose_what_one_step_at_a_time_chooses() {
    let _ = gpu();
    let loaded = load_model(&fixture(), &LoadOptions { quant: None }).unwrap();
    let opts = CudaOptions {
        max_context: Some(256),
        ..Default::default()
    };
    let mut be = CudaBackend::new(&loaded.spec, &loaded.weights, &opts).unwrap();
    let prompt: Vec<u32> = (0..23u32)
        .map(|i| (i * 37 + 11) % loaded.spec.vocab_size as u32)
        .collect();
    let sampled = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 40,
        repetition_penalty: 1.15,
        presence_penalty: 0.3,
        frequency_penalty: 0.2,
        seed: 1234,
        logit_bias: vec![(5, 1.5)],
        ..Default::default()
    };
    let mut all = true;
    for (name, params) in [
        ("greedy", SamplingParams::greedy()),
        ("sampled, penalties, bias", sampled),
    ] {
        let a = one_at_a_time(&mut be, &prompt, &params);
        let b = pipelined(&mut be, &prompt, &params);
        let distinct = b
            .iter()
            .map(|c| c.token)
            .collect::<std::collections::BTreeSet<_>>()
            .len();
        all &= check_count(
            &format!("pipelined decode: {name}"),
            &format!("{STEPS} steps, fixture"),
            identical(&a, &b),
            STEPS,
            &format!("{distinct} ids"),
        );
    }
    assert!(all, "two steps in flight chose differently (see the table)");

    // A request that stops mid-flight: the step after the last token ran; the next request on a
    // fresh sequence starts from clean selection state and chooses as before.
    let params = SamplingParams::greedy();
    let expected = one_at_a_time(&mut be, &prompt, &params);
    let stop = expected[5].token;
    let req = GenerateRequest {
        prompt: prompt.clone(),
        max_tokens: STEPS,
        sampling: params.clone(),
        stop_token_ids: vec![stop],
        ignore_eos: true,
        top_logprobs: 4,
    };
    let mut seq = be.new_sequence().unwrap();
    let out = generate_on(&mut be, seq.as_mut(), &req, Instant::now(), |_| {
        ControlFlow::Continue(())
    })
    .unwrap();
    let first_stop = expected.iter().position(|c| c.token == stop).unwrap();
    assert_eq!(out.tokens.len(), first_stop);
    assert_eq!(
        seq.len(),
        prompt.len() + first_stop + 1,
        "the stop token was consumed ahead"
    );
    drop(seq);
    let again = pipelined(&mut be, &prompt, &params);
    assert_eq!(
        identical(&expected, &again),
        STEPS,
        "after a stopped request"
    );

    // Another sequence steps while one has a step ahead: the first can only be dropped.
    let sel = |step| Selection {
        params: &params,
        prompt: &[],
        generated: &[],
        step,
        top_logprobs: 0,
    };
    let mut a = be.new_sequence().unwrap();
    let first = be
        .step_pipelined(a.as_mut(), &prompt, &sel(0), true)
        .unwrap();
    assert_eq!(first.token, expected[0].token);
    let wrong = be.step(a.as_mut(), &[first.token ^ 1], &sel(1));
    assert!(
        wrong.is_err(),
        "a call other than the step run ahead must fail"
    );
    let mut b = be.new_sequence().unwrap();
    let other = be.step(b.as_mut(), &prompt, &sel(0)).unwrap();
    assert_eq!(other.token, expected[0].token);
    let err = be.step(a.as_mut(), &[first.token], &sel(1)).unwrap_err();
    assert!(format!("{err:#}").contains("ran a step ahead"), "{err:#}");
    // and the engine goes on as before
    let again = pipelined(&mut be, &prompt, &params);
    assert_eq!(
        identical(&expected, &again),
        STEPS,
        "after an abandoned sequence"
    );
}
