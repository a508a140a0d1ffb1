//! POST /tokenize and /detokenize (vLLM's and llama.cpp's shapes): text (`prompt` or `content`) or
//! chat `messages` (rendered by the template, with the generation prompt) → token ids, and ids →
//! text. Ids are checked against the model's vocabulary.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json as JsonBody;
use serde_json::{json, Value as Json};

use crate::chat::{chat_prompt, ToolChoice};
use crate::errors::ApiError;
use crate::request::{check_model, parse_body};
use crate::state::AppState;

fn tokenize_body(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Json, ApiError> {
    let runtime = state.runtime()?;
    let body = parse_body(body)?;
    check_model(state, body["model"].as_str())?;
    let ids = if let Some(text) = body
        .get("prompt")
        .or(body.get("content"))
        .and_then(Json::as_str)
    {
        runtime.codec.encode(text).map_err(ApiError::internal)?
    } else if let Some(messages) = body.get("messages").and_then(Json::as_array) {
        let tools = body["tools"].as_array().cloned().unwrap_or_default();
        let choice = if tools.is_empty() {
            ToolChoice::None
        } else {
            ToolChoice::Auto
        };
        let kwargs = body["chat_template_kwargs"].as_object();
        chat_prompt(&runtime, messages, &tools, &choice, kwargs)?.ids
    } else {
        return Err(ApiError::bad_param(
            "prompt",
            "send 'prompt' (or 'content') as a string, or chat 'messages'",
        ));
    };
    Ok(json!({"tokens": ids, "count": ids.len(), "max_model_len": runtime.max_context}))
}

pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match state
        .prepare({
            let state = Arc::clone(&state);
            move || tokenize_body(&state, body)
        })
        .await
    {
        Ok(v) => JsonBody(v).into_response(),
        Err(e) => e.into_response(),
    }
}

fn detokenize_body(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json, ApiError> {
    let runtime = state.runtime()?;
    let body = parse_body(body)?;
    check_model(state, body["model"].as_str())?;
    let vocab = runtime
        .scheduler
        .vocab_size()
        .max(runtime.codec.vocab_size());
    let bad = || {
        ApiError::bad_param(
            "tokens",
            format!("'tokens' must be a list of token ids below {vocab}"),
        )
    };
    let ids: Vec<u32> = body
        .get("tokens")
        .and_then(Json::as_array)
        .ok_or_else(bad)?
        .iter()
        .map(|v| {
            v.as_u64()
                .filter(|&id| (id as usize) < vocab)
                .map(|id| id as u32)
                .ok_or_else(bad)
        })
        .collect::<Result<_, _>>()?;
    let text = runtime.codec.decode(&ids);
    Ok(json!({"prompt": text, "content": text}))
}

pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match state
        .prepare({
            let state = Arc::clone(&state);
            move || detokenize_body(&state, body)
        })
        .await
    {
        Ok(v) => JsonBody(v).into_response(),
        Err(e) => e.into_response(),
    }
}
