//! A checkpoint directory + a backend → a [`Runtime`]: tokenizer, chat template, sampling defaults,
//! the engine thread.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use calla_chat::template::DEFAULT_RENDER_FUEL;
use calla_chat::{ChatTemplate, TemplateError};
use calla_engine::scheduler::{Scheduler, SchedulerConfig};
use calla_engine::Backend;
use calla_model::load::GenerationDefaults;
use calla_model::tokenizer::Tokenizer;

use crate::state::{Runtime, ServerConfig};

#[derive(Debug, Clone)]
pub struct RuntimeOptions {
    /// Requests that may wait; more get 429.
    pub max_queue: usize,
    /// Cap on prompt + output tokens (None: the model's max_position_embeddings).
    pub max_context: Option<usize>,
    /// Memory for the prefix cache's saved states (0 disables it).
    pub prefix_cache_bytes: usize,
    /// Most bytes one chat-template render may write (set it to the server's max_prompt_bytes).
    pub max_prompt_bytes: usize,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        RuntimeOptions {
            max_queue: 64,
            max_context: None,
            prefix_cache_bytes: 2 << 30,
            max_prompt_bytes: ServerConfig::default().max_prompt_bytes,
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
    let tokenizer = Tokenizer::from_dir(dir)?;
    let template = match ChatTemplate::from_dir(dir) {
        Ok(mut template) => {
            template.set_limits(DEFAULT_RENDER_FUEL, opts.max_prompt_bytes);
            Some(template)
        }
        Err(TemplateError::Missing(_)) => {
            tracing::warn!(
                "{}: no chat template; only /v1/completions will work",
                dir.display()
            );
            None
        }
        Err(e) => return Err(e).context("loading the chat template"),
    };
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
