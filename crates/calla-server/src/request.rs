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
