//! `calla chat`: a terminal chat on a checkpoint (or the bundled demo). Streams the reply, shows the
//! thinking dimmed, keeps the conversation (the prefix cache makes each turn run only its new
//! tokens), and understands /reset and /exit.
//!
//! It runs the same path as the server (template, scheduler, stop handling, reasoning parser), in
//! process, without HTTP.

use std::io::{BufRead, IsTerminal, Write};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use calla_chat::{OutputEvent, OutputParser};
use calla_model::load::{load_model, LoadOptions};
use calla_server::chat::{chat_prompt, ToolChoice};
use calla_server::generation::{submit, GenEvent, Work};
use calla_server::params::SamplingFields;
use calla_server::{start_runtime, AppState, RuntimeOptions, ServerConfig};
use serde_json::{json, Map, Value as Json};

use crate::args::{CacheArgs, DeviceArgs, ModelArgs, SamplingArgs};
use crate::device::open_backend;
use crate::serve::demo_checkpoint;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    device: DeviceArgs,
    /// A system prompt for the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Answer without thinking (chat_template_kwargs enable_thinking=false).
    #[arg(long)]
    no_think: bool,
    /// Most tokens per reply (default: what the context has left).
    #[arg(long)]
    max_tokens: Option<usize>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Seed of the sampler, the same for every reply (default: a fresh one per reply).
    #[arg(long)]
    seed: Option<u64>,
    #[command(flatten)]
    cache: CacheArgs,
}

const DIM: &str = "\x1b[2m";
const RESET: &str = "\x1b[0m";

pub fn run(args: Args) -> Result<()> {
    args.sampling.check()?;
    let dir = match &args.model.model {
        Some(dir) => dir.clone(),
        None => {
            eprintln!("(no --model: chatting with the bundled tiny demo checkpoint; its text is meaningless)");
            demo_checkpoint()?
        }
    };
    let loaded = load_model(
        &dir,
        &LoadOptions {
            quant: args.model.quant,
        },
    )
    .with_context(|| format!("loading {}", dir.display()))?;
    let defaults = args.sampling.over(loaded.generation.clone())?;
    let opened = open_backend(&loaded, &args.device, args.cache.max_context)?;
    let options = RuntimeOptions {
        max_queue: 4,
        max_context: opened.capacity,
        prefix_cache_bytes: args.cache.prefix_cache_bytes(),
    };
    let runtime = start_runtime(&dir, opened.backend, defaults, &options)?;
    drop(loaded);
    let state = AppState::new(ServerConfig::default());
    state.set_ready(runtime);
    let runtime = state
        .runtime()
        .map_err(|e| anyhow::anyhow!("{}", e.message))?;

    let tty = std::io::stdout().is_terminal();
    let mut kwargs = Map::new();
    if args.no_think {
        kwargs.insert("enable_thinking".into(), json!(false));
    }
    let system: Vec<Json> = args
        .system
        .iter()
        .map(|s| json!({"role": "system", "content": s}))
        .collect();
    let mut messages = system.clone();
    eprintln!(
        "calla chat on {} ({}). /reset clears the conversation, /exit quits.",
        dir.display(),
        runtime.scheduler.backend()
    );

    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    let mut line = String::new();
    loop {
        if tty {
            write!(stdout, "\n> ")?;
            stdout.flush()?;
        }
        line.clear();
        if stdin.lock().read_line(&mut line).context("reading stdin")? == 0 {
            break; // end of input
        }
        let input = line.trim();
        match input {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages = system.clone();
                writeln!(stdout, "(conversation cleared)")?;
                continue;
            }
            _ => {}
        }
        messages.push(json!({"role": "user", "content": input}));
        match reply(&state, &runtime, &args, &messages, &kwargs, tty) {
            Ok(assistant) => messages.push(assistant),
            Err(e) => {
                messages.pop();
                writeln!(stdout, "error: {e}")?;
            }
        }
    }
    Ok(())
}

