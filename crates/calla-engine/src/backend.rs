//! The backend boundary: "run these tokens through the model for this sequence and pick the next token".
//!
//! A backend implements the whole forward pass of the family and token selection; nothing above it sees
//! activations or logits (except through `forward_logits`, which exists for parity tests and tooling).

use std::any::Any;

use calla_model::ModelSpec;

use crate::constraint::TokenMask;
use crate::sampling::SamplingParams;

/// A sequence's state inside a backend: KV cache of attention layers, conv + recurrent state of DeltaNet
/// layers, and the number of tokens consumed. It is a value: `snapshot` returns an independent copy that can
/// later replace the live state (prefix caching across chat turns, cancellation).
pub trait Sequence: Send {
    /// Tokens consumed so far (the position of the next token).
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// An independent copy of this state.
    fn snapshot(&self) -> Box<dyn Sequence>;
    /// Memory the state occupies (host or device), for cache accounting.
    fn byte_size(&self) -> usize;
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// What a step must choose the next token with.
#[derive(Debug, Clone, Copy)]
pub struct Selection<'a> {
    pub params: &'a SamplingParams,
    /// The prompt's tokens (repetition penalty applies to prompt and output, as in vLLM/HF).
    pub prompt: &'a [u32],
    /// Tokens generated so far in this request (presence/frequency penalties apply to these).
    pub generated: &'a [u32],
    /// Index of the token being drawn (0 for the first generated token): the RNG draw is keyed by
    /// (params.seed, step) so every backend draws the same token.
    pub step: u64,
    /// How many top log-probabilities to return (0 = none).
    pub top_logprobs: usize,
}

/// The chosen token, its log-probability and the top alternatives, all from the log-softmax of the raw
/// logits of the step that produced it (before penalties, bias, temperature or truncation).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenChoice {
    pub token: u32,
    pub logprob: f32,
    /// best first; `top_logprobs` entries
    pub top: Vec<(u32, f32)>,
}

/// One row of a batched step ([`Backend::step_batch`]): a sequence, the tokens it runs at its
/// position (one for a decoding sequence; a prompt chunk may join the step) and how the row chooses
/// its next token. The rows of one step are distinct sequences.
pub struct BatchRow<'a> {
    pub seq: &'a mut dyn Sequence,
    pub tokens: &'a [u32],
    pub sel: Selection<'a>,
    /// Choose only among these tokens (constrained decoding); None: unconstrained.
    pub mask: Option<&'a TokenMask>,
}

pub trait Backend: Send {
    fn spec(&self) -> &ModelSpec;
    /// "cpu", "cuda:0 (NVIDIA H200)", … for logs.
    fn describe(&self) -> String;
    /// A fresh, empty sequence state.
    fn new_sequence(&mut self) -> anyhow::Result<Box<dyn Sequence>>;
    /// Run `tokens` (a prompt, a prompt suffix, or the last chosen token) through the model at the
    /// sequence's position, and choose the next token.
    fn step(
        &mut self,
        seq: &mut dyn Sequence,
        tokens: &[u32],
        sel: &Selection,
    ) -> anyhow::Result<TokenChoice>;
    /// `step`, with leave to start the next step before this one's token is returned (two steps in
    /// flight: the device does not wait for the host between tokens) when `continue_after` is set.
    /// The next step is the one the caller would ask for to go on with the same request:
    /// `step(seq, &[chosen], sel')`, where `sel'` is `sel` with `step + 1` and the chosen token
    /// appended to `generated`. After such a call the sequence has consumed the chosen token too
    /// (`len()` counts it) and the next call on it must be exactly that step (through either
    /// method), before any other sequence steps; otherwise the sequence can only be dropped
    /// (a request that ends at a stop token does just that). Backends without a queue just `step`.
    fn step_pipelined(
        &mut self,
        seq: &mut dyn Sequence,
        tokens: &[u32],
        sel: &Selection,
        continue_after: bool,
    ) -> anyhow::Result<TokenChoice> {
        let _ = continue_after;
        self.step(seq, tokens, sel)
    }
    /// Whether `step_masked` applies the mask where this backend chooses its token. When false,
    /// the generation loop runs constrained steps as `forward_logits` + the reference sampler on
    /// the host (`sampling::select_token_masked`).
    fn supports_token_mask(&self) -> bool {
        false
    }
    /// `step`, choosing only among the tokens `allowed` (see `constraint.rs` for where the mask
    /// applies). Never runs ahead. The default selects on the host from `forward_logits`.
    fn step_masked(
        &mut self,
        seq: &mut dyn Sequence,
        tokens: &[u32],
        sel: &Selection,
        allowed: &TokenMask,
    ) -> anyhow::Result<TokenChoice> {
        let logits = self.forward_logits(seq, tokens)?;
        crate::sampling::select_token_masked(&logits, sel, Some(allowed))
    }
    /// Rows one [`Backend::step_batch`] call runs together at best (1: the backend has no batched
    /// step; `step_batch` then runs its rows one after the other). A scheduler may pass more rows;
    /// the backend splits them.
    fn max_batch(&self) -> usize {
        1
    }
    /// One step for several sequences: each row's tokens through the model at its sequence's
    /// position, and each row's next token chosen with its own selection (and mask). Row `i`'s
    /// result is the token `step` (or `step_masked`) would choose for it alone: exactly on
    /// backends whose batched arithmetic is the one-row arithmetic (the CPU reference), within the
    /// backend's parity tolerance on the logits elsewhere. Never runs ahead; a sequence that ran
    /// ahead (`step_pipelined`) must have taken its pending step before it joins a batch. The
    /// default runs the rows one after the other.
    fn step_batch(&mut self, rows: &mut [BatchRow<'_>]) -> anyhow::Result<Vec<TokenChoice>> {
        rows.iter_mut()
            .map(|row| match row.mask {
                Some(mask) => self.step_masked(&mut *row.seq, row.tokens, &row.sel, mask),
                None => self.step(&mut *row.seq, row.tokens, &row.sel),
            })
            .collect()
    }
    /// Run `tokens` and return the raw f32 logits of the last position. For parity tests, tools and
    /// host-side constrained selection.
    fn forward_logits(
        &mut self,
        seq: &mut dyn Sequence,
        tokens: &[u32],
    ) -> anyhow::Result<Vec<f32>>;
}
