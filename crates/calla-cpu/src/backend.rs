//! `CpuBackend`: the reference engine behind the `calla_engine::Backend` trait.

use anyhow::{ensure, Context, Result};
use calla_engine::sampling::{select_token, select_token_masked};
use calla_engine::{Backend, Selection, Sequence, TokenChoice, TokenMask};
use calla_model::{ModelSpec, Weights};

use crate::forward::{Logits, Model};
use crate::sequence::CpuSequence;

/// Prompt tokens run per forward call: bounds activation memory ([chunk, D] per buffer, [chunk, C] in
/// DeltaNet) while keeping each weight read shared by many tokens.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

pub struct CpuBackend {
    model: Model,
    prefill_chunk: usize,
}

impl CpuBackend {
    pub fn new(spec: ModelSpec, weights: Weights) -> Result<CpuBackend> {
        let model = Model::new(spec, &weights).context("preparing weights for the CPU engine")?;
        Ok(CpuBackend {
            model,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
        })
    }

    /// Run prompts in pieces of at most `tokens` (≥ 1).
    pub fn with_prefill_chunk(mut self, tokens: usize) -> CpuBackend {
        self.prefill_chunk = tokens.max(1);
        self
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        ensure!(!tokens.is_empty(), "no tokens to run");
        let vocab = self.model.spec().vocab_size;
        if let Some((i, id)) = tokens
            .iter()
            .enumerate()
            .find(|(_, id)| **id as usize >= vocab)
        {
            anyhow::bail!("token id {id} at index {i} is out of range (vocab_size {vocab})");
        }
        Ok(())
    }

    /// Run `tokens` in prefill-sized pieces; returns the logits the last piece was asked for.
    pub fn run(&self, seq: &mut dyn Sequence, tokens: &[u32], logits: Logits) -> Result<Vec<f32>> {
        self.check_tokens(tokens)?;
        let seq = seq
            .as_any_mut()
            .downcast_mut::<CpuSequence>()
            .context("this sequence was not created by the CPU backend")?;
        let pieces: Vec<&[u32]> = tokens.chunks(self.prefill_chunk).collect();
        let mut out = Vec::new();
        for (i, piece) in pieces.iter().enumerate() {
            let want = if i + 1 == pieces.len() {
                logits
            } else {
                Logits::Skip
            };
            out = self.model.forward(piece, seq, want, None);
        }
        Ok(out)
    }
}

impl Backend for CpuBackend {
    fn spec(&self) -> &ModelSpec {
        self.model.spec()
    }
    fn describe(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }
    fn new_sequence(&mut self) -> Result<Box<dyn Sequence>> {
        Ok(Box::new(self.model.new_sequence()))
    }
    fn step(
        &mut self,
        seq: &mut dyn Sequence,
        tokens: &[u32],
        sel: &Selection,
    ) -> Result<TokenChoice> {
        let logits = self.run(seq, tokens, Logits::Last)?;
        Ok(select_token(&logits, sel))
    }
    /// The CPU chooses on the host anyway: the mask applies inside its selection.
    fn supports_token_mask(&self) -> bool {
        true
    }
    fn step_masked(
        &mut self,
        seq: &mut dyn Sequence,
        tokens: &[u32],
        sel: &Selection,
        allowed: &TokenMask,
    ) -> Result<TokenChoice> {
        let logits = self.run(seq, tokens, Logits::Last)?;
        select_token_masked(&logits, sel, Some(allowed))
    }
    fn forward_logits(&mut self, seq: &mut dyn Sequence, tokens: &[u32]) -> Result<Vec<f32>> {
        self.run(seq, tokens, Logits::Last)
    }
}
