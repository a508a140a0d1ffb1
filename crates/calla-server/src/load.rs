//! A checkpoint directory + a backend → a [`Runtime`]: tokenizer, chat template, sampling defaults,
//! the engine thread.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use calla_chat::{ChatTemplate, TemplateError};
use calla_engine::scheduler::{Scheduler, SchedulerConfig};
use calla_engine::Backend;
use calla_model::load::GenerationDefaults;
use calla_model::tokenizer::Tokenizer;

use crate::state::{AppState, Runtime};

#[derive(Debug, Clone)]
pub struct RuntimeOptions {
    /// Requests that may wait; more get 429.
    pub max_queue: usize,
    /// Cap on prompt + output tokens (None: the model's max_position_embeddings).
    pub max_context: Option<usize>,
    /// Memory for the prefix cache's saved states (0 disables it).
    pub prefix_cache_bytes: usize,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        RuntimeOptions {
            max_queue: 64,
            max_context: None,
            prefix_cache_bytes: 2 << 30,
        }
    }
}

/// Read the tokenizer and chat template of `dir` and start the engine thread on `backend`.
pub fn start_runtime(
    dir: &Path,
    backend: Box<dyn Backend>,
    defaults: GenerationDefaults,
    opts: &RuntimeOptions,
) -> anyhow::Result<Runtime> {
    anyhow::ensure!(
        opts.max_queue >= 1,
        "--max-queue must be at least 1 (0 would refuse every request)"
    );
    let tokenizer = Tokenizer::from_dir(dir)?;
    let template = match ChatTemplate::from_dir(dir) {
        Ok(template) => Some(template),
        Err(TemplateError::Missing(_)) => {
            tracing::warn!(
                "{}: no chat template; only /v1/completions will work",
                dir.display()
            );
            None
        }
        Err(e) => return Err(e).context("loading the chat template"),
    };
    // An id the tokenizer can produce must have an embedding row: checked here, not found as a 500
    // (or an out-of-range read) on the first prompt that uses it.
    let model_vocab = backend.spec().vocab_size;
    anyhow::ensure!(
        tokenizer.vocab_size() <= model_vocab,
        "{}: the tokenizer has {} tokens, more than the model's vocab_size {model_vocab} \
         (a tokenizer from another model?)",
        dir.display(),
        tokenizer.vocab_size()
    );
    let model_context = backend.spec().max_position_embeddings;
    let max_context = opts
        .max_context
        .map_or(model_context, |c| c.min(model_context));
    anyhow::ensure!(max_context >= 2, "--max-context must be at least 2 tokens");
    let scheduler = Scheduler::start(
        backend,
        SchedulerConfig {
            max_queue: opts.max_queue,
            prefix_cache_bytes: opts.prefix_cache_bytes,
            max_context,
        },
    );
    Ok(Runtime {
        scheduler,
        codec: Arc::new(tokenizer),
        template,
        defaults,
        max_context,
    })
}

/// Run `load` on a blocking thread and make `state` ready with its runtime. The receiver gets Ok
/// once the server is ready, or the loader's error; a panic in the loader is an error too (it used
/// to drop the channel, which read as success and left a server answering 503 for ever).
pub fn load_in_background(
    state: Arc<AppState>,
    load: impl FnOnce() -> anyhow::Result<Runtime> + Send + 'static,
) -> tokio::sync::oneshot::Receiver<anyhow::Result<()>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::task::spawn_blocking(move || {
        let outcome = match catch_unwind(AssertUnwindSafe(load)) {
            Ok(Ok(runtime)) => {
                state.set_ready(runtime);
                Ok(())
            }
            Ok(Err(e)) => Err(e),
            Err(panic) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "no message".into());
                Err(anyhow::anyhow!("the loader panicked: {message}"))
            }
        };
        if let Err(e) = &outcome {
            tracing::error!("loading the model failed: {e:#}");
        }
        let _ = tx.send(outcome);
    });
    rx
}

/// What the server does with [`load_in_background`]'s report: a report that never comes (the
/// loading thread vanished) is a failure, not success.
pub fn load_outcome(
    report: Result<anyhow::Result<()>, tokio::sync::oneshot::error::RecvError>,
) -> anyhow::Result<()> {
    match report {
        Ok(outcome) => outcome,
        Err(_) => Err(anyhow::anyhow!("the model loader stopped without a result")),
    }
}
