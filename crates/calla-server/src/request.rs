//! Request plumbing both endpoints share: the body as JSON, the model check, usage accounting.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde_json::{json, Value as Json};

use crate::errors::ApiError;
use crate::state::AppState;

/// The body as a JSON object; a body over the limit is 413, bad JSON 400.
pub fn parse_body(body: Result<Bytes, BytesRejection>) -> Result<Json, ApiError> {
    let bytes = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large()
        } else {
            ApiError::bad_request(format!("Could not read the request body: {rejection}"))
        }
    })?;
    let value: Json = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("The request body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request(
            "The request body must be a JSON object.",
        ));
    }
    Ok(value)
}

/// Bytes of all the strings in `values` (message contents, tool definitions, prompts): what the
/// tokenizer and the template will be given, counted before either runs.
pub fn text_bytes(values: &[Json]) -> usize {
    fn walk(v: &Json) -> usize {
        match v {
            Json::String(s) => s.len(),
            Json::Array(items) => items.iter().map(walk).sum(),
            Json::Object(map) => map.iter().map(|(k, v)| k.len() + walk(v)).sum(),
            _ => 0,
        }
    }
    values.iter().map(walk).sum()
}

/// A prompt over `--max-prompt-mb` is refused before it is templated or tokenized.
pub fn check_prompt_bytes(bytes: usize, limit: usize, param: &str) -> Result<(), ApiError> {
    if bytes > limit {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::bad_param(
                param,
                format!(
                    "The prompt has {bytes} bytes of text; this server accepts at most {limit}."
                ),
            )
        });
    }
    Ok(())
}

/// `model` must be the served name (or absent: clients that send none get the one model).
pub fn check_model(state: &AppState, requested: Option<&str>) -> Result<(), ApiError> {
    match requested {
        Some(name) if name != state.config.served_model_name => Err(ApiError::unknown_model(
            name,
            &state.config.served_model_name,
        )),
        _ => Ok(()),
    }
}

/// OpenAI `usage`, with the prefix-cache hits in `prompt_tokens_details.cached_tokens`.
#[derive(Debug, Clone, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize) -> Usage {
        Usage {
            prompt_tokens,
            ..Default::default()
        }
    }

    /// A choice started; the cached tokens of a prompt's first choice are the prompt's (later choices
    /// of the same prompt reuse the first one's state, which is not a saving the client made).
    pub fn started(&mut self, first_of_prompt: bool, cached_tokens: usize) {
        if first_of_prompt {
            self.cached_tokens += cached_tokens;
        }
    }

    pub fn to_json(&self) -> Json {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}
