//! `calla serve`: the OpenAI-compatible HTTP API (calla-server) on a checkpoint, or on the bundled tiny
//! demo checkpoint when no --model is given.
//!
//! The port is bound first and answers /health with 503 while the model loads, then 200. One log line
//! per request (timings, token counts); prompt and output text only with --log-text.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use calla_model::load::{load_model, LoadOptions};
use calla_server::{start_runtime, AppState, RuntimeOptions, ServerConfig};

use crate::args::{CacheArgs, DeviceArgs, ModelArgs, SamplingArgs};
use crate::device::open_backend;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on (loopback unless told otherwise).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require this key (`Authorization: Bearer KEY` or `X-Api-Key: KEY`); /health and /metrics stay open.
    #[arg(long, env = "CALLA_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The model name clients send (default: the checkpoint directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    #[command(flatten)]
    device: DeviceArgs,
    /// Sampling defaults for requests that do not set them (over generation_config.json).
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    cache: CacheArgs,
    /// Requests that may wait for the engine; more get 429.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Largest request body, in MiB.
    #[arg(long, default_value_t = 16)]
    max_body_mb: usize,
    /// Also log each request's prompt and output text.
    #[arg(long)]
    log_text: bool,
    /// Browser origin allowed CORS (repeatable; `*` for any); default: none.
    #[arg(long = "cors-origin")]
    cors_origins: Vec<String>,
}

pub fn run(args: Args) -> Result<()> {
    args.sampling.check()?;
    let (dir, demo) = match &args.model.model {
        Some(dir) => (dir.clone(), false),
        None => (demo_checkpoint()?, true),
    };
    let served_model_name = args.served_model_name.clone().unwrap_or_else(|| {
        if demo {
            DEMO_NAME.to_string()
        } else {
            model_name_of(&dir)
        }
    });
    let config = ServerConfig {
        served_model_name: served_model_name.clone(),
        api_key: args.api_key.clone(),
        max_body_bytes: args.max_body_mb << 20,
        log_text: args.log_text,
        cors_origins: args.cors_origins.clone(),
        ..ServerConfig::default()
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("calla-http")
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", args.host, args.port)
            .parse()
            .or_else(|_| {
                std::net::ToSocketAddrs::to_socket_addrs(&(args.host.as_str(), args.port))
                    .ok()
                    .and_then(|mut addrs| addrs.next())
                    .ok_or(())
            })
            .map_err(|_| anyhow::anyhow!("--host {}: not an address", args.host))?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let state = AppState::new(config);
        tracing::info!(
            "listening on http://{addr} (model '{served_model_name}' loading from {})",
            dir.display()
        );
        if demo {
            tracing::warn!(
                "no --model given: serving the bundled tiny demo checkpoint; its text is meaningless \
                 (serve a real one with `calla serve --model /path/to/Qwen3.6-35B-A3B`)"
            );
        }
        if args.api_key.is_none() && !addr.ip().is_loopback() {
            tracing::warn!("listening on {addr} without --api-key: anyone who can reach it can use it");
        }

        // Load in the background; a load failure stops the server.
        let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<anyhow::Error>();
        let loader_state = Arc::clone(&state);
        let options = RuntimeOptions {
            max_queue: args.max_queue,
            max_context: args.cache.max_context,
            prefix_cache_bytes: args.cache.prefix_cache_bytes(),
        };
        let (model, device, sampling) = (args.model.clone(), args.device, args.sampling);
        tokio::task::spawn_blocking(move || {
            match load(&dir, &model, &device, &sampling, options) {
                Ok(runtime) => {
                    tracing::info!(
                        "ready: {} on {}, context {} tokens",
                        dir.display(),
                        runtime.scheduler.backend(),
                        runtime.max_context
                    );
                    loader_state.set_ready(runtime);
                }
                Err(e) => {
                    let _ = failed_tx.send(e);
                }
            }
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(calla_server::serve(listener, state, async move {
            let _ = stop_rx.await;
        }));
        let outcome = tokio::select! {
            failure = failed_rx => match failure {
                Ok(e) => Err(e.context("loading the model")),
                Err(_) => {
                    // Loaded: serve until a signal.
                    shutdown_signal().await;
                    tracing::info!("shutting down");
                    Ok(())
                }
            },
            _ = shutdown_signal() => {
                tracing::info!("shutting down");
                Ok(())
            }
        };
        let _ = stop_tx.send(());
        match server.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!("server error: {e}"),
            Err(e) => tracing::error!("server task failed: {e}"),
        }
        outcome
    })
}

fn load(
    dir: &Path,
    model: &ModelArgs,
    device: &DeviceArgs,
    sampling: &SamplingArgs,
    mut options: RuntimeOptions,
) -> Result<calla_server::Runtime> {
    let loaded = load_model(dir, &LoadOptions { quant: model.quant })?;
    let defaults = sampling.over(loaded.generation.clone())?;
    let opened = open_backend(&loaded, device, options.max_context)?;
    options.max_context = opened.capacity;
    start_runtime(dir, opened.backend, defaults, &options)
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = terminate => {},
    }
}

/// The name clients use for a checkpoint: its directory's name ("Qwen3.6-35B-A3B").
pub fn model_name_of(dir: &Path) -> String {
    dir.canonicalize()
        .unwrap_or_else(|_| dir.to_path_buf())
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "calla".into())
}

// ---------------------------------------------------------------------------------------------------
// The bundled demo checkpoint: the tiny test fixture (Qwen3_5MoeForCausalLM, 4 layers, random
// weights, a 512-token vocabulary), compiled into the binary so a fresh machine can try the whole API
// with one command. Written to a cache directory named by its content on first use.

pub const DEMO_NAME: &str = "calla-demo";

macro_rules! demo_file {
    ($name:literal) => {
        (
            $name,
            include_bytes!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../tests/fixtures/models/qwen35moe-causal-perexpert/",
                $name
            ))
            .as_slice(),
        )
    };
}

const DEMO_FILES: [(&str, &[u8]); 6] = [
    demo_file!("config.json"),
    demo_file!("generation_config.json"),
    demo_file!("model.safetensors"),
    demo_file!("tokenizer.json"),
    demo_file!("tokenizer_config.json"),
    demo_file!("chat_template.jinja"),
];

/// The demo checkpoint's directory, written on first use.
pub fn demo_checkpoint() -> Result<PathBuf> {
    // FNV-1a over names and bytes: a stable name for this build's demo files.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for (name, bytes) in DEMO_FILES {
        for &b in name.as_bytes().iter().chain(bytes) {
            hash = (hash ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("calla");
    let dir = base.join(format!("demo-{hash:016x}"));
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    // Write beside, then rename, so a concurrent start never sees half a checkpoint.
    let partial = base.join(format!("demo-{hash:016x}.partial-{}", std::process::id()));
    std::fs::create_dir_all(&partial).with_context(|| format!("creating {}", partial.display()))?;
    for (name, bytes) in DEMO_FILES {
        let path = partial.join(name);
        std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
    }
    match std::fs::rename(&partial, &dir) {
        Ok(()) => {}
        // Another process finished first: use its copy.
        Err(_) if dir.join("config.json").is_file() => {
            let _ = std::fs::remove_dir_all(&partial);
        }
        Err(e) => {
            return Err(e)
                .with_context(|| format!("moving the demo checkpoint to {}", dir.display()))
        }
    }
    Ok(dir)
}
