//! `calla serve`: the OpenAI-compatible HTTP API (calla-server) on a checkpoint, or on the bundled tiny
//! demo checkpoint when no --model is given.
//!
//! The port is bound first and answers /health with 503 while the model loads, then 200. One log line
//! per request (timings, token counts); prompt and output text only with --log-text.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use calla_chat::template::DEFAULT_RENDER_FUEL;
use calla_model::load::{load_model_with, FileStamp, LoadOptions, Residency};
use calla_server::{
    load_in_background, load_outcome, start_runtime, AppState, RuntimeOptions, ServerConfig,
};

use crate::args::Device;
use crate::args::{CacheArgs, DeviceArgs, ModelArgs, SamplingArgs};
use crate::device::{open_backend, resolve};
use crate::limits::{self, ServeLimits};

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
    #[arg(long, default_value = "64", value_parser = limits::queue_len)]
    max_queue: usize,
    /// Largest request body, in MiB.
    #[arg(long, default_value = "16", value_parser = limits::request_mib)]
    max_body_mb: usize,
    /// Also log each request's prompt and output text.
    #[arg(long)]
    log_text: bool,
    /// Timeouts, connection cap, prompt size, --cors-origin, --no-mmap (limits.rs).
    #[command(flatten)]
    limits: ServeLimits,
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
        max_prompt_bytes: args.limits.max_prompt_mb << 20,
        allowed_hosts: calla_server::guard::allowed_hosts_for(&args.host),
        cors_origins: args.limits.cors_origins.clone(),
        limits: args.limits.limits(),
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

        // Load in the background; a load failure (error or panic) stops the server, non-zero.
        let options = RuntimeOptions {
            max_queue: args.max_queue,
            max_context: args.cache.max_context,
            prefix_cache_bytes: args.cache.prefix_cache_bytes(),
        };
        let (model, device, sampling) = (args.model.clone(), args.device, args.sampling);
        let max_prompt_bytes = state.config.max_prompt_bytes;
        let residency = if args.limits.no_mmap {
            Residency::Read
        } else {
            Residency::Mapped
        };
        let loaded = load_in_background(Arc::clone(&state), move || {
            let mut runtime = load(&dir, &model, &device, &sampling, options, residency)?;
            if let Some(template) = &mut runtime.template {
                // A render writes at most what a prompt may hold.
                template.set_limits(DEFAULT_RENDER_FUEL, max_prompt_bytes);
            }
            tracing::info!(
                "ready: {} on {}, context {} tokens",
                dir.display(),
                runtime.scheduler.backend(),
                runtime.max_context
            );
            Ok(runtime)
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(calla_server::serve(listener, state, async move {
            let _ = stop_rx.await;
        }));
        let outcome = tokio::select! {
            report = loaded => match load_outcome(report) {
                Err(e) => Err(e.context("loading the model")),
                Ok(()) => {
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
    residency: Residency,
) -> Result<calla_server::Runtime> {
    let loaded = load_model_with(dir, &LoadOptions { quant: model.quant }, residency)?;
    let defaults = sampling.over(loaded.generation.clone())?;
    let opened = open_backend(&loaded, device, options.max_context)?;
    options.max_context = opened.capacity;
    let mapped = loaded.mapped.clone();
    // The CUDA engine copies every weight to the device and keeps no view of the host bytes:
    // dropping the loaded weights here unmaps the checkpoint, so later changes to it are harmless.
    // The CPU engine reads the map while serving: watch it.
    drop(loaded);
    match resolve(device.device) {
        Device::Cuda => {
            tracing::info!("weights uploaded; the checkpoint files are no longer mapped")
        }
        _ if !mapped.is_empty() => watch_mapped_files(mapped),
        _ => {}
    }
    start_runtime(dir, opened.backend, defaults, &options)
}

/// Log (once per file) when a memory-mapped checkpoint file changes under the running server: its
/// weights are then corrupt, and a truncation will kill the process with SIGBUS.
fn watch_mapped_files(stamps: Vec<FileStamp>) {
    let spawned = std::thread::Builder::new()
        .name("calla-mmap-watch".into())
        .spawn(move || {
            let mut reported = vec![false; stamps.len()];
            loop {
                std::thread::sleep(std::time::Duration::from_secs(5));
                for (stamp, reported) in stamps.iter().zip(&mut reported) {
                    if *reported {
                        continue;
                    }
                    if let Some(change) = stamp.changed() {
                        tracing::error!(
                            "{} changed on disk while memory-mapped ({change}): the served weights \
                             may now be wrong, and a truncated file crashes the server (SIGBUS). \
                             Restart calla; serve with --no-mmap to be immune.",
                            stamp.path.display()
                        );
                        *reported = true;
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot watch the mapped checkpoint files: {e}");
    }
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
