//! Checks every request passes before routing: Host and Origin (a web page must not drive a local
//! server, directly or by DNS rebinding), a JSON Content-Type on POST (so a cross-site "simple"
//! `text/plain` form post cannot reach a handler), the size of the request target and headers, and
//! the body read with a deadline and a size limit.
//!
//! Allowed hosts come from the bound address (`--host`): a loopback bind allows `localhost`,
//! `127.0.0.1` and `[::1]`; a named or specific address allows that name; an unspecified bind
//! (`0.0.0.0`, `::`) allows any Host. On POST (and other non-read methods) origins are allowed when
//! their host is an allowed host, or when `--cors-origin` lists them (or `*`). Requests without an
//! Origin (curl, SDKs) are not affected by the Origin check.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::errors::ApiError;
use crate::state::AppState;

/// The Host names a server bound to `host` answers to; None = any (an unspecified address).
pub fn allowed_hosts_for(host: &str) -> Option<Vec<String>> {
    let bare = strip_brackets(host).to_ascii_lowercase();
    match bare.parse::<std::net::IpAddr>() {
        Ok(ip) if ip.is_unspecified() => None,
        Ok(ip) if ip.is_loopback() => Some(vec![
            "localhost".into(),
            "127.0.0.1".into(),
            "::1".into(),
            bare,
        ]),
        Ok(_) => Some(vec![bare]),
        Err(_) if bare == "localhost" => allowed_hosts_for("127.0.0.1"),
        Err(_) => Some(vec![bare]),
    }
}

fn strip_brackets(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// The host part of a `Host` header value or of an origin's authority (no port, no brackets,
/// lower case).
pub fn host_of(authority: &str) -> String {
    let authority = authority.trim();
    let host = if let Some(rest) = authority.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        match authority.rsplit_once(':') {
            Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) => h,
            _ => authority,
        }
    };
    host.trim_end_matches('.').to_ascii_lowercase()
}

fn host_allowed(allowed: &Option<Vec<String>>, host: &str) -> bool {
    match allowed {
        None => true,
        Some(list) => list.iter().any(|h| h == host),
    }
}

/// Whether a request with this `Origin` may be served.
pub fn origin_allowed(
    allowed_hosts: &Option<Vec<String>>,
    cors_origins: &[String],
    request_host: Option<&str>,
    origin: &str,
) -> bool {
    let origin = origin.trim().trim_end_matches('/');
    if cors_origins
        .iter()
        .any(|o| o == "*" || o.trim_end_matches('/').eq_ignore_ascii_case(origin))
    {
        return true;
    }
    // `null` (sandboxed frames, file://) and anything that is not scheme://authority.
    let Some((scheme, authority)) = origin.split_once("://") else {
        return false;
    };
    if !matches!(scheme.to_ascii_lowercase().as_str(), "http" | "https") {
        return false;
    }
    let host = host_of(authority);
    match allowed_hosts {
        Some(list) => list.iter().any(|h| *h == host),
        // Any Host: only a same-origin page (served under the name the request uses).
        None => request_host.is_some_and(|h| host_of(h) == host),
    }
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .is_some_and(|essence| {
            essence == "application/json"
                || (essence.starts_with("application/") && essence.ends_with("+json"))
        })
}

fn refuse(status: StatusCode, kind: &'static str, message: String) -> Response {
    let mut response = ApiError::new(status, kind, message).into_response();
    if matches!(
        status,
        StatusCode::URI_TOO_LONG | StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
    ) {
        // The rest of such a request is not worth reading.
        response.headers_mut().insert(
            header::CONNECTION,
            header::HeaderValue::from_static("close"),
        );
    }
    response
}

