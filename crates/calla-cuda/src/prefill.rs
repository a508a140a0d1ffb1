//! The prompt path. For now every prompt token runs through the decode chain (graph replay per
//! token): correct and simple, linear in prompt length. This file is the entry point to replace
//! with batched prompt kernels (tensor-core grouped expert GEMMs, chunked DeltaNet, flash
//! attention); `CudaBackend::step` and `forward_logits` call only `run_prompt_tokens`.

use anyhow::Result;

use crate::backend::CudaBackend;
use crate::sequence::CudaSequence;

/// Run `tokens` through the layers at the sequence's next positions (no head, no selection). The
/// caller has checked the ids and the capacity; `seq.len` is not advanced here.
pub fn run_prompt_tokens(
    backend: &mut CudaBackend,
    seq: &CudaSequence,
    tokens: &[u32],
) -> Result<()> {
    for (i, &t) in tokens.iter().enumerate() {
        backend.set_cursor(seq, seq.len + i, t)?;
        backend.run_token()?;
    }
    Ok(())
}
