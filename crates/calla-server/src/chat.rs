//! POST /v1/chat/completions.
//!
//! messages → `prepare_messages` → the checkpoint's template (tools, chat_template_kwargs) → ids →
//! engine; generated text → reasoning / content / tool calls (calla-chat's parsers) → one JSON reply
//! or SSE chunks. Tool choice: "none" renders no tools and parses none; "auto" renders and parses;
//! "required" and a named function also start the reply with the call's opening tags (there is no
//! constrained decoding, so the rest is up to the model), closing an open think block first.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json as JsonBody;
use calla_chat::{
    prepare_messages, prompt_opens_thinking, OutputConfig, OutputEvent, OutputParser, ParsedOutput,
    RenderInput,
};
use serde::Deserialize;
use serde_json::{json, Map, Value as Json};

use crate::errors::ApiError;
use crate::generation::{submit, Events, GenEvent, RequestLog, TokenLogprob, Work};
use crate::params::{from_body, GenParams, SamplingFields};
use crate::request::{check_model, parse_body, Usage};
use crate::sse::{self, Flow, Reply};
use crate::state::{unix_now, AppState, Runtime};

#[derive(Debug, Deserialize)]
struct ChatFields {
    messages: Vec<Json>,
    tools: Option<Vec<Json>>,
    tool_choice: Option<Json>,
    logprobs: Option<bool>,
    top_logprobs: Option<i64>,
    chat_template_kwargs: Option<Map<String, Json>>,
}

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Function(String),
}

fn tool_choice(fields: &ChatFields) -> Result<(ToolChoice, Vec<Json>), ApiError> {
    let tools = fields.tools.clone().unwrap_or_default();
    let mut names = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let name = tool
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Json::as_str);
        match (tool.get("type").and_then(Json::as_str), name) {
            (Some("function"), Some(name)) => names.push(name.to_string()),
            _ => {
                return Err(ApiError::bad_param(
                    format!("tools[{i}]"),
                    format!(
                    "tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": …}}}}"
                ),
                ))
            }
        }
    }
    let default = if tools.is_empty() {
        ToolChoice::None
    } else {
        ToolChoice::Auto
    };
    let choice = match &fields.tool_choice {
        None | Some(Json::Null) => default,
        Some(Json::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => default,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::bad_param(
                    "tool_choice",
                    format!("tool_choice '{other}' is not one of none, auto, required"),
                ))
            }
        },
        Some(Json::Object(o)) => match o.get("function").and_then(|f| f.get("name")).and_then(Json::as_str) {
            Some(name) => ToolChoice::Function(name.to_string()),
            None => {
                return Err(ApiError::bad_param(
                    "tool_choice",
                    "tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": …}}",
                ))
            }
        },
        Some(_) => return Err(ApiError::bad_param("tool_choice", "tool_choice must be a string or an object")),
    };
    match &choice {
        ToolChoice::Required if tools.is_empty() => Err(ApiError::bad_param(
            "tool_choice",
            "tool_choice 'required' needs tools",
        )),
        ToolChoice::Function(name) if !names.contains(name) => Err(ApiError::bad_param(
            "tool_choice",
            format!("tool_choice names '{name}', which is not among the tools"),
        )),
        _ => Ok((choice, tools)),
    }
}

/// A validated chat request, ready for the engine.
struct Prepared {
    params: GenParams,
    prompt: ChatPrompt,
    top_logprobs: Option<usize>,
    max_tokens: usize,
}

