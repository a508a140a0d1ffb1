//! CORS for browser clients, off by default: only origins listed in `ServerConfig::cors_origins`
//! (`--cors-origin`, repeatable; `*` allows any) get CORS headers. For an allowed origin a preflight
//! (`OPTIONS` with `Access-Control-Request-Method`) is answered here with 204, before the API-key
//! check (browsers send no credentials on a preflight), and every other response carries
//! `Access-Control-Allow-Origin` (the origin itself, with `Vary: Origin`). Requests from other
//! origins pass through untouched: refusing them is the Origin check's business (same list,
//! [`origin_allowed`]).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::state::AppState;

const ALLOW_METHODS: &str = "GET, POST, OPTIONS";
const ALLOW_HEADERS: &str =
    "authorization, content-type, x-api-key, anthropic-version, anthropic-beta, \
     anthropic-dangerous-direct-browser-access, openai-organization, openai-project, openai-beta, \
     x-stainless-os, x-stainless-lang, x-stainless-package-version, x-stainless-runtime, \
     x-stainless-runtime-version, x-stainless-arch, x-stainless-retry-count, x-stainless-timeout";
const EXPOSE_HEADERS: &str = "retry-after, content-type";

/// Whether `origin` is in the configured list (`*` matches any; comparison ignores a trailing `/`
/// and ASCII case, as origins are case-insensitive in scheme and host).
pub fn origin_allowed(allowed: &[String], origin: &str) -> bool {
    let norm = |s: &str| s.trim_end_matches('/').to_ascii_lowercase();
    let origin = norm(origin);
    allowed.iter().any(|a| a == "*" || norm(a) == origin)
}

fn allowed_origin(state: &AppState, headers: &HeaderMap) -> Option<HeaderValue> {
    if state.config.cors_origins.is_empty() {
        return None;
    }
    let origin = headers.get(header::ORIGIN)?;
    origin_allowed(&state.config.cors_origins, origin.to_str().ok()?).then(|| origin.clone())
}

pub async fn cors(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some(origin) = allowed_origin(&state, request.headers()) else {
        return next.run(request).await;
    };
    let preflight = request.method() == Method::OPTIONS
        && request
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    if preflight {
        let allow_headers = request
            .headers()
            .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
            .cloned()
            .unwrap_or(HeaderValue::from_static(ALLOW_HEADERS));
        let mut response = StatusCode::NO_CONTENT.into_response();
        let h = response.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static(ALLOW_METHODS),
        );
        h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, allow_headers);
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
        h.insert(header::VARY, HeaderValue::from_static("Origin"));
        return response;
    }
    let mut response = next.run(request).await;
    let h = response.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static(EXPOSE_HEADERS),
    );
    h.append(header::VARY, HeaderValue::from_static("Origin"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_match_exactly_or_by_wildcard() {
        let list = vec!["http://localhost:3000".to_string()];
        assert!(origin_allowed(&list, "http://localhost:3000"));
        assert!(origin_allowed(&list, "HTTP://LOCALHOST:3000/"));
        assert!(!origin_allowed(&list, "http://localhost:3001"));
        assert!(!origin_allowed(&[], "http://localhost:3000"));
        assert!(origin_allowed(&["*".to_string()], "https://example.com"));
    }
}
