//! The generation loop for one request on any backend: prompt → first token → one token at a time.
//!
//! Stop tokens (as vLLM and the OpenAI API treat EOS): the token that ends generation — one of
//! `stop_token_ids`, or of the model's EOS ids unless `ignore_eos` — is NOT part of the output: it is
//! not in `tokens` or `choices`, it is not passed to the callback, and so never reaches text. It is
//! reported in `GenerateOutput::stop_token` and counts towards `max_tokens` (it was generated).
//! `ignore_eos` drops only the model's EOS ids; explicit `stop_token_ids` still stop (vLLM semantics).
//!
//! The callback sees each emitted token as soon as it is chosen; returning `ControlFlow::Break(())`
//! ends generation after that token with `FinishReason::Stop` (a stop string seen by the caller, or a
//! cancelled request).

use std::ops::ControlFlow;
use std::time::Instant;

use anyhow::{ensure, Result};

use crate::backend::{Backend, Selection, Sequence, TokenChoice};
use crate::constraint::TokenConstraint;
use crate::sampling::select_token_masked;
use crate::sampling::SamplingParams;

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (the stop token included).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Extra stop tokens, on top of the model's EOS ids.
    pub stop_token_ids: Vec<u32>,
    /// Do not stop on the model's EOS ids.
    pub ignore_eos: bool,
    /// Top log-probabilities to return per token (0 = none).
    pub top_logprobs: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// A stop token, or the callback asked to stop.
    Stop,
}

impl FinishReason {
    /// The OpenAI spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timings {
    /// Seconds from the start to the first token chosen (the prompt's forward pass).
    pub prefill_s: f64,
    /// Seconds for every later token.
    pub decode_s: f64,
}

#[derive(Debug, Clone)]
pub struct GenerateOutput {
    /// Emitted tokens, stop token excluded.
    pub tokens: Vec<u32>,
    /// One per emitted token, with its log-probability and alternatives.
    pub choices: Vec<TokenChoice>,
    pub finish_reason: FinishReason,
    /// The stop token that ended generation, if one did.
    pub stop_token: Option<TokenChoice>,
    pub prompt_tokens: usize,
    pub timings: Timings,
}

impl GenerateOutput {
    /// Tokens generated, the stop token included (the OpenAI `completion_tokens`).
    pub fn completion_tokens(&self) -> usize {
        self.tokens.len() + usize::from(self.stop_token.is_some())
    }
}

/// Generate for `req` on `backend` from a fresh sequence, calling `on_token` with each emitted token.
pub fn generate(
    backend: &mut dyn Backend,
    req: &GenerateRequest,
    on_token: impl FnMut(&TokenChoice) -> ControlFlow<()>,
) -> Result<GenerateOutput> {
    ensure!(
        !req.prompt.is_empty(),
        "the prompt is empty (this model family has no BOS token)"
    );
    let started = Instant::now();
    if req.max_tokens == 0 {
        return Ok(GenerateOutput::empty(req));
    }
    let mut seq = backend.new_sequence()?;
    generate_on(backend, seq.as_mut(), req, started, on_token)
}

/// The generation loop on a sequence that already holds the first `seq.len()` tokens of `req.prompt`
/// (a restored prefix, or nothing): runs the rest of the prompt, then one token at a time. Timings
/// count from `started`.
pub fn generate_on(
    backend: &mut dyn Backend,
    seq: &mut dyn Sequence,
    req: &GenerateRequest,
    started: Instant,
    on_token: impl FnMut(&TokenChoice) -> ControlFlow<()>,
) -> Result<GenerateOutput> {
    generate_constrained_on(backend, seq, req, None, started, on_token)
}