fn prepare(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Prepared, ApiError> {
    let runtime = state.runtime()?;
    let body = parse_body(body)?;
    let common: SamplingFields = from_body(&body)?;
    let fields: ChatFields = from_body(&body)?;
    check_model(state, common.model.as_deref())?;
    let params = common.resolve(
        &runtime.defaults,
        runtime.codec.vocab_size(),
        state.config.max_n,
        state.random_u64(),
    )?;
    let top_logprobs = match (fields.logprobs.unwrap_or(false), fields.top_logprobs) {
        (false, Some(k)) if k > 0 => {
            return Err(ApiError::bad_param(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ))
        }
        (false, _) => None,
        (true, None) => Some(0),
        (true, Some(k)) if (0..=20).contains(&k) => Some(k as usize),
        (true, Some(k)) => {
            return Err(ApiError::bad_param(
                "top_logprobs",
                format!("top_logprobs must be between 0 and 20 (got {k})"),
            ))
        }
    };
    let (choice, tools) = tool_choice(&fields)?;
    let prompt = chat_prompt(
        &runtime,
        &fields.messages,
        &tools,
        &choice,
        fields.chat_template_kwargs.as_ref(),
    )?;
    let room = runtime.max_context - prompt.ids.len();
    let max_tokens = params.max_tokens.unwrap_or(room).min(room);
    Ok(Prepared {
        params,
        prompt,
        top_logprobs,
        max_tokens,
    })
}

/// A conversation rendered and encoded for the engine.
pub struct ChatPrompt {
    pub text: String,
    pub ids: Vec<u32>,
    /// Text the reply starts with that the model does not generate (forced tool-call tags).
    pub forced: String,
    /// Tokens of the conversation before the generation prompt, when `ids` start with them: the
    /// next turn renders the same text, so the state there is worth saving.
    pub history_tokens: Option<usize>,
    /// How to parse the reply.
    pub output: OutputConfig,
}

/// OpenAI messages (+ tools, tool choice, template kwargs) → the prompt, through the checkpoint's
/// template. Errors are 400s naming the field.
pub fn chat_prompt(
    runtime: &Runtime,
    messages: &[Json],
    tools: &[Json],
    choice: &ToolChoice,
    kwargs: Option<&Map<String, Json>>,
) -> Result<ChatPrompt, ApiError> {
    let messages =
        prepare_messages(messages).map_err(|e| ApiError::bad_param(e.param, e.message))?;
    let template = runtime.template.as_ref().ok_or_else(|| {
        ApiError::bad_request("This checkpoint has no chat template; use /v1/completions.")
    })?;
    let with_tools = *choice != ToolChoice::None && !tools.is_empty();
    let render = |add_generation_prompt| {
        template.render(&RenderInput {
            messages: &messages,
            tools: with_tools.then_some(tools),
            add_generation_prompt,
            kwargs,
        })
    };
    let mut text = render(true).map_err(|e| ApiError::bad_param("messages", e.to_string()))?;
    let forced = match choice {
        ToolChoice::Required => "<tool_call>\n<function=".to_string(),
        ToolChoice::Function(name) => format!("<tool_call>\n<function={name}>\n"),
        _ => String::new(),
    };
    if !forced.is_empty() && prompt_opens_thinking(&text) {
        // The call comes first: close the think block the generation prompt opened, as the template
        // renders an empty one.
        text.push_str("\n</think>\n\n");
    }
    text.push_str(&forced);
    let ids = runtime.codec.encode(&text).map_err(ApiError::internal)?;
    if ids.len() >= runtime.max_context {
        return Err(ApiError::context_length(
            ids.len(),
            runtime.max_context,
            "messages",
        ));
    }
    // The history ends where the generation prompt (`<|im_start|>assistant\n<think>…`) starts; Qwen
    // templates drop earlier turns' thinking, so the next turn shares this prefix, not the whole prompt.
    let history_tokens = render(false)
        .ok()
        .filter(|history| text.starts_with(history.as_str()) && !history.is_empty())
        .and_then(|history| runtime.codec.encode(&history).ok())
        .filter(|history| ids.starts_with(history))
        .map(|history| history.len());
    let output = OutputConfig {
        starts_in_reasoning: prompt_opens_thinking(&text),
        tools: with_tools.then(|| tools.to_vec()),
    };
    Ok(ChatPrompt {
        text,
        ids,
        forced,
        history_tokens,
        output,
    })
}

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrival = Instant::now();
    let id = state.new_id("chatcmpl-");
    let prepared = match prepare(&state, body) {
        Ok(p) => p,
        Err(e) => {
            tracing::info!(target: "calla::request", "{id} chat refused: {e}");
            return e.into_response();
        }
    };
    let Ok(runtime) = state.runtime() else {
        return ApiError::loading().into_response();
    };
    let n = prepared.params.n;
    let work = (0..n)
        .map(|choice| Work {
            choice,
            prompt: prepared.prompt.ids.clone(),
            save_prefixes: prepared.prompt.history_tokens.into_iter().collect(),
        })
        .collect();
    let events = match submit(
        &state,
        &runtime,
        work,
        &prepared.params,
        prepared.max_tokens,
        prepared.top_logprobs,
        arrival,
    ) {
        Ok(events) => events,
        Err(e) => {
            tracing::info!(target: "calla::request", "{id} chat refused: {e}");
            return e.into_response();
        }
    };
    let mut log = RequestLog::new(id.clone(), "chat", arrival, prepared.params.stream);
    log.prompt_tokens = prepared.prompt.ids.len();
    if state.config.log_text {
        log.keep_text(prepared.prompt.text.clone(), n);
    }
    let mut reply = ChatReply::new(&state, id, &prepared, log);
    if prepared.params.stream {
        let first = reply.opening_chunks();
        sse::stream(events, reply, first)
    } else {
        respond(events, reply).await
    }
}

