//! OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status the
//! OpenAI API uses (400 validation and context overflow, 401, 404, 413, 429, 503, 500).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: invalid_request_error, authentication_error, not_found_error, …
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// A bad value of one request field.
    pub fn bad_param(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.into()),
            ..ApiError::bad_request(message)
        }
    }

    pub fn context_length(prompt_tokens: usize, max_context: usize, param: &str) -> ApiError {
        ApiError {
            param: Some(param.into()),
            code: Some("context_length_exceeded"),
            ..ApiError::bad_request(format!(
                "This model's maximum context length is {max_context} tokens, but the prompt has \
                 {prompt_tokens} tokens (at least one token must remain to generate)."
            ))
        }
    }

    pub fn unknown_model(requested: &str, served: &str) -> ApiError {
        ApiError {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found_error",
                format!("The model '{requested}' does not exist; this server serves '{served}'."),
            )
        }
    }

    pub fn unauthorized() -> ApiError {
        ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "Missing or invalid API key: send it as 'Authorization: Bearer KEY' or 'X-Api-Key: KEY'.",
            )
        }
    }

    pub fn queue_full(capacity: usize) -> ApiError {
        ApiError {
            code: Some("queue_full"),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                format!(
                    "The server is busy: {capacity} requests are already waiting. Retry later."
                ),
            )
        }
    }

    /// Too many open connections (the connection cap).
    pub fn overloaded() -> ApiError {
        ApiError {
            code: Some("server_overloaded"),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable_error",
                "The server has too many open connections. Retry later.",
            )
        }
    }

    pub fn too_large() -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "The request body is too large.",
        )
    }

    pub fn loading() -> ApiError {
        ApiError {
            code: Some("model_loading"),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable_error",
                "The model is loading.",
            )
        }
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// Seconds a client told 429 should wait before retrying.
pub const RETRY_AFTER_SECONDS: &str = "1";

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if matches!(
            self.status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        ) {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static(RETRY_AFTER_SECONDS),
            );
        }
        response
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}
