//! `calla`: one binary, one subcommand per file.

mod args;
mod bench;
mod chat;
mod device;
mod generate;
mod inspect;
mod limits;
mod serve;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "calla",
    version,
    about = "Fast inference for the Qwen3.5/3.6 hybrid MoE family"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Describe a checkpoint: architecture, formats, parameter and byte counts, ignored tensors.
    Inspect(inspect::Args),
    /// Generate a continuation of a prompt.
    Generate(generate::Args),
    /// Serve the OpenAI-compatible HTTP API.
    Serve(serve::Args),
    /// Chat in the terminal.
    Chat(chat::Args),
    /// Benchmark prefill and decode.
    Bench(bench::Args),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    // An empty CALLA_PROMPT_PRECISION means "unset" (the flag's default, balanced);
    // clap would reject it as an empty value, so it goes before parsing (still single-threaded).
    if std::env::var_os(crate::args::PROMPT_PRECISION_ENV).is_some_and(|v| v.is_empty()) {
        std::env::remove_var(crate::args::PROMPT_PRECISION_ENV);
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect(args) => inspect::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Chat(args) => chat::run(args),
        Command::Bench(args) => bench::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // The reader went away (`calla inspect … | head`): nothing more to say to anyone.
        Err(e) if is_broken_pipe(&e) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Whether `e` is (or was caused by) a write to a closed pipe.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