/// Generate and print one reply; returns the assistant message to keep in the conversation.
fn reply(
    state: &Arc<AppState>,
    runtime: &calla_server::Runtime,
    args: &Args,
    messages: &[Json],
    kwargs: &Map<String, Json>,
    tty: bool,
) -> Result<Json> {
    let prompt = chat_prompt(runtime, messages, &[], &ToolChoice::None, Some(kwargs))
        .map_err(|e| anyhow::anyhow!("{}", e.message))?;
    // temperature, top-k/p, min-p: the runtime's defaults (generation_config.json with the flags
    // over it)
    let fields = SamplingFields {
        max_tokens: args.max_tokens.map(|n| n.min(i64::MAX as usize) as i64),
        seed: args.seed.map(|s| s as i64),
        ..SamplingFields::default()
    };
    let params = fields
        .resolve(
            &runtime.defaults,
            runtime.codec.vocab_size(),
            1,
            state.random_u64(),
        )
        .map_err(|e| anyhow::anyhow!("{}", e.message))?;
    let room = runtime.max_context - prompt.ids.len();
    let max_tokens = params.max_tokens.unwrap_or(room).min(room);
    let work = vec![Work {
        choice: 0,
        prompt: prompt.ids.clone(),
        save_prefixes: prompt.history_tokens.into_iter().collect(),
    }];
    let mut events = submit(
        state,
        runtime,
        work,
        &params,
        max_tokens,
        None,
        Instant::now(),
    )
    .map_err(|e| anyhow::anyhow!("{}", e.message))?;
    let mut parser = OutputParser::new(&prompt.output);
    let mut printer = Printer::new(tty);
    let (mut content, mut reasoning) = (String::new(), String::new());
    while let Some((_, event)) = events.blocking_recv() {
        let parsed = match event {
            GenEvent::Started { .. } => continue,
            GenEvent::Text { text, .. } => parser.push(&text),
            GenEvent::Finished(Err(e)) => anyhow::bail!("generation failed: {e}"),
            GenEvent::Finished(Ok(finished)) => {
                let rest = parser.finish();
                for event in &rest {
                    printer.show(event, &mut content, &mut reasoning)?;
                }
                printer.end(finished.finish_reason())?;
                break;
            }
        };
        for event in &parsed {
            printer.show(event, &mut content, &mut reasoning)?;
        }
    }
    let mut assistant = json!({"role": "assistant", "content": content});
    if !reasoning.is_empty() {
        assistant["reasoning_content"] = json!(reasoning);
    }
    Ok(assistant)
}

/// Writes reasoning (dimmed on a terminal, between <think> tags otherwise) and content as they come.
struct Printer {
    tty: bool,
    in_reasoning: bool,
    out: std::io::Stdout,
}

impl Printer {
    fn new(tty: bool) -> Printer {
        Printer {
            tty,
            in_reasoning: false,
            out: std::io::stdout(),
        }
    }

    fn show(
        &mut self,
        event: &OutputEvent,
        content: &mut String,
        reasoning: &mut String,
    ) -> Result<()> {
        match event {
            OutputEvent::Reasoning(text) => {
                if !self.in_reasoning {
                    write!(self.out, "{}", if self.tty { DIM } else { "<think>\n" })?;
                    self.in_reasoning = true;
                }
                reasoning.push_str(text);
                write!(self.out, "{}", self.visible(text))?;
            }
            OutputEvent::Content(text) => {
                self.close_reasoning()?;
                content.push_str(text);
                write!(self.out, "{}", self.visible(text))?;
            }
            OutputEvent::ToolCallStart { .. } | OutputEvent::ToolCallArguments { .. } => {}
        }
        self.out.flush()?;
        Ok(())
    }

    /// On a terminal, control characters in the model's text (an ESC could restyle the screen) are
    /// shown as U+FFFD; newlines and tabs stay.
    fn visible<'a>(&self, text: &'a str) -> std::borrow::Cow<'a, str> {
        if self.tty
            && text
                .chars()
                .any(|c| c.is_control() && c != '\n' && c != '\t')
        {
            text.chars()
                .map(|c| {
                    if c.is_control() && c != '\n' && c != '\t' {
                        '\u{FFFD}'
                    } else {
                        c
                    }
                })
                .collect::<String>()
                .into()
        } else {
            text.into()
        }
    }

    fn close_reasoning(&mut self) -> Result<()> {
        if self.in_reasoning {
            if self.tty {
                write!(self.out, "{RESET}\n\n")?;
            } else {
                write!(self.out, "\n</think>\n\n")?;
            }
            self.in_reasoning = false;
        }
        Ok(())
    }

    fn end(&mut self, finish_reason: &str) -> Result<()> {
        self.close_reasoning()?;
        if finish_reason == "length" {
            write!(
                self.out,
                "{}[stopped: length]{}",
                if self.tty { DIM } else { "" },
                if self.tty { RESET } else { "" }
            )?;
        }
        writeln!(self.out)?;
        self.out.flush()?;
        Ok(())
    }
}
