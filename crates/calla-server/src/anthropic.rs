//! POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API.
//!
//! The request is translated to the OpenAI chat shape (system → a system message; text blocks →
//! text; `tool_use` blocks → assistant tool calls; `tool_result` blocks → tool messages; `thinking`
//! blocks → `reasoning_content`) and runs as one chat turn (turn.rs). Honoured: `max_tokens`
//! (required), `stop_sequences`, `temperature`, `top_p`, `top_k`, `tools` (`input_schema`),
//! `tool_choice` (auto / any / tool / none, `disable_parallel_tool_use`), `thinking` (enabled →
//! the template's thinking on; absent or disabled → off, as Anthropic defaults), `stream`.
//! `metadata`, `service_tier`, `cache_control` and other fields are accepted and ignored (logged).
//! Images and documents are refused with 400.
//!
//! Streaming follows Anthropic's sequence: `message_start`, then per block `content_block_start`,
//! `content_block_delta` (text_delta / thinking_delta / input_json_delta), `content_block_stop`,
//! then `message_delta` (stop_reason, usage) and `message_stop`; `ping` keeps the line alive.
//! Errors are `{"type": "error", "error": {"type", "message"}}` ([`anthropic_errors`] rewrites
//! every error response of these routes, the auth layer's included).

use std::sync::Arc;
use std::time::Instant;

use axum::body::{to_bytes, Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json as JsonBody;
use serde_json::{json, Map, Value as Json};

use crate::anthropic_input::{to_openai_messages, to_openai_tools, to_tool_choice};
use crate::errors::ApiError;
use crate::generation::{Events, GenEvent, RequestLog};
use crate::request::{check_model, parse_body};
use crate::sse::{self, typed_event, Flow, Reply};
use crate::state::AppState;
use crate::turn::{
    arguments_object, BlockEvent, BlockKind, Turn, TurnEnd, TurnOutput, TurnRequest,
};
use crate::unknown::warn_unknown_fields;

/// Fields read, and metadata accepted without effect; others are warned about.
const FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "tools",
    "tool_choice",
    "thinking",
    "metadata",
    "service_tier",
];

/// Anthropic's error `type` for an HTTP status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 405 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

fn anthropic_body(status: StatusCode, message: &str) -> Json {
    json!({"type": "error", "error": {"type": error_type(status), "message": message}})
}

/// Paths of the Anthropic protocol (with and without /v1).
pub fn is_anthropic_path(path: &str) -> bool {
    let path = path.strip_prefix("/v1").unwrap_or(path);
    path == "/messages" || path.starts_with("/messages/")
}

/// Rewrite OpenAI-shaped error responses of Anthropic routes into Anthropic's shape.
pub async fn anthropic_errors(request: Request, next: Next) -> Response {
    if !is_anthropic_path(request.uri().path()) {
        return next.run(request).await;
    }
    let response = next.run(request).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if status.is_success() || !is_json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let Ok(bytes) = to_bytes(body, 1 << 20).await else {
        return (status, JsonBody(anthropic_body(status, "error"))).into_response();
    };
    let message = serde_json::from_slice::<Json>(&bytes)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    let body = anthropic_body(status, &message).to_string();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, Body::from(body))
}

struct Prepared {
    turn: Turn,
    stream: bool,
    stops: Vec<String>,
}

