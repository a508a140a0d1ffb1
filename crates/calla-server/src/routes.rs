//! The route table and the small endpoints: /v1/models, /health, /metrics, and OpenAI-shaped 404/405.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::auth::require_api_key;
use crate::chat::chat_completions;
use crate::completions::completions;
use crate::errors::ApiError;
use crate::guard::{check_request, read_body};
use crate::state::AppState;

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Innermost first: the body is read (with its deadline) only for authorised requests, and
        // nothing runs before the Host / Origin / Content-Type checks.
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            read_body,
        ))
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            require_api_key,
        ))
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            check_request,
        ))
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .with_state(state)
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let max_context = state.runtime().map(|rt| rt.max_context).ok();
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.config.served_model_name,
            "object": "model",
            "created": state.started,
            "owned_by": "calla",
            "max_model_len": max_context,
        }],
    }))
    .into_response()
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.is_ready() {
        Json(json!({"status": "ok"})).into_response()
    } else {
        ApiError::loading().into_response()
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.render_metrics(),
    )
        .into_response()
}

async fn not_found(uri: axum::http::Uri) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found_error",
        format!("No route {}", uri.path()),
    )
    .into_response()
}

async fn method_not_allowed() -> Response {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "Method not allowed for this route.",
    )
    .into_response()
}
