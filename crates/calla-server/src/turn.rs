//! One assistant turn as the Anthropic Messages and OpenAI Responses endpoints see it: a
//! conversation already in OpenAI chat shape (their handlers translate) → the same template,
//! tool choice, structured-output grammar and engine path as /v1/chat/completions (one choice) →
//! the reply as content blocks (thinking, text, tool calls), opened, extended and closed in order.

use std::sync::Arc;
use std::time::Instant;

use calla_chat::{OutputEvent, OutputParser};
use calla_engine::TokenConstraint;
use serde_json::{Map, Value as Json};

use crate::chat::{chat_prompt_constrained, forced_tools, ChatPrompt, ToolChoice};
use crate::errors::ApiError;
use crate::generation::{submit_constrained, Events, Finished, Work};
use crate::params::{from_body, GenParams, SamplingFields};
use crate::state::{AppState, Runtime};
use crate::structured::{thinking_requested, OutputGrammar};
use crate::tool_filter::{ToolCalls, ToolFilter};

/// What a protocol handler hands over.
pub struct TurnRequest {
    /// OpenAI chat messages.
    pub messages: Vec<Json>,
    /// OpenAI function tools.
    pub tools: Vec<Json>,
    pub choice: ToolChoice,
    pub parallel: bool,
    pub kwargs: Option<Map<String, Json>>,
    /// Structured output asked for (besides forced tool calls), and the field that asked.
    pub format: Option<(OutputGrammar, &'static str)>,
    /// The sampling fields in OpenAI spelling (max_tokens, temperature, stop, stream, …).
    pub sampling: Json,
}

pub struct Turn {
    pub prompt: ChatPrompt,
    pub params: GenParams,
    pub max_tokens: usize,
    constraint: Option<Box<dyn TokenConstraint>>,
    pub tools: ToolFilter,
}

impl Turn {
    pub fn prepare(
        state: &AppState,
        runtime: &Runtime,
        req: TurnRequest,
    ) -> Result<Turn, ApiError> {
        crate::request::check_prompt_bytes(
            crate::request::text_bytes(&req.messages) + crate::request::text_bytes(&req.tools),
            state.config.max_prompt_bytes,
            "messages",
        )?;
        let fields: SamplingFields = from_body(&req.sampling)?;
        let params = fields.resolve(
            &runtime.defaults,
            runtime.codec.vocab_size(),
            1,
            state.random_u64(),
        )?;
        let (grammar, param) = match forced_tools(&req.choice, &req.tools, req.parallel) {
            Some(g) => (Some(g), "tool_choice"),
            None => match req.format {
                Some((g, param)) => (Some(g), param),
                None => (None, ""),
            },
        };
        // Thinking asked for explicitly: reason first, constrain after (structured.rs).
        let thinks = thinking_requested(req.kwargs.as_ref());
        let prompt = chat_prompt_constrained(
            runtime,
            &req.messages,
            &req.tools,
            &req.choice,
            req.kwargs.as_ref(),
            grammar.is_some() && !thinks,
        )?;
        let constraint = match &grammar {
            Some(g) => state
                .grammars
                .constraints(runtime, g, prompt.output.starts_in_reasoning, 1, param)?
                .pop(),
            None => None,
        };
        let room = runtime.max_context - prompt.ids.len();
        let max_tokens = params.max_tokens.unwrap_or(room).min(room);
        let tools = if req.choice == ToolChoice::None {
            ToolFilter::new(&[], req.parallel)
        } else {
            ToolFilter::new(&req.tools, req.parallel)
        };
        Ok(Turn {
            prompt,
            params,
            max_tokens,
            constraint,
            tools,
        })
    }