fn prepare(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Prepared, ApiError> {
    let runtime = state.runtime()?;
    let body = parse_body(body)?;
    warn_unknown_fields(&body, FIELDS, "/v1/messages");
    check_model(state, body["model"].as_str())?;
    let max_tokens = body
        .get("max_tokens")
        .and_then(Json::as_i64)
        .ok_or_else(|| {
            ApiError::bad_param(
                "max_tokens",
                "'max_tokens' is required (a positive integer)",
            )
        })?;
    let messages = to_openai_messages(
        body.get("system"),
        body.get("messages").unwrap_or(&Json::Null),
    )?;
    let tools = to_openai_tools(body.get("tools"))?;
    let (choice, parallel) = to_tool_choice(body.get("tool_choice"), &tools)?;
    let thinking = match body
        .get("thinking")
        .and_then(|t| t.get("type"))
        .and_then(Json::as_str)
    {
        None | Some("disabled") => false,
        Some("enabled") | Some("adaptive") => true,
        Some(other) => {
            return Err(ApiError::bad_param(
                "thinking.type",
                format!("thinking.type must be enabled or disabled (got '{other}')"),
            ))
        }
    };
    let stops = match body.get("stop_sequences") {
        None | Some(Json::Null) => Vec::new(),
        Some(v) => serde_json::from_value::<Vec<String>>(v.clone()).map_err(|_| {
            ApiError::bad_param(
                "stop_sequences",
                "'stop_sequences' must be a list of strings",
            )
        })?,
    };
    let mut sampling = Map::new();
    sampling.insert("max_tokens".into(), json!(max_tokens));
    for key in ["temperature", "top_p", "top_k", "stream"] {
        if let Some(v) = body.get(key) {
            sampling.insert(key.into(), v.clone());
        }
    }
    sampling.insert("stop".into(), json!(stops));
    let mut kwargs = Map::new();
    kwargs.insert("enable_thinking".into(), Json::from(thinking));
    let turn = Turn::prepare(
        state,
        &runtime,
        TurnRequest {
            messages,
            tools,
            choice,
            parallel,
            kwargs: Some(kwargs),
            format: None,
            sampling: Json::Object(sampling),
        },
    )?;
    let stops = turn.params.stop.clone();
    Ok(Prepared {
        stream: turn.params.stream,
        turn,
        stops,
    })
}

pub async fn messages(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrival = Instant::now();
    let id = state.new_id("msg_");
    let mut prepared = match state
        .prepare({
            let state = Arc::clone(&state);
            move || prepare(&state, body)
        })
        .await
    {
        Ok(p) => p,
        Err(e) => {
            tracing::info!(target: "calla::request", "{id} messages refused: {e}");
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
    let mut log = RequestLog::new(id.clone(), "messages", arrival, prepared.stream);
    log.prompt_tokens = prepared.turn.prompt.ids.len();
    if state.config.log_text {
        log.keep_text(prepared.turn.prompt.text.clone(), 1);
    }
    let reply = MessageReply {
        id,
        model: state.config.served_model_name.clone(),
        output: TurnOutput::new(&state, &prepared.turn, "toolu_"),
        stream: prepared.stream,
        stops: prepared.stops,
        input_tokens: prepared.turn.prompt.ids.len(),
        cached_tokens: 0,
        output_tokens: 0,
        end: None,
        log,
    };
    if prepared.stream {
        let first = vec![reply.message_start(), json!({"type": "ping"})];
        sse::stream(events, reply, first)
    } else {
        respond(events, reply).await
    }
}

async fn respond(mut events: Events, mut reply: MessageReply) -> Response {
    match sse::collect(&mut events, &mut reply).await {
        Ok(()) => JsonBody(reply.message()).into_response(),
        Err(e) => e.into_response(),
    }
}

/// POST /v1/messages/count_tokens: the prompt's length as it would run.
pub async fn count_tokens(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(bytes) => {
            // max_tokens is not part of a count request.
            let mut v: Json = serde_json::from_slice(&bytes).unwrap_or(Json::Null);
            if let Some(obj) = v.as_object_mut() {
                obj.entry("max_tokens").or_insert(json!(1));
                obj.remove("stream");
            }
            Ok(Bytes::from(v.to_string()))
        }
        Err(e) => Err(e),
    };
    match state
        .prepare({
            let state = Arc::clone(&state);
            move || prepare(&state, body)
        })
        .await
    {
        Ok(p) => JsonBody(json!({"input_tokens": p.turn.prompt.ids.len()})).into_response(),
        Err(e) => e.into_response(),
    }
}

struct MessageReply {
    id: String,
    model: String,
    output: TurnOutput,
    stream: bool,
    stops: Vec<String>,
    input_tokens: usize,
    cached_tokens: usize,
    output_tokens: usize,
    end: Option<TurnEnd>,
    log: RequestLog,
}

impl MessageReply {
    fn usage(&self) -> Json {
        json!({
            "input_tokens": self.input_tokens - self.cached_tokens,
            "output_tokens": self.output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.cached_tokens,
        })
    }

    fn stop_reason(&self) -> (Json, Json) {
        match self.end {
            Some(TurnEnd::Length) => (json!("max_tokens"), Json::Null),
            Some(TurnEnd::StopString(i)) => (json!("stop_sequence"), json!(self.stops.get(i))),
            Some(TurnEnd::ToolCalls) => (json!("tool_use"), Json::Null),
            Some(TurnEnd::Done) => (json!("end_turn"), Json::Null),
            None => (Json::Null, Json::Null),
        }
    }

    fn message_start(&self) -> Json {
        json!({"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        }})
    }

    fn block_json(&self, index: usize, full: bool) -> Json {
        let block = &self.output.blocks[index];
        match &block.kind {
            BlockKind::Thinking => json!({"type": "thinking",
                "thinking": if full { block.text.as_str() } else { "" }, "signature": ""}),
            BlockKind::Text => {
                json!({"type": "text", "text": if full { block.text.as_str() } else { "" }})
            }
            BlockKind::ToolCall { id, name } => json!({"type": "tool_use", "id": id, "name": name,
                "input": if full { arguments_object(&block.text) } else { json!({}) }}),
        }
    }

    fn message(&self) -> Json {
        let (stop_reason, stop_sequence) = self.stop_reason();
        let content: Vec<Json> = (0..self.output.blocks.len())
            .map(|i| self.block_json(i, true))
            .collect();
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": self.usage(),
        })
    }

    fn chunks(&self, events: Vec<BlockEvent>) -> Vec<Json> {
        if !self.stream {
            return Vec::new();
        }
        events
            .into_iter()
            .map(|event| match event {
                BlockEvent::Start(i) => json!({"type": "content_block_start", "index": i,
                    "content_block": self.block_json(i, false)}),
                BlockEvent::Delta(i, text) => {
                    let delta = match self.output.blocks[i].kind {
                        BlockKind::Thinking => json!({"type": "thinking_delta", "thinking": text}),
                        BlockKind::Text => json!({"type": "text_delta", "text": text}),
                        BlockKind::ToolCall { .. } => {
                            json!({"type": "input_json_delta", "partial_json": text})
                        }
                    };
                    json!({"type": "content_block_delta", "index": i, "delta": delta})
                }
                BlockEvent::Stop(i) => json!({"type": "content_block_stop", "index": i}),
            })
            .collect()
    }
}

impl Reply for MessageReply {
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
                let end = TurnEnd::of(&finished, self.output.tool_calls());
                self.end = Some(end);
                self.output_tokens = finished.report.completion_tokens();
                self.log.finish_reasons.push(finished.finish_reason());
                self.log.complete = true;
                if self.stream {
                    let (stop_reason, stop_sequence) = self.stop_reason();
                    chunks.push(json!({"type": "message_delta",
                        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        "usage": {"output_tokens": self.output_tokens}}));
                    chunks.push(json!({"type": "message_stop"}));
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
        typed_event(&anthropic_body(error.status, &error.message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anthropic_paths_and_error_types() {
        assert!(is_anthropic_path("/v1/messages") && is_anthropic_path("/messages/count_tokens"));
        assert!(!is_anthropic_path("/v1/chat/completions") && !is_anthropic_path("/v1/messagesx"));
        assert_eq!(error_type(StatusCode::UNAUTHORIZED), "authentication_error");
        assert_eq!(
            error_type(StatusCode::TOO_MANY_REQUESTS),
            "rate_limit_error"
        );
    }
}
