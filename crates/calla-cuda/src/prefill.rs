//! The prompt path: `CudaBackend::step` and `forward_logits` call only `run_prompt_tokens`.
//! Prompts run through the batched prefill kernels (prefill_layer.rs: tensor-core GEMMs, chunked
//! DeltaNet, flash attention, grouped MoE) in chunks of `CudaOptions::prompt_chunk` tokens, writing
//! the same sequence state the decode step reads; with `prompt_chunk = 0`, token by token through
//! the decode chain (graph replay per token).

use anyhow::Result;
use calla_engine::Backend;

use crate::backend::CudaBackend;
use crate::pool::Arena;
use crate::prefill_layer::{PrefillOptions, PromptRunner};
use crate::sequence::CudaSequence;

/// The batched prompt path's scratch, made on the first prompt (its arena outlives the runner).
pub(crate) struct PromptPath {
    runner: PromptRunner,
    _arena: Arena,
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
    if backend.prompt_chunk == 0 {
        for (i, &t) in tokens.iter().enumerate() {
            backend.set_cursor(seq, seq.len + i, t)?;
            backend.run_token()?;
        }
        return Ok(());
    }
    let gpu = backend.gpu().clone();
    if backend.prompt.is_none() {
        let mut arena = Arena::new(&gpu, 64 << 20);
        let chunk = backend.prompt_chunk.min(backend.max_context()).max(1);
        let opts = PrefillOptions {
            precision: backend.prompt_precision,
        };
        let runner = PromptRunner::new(&mut arena, backend.spec(), chunk, opts)?;
        backend.prompt = Some(PromptPath {
            runner,
            _arena: arena,
        });
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
