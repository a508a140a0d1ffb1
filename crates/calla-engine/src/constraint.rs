//! Constrained decoding: a per-request [`TokenConstraint`] (a grammar, in calla-server) names the
//! tokens allowed at each step as a [`TokenMask`], and is told every token chosen.
//!
//! Where the mask applies: to the adjusted logits (after logit_bias and the penalties), before
//! temperature, top-k/top-p/min-p and the draw: a disallowed token's logit is −∞, so it is never
//! chosen, greedy or sampled, and the truncations see only allowed tokens. Log-probabilities
//! reported to users stay those of the raw logits (the unconstrained model's), as with logit_bias.
//!
//! Backends that choose the token themselves say so with `Backend::supports_token_mask` and take
//! the mask in `Backend::step_masked`; for the others the generation loop asks for
//! `forward_logits` and selects on the host with the reference sampler. Either way a constrained
//! step never runs ahead (the next mask depends on this step's token), so the two-steps-in-flight
//! pipeline is kept for unconstrained requests only.

/// A set of token ids, one bit each (bit `id % 32` of word `id / 32`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
    len: usize,
}

impl TokenMask {
    /// No token allowed, over ids `0..len`.
    pub fn none(len: usize) -> TokenMask {
        TokenMask {
            words: vec![0; len.div_ceil(32)],
            len,
        }
    }

    /// From 32-bit words (llguidance's `SimpleVob` layout); bits at or past `len` are ignored.
    pub fn from_words(words: Vec<u32>, len: usize) -> TokenMask {
        let mut mask = TokenMask { words, len };
        mask.words.resize(len.div_ceil(32), 0);
        // (is_multiple_of is newer than the workspace's rust-version)
        #[allow(clippy::manual_is_multiple_of)]
        let partial = len % 32 != 0;
        if partial {
            if let Some(last) = mask.words.last_mut() {
                *last &= (1u32 << (len % 32)) - 1;
            }
        }
        mask
    }

    /// Ids covered (allowed or not).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn allow(&mut self, id: u32) {
        if (id as usize) < self.len {
            self.words[id as usize / 32] |= 1 << (id % 32);
        }
    }

    /// Ids past `len()` are never allowed.
    pub fn allows(&self, id: u32) -> bool {
        (id as usize) < self.len && self.words[id as usize / 32] & (1 << (id % 32)) != 0
    }

    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Set every disallowed entry of `logits` to −∞.
    pub fn apply(&self, logits: &mut [f32]) {
        for (id, x) in logits.iter_mut().enumerate() {
            if !self.allows(id as u32) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

/// A constraint on one request's tokens, driven by the generation loop on the engine thread.
pub trait TokenConstraint: Send {
    /// The tokens allowed for the next step, over the model's vocabulary.
    fn allowed(&mut self, vocab_size: usize) -> anyhow::Result<TokenMask>;
    /// The token chosen (it was allowed), stop tokens included.
    fn accept(&mut self, token: u32) -> anyhow::Result<()>;
    /// Nothing more may follow: generation ends here (finish reason `Stop`).
    fn is_finished(&self) -> bool;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_cover_exactly_their_ids() {
        let mut m = TokenMask::none(40);
        m.allow(0);
        m.allow(33);
        m.allow(40);
        assert!(m.allows(0) && m.allows(33) && !m.allows(40) && !m.allows(1));
        assert_eq!(m.count(), 2);
        let mut logits = vec![1.0; 41];
        m.apply(&mut logits);
        assert_eq!(logits.iter().filter(|x| x.is_finite()).count(), 2);
        let m = TokenMask::from_words(vec![u32::MAX, u32::MAX], 35);
        assert_eq!(m.count(), 35);
        assert!(!m.allows(35));
    }
}
