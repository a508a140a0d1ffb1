//! The prompt path: `CudaBackend::step` and `forward_logits` call only `run_prompt_tokens`.
//! Prompts run through the batched prefill kernels (engine/prefill.rs: tensor-core GEMMs, chunked
//! DeltaNet, flash attention, grouped MoE) in chunks of `CudaOptions::prompt_chunk` tokens, writing
//! the same sequence state the decode step reads; with `prompt_chunk = 0`, token by token through
//! the decode chain (graph replay per token).

use anyhow::Result;
use calla_engine::Backend;

use crate::engine::backend::CudaBackend;
use crate::engine::prefill::{PrefillOptions, PromptRunner};
use crate::engine::sequence::CudaSequence;
use crate::runtime::pool::Arena;

/// The batched prompt path's scratch, made on the first prompt for that prompt's size and remade
/// larger when a longer one comes (its arena outlives the runner).
pub(crate) struct PromptPath {
    runner: PromptRunner,
    arena: Arena,
}

impl PromptPath {
    /// Device bytes the path holds.
    pub(crate) fn reserved(&self) -> usize {
        self.arena.reserved()
    }
}

/// Fewest rows a prompt scratch is made for (short prompts in a row do not remake it).
const MIN_SCRATCH_ROWS: usize = 64;

/// Rows of the prompt scratch to (re)make for a prompt of `tokens` when it holds `current` rows
/// (None: none yet), with chunks capped at `cap` = min(prompt_chunk, max_context); None when the
/// current one serves. The size is the prompt's rounded up to a power of two (so a few growing
/// prompts remake it a few times), never above the cap: memory follows the prompts actually seen
/// instead of the largest chunk allowed.
pub fn scratch_rows(tokens: usize, cap: usize, current: Option<usize>) -> Option<usize> {
    let cap = cap.max(1);
    let need = tokens.clamp(1, cap);
    match current {
        Some(rows) if rows >= need => None,
        _ => Some(need.next_power_of_two().max(MIN_SCRATCH_ROWS).min(cap)),
    }
}

/// Run `tokens` through the layers at the sequence's next positions (no head, no selection); the
/// last token's residual row ends in the decode scratch's h (for the head). The caller has checked
/// the ids and the capacity; `seq.len` is not advanced here.
pub fn run_prompt_tokens(
    backend: &mut CudaBackend,
    seq: &CudaSequence,
    tokens: &[u32],
) -> Result<()> {
    if tokens.is_empty() {
        return Ok(());
    }
    // Token by token through the decode chain when asked (prompt_chunk 0) or where the chunked
    // DeltaNet prompt kernels do not take the head dims.
    if backend.prompt_chunk == 0 || crate::ops::deltanet_general::prefill_is_general(backend.spec())
    {
        for (i, &t) in tokens.iter().enumerate() {
            backend.set_cursor(seq, seq.len + i, t)?;
            backend.run_token()?;
        }
        return Ok(());
    }
    let gpu = backend.gpu().clone();
    let cap = backend.prompt_chunk.min(backend.max_context());
    let current = backend.prompt.as_ref().map(|p| p.runner.scratch.max_tokens);
    if let Some(rows) = scratch_rows(tokens.len(), cap, current) {
        backend.prompt = None; // the old scratch goes back before the new one is made
        let mut arena = Arena::new(&gpu, crate::runtime::pool::DEFAULT_BLOCK);
        let opts = PrefillOptions {
            precision: backend.prompt_precision,
        };
        let runner = PromptRunner::new(&mut arena, backend.spec(), rows, opts)?;
        tracing::debug!(
            "cuda: prompt scratch for {rows} tokens: {:.1} MB (mixer pieces of {})",
            arena.reserved() as f64 / 1e6,
            runner.scratch.mixer_tokens
        );
        backend.prompt = Some(PromptPath { runner, arena });
    }
    let path = backend.prompt.as_ref().expect("made above");
    path.runner.run(
        &gpu,
        backend.spec(),
        &backend.model,
        backend.layout(),
        seq.base(),
        seq.len,
        tokens,
        Some(backend.scratch.h),
    )
}

#[cfg(test)]
mod tests {
    use super::scratch_rows;

    #[test]
    fn prompt_scratch_follows_the_prompts_seen_up_to_the_chunk() {
        // first prompt: its size rounded up to a power of two, at least 64, at most the cap
        assert_eq!(scratch_rows(1, 8192, None), Some(64));
        assert_eq!(scratch_rows(300, 8192, None), Some(512));
        assert_eq!(scratch_rows(8191, 8192, None), Some(8192));
        assert_eq!(scratch_rows(50_000, 8192, None), Some(8192));
        assert_eq!(scratch_rows(5000, 6000, None), Some(6000));
        assert_eq!(scratch_rows(10, 20, None), Some(20));
        // a prompt the scratch holds (or that runs in chunks of the cap): kept
        assert_eq!(scratch_rows(512, 8192, Some(512)), None);
        assert_eq!(scratch_rows(100, 8192, Some(512)), None);
        assert_eq!(scratch_rows(50_000, 8192, Some(8192)), None);
        // longer: remade larger
        assert_eq!(scratch_rows(513, 8192, Some(512)), Some(1024));
        assert_eq!(scratch_rows(9000, 8192, Some(1024)), Some(8192));
    }
}