async fn respond(mut events: Events, mut reply: ChatReply) -> Response {
    // Dropping this future (client gone) drops `events`, which cancels the engine's work.
    match sse::collect(&mut events, &mut reply).await {
        Ok(()) => JsonBody(reply.response()).into_response(),
        Err(e) => e.into_response(),
    }
}

struct ChatChoice {
    parser: OutputParser,
    parsed: ParsedOutput,
    /// `call_…` ids, one per tool call started.
    tool_ids: Vec<String>,
    /// Non-streamed: every token's; streamed: those not yet sent.
    logprobs: Vec<TokenLogprob>,
    finish_reason: Option<&'static str>,
    /// The forced tool-call opening's events, sent first when streaming.
    opening: Vec<OutputEvent>,
}

struct ChatReply {
    state: Arc<AppState>,
    id: String,
    created: u64,
    model: String,
    /// Streamed replies send chunks (and their log-probabilities) as events come; others keep all.
    stream: bool,
    include_usage: bool,
    with_logprobs: bool,
    choices: Vec<ChatChoice>,
    usage: Usage,
    log: RequestLog,
}

impl ChatChoice {
    fn absorb(&mut self, state: &AppState, event: &OutputEvent) {
        if let OutputEvent::ToolCallStart { .. } = event {
            self.tool_ids.push(state.new_id("call_"));
        }
        self.parsed.absorb(event.clone());
    }
}

impl ChatReply {
    fn new(state: &Arc<AppState>, id: String, prepared: &Prepared, log: RequestLog) -> ChatReply {
        let mut choices = Vec::new();
        for _ in 0..prepared.params.n {
            let mut choice = ChatChoice {
                parser: OutputParser::new(&prepared.prompt.output),
                parsed: ParsedOutput::default(),
                tool_ids: Vec::new(),
                logprobs: Vec::new(),
                finish_reason: None,
                opening: Vec::new(),
            };
            // The forced opening is part of the reply although the model did not generate it.
            let opening = choice.parser.push(&prepared.prompt.forced);
            for event in &opening {
                choice.absorb(state, event);
            }
            choice.opening = opening;
            choices.push(choice);
        }
        ChatReply {
            state: Arc::clone(state),
            id,
            created: unix_now(),
            model: state.config.served_model_name.clone(),
            stream: prepared.params.stream,
            include_usage: prepared.params.include_usage,
            with_logprobs: prepared.top_logprobs.is_some(),
            choices,
            usage: Usage::new(prepared.prompt.ids.len()),
            log,
        }
    }

