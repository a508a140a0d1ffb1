//! POST /v1/responses (and GET /v1/responses/{id}): the OpenAI Responses API.
//!
//! `input` (a string, or items: messages with `input_text` / `output_text` parts, `function_call`,
//! `function_call_output`, `reasoning`) and `instructions` become chat messages and run as one chat
//! turn (turn.rs). Honoured: function `tools`, `tool_choice`, `parallel_tool_calls`,
//! `max_output_tokens`, `temperature`, `top_p`, `text.format` (json_object / json_schema, enforced
//! by constrained decoding), `reasoning.effort` ("none" turns the template's thinking off, any
//! other value on),
//! `stream`, `store`, and `previous_response_id`: the last [`STORED`] stored responses are kept
//! in memory with their conversation, so a follow-up sends only what is new (and the prefix cache
//! reuses the state); an unknown id is a 400. Other tool types, images and files are refused.
//!
//! Streaming: `response.created`, `response.in_progress`, per output item
//! `response.output_item.added` … (`response.content_part.added`, `response.output_text.delta` /
//! `.done`, `response.content_part.done`; `response.reasoning_text.delta` / `.done`;
//! `response.function_call_arguments.delta` / `.done`) … `response.output_item.done`, then
//! `response.completed` (or `response.incomplete` at max_output_tokens), each with its
//! `sequence_number`, as named SSE events; no `[DONE]`.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json as JsonBody;
use serde_json::{json, Map, Value as Json};

use crate::errors::ApiError;
use crate::generation::{Events, GenEvent, RequestLog};
use crate::request::{check_model, parse_body};
use crate::responses_input::{input_messages, to_chat_tools, to_tool_choice};
use crate::sse::{self, typed_event, Flow, Reply};
use crate::state::{unix_now, AppState};
use crate::structured::response_format;
use crate::turn::{BlockEvent, BlockKind, Turn, TurnEnd, TurnOutput, TurnRequest};
use crate::unknown::warn_unknown_fields;

/// Responses kept for `previous_response_id` and GET.
pub const STORED: usize = 256;

/// Fields read, and metadata accepted without effect; others are warned about.
const FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "text",
    "reasoning",
    "stream",
    "store",
    "previous_response_id",
    "metadata",
    "user",
    "prompt_cache_key",
    "safety_identifier",
];

struct Stored {
    id: String,
    response: Json,
    /// The conversation through this response's output, as chat messages (no instructions).
    messages: Vec<Json>,
}

/// Recent responses, newest last.
#[derive(Default)]
pub struct ResponseStore(Mutex<VecDeque<Stored>>);

impl ResponseStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Stored>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn insert(&self, stored: Stored) {
        let mut all = self.lock();
        if all.len() >= STORED {
            all.pop_front();
        }
        all.push_back(stored);
    }
    fn messages(&self, id: &str) -> Option<Vec<Json>> {
        self.lock()
            .iter()
            .find(|s| s.id == id)
            .map(|s| s.messages.clone())
    }
    fn response(&self, id: &str) -> Option<Json> {
        self.lock()
            .iter()
            .find(|s| s.id == id)
            .map(|s| s.response.clone())
    }
}

struct Prepared {
    turn: Turn,
    /// The conversation sent to the template, minus the instructions (what a follow-up extends).
    conversation: Vec<Json>,
    /// Request fields echoed in the response object.
    echo: Map<String, Json>,
    store: bool,
}

