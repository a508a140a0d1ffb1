//! Sequence snapshots (what the prefix cache stores): a snapshot holds only the DeltaNet states and
//! the K/V of the positions it has (compact), and a sequence restored from it — by a snapshot of
//! the snapshot, or by stepping the snapshot itself — continues exactly as the original does:
//! every token and log-probability equal to the bit.

use calla_cuda::engine::sequence::CudaSequence;
use calla_cuda::{CudaBackend, CudaOptions};
use calla_engine::sampling::SamplingParams;
use calla_engine::{Backend, Selection, Sequence, TokenChoice};

use crate::support::*;

fn continue_greedy(
    be: &mut CudaBackend,
    seq: &mut dyn Sequence,
    prompt: &[u32],
    first: u32,
    steps: usize,
) -> Vec<TokenChoice> {
    let params = SamplingParams::greedy();
    let mut generated = vec![first];
    let mut out = Vec::new();
    for step in 1..=steps {
        let sel = Selection {
            params: &params,
            prompt,
            generated: &generated,
            step: step as u64,
            top_logprobs: 3,
        };
        let c = be.step(seq, &[*generated.last().unwrap()], &sel).unwrap();
        generated.push(c.token);
        out.push(c);
    }
    out
}

#[test]
#[ignore = "needs CUDA"]
fn snapshots_are_compact_and_restore_exactly() {
    let _ = gpu();
    let spec = calla_model::synthetic::preset("tiny").expect("the tiny preset");
    let w = random_weights(&spec, None, 141);
    let opts = CudaOptions {
        max_context: Some(4096),
        ..Default::default()
    };
    let mut be = CudaBackend::new(&spec, &w, &opts).unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 53 % spec.vocab_size) as u32).collect();
    let params = SamplingParams::greedy();
    let sel = Selection {
        params: &params,
        prompt: &prompt,
        generated: &[],
        step: 0,
        top_logprobs: 3,
    };
    let mut a = be.new_sequence().unwrap();
    let first = be.step(a.as_mut(), &prompt, &sel).unwrap().token;
    let snap = a.snapshot();
    let full_bytes = be.layout.bytes;
    let compact = snap
        .as_any()
        .downcast_ref::<CudaSequence>()
        .is_some_and(|s| s.is_compact());
    let small = snap.byte_size() * 10 < full_bytes;
    let mut restored = snap.snapshot();
    let mut stepped = snap.snapshot().snapshot(); // compact again: the backend makes it full itself
    let steps = 12;
    let want = continue_greedy(&mut be, a.as_mut(), &prompt, first, steps);
    let got = continue_greedy(&mut be, restored.as_mut(), &prompt, first, steps);
    let got2 = continue_greedy(&mut be, stepped.as_mut(), &prompt, first, steps);
    let bits = |c: &TokenChoice| (c.token, c.logprob.to_bits());
    let same = want
        .iter()
        .zip(&got)
        .filter(|(x, y)| bits(x) == bits(y))
        .count();
    let same2 = want
        .iter()
        .zip(&got2)
        .filter(|(x, y)| bits(x) == bits(y))
        .count();
    let pass = check_count(
        "snapshot restored vs original",
        &format!("tiny, 41 positions, {steps} steps"),
        same.min(same2),
        steps,
        &format!(
            "{} of {} bytes{}",
            snap.byte_size(),
            full_bytes,
            if compact { "" } else { " NOT COMPACT" }
        ),
    );
    assert!(
        pass && compact && small,
        "snapshot: compact {compact}, small {small}, {same}/{same2} of {steps}"
    );
}