/// `generate_on` under a token constraint (a grammar): each step chooses among the tokens the
/// constraint allows (constraint.rs), one step at a time, and generation ends with `Stop` when the
/// constraint is finished. Without a constraint this is `generate_on`.
pub fn generate_constrained_on(
    backend: &mut dyn Backend,
    seq: &mut dyn Sequence,
    req: &GenerateRequest,
    mut constraint: Option<&mut dyn TokenConstraint>,
    started: Instant,
    mut on_token: impl FnMut(&TokenChoice) -> ControlFlow<()>,
) -> Result<GenerateOutput> {
    ensure!(
        seq.len() < req.prompt.len(),
        "the sequence already holds {} tokens; the prompt has {}: nothing left to run",
        seq.len(),
        req.prompt.len()
    );
    let mut stop_ids = req.stop_token_ids.clone();
    if !req.ignore_eos {
        stop_ids.extend(&backend.spec().eos_token_ids);
    }
    let mut out = GenerateOutput::empty(req);
    let mut input: Vec<u32> = req.prompt[seq.len()..].to_vec();
    for step in 0..req.max_tokens {
        let sel = Selection {
            params: &req.sampling,
            prompt: &req.prompt,
            generated: &out.tokens,
            step: step as u64,
            top_logprobs: req.top_logprobs,
        };
        // Two steps in flight where the backend can: the next step may start before this token
        // is seen here (a stop ends the request with that step's state thrown away with it).
        let choice = match constraint.as_deref_mut() {
            None => backend.step_pipelined(seq, &input, &sel, step + 1 < req.max_tokens)?,
            Some(constraint) => {
                let allowed = constraint.allowed(backend.spec().vocab_size)?;
                let choice = if backend.supports_token_mask() {
                    backend.step_masked(seq, &input, &sel, &allowed)?
                } else {
                    let logits = backend.forward_logits(seq, &input)?;
                    select_token_masked(&logits, &sel, Some(&allowed))?
                };
                constraint.accept(choice.token)?;
                choice
            }
        };
        if step == 0 {
            out.timings.prefill_s = started.elapsed().as_secs_f64();
        }
        if stop_ids.contains(&choice.token) {
            out.stop_token = Some(choice);
            out.finish_reason = FinishReason::Stop;
            break;
        }
        out.tokens.push(choice.token);
        let flow = on_token(&choice);
        input = vec![choice.token];
        out.choices.push(choice);
        let finished = constraint.as_deref().is_some_and(|c| c.is_finished());
        if flow.is_break() || finished {
            out.finish_reason = FinishReason::Stop;
            break;
        }
    }
    out.timings.decode_s = (started.elapsed().as_secs_f64() - out.timings.prefill_s).max(0.0);
    Ok(out)
}