    fn chunk(
        &self,
        index: usize,
        delta: Json,
        logprobs: Json,
        finish_reason: Option<&str>,
    ) -> Json {
        let mut chunk = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
        });
        if self.include_usage {
            chunk["usage"] = Json::Null;
        }
        chunk
    }

    /// The role first, then any forced opening, for every choice.
    fn opening_chunks(&mut self) -> Vec<Json> {
        let mut chunks = Vec::new();
        for index in 0..self.choices.len() {
            chunks.push(self.chunk(
                index,
                json!({"role": "assistant", "content": ""}),
                Json::Null,
                None,
            ));
            let opening = std::mem::take(&mut self.choices[index].opening);
            chunks.extend(self.delta_chunks(index, &opening));
        }
        chunks
    }

    /// Output events → delta chunks, consecutive events of one kind merged; pending log-probabilities
    /// ride on the first chunk.
    fn delta_chunks(&mut self, index: usize, events: &[OutputEvent]) -> Vec<Json> {
        if !self.stream {
            return Vec::new();
        }
        let mut deltas: Vec<Json> = Vec::new();
        for event in events {
            let merged = deltas
                .last_mut()
                .is_some_and(|last| merge_delta(last, event));
            if !merged {
                let ids = &self.choices[index].tool_ids;
                deltas.push(match event {
                    OutputEvent::Content(t) => json!({"content": t}),
                    OutputEvent::Reasoning(t) => json!({"reasoning_content": t, "reasoning": t}),
                    OutputEvent::ToolCallStart { index: i, name } => json!({"tool_calls": [{
                        "index": i, "id": ids.get(*i), "type": "function",
                        "function": {"name": name, "arguments": ""}}]}),
                    OutputEvent::ToolCallArguments { index: i, fragment } => {
                        json!({"tool_calls": [{"index": i, "function": {"arguments": fragment}}]})
                    }
                });
            }
        }
        deltas
            .into_iter()
            .map(|delta| {
                let logprobs = self.take_logprobs(index);
                self.chunk(index, delta, logprobs, None)
            })
            .collect()
    }

    fn take_logprobs(&mut self, index: usize) -> Json {
        let pending = std::mem::take(&mut self.choices[index].logprobs);
        if !self.with_logprobs || pending.is_empty() {
            return Json::Null;
        }
        json!({"content": pending.iter().map(chat_logprob).collect::<Vec<_>>()})
    }

    fn usage_chunk(&self) -> Json {
        json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage.to_json(),
        })
    }

    fn response(&mut self) -> Json {
        let mut choices = Vec::new();
        for index in 0..self.choices.len() {
            let logprobs = self.take_logprobs(index);
            let choice = &self.choices[index];
            let parsed = &choice.parsed;
            let mut message = json!({"role": "assistant"});
            message["content"] = if parsed.content.is_empty() && !parsed.tool_calls.is_empty() {
                Json::Null
            } else {
                Json::from(parsed.content.clone())
            };
            if !parsed.reasoning.is_empty() {
                message["reasoning_content"] = Json::from(parsed.reasoning.clone());
                message["reasoning"] = Json::from(parsed.reasoning.clone());
            }
            if !parsed.tool_calls.is_empty() {
                message["tool_calls"] = parsed
                    .tool_calls
                    .iter()
                    .zip(&choice.tool_ids)
                    .map(|(call, id)| {
                        json!({"id": id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                    })
                    .collect();
            }
            choices.push(json!({
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason.unwrap_or("stop"),
            }));
        }
        json!({
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage.to_json(),
        })
    }
}

/// Extend `last` with `event` when they are of one kind (text of the same field, arguments of the
/// same call).
fn merge_delta(last: &mut Json, event: &OutputEvent) -> bool {
    match event {
        OutputEvent::Content(t) => match last
            .get_mut("content")
            .and_then(|c| c.as_str().map(str::to_owned))
        {
            Some(prev) => {
                last["content"] = Json::from(prev + t);
                true
            }
            None => false,
        },
        OutputEvent::Reasoning(t) => match last.get("reasoning_content").and_then(Json::as_str) {
            Some(prev) => {
                let joined = format!("{prev}{t}");
                last["reasoning_content"] = Json::from(joined.clone());
                last["reasoning"] = Json::from(joined);
                true
            }
            None => false,
        },
        OutputEvent::ToolCallArguments { index, fragment } => {
            let Some(call) = last.get_mut("tool_calls").and_then(|c| c.get_mut(0)) else {
                return false;
            };
            // The call's first delta carries its name with empty arguments; fragments follow it.
            if call["index"] != json!(index) || call["function"].get("name").is_some() {
                return false;
            }
            let prev = call["function"]["arguments"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            call["function"]["arguments"] = Json::from(prev + fragment);
            true
        }
        OutputEvent::ToolCallStart { .. } => false,
    }
}

fn chat_logprob(lp: &TokenLogprob) -> Json {
    let entry = |token: &str, logprob: f32| json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()});
    let mut item = entry(&lp.token, lp.logprob);
    item["top_logprobs"] = lp.top.iter().map(|(t, l)| entry(t, *l)).collect();
    item
}

impl Reply for ChatReply {
    fn on_event(&mut self, index: usize, event: GenEvent) -> Flow {
        self.log.observe(index, &event);
        match event {
            GenEvent::Started { cached_tokens } => {
                self.usage.started(index == 0, cached_tokens);
                Flow::Chunks(Vec::new())
            }
            GenEvent::Text { text, logprob } => {
                let choice = &mut self.choices[index];
                choice.logprobs.extend(logprob);
                let events = choice.parser.push(&text);
                for event in &events {
                    self.choices[index].absorb(&self.state, event);
                }
                Flow::Chunks(self.delta_chunks(index, &events))
            }
            GenEvent::Finished(Err(e)) => {
                Flow::Failed(ApiError::internal(format!("generation failed: {e}")))
            }
            GenEvent::Finished(Ok(finished)) => {
                let events = self.choices[index].parser.finish();
                for event in &events {
                    self.choices[index].absorb(&self.state, event);
                }
                let mut chunks = self.delta_chunks(index, &events);
                let choice = &mut self.choices[index];
                let reason = match finished.finish_reason() {
                    "stop" if choice.parser.tool_calls() > 0 => "tool_calls",
                    reason => reason,
                };
                choice.finish_reason = Some(reason);
                self.usage.completion_tokens += finished.report.completion_tokens();
                self.log.finish_reasons.push(reason);
                if self.stream {
                    let logprobs = self.take_logprobs(index);
                    chunks.push(self.chunk(index, json!({}), logprobs, Some(reason)));
                }
                if self.choices.iter().all(|c| c.finish_reason.is_some()) {
                    self.log.complete = true;
                    if self.include_usage {
                        chunks.push(self.usage_chunk());
                    }
                    return Flow::Done(chunks);
                }
                Flow::Chunks(chunks)
            }
        }
    }
}