    /// Queue the turn on the engine.
    pub fn submit(
        &mut self,
        state: &Arc<AppState>,
        runtime: &Runtime,
        arrival: Instant,
    ) -> Result<Events, ApiError> {
        let work = vec![Work {
            choice: 0,
            prompt: self.prompt.ids.clone(),
            save_prefixes: self.prompt.history_tokens.into_iter().collect(),
        }];
        let constraints = self.constraint.take().into_iter().collect();
        submit_constrained(
            state,
            runtime,
            work,
            constraints,
            &self.params,
            self.max_tokens,
            None,
            arrival,
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockKind {
    Thinking,
    Text,
    /// A tool call: its id and function name; the block's text is the arguments' JSON.
    ToolCall {
        id: String,
        name: String,
    },
}

#[derive(Debug, Clone)]
pub struct Block {
    pub kind: BlockKind,
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockEvent {
    Start(usize),
    Delta(usize, String),
    Stop(usize),
}

/// The reply of one turn as blocks.
pub struct TurnOutput {
    parser: OutputParser,
    filter: ToolFilter,
    calls: ToolCalls,
    pub blocks: Vec<Block>,
    open: Option<usize>,
    /// Parser-side call index → block.
    call_blocks: Vec<usize>,
    id_prefix: &'static str,
    state: Arc<AppState>,
}

impl TurnOutput {
    pub fn new(state: &Arc<AppState>, turn: &Turn, tool_id_prefix: &'static str) -> TurnOutput {
        TurnOutput {
            parser: OutputParser::new(&turn.prompt.output),
            filter: turn.tools.clone(),
            calls: ToolCalls::default(),
            blocks: Vec::new(),
            open: None,
            call_blocks: Vec::new(),
            id_prefix: tool_id_prefix,
            state: Arc::clone(state),
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<BlockEvent> {
        let events = self.parser.push(text);
        let events = self.filter.filter(&mut self.calls, events);
        self.absorb(events)
    }

    /// The end of generation: the parser's tail, then every open block closed.
    pub fn finish(&mut self) -> Vec<BlockEvent> {
        let events = self.parser.finish();
        let events = self.filter.filter(&mut self.calls, events);
        let mut out = self.absorb(events);
        out.extend(self.close());
        out
    }

    pub fn tool_calls(&self) -> usize {
        self.calls.kept()
    }

    fn close(&mut self) -> Option<BlockEvent> {
        self.open.take().map(BlockEvent::Stop)
    }

    fn open(&mut self, kind: BlockKind, out: &mut Vec<BlockEvent>) -> usize {
        out.extend(self.close());
        self.blocks.push(Block {
            kind,
            text: String::new(),
        });
        let index = self.blocks.len() - 1;
        self.open = Some(index);
        out.push(BlockEvent::Start(index));
        index
    }

    fn extend(&mut self, index: usize, text: String, out: &mut Vec<BlockEvent>) {
        if text.is_empty() {
            return;
        }
        self.blocks[index].text.push_str(&text);
        out.push(BlockEvent::Delta(index, text));
    }

    fn absorb(&mut self, events: Vec<OutputEvent>) -> Vec<BlockEvent> {
        let mut out = Vec::new();
        for event in events {
            let open_kind = self.open.map(|i| self.blocks[i].kind.clone());
            match event {
                OutputEvent::Reasoning(text) => {
                    let index = match (open_kind, self.open) {
                        (Some(BlockKind::Thinking), Some(i)) => i,
                        _ if text.trim().is_empty() => continue,
                        _ => self.open(BlockKind::Thinking, &mut out),
                    };
                    self.extend(index, text, &mut out);
                }
                OutputEvent::Content(text) => {
                    let index = match (open_kind, self.open) {
                        (Some(BlockKind::Text), Some(i)) => i,
                        // Whitespace between blocks is the template's framing, not a block.
                        _ if text.trim().is_empty() => continue,
                        _ => self.open(BlockKind::Text, &mut out),
                    };
                    let text = if self.blocks[index].text.is_empty() {
                        text.trim_start().to_string()
                    } else {
                        text
                    };
                    self.extend(index, text, &mut out);
                }
                OutputEvent::ToolCallStart { index, name } => {
                    let id = self.state.new_id(self.id_prefix);
                    let block = self.open(BlockKind::ToolCall { id, name }, &mut out);
                    if self.call_blocks.len() <= index {
                        self.call_blocks.resize(index + 1, usize::MAX);
                    }
                    self.call_blocks[index] = block;
                }
                OutputEvent::ToolCallArguments { index, fragment } => {
                    if let Some(&block) = self.call_blocks.get(index) {
                        if block != usize::MAX {
                            self.extend(block, fragment, &mut out);
                        }
                    }
                }
            }
        }
        out
    }
}

/// Why the turn ended, in neutral words each protocol spells its own way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnEnd {
    /// The model finished (EOS or the grammar's end).
    Done,
    /// max_tokens or the context.
    Length,
    /// A stop string (its index among the request's).
    StopString(usize),
    ToolCalls,
}

impl TurnEnd {
    pub fn of(finished: &Finished, tool_calls: usize) -> TurnEnd {
        match (finished.finish_reason(), finished.stop_string) {
            ("length", _) => TurnEnd::Length,
            (_, Some(i)) => TurnEnd::StopString(i),
            _ if tool_calls > 0 => TurnEnd::ToolCalls,
            _ => TurnEnd::Done,
        }
    }
}

/// A tool call's arguments (the parser's JSON text) as a JSON object (`{}` when they do not parse).
pub fn arguments_object(text: &str) -> Json {
    serde_json::from_str::<Json>(text)
        .ok()
        .filter(Json::is_object)
        .unwrap_or_else(|| Json::Object(Map::new()))
}