impl GenerateOutput {
    fn empty(req: &GenerateRequest) -> Self {
        GenerateOutput {
            tokens: Vec::new(),
            choices: Vec::new(),
            finish_reason: FinishReason::Length,
            stop_token: None,
            prompt_tokens: req.prompt.len(),
            timings: Timings::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use calla_model::{Family, FeedForwardSpec, ModelSpec};
    use std::any::Any;

    /// A backend whose greedy next token is (last input + 1) mod V, recording what it was asked to run.
    struct Counter {
        spec: ModelSpec,
        calls: Vec<Vec<u32>>,
    }
    struct Pos(usize);
    impl Sequence for Pos {
        fn len(&self) -> usize {
            self.0
        }
        fn snapshot(&self) -> Box<dyn Sequence> {
            Box::new(Pos(self.0))
        }
        fn byte_size(&self) -> usize {
            8
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
        fn as_any_mut(&mut self) -> &mut dyn Any {
            self
        }
    }
    impl Backend for Counter {
        fn spec(&self) -> &ModelSpec {
            &self.spec
        }
        fn describe(&self) -> String {
            "counter".into()
        }
        fn new_sequence(&mut self) -> Result<Box<dyn Sequence>> {
            Ok(Box::new(Pos(0)))
        }
        fn step(
            &mut self,
            seq: &mut dyn Sequence,
            tokens: &[u32],
            sel: &Selection,
        ) -> Result<TokenChoice> {
            let logits = self.forward_logits(seq, tokens)?;
            Ok(crate::sampling::select_token(&logits, sel))
        }
        fn forward_logits(&mut self, seq: &mut dyn Sequence, tokens: &[u32]) -> Result<Vec<f32>> {
            self.calls.push(tokens.to_vec());
            seq.as_any_mut().downcast_mut::<Pos>().unwrap().0 += tokens.len();
            let v = self.spec.vocab_size;
            let next = (*tokens.last().unwrap() as usize + 1) % v;
            Ok((0..v)
                .map(|i| if i == next { 5.0 } else { -(i as f32) * 0.01 })
                .collect())
        }
    }

    fn counter() -> Counter {
        Counter {
            spec: ModelSpec {
                family: Family::Qwen35Moe,
                vocab_size: 16,
                hidden_size: 8,
                layers: vec![],
                rms_norm_eps: 1e-6,
                num_attention_heads: 1,
                num_key_value_heads: 1,
                head_dim: 8,
                rotary_dim: 2,
                rope_theta: 1e4,
                attn_output_gate: true,
                linear_num_key_heads: 1,
                linear_num_value_heads: 1,
                linear_key_head_dim: 8,
                linear_value_head_dim: 8,
                linear_conv_kernel_dim: 4,
                feed_forward: FeedForwardSpec::Dense { intermediate: 8 },
                tie_word_embeddings: false,
                max_position_embeddings: 64,
                eos_token_ids: vec![9],
            },
            calls: vec![],
        }
    }

    fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
        GenerateRequest {
            prompt,
            max_tokens,
            sampling: SamplingParams::greedy(),
            stop_token_ids: vec![],
            ignore_eos: false,
            top_logprobs: 2,
        }
    }

    #[test]
    fn runs_prompt_once_then_one_token_at_a_time_and_stops_at_eos_without_emitting_it() {
        let mut b = counter();
        let mut streamed = vec![];
        let out = generate(&mut b, &request(vec![3, 4, 5], 10), |c| {
            streamed.push(c.token);
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_eq!(out.tokens, [6, 7, 8]);
        assert_eq!(streamed, out.tokens);
        assert_eq!(out.finish_reason, FinishReason::Stop);
        assert_eq!(out.stop_token.as_ref().unwrap().token, 9);
        assert_eq!(out.completion_tokens(), 4);
        assert_eq!(b.calls, vec![vec![3, 4, 5], vec![6], vec![7], vec![8]]);
        assert_eq!(out.choices.len(), 3);
        assert_eq!(out.choices[0].top.len(), 2);
    }

    #[test]
    fn ignore_eos_runs_to_length_but_explicit_stop_ids_still_stop() {
        let mut b = counter();
        let mut req = request(vec![7], 5);
        req.ignore_eos = true;
        let out = generate(&mut b, &req, |_| ControlFlow::Continue(())).unwrap();
        assert_eq!(out.tokens, [8, 9, 10, 11, 12]);
        assert_eq!(out.finish_reason, FinishReason::Length);
        req.stop_token_ids = vec![11];
        let out = generate(&mut b, &req, |_| ControlFlow::Continue(())).unwrap();
        assert_eq!(out.tokens, [8, 9, 10]);
        assert_eq!(out.finish_reason, FinishReason::Stop);
    }

    #[test]
    fn callback_break_stops_after_that_token() {
        let mut b = counter();
        let out = generate(&mut b, &request(vec![0], 8), |c| {
            if c.token == 2 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .unwrap();
        assert_eq!(out.tokens, [1, 2]);
        assert_eq!(out.finish_reason, FinishReason::Stop);
    }

    /// A backend with two steps in flight, as the CUDA one: with `continue_after` it runs the next
    /// step (on the chosen token, the selection advanced) before returning, and the next call must
    /// be exactly that step.
    struct Ahead {
        inner: Counter,
        /// (input tokens, continue_after) per call
        calls: Vec<(Vec<u32>, bool)>,
        /// the step run ahead: its input and its choice
        pending: Option<(u32, TokenChoice)>,
    }
    impl Backend for Ahead {
        fn spec(&self) -> &ModelSpec {
            self.inner.spec()
        }
        fn describe(&self) -> String {
            "ahead".into()
        }
        fn new_sequence(&mut self) -> Result<Box<dyn Sequence>> {
            self.inner.new_sequence()
        }
        fn step(
            &mut self,
            seq: &mut dyn Sequence,
            tokens: &[u32],
            sel: &Selection,
        ) -> Result<TokenChoice> {
            self.step_pipelined(seq, tokens, sel, false)
        }
        fn step_pipelined(
            &mut self,
            seq: &mut dyn Sequence,
            tokens: &[u32],
            sel: &Selection,
            continue_after: bool,
        ) -> Result<TokenChoice> {
            self.calls.push((tokens.to_vec(), continue_after));
            let choice = match self.pending.take() {
                Some((input, choice)) => {
                    anyhow::ensure!(tokens == [input], "not the step run ahead");
                    choice
                }
                None => self.inner.step(seq, tokens, sel)?,
            };
            if continue_after {
                let mut generated = sel.generated.to_vec();
                generated.push(choice.token);
                let next = Selection {
                    step: sel.step + 1,
                    generated: &generated,
                    ..*sel
                };
                let ahead = self.inner.step(seq, &[choice.token], &next)?;
                self.pending = Some((choice.token, ahead));
            }
            Ok(choice)
        }
        fn forward_logits(&mut self, seq: &mut dyn Sequence, tokens: &[u32]) -> Result<Vec<f32>> {
            self.inner.forward_logits(seq, tokens)
        }
    }

    #[test]
    fn pipelined_generation_asks_ahead_only_for_steps_it_will_take() {
        let mut b = Ahead {
            inner: counter(),
            calls: vec![],
            pending: None,
        };
        let mut req = request(vec![3, 4], 4);
        req.ignore_eos = true;
        let mut seq = b.new_sequence().unwrap();
        let out = generate_on(&mut b, seq.as_mut(), &req, Instant::now(), |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
        // the same tokens as one step at a time; the last step does not run ahead
        assert_eq!(out.tokens, [5, 6, 7, 8]);
        assert_eq!(
            b.calls,
            vec![
                (vec![3, 4], true),
                (vec![5], true),
                (vec![6], true),
                (vec![7], false)
            ]
        );
        assert!(b.pending.is_none());
        assert_eq!(seq.len(), 2 + 3);

        // A stop token: the step after it already ran, and the sequence counts its token.
        b.calls.clear();
        let mut seq = b.new_sequence().unwrap();
        let out = generate_on(
            &mut b,
            seq.as_mut(),
            &request(vec![6], 10),
            Instant::now(),
            |_| ControlFlow::Continue(()),
        )
        .unwrap();
        assert_eq!(out.tokens, [7, 8]);
        assert_eq!(out.stop_token.as_ref().unwrap().token, 9);
        assert_eq!(
            b.calls,
            vec![(vec![6], true), (vec![7], true), (vec![8], true)]
        );
        assert_eq!(seq.len(), 1 + 3);
    }

    /// Allows only even ids below 8, then only EOS (9) once three tokens were taken.
    struct EvenThenEos {
        taken: Vec<u32>,
    }
    impl TokenConstraint for EvenThenEos {
        fn allowed(&mut self, vocab_size: usize) -> Result<crate::TokenMask> {
            let mut mask = crate::TokenMask::none(vocab_size);
            if self.taken.len() < 3 {
                (0..8).step_by(2).for_each(|id| mask.allow(id));
            } else {
                mask.allow(9);
            }
            Ok(mask)
        }
        fn accept(&mut self, token: u32) -> Result<()> {
            self.taken.push(token);
            Ok(())
        }
        fn is_finished(&self) -> bool {
            false
        }
    }

    #[test]
    fn a_constraint_masks_every_step_on_the_host_and_never_runs_ahead() {
        let mut b = Ahead {
            inner: counter(),
            calls: vec![],
            pending: None,
        };
        let mut constraint = EvenThenEos { taken: vec![] };
        let mut seq = b.new_sequence().unwrap();
        let out = generate_constrained_on(
            &mut b,
            seq.as_mut(),
            &request(vec![3], 10),
            Some(&mut constraint),
            Instant::now(),
            |_| ControlFlow::Continue(()),
        )
        .unwrap();
        // unconstrained greedy would say 4, 5, 6…; the best allowed (the logits fall with the id
        // away from the favourite) are even ids, then EOS
        assert!(
            out.tokens.iter().all(|t| t % 2 == 0 && *t < 8),
            "{:?}",
            out.tokens
        );
        assert_eq!(out.tokens.len(), 3);
        assert_eq!(out.stop_token.as_ref().unwrap().token, 9);
        assert_eq!(constraint.taken.len(), 4);
        // all through forward_logits: nothing stepped ahead
        assert!(b.calls.is_empty() && b.pending.is_none());
        // the raw log-probability is reported, not the masked one
        assert!(out.choices[0].logprob < 0.0);
    }

    #[test]
    fn empty_prompt_is_an_error_and_zero_max_tokens_runs_nothing() {
        let mut b = counter();
        assert!(generate(&mut b, &request(vec![], 3), |_| ControlFlow::Continue(())).is_err());
        let out = generate(&mut b, &request(vec![1], 0), |_| ControlFlow::Continue(())).unwrap();
        assert!(out.tokens.is_empty() && b.calls.is_empty());
        assert_eq!(out.finish_reason, FinishReason::Length);
    }
}