fn prepare(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Prepared, ApiError> {
    let runtime = state.runtime()?;
    let body = parse_body(body)?;
    warn_unknown_fields(&body, FIELDS, "/v1/responses");
    check_model(state, body["model"].as_str())?;
    let mut conversation = Vec::new();
    let previous = body["previous_response_id"].as_str();
    if let Some(previous) = previous {
        let history = state.responses.messages(previous).ok_or_else(|| {
            ApiError::bad_param(
                "previous_response_id",
                format!("Previous response with id '{previous}' not found (this server keeps the last {STORED} stored responses in memory)."),
            )
        })?;
        conversation = history;
    }
    input_messages(body.get("input").unwrap_or(&Json::Null), &mut conversation)?;
    let mut messages = Vec::new();
    if let Some(instructions) = body["instructions"].as_str().filter(|s| !s.is_empty()) {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    messages.extend(conversation.iter().cloned());
    let tools = to_chat_tools(body.get("tools"))?;
    let choice = to_tool_choice(body.get("tool_choice"), &tools)?;
    let parallel = body["parallel_tool_calls"].as_bool().unwrap_or(true);
    let format = response_format(
        body.get("text").and_then(|t| t.get("format")),
        "text.format",
    )?;
    let mut kwargs = Map::new();
    match body["reasoning"]["effort"].as_str() {
        Some("none") => {
            kwargs.insert("enable_thinking".into(), Json::from(false));
        }
        // An effort asks for thinking explicitly (it then precedes a constrained reply).
        Some(_) => {
            kwargs.insert("enable_thinking".into(), Json::from(true));
        }
        None => {}
    }
    let mut sampling = Map::new();
    for (from, to) in [
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("stream", "stream"),
    ] {
        if let Some(v) = body.get(from).filter(|v| !v.is_null()) {
            sampling.insert(to.into(), v.clone());
        }
    }
    let turn = Turn::prepare(
        state,
        &runtime,
        TurnRequest {
            messages,
            tools: tools.clone(),
            choice,
            parallel,
            kwargs: (!kwargs.is_empty()).then_some(kwargs),
            format: format.map(|g| (g, "text.format")),
            sampling: Json::Object(sampling),
        },
    )?;
    let mut echo = Map::new();
    for key in [
        "instructions",
        "max_output_tokens",
        "previous_response_id",
        "metadata",
        "user",
    ] {
        echo.insert(key.into(), body.get(key).cloned().unwrap_or(Json::Null));
    }
    if echo["metadata"].is_null() {
        echo.insert("metadata".into(), json!({}));
    }
    echo.insert(
        "temperature".into(),
        json!(turn.params.sampling.temperature),
    );
    echo.insert("top_p".into(), json!(turn.params.sampling.top_p));
    echo.insert("parallel_tool_calls".into(), json!(parallel));
    echo.insert(
        "tool_choice".into(),
        body.get("tool_choice").cloned().unwrap_or(json!("auto")),
    );
    echo.insert(
        "tools".into(),
        body.get("tools").cloned().unwrap_or(json!([])),
    );
    echo.insert(
        "text".into(),
        body.get("text")
            .cloned()
            .unwrap_or(json!({"format": {"type": "text"}})),
    );
    echo.insert(
        "reasoning".into(),
        body.get("reasoning")
            .cloned()
            .unwrap_or(json!({"effort": null, "summary": null})),
    );
    echo.insert("truncation".into(), json!("disabled"));
    let store = body["store"].as_bool().unwrap_or(true);
    echo.insert("store".into(), json!(store));
    Ok(Prepared {
        turn,
        conversation,
        echo,
        store,
    })
}

pub async fn create(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrival = Instant::now();
    let id = state.new_id("resp_");
    let mut prepared = match state
        .prepare({
            let state = Arc::clone(&state);
            move || prepare(&state, body)
        })
        .await
    {
        Ok(p) => p,
        Err(e) => {
            tracing::info!(target: "calla::request", "{id} responses refused: {e}");
            return e.into_response();
        }
    };
    let Ok(runtime) = state.runtime() else {
        return ApiError::loading().into_response();
    };
    let events = match prepared.turn.submit(&state, &runtime, arrival) {
        Ok(events) => events,
        Err(e) => return e.into_response(),
    };
    let stream = prepared.turn.params.stream;
    let mut log = RequestLog::new(id.clone(), "responses", arrival, stream);
    log.prompt_tokens = prepared.turn.prompt.ids.len();
    if state.config.log_text {
        log.keep_text(prepared.turn.prompt.text.clone(), 1);
    }
    let mut reply = ResponseReply {
        state: Arc::clone(&state),
        id,
        created: unix_now(),
        model: state.config.served_model_name.clone(),
        output: TurnOutput::new(&state, &prepared.turn, "call_"),
        item_ids: Vec::new(),
        stream,
        sequence: 0,
        echo: prepared.echo,
        conversation: prepared.conversation,
        store: prepared.store,
        input_tokens: prepared.turn.prompt.ids.len(),
        cached_tokens: 0,
        output_tokens: 0,
        end: None,
        log,
    };
    if stream {
        let created = reply.lifecycle("response.created");
        let in_progress = reply.lifecycle("response.in_progress");
        sse::stream(events, reply, vec![created, in_progress])
    } else {
        respond(events, reply).await
    }
}

async fn respond(mut events: Events, mut reply: ResponseReply) -> Response {
    match sse::collect(&mut events, &mut reply).await {
        Ok(()) => JsonBody(reply.response()).into_response(),
        Err(e) => e.into_response(),
    }
}

/// GET /v1/responses/{id}: a stored response.
pub async fn retrieve(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    match state.responses.response(&id) {
        Some(r) => JsonBody(r).into_response(),
        None => ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            format!("No response with id '{id}' (this server keeps the last {STORED} in memory)."),
        )
        .into_response(),
    }
}

struct ResponseReply {
    state: Arc<AppState>,
    id: String,
    created: u64,
    model: String,
    output: TurnOutput,
    /// One per output item (block).
    item_ids: Vec<String>,
    stream: bool,
    sequence: u64,
    echo: Map<String, Json>,
    conversation: Vec<Json>,
    store: bool,
    input_tokens: usize,
    cached_tokens: usize,
    output_tokens: usize,
    end: Option<TurnEnd>,
    log: RequestLog,
}

impl ResponseReply {
    fn status(&self) -> &'static str {
        match self.end {
            None => "in_progress",
            Some(TurnEnd::Length) => "incomplete",
            Some(_) => "completed",
        }
    }

    fn item(&self, index: usize, done: bool) -> Json {
        let block = &self.output.blocks[index];
        let id = &self.item_ids[index];
        let status = if done { "completed" } else { "in_progress" };
        let text = if done { block.text.as_str() } else { "" };
        match &block.kind {
            BlockKind::Thinking => json!({"type": "reasoning", "id": id, "summary": [],
                "content": if done { json!([{"type": "reasoning_text", "text": text}]) } else { json!([]) },
                "status": status}),
            BlockKind::Text => {
                json!({"type": "message", "id": id, "status": status, "role": "assistant",
                "content": if done { json!([output_text(text)]) } else { json!([]) }})
            }
            BlockKind::ToolCall { id: call_id, name } => json!({"type": "function_call", "id": id,
                "call_id": call_id, "name": name, "arguments": text, "status": status}),
        }
    }

    fn response(&self) -> Json {
        let mut r = json!({
            "id": self.id, "object": "response", "created_at": self.created, "status": self.status(),
            "error": null,
            "incomplete_details": if self.end == Some(TurnEnd::Length) {
                json!({"reason": "max_output_tokens"}) } else { Json::Null },
            "model": self.model,
            "output": (0..self.output.blocks.len()).map(|i| self.item(i, true)).collect::<Vec<_>>(),
            "usage": if self.end.is_some() { json!({
                "input_tokens": self.input_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.input_tokens + self.output_tokens,
            }) } else { Json::Null },
        });
        if self.end.is_none() {
            r["output"] = json!([]);
        }
        for (k, v) in &self.echo {
            r[k] = v.clone();
        }
        r
    }

    fn event(&mut self, mut chunk: Json) -> Json {
        chunk["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        chunk
    }

    fn lifecycle(&mut self, kind: &str) -> Json {
        let response = self.response();
        self.event(json!({"type": kind, "response": response}))
    }

    fn chunks(&mut self, events: Vec<BlockEvent>) -> Vec<Json> {
        let mut out = Vec::new();
        for event in events {
            let index = match event {
                BlockEvent::Start(i) | BlockEvent::Delta(i, _) | BlockEvent::Stop(i) => i,
            };
            while self.item_ids.len() <= index {
                let prefix = match self.output.blocks[self.item_ids.len()].kind {
                    BlockKind::Thinking => "rs_",
                    BlockKind::Text => "msg_",
                    BlockKind::ToolCall { .. } => "fc_",
                };
                self.item_ids.push(self.state.new_id(prefix));
            }
            if !self.stream {
                continue;
            }
            let item_id = self.item_ids[index].clone();
            let kind = self.output.blocks[index].kind.clone();
            let text = self.output.blocks[index].text.clone();
            let base =
                |kind: &str| json!({"type": kind, "item_id": item_id, "output_index": index});
            let chunks: Vec<Json> = match (event, &kind) {
                (BlockEvent::Start(_), kind) => {
                    let mut v = vec![
                        json!({"type": "response.output_item.added", "output_index": index,
                        "item": self.item(index, false)}),
                    ];
                    if *kind == BlockKind::Text {
                        let mut part = base("response.content_part.added");
                        part["content_index"] = json!(0);
                        part["part"] = output_text("");
                        v.push(part);
                    }
                    v
                }
                (BlockEvent::Delta(_, delta), BlockKind::Text) => {
                    let mut c = base("response.output_text.delta");
                    c["content_index"] = json!(0);
                    c["delta"] = json!(delta);
                    c["logprobs"] = json!([]);
                    vec![c]
                }
                (BlockEvent::Delta(_, delta), BlockKind::Thinking) => {
                    let mut c = base("response.reasoning_text.delta");
                    c["content_index"] = json!(0);
                    c["delta"] = json!(delta);
                    vec![c]
                }
                (BlockEvent::Delta(_, delta), BlockKind::ToolCall { .. }) => {
                    let mut c = base("response.function_call_arguments.delta");
                    c["delta"] = json!(delta);
                    vec![c]
                }
                (BlockEvent::Stop(_), kind) => {
                    let mut v = Vec::new();
                    match kind {
                        BlockKind::Text => {
                            let mut c = base("response.output_text.done");
                            c["content_index"] = json!(0);
                            c["text"] = json!(text);
                            c["logprobs"] = json!([]);
                            v.push(c);
                            let mut c = base("response.content_part.done");
                            c["content_index"] = json!(0);
                            c["part"] = output_text(&text);
                            v.push(c);
                        }
                        BlockKind::Thinking => {
                            let mut c = base("response.reasoning_text.done");
                            c["content_index"] = json!(0);
                            c["text"] = json!(text);
                            v.push(c);
                        }
                        BlockKind::ToolCall { name, .. } => {
                            let mut c = base("response.function_call_arguments.done");
                            c["arguments"] = json!(text);
                            c["name"] = json!(name);
                            v.push(c);
                        }
                    }
                    v.push(
                        json!({"type": "response.output_item.done", "output_index": index,
                        "item": self.item(index, true)}),
                    );
                    v
                }
            };
            for c in chunks {
                let c = self.event(c);
                out.push(c);
            }
        }
        out
    }

    /// The conversation through this reply, for a follow-up's previous_response_id.
    fn remember(&self, response: &Json) {
        let mut messages = self.conversation.clone();
        let mut msg = json!({"role": "assistant", "content": ""});
        let mut content = String::new();
        let mut calls = Vec::new();
        for block in &self.output.blocks {
            match &block.kind {
                BlockKind::Thinking => msg["reasoning_content"] = json!(block.text),
                BlockKind::Text => content.push_str(&block.text),
                BlockKind::ToolCall { id, name } => calls
                    .push(json!({"id": id, "type": "function",
                    "function": {"name": name, "arguments": block.text}})),
            }
        }
        msg["content"] = json!(content);
        if !calls.is_empty() {
            msg["tool_calls"] = json!(calls);
        }
        messages.push(msg);
        self.state.responses.insert(Stored {
            id: self.id.clone(),
            response: response.clone(),
            messages,
        });
    }
}

fn output_text(text: &str) -> Json {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

impl Reply for ResponseReply {
    fn on_event(&mut self, index: usize, event: GenEvent) -> Flow {
        self.log.observe(index, &event);
        match event {
            GenEvent::Started { cached_tokens } => {
                self.cached_tokens = cached_tokens;
                Flow::Chunks(Vec::new())
            }
            GenEvent::Text { text, .. } => {
                let events = self.output.push(&text);
                Flow::Chunks(self.chunks(events))
            }
            GenEvent::Finished(Err(e)) => {
                Flow::Failed(ApiError::internal(format!("generation failed: {e}")))
            }
            GenEvent::Finished(Ok(finished)) => {
                let events = self.output.finish();
                let mut chunks = self.chunks(events);
                self.end = Some(TurnEnd::of(&finished, self.output.tool_calls()));
                self.output_tokens = finished.report.completion_tokens();
                self.log.finish_reasons.push(finished.finish_reason());
                self.log.complete = true;
                let response = self.response();
                if self.store {
                    self.remember(&response);
                }
                if self.stream {
                    let kind = if self.end == Some(TurnEnd::Length) {
                        "response.incomplete"
                    } else {
                        "response.completed"
                    };
                    let c = self.event(json!({"type": kind, "response": response}));
                    chunks.push(c);
                }
                Flow::Done(chunks)
            }
        }
    }

    fn sse_event(&self, chunk: &Json) -> Event {
        typed_event(chunk)
    }

    fn done_event(&self) -> Option<Event> {
        None
    }

    fn error_event(&self, error: &ApiError) -> Event {
        let body = error.body();
        typed_event(
            &json!({"type": "error", "code": error.code, "message": error.message,
            "param": error.param, "sequence_number": self.sequence, "error": body["error"]}),
        )
    }
}
