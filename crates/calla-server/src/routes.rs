//! The route table and the small endpoints: /v1/models, /health, /metrics, and OpenAI-shaped 404/405.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Path, State};
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
use crate::{anthropic, cors, responses, tokenize};

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::retrieve))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        // Anthropic clients configured with a base URL that already ends in /v1.
        .route("/messages", post(anthropic::messages))
        .route("/messages/count_tokens", post(anthropic::count_tokens))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
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
        .layer(middleware::from_fn(anthropic::anthropic_errors))
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            cors::cors,
        ))
        .with_state(state)
}

fn model_card(state: &AppState) -> serde_json::Value {
    let max_context = state.runtime().map(|rt| rt.max_context).ok();
    json!({
        "id": state.config.served_model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "calla",
        "max_model_len": max_context,
    })
}

/// GET /v1/models/{id}: the served model's card, 404 for any other id.
async fn model(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if id != state.config.served_model_name {
        return ApiError::unknown_model(&id, &state.config.served_model_name).into_response();
    }
    Json(model_card(&state)).into_response()
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    Json(json!({"object": "list", "data": [model_card(&state)]})).into_response()
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
