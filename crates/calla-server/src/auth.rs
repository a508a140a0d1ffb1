//! API-key check: `Authorization: Bearer KEY` or `X-Api-Key: KEY`, compared in constant time.
//! Keys are compared as SHA-256 digests, so neither the content nor the length of the configured key
//! shows in the timing. /health and /metrics stay open (load balancers and scrapers).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

use crate::errors::ApiError;
use crate::state::AppState;

pub const PUBLIC_PATHS: [&str; 2] = ["/health", "/metrics"];

pub struct ApiKey {
    digest: [u8; 32],
}

impl ApiKey {
    pub fn new(key: &str) -> ApiKey {
        ApiKey {
            digest: Sha256::digest(key.as_bytes()).into(),
        }
    }

    pub fn matches(&self, provided: &str) -> bool {
        let provided: [u8; 32] = Sha256::digest(provided.as_bytes()).into();
        constant_time_eq(&self.digest, &provided)
    }
}

/// Every byte is compared whatever the earlier ones were.
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let mut difference = 0u8;
    for i in 0..32 {
        difference |= std::hint::black_box(a[i] ^ b[i]);
    }
    difference == 0
}

fn provided_key(headers: &HeaderMap) -> Option<&str> {
    if let Some(value) = headers.get(axum::http::header::AUTHORIZATION) {
        let value = value.to_str().ok()?;
        let (scheme, token) = value.split_once(' ')?;
        return scheme.eq_ignore_ascii_case("bearer").then(|| token.trim());
    }
    headers.get("x-api-key")?.to_str().ok()
}

pub async fn require_api_key(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(key) = &state.api_key {
        let public = PUBLIC_PATHS.contains(&request.uri().path());
        let allowed = provided_key(request.headers()).is_some_and(|k| key.matches(k));
        if !public && !allowed {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_by_digest() {
        let key = ApiKey::new("sk-secret");
        assert!(key.matches("sk-secret"));
        assert!(!key.matches("sk-secreT"));
        assert!(!key.matches("sk-secret "));
        assert!(!key.matches(""));
    }

    #[test]
    fn bearer_or_x_api_key() {
        let mut h = HeaderMap::new();
        h.insert("authorization", "Bearer abc".parse().unwrap());
        assert_eq!(provided_key(&h), Some("abc"));
        let mut h = HeaderMap::new();
        h.insert("x-api-key", "xyz".parse().unwrap());
        assert_eq!(provided_key(&h), Some("xyz"));
        let mut h = HeaderMap::new();
        h.insert("authorization", "Basic abc".parse().unwrap());
        assert_eq!(provided_key(&h), None);
    }
}