/// Host, Origin, request-target and header sizes, Content-Type: before anything else runs.
pub async fn check_request(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let config = &state.config;
    let limits = &config.limits;
    let target = request
        .uri()
        .path_and_query()
        .map_or(0, |pq| pq.as_str().len());
    if target > limits.max_uri_bytes {
        return refuse(
            StatusCode::URI_TOO_LONG,
            "invalid_request_error",
            format!(
                "The request target has {target} bytes; at most {} are accepted.",
                limits.max_uri_bytes
            ),
        );
    }
    let header_bytes: usize = request
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum();
    if header_bytes > limits.max_header_bytes {
        return refuse(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "invalid_request_error",
            format!(
                "The request headers have {header_bytes} bytes; at most {} are accepted.",
                limits.max_header_bytes
            ),
        );
    }
    let host = request
        .headers()
        .get(header::HOST)
        .map(|h| h.to_str().unwrap_or("\u{fffd}").to_string())
        .or_else(|| request.uri().authority().map(|a| a.to_string()));
    if let Some(host) = &host {
        if !host_allowed(&config.allowed_hosts, &host_of(host)) {
            return refuse(
                StatusCode::FORBIDDEN,
                "permission_error",
                format!(
                    "Host '{host}' is not a name this server answers to (start it with --host NAME \
                     to serve under another name)."
                ),
            );
        }
    }
    // Reads (GET, HEAD) and preflights (OPTIONS) from other origins are harmless: the browser does
    // not let the page see the answer without CORS headers (cors.rs). Anything else is refused.
    let reads = matches!(
        *request.method(),
        Method::GET | Method::HEAD | Method::OPTIONS
    );
    if let Some(origin) = request.headers().get(header::ORIGIN).filter(|_| !reads) {
        let origin = origin.to_str().unwrap_or("\u{fffd}");
        if !origin_allowed(
            &config.allowed_hosts,
            &config.cors_origins,
            host.as_deref(),
            origin,
        ) {
            return refuse(
                StatusCode::FORBIDDEN,
                "permission_error",
                format!(
                    "Requests from origin '{origin}' are not allowed (allow it with --cors-origin)."
                ),
            );
        }
    }
    if request.method() == Method::POST && !is_json(request.headers()) {
        return refuse(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            "POST bodies must be JSON: send 'Content-Type: application/json'.".into(),
        );
    }
    next.run(request).await
}

/// Read the whole body within the body timeout and the size limit (408 / 413), then hand it on.
pub async fn read_body(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    if request.method() == Method::GET || request.method() == Method::HEAD {
        return next.run(request).await;
    }
    let limit = state.config.max_body_bytes;
    let (parts, body) = request.into_parts();
    let read = tokio::time::timeout(
        state.config.limits.body_timeout,
        Limited::new(body, limit).collect(),
    )
    .await;
    let bytes = match read {
        Err(_) => {
            let mut response = refuse(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!(
                    "The request body did not arrive within {} s.",
                    state.config.limits.body_timeout.as_secs_f64()
                ),
            );
            response.headers_mut().insert(
                header::CONNECTION,
                header::HeaderValue::from_static("close"),
            );
            return response;
        }
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            let mut response = ApiError::too_large().into_response();
            response.headers_mut().insert(
                header::CONNECTION,
                header::HeaderValue::from_static("close"),
            );
            return response;
        }
        Ok(Err(e)) => {
            return ApiError::bad_request(format!("Could not read the request body: {e}"))
                .into_response()
        }
        Ok(Ok(collected)) => collected.to_bytes(),
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_of_a_bind_address() {
        assert_eq!(allowed_hosts_for("0.0.0.0"), None);
        assert_eq!(allowed_hosts_for("::"), None);
        let local = allowed_hosts_for("127.0.0.1").unwrap();
        assert!(local.contains(&"localhost".to_string()) && local.contains(&"::1".to_string()));
        assert_eq!(
            allowed_hosts_for("Box.Local"),
            Some(vec!["box.local".to_string()])
        );
        assert_eq!(
            allowed_hosts_for("10.1.2.3"),
            Some(vec!["10.1.2.3".to_string()])
        );
    }

    #[test]
    fn host_header_forms() {
        assert_eq!(host_of("localhost:8000"), "localhost");
        assert_eq!(host_of("[::1]:8000"), "::1");
        assert_eq!(host_of("[::1]"), "::1");
        assert_eq!(host_of("Example.COM."), "example.com");
        assert_eq!(host_of("127.0.0.1"), "127.0.0.1");
    }

    #[test]
    fn origins() {
        let local = allowed_hosts_for("127.0.0.1");
        assert!(origin_allowed(&local, &[], None, "http://localhost:3000"));
        assert!(!origin_allowed(&local, &[], None, "https://evil.example"));
        assert!(!origin_allowed(&local, &[], None, "null"));
        assert!(origin_allowed(
            &local,
            &["https://app.example".into()],
            None,
            "https://app.example"
        ));
        assert!(origin_allowed(&local, &["*".into()], None, "null"));
        // Any host: same origin only.
        assert!(origin_allowed(
            &None,
            &[],
            Some("box:8000"),
            "http://box:8000"
        ));
        assert!(!origin_allowed(
            &None,
            &[],
            Some("box:8000"),
            "http://evil.example"
        ));
    }
}
