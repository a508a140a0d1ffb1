//! What every handler shares: the configuration, the model once it is loaded, metrics, ids.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use calla_chat::ChatTemplate;
use calla_engine::scheduler::Scheduler;
use calla_model::load::GenerationDefaults;
use tokio::sync::Semaphore;

use crate::auth::ApiKey;
use crate::codec::TextCodec;
use crate::errors::ApiError;
use crate::listen::Limits;
use crate::metrics::{EngineGauges, Metrics};
use crate::responses::ResponseStore;
use crate::structured::Grammars;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The `model` clients must name (and /v1/models lists).
    pub served_model_name: String,
    pub api_key: Option<String>,
    /// Larger request bodies get 413.
    pub max_body_bytes: usize,
    /// Log prompt and output text (off by default: they may be private).
    pub log_text: bool,
    /// Most choices one request may ask for (`n`).
    pub max_n: usize,
    /// Longest prompt text (a completion prompt, or all message contents of a chat request), in
    /// bytes, checked before tokenizing; longer gets 400.
    pub max_prompt_bytes: usize,
    /// Host names requests may name (guard.rs); None = any. Default: loopback names.
    pub allowed_hosts: Option<Vec<String>>,
    /// Browser origins that get CORS headers and pass the Origin check besides the allowed hosts'
    /// own pages (`--cors-origin`; `*`: any); empty: no CORS (cors.rs, guard.rs).
    pub cors_origins: Vec<String>,
    /// Timeouts and the connection cap (listen.rs).
    pub limits: Limits,
    /// Requests parsed, templated and tokenized at once, on the blocking pool (never on the async
    /// workers, which must keep answering /health and streaming).
    pub prepare_threads: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            served_model_name: "calla".into(),
            api_key: None,
            max_body_bytes: 16 << 20,
            log_text: false,
            max_n: 16,
            max_prompt_bytes: 4 << 20,
            allowed_hosts: crate::guard::allowed_hosts_for("127.0.0.1"),
            cors_origins: Vec::new(),
            limits: Limits::default(),
            prepare_threads: std::thread::available_parallelism()
                .map_or(2, |n| n.get().clamp(1, 8)),
        }
    }
}

/// A loaded model ready to serve.
pub struct Runtime {
    pub scheduler: Scheduler,
    pub codec: Arc<dyn TextCodec>,
    /// None when the checkpoint has no chat template (only /v1/completions works then).
    pub template: Option<ChatTemplate>,
    /// generation_config.json: the sampling defaults when a request leaves a field out.
    pub defaults: GenerationDefaults,
    /// Longest prompt + output.
    pub max_context: usize,
}

pub struct AppState {
    pub config: ServerConfig,
    pub api_key: Option<ApiKey>,
    pub metrics: Metrics,
    /// Constrained decoding's shared parser factory (structured.rs).
    pub grammars: Grammars,
    /// Recent /v1/responses results, for previous_response_id (responses.rs).
    pub responses: ResponseStore,
    /// Unix time the server started (the `created` of /v1/models).
    pub started: u64,
    runtime: OnceLock<Arc<Runtime>>,
    prepare_permits: Arc<Semaphore>,
    ids: AtomicU64,
    id_hasher: RandomState,
}

impl AppState {
    pub fn new(config: ServerConfig) -> Arc<AppState> {
        Arc::new(AppState {
            api_key: config.api_key.as_deref().map(ApiKey::new),
            metrics: Metrics::default(),
            grammars: Grammars::default(),
            responses: ResponseStore::default(),
            started: unix_now(),
            prepare_permits: Arc::new(Semaphore::new(config.prepare_threads.max(1))),
            config,
            runtime: OnceLock::new(),
            ids: AtomicU64::new(0),
            id_hasher: RandomState::new(),
        })
    }

    /// The model is loaded: start answering.
    pub fn set_ready(&self, runtime: Runtime) {
        let _ = self.runtime.set(Arc::new(runtime));
    }

    pub fn is_ready(&self) -> bool {
        self.runtime.get().is_some()
    }

    pub fn runtime(&self) -> Result<Arc<Runtime>, ApiError> {
        self.runtime.get().cloned().ok_or_else(ApiError::loading)
    }

    /// 64 unpredictable bits (per-process random keys over a counter): ids and default seeds.
    pub fn random_u64(&self) -> u64 {
        let mut h = self.id_hasher.build_hasher();
        h.write_u64(self.ids.fetch_add(1, Ordering::Relaxed));
        h.finish()
    }

    /// `chatcmpl-…`, `cmpl-…`, `call_…`: prefix + 24 hex digits.
    pub fn new_id(&self, prefix: &str) -> String {
        format!(
            "{prefix}{:016x}{:08x}",
            self.random_u64(),
            self.random_u64() as u32
        )
    }

    /// Run request preparation (JSON, template, tokenizer: CPU work sized by the request) on the
    /// blocking pool, at most `prepare_threads` at a time. A panic in it is a 500, not a crash.
    pub async fn prepare<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let permit = Arc::clone(&self.prepare_permits)
            .acquire_owned()
            .await
            .map_err(|_| ApiError::internal("the server is shutting down"))?;
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            work()
        })
        .await
        .unwrap_or_else(|e| {
            tracing::error!("request preparation failed: {e}");
            Err(ApiError::internal("preparing the request failed"))
        })
    }

    pub fn render_metrics(&self) -> String {
        let engine = self.runtime.get().map(|rt| EngineGauges {
            running: rt.scheduler.running(),
            waiting: rt.scheduler.waiting(),
            prefix_cache: rt.scheduler.prefix_cache_stats(),
        });
        self.metrics.render(&self.config.served_model_name, engine)
    }
}

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
