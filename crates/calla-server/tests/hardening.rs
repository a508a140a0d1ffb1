//! Hostile and stalled clients (issue 33): connection timeouts and cap, shutdown deadline, Host /
//! Origin / Content-Type checks, JSON bodies for HTTP-layer errors, prompt-size and queue limits.
//! Every test is bounded: timeouts are set to fractions of a second.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use calla_server::{AppState, Limits, ServerConfig};
use common::*;
use serde_json::{json, Value as Json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CHAT: &str = "/v1/chat/completions";

fn quick_limits() -> Limits {
    Limits {
        header_timeout: Duration::from_millis(300),
        body_timeout: Duration::from_millis(300),
        write_timeout: Duration::from_millis(300),
        shutdown_deadline: Duration::from_millis(500),
        ..Limits::default()
    }
}

fn config(limits: Limits) -> ServerConfig {
    ServerConfig {
        served_model_name: "test-model".into(),
        limits,
        ..ServerConfig::default()
    }
}

/// Read until the server closes the connection (or `within` passes: then None).
async fn read_until_closed(stream: &mut TcpStream, within: Duration) -> Option<String> {
    let mut out = Vec::new();
    let read = tokio::time::timeout(within, async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    read.ok()
        .map(|_| String::from_utf8_lossy(&out).into_owned())
}

fn body_of(raw: &str) -> Json {
    let body = raw.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {raw:?}"))
}

fn status_of(raw: &str) -> u16 {
    raw.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_and_half_sent_connections_are_closed() {
    let server = start(Options {
        config: config(quick_limits()),
        ..Options::default()
    })
    .await;
    // Connected, says nothing.
    let mut idle = TcpStream::connect(server.addr).await.unwrap();
    // Half a request head.
    let mut partial = TcpStream::connect(server.addr).await.unwrap();
    partial
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .await
        .unwrap();
    // A kept-alive connection after one complete request.
    let mut kept = TcpStream::connect(server.addr).await.unwrap();
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    for stream in [&mut idle, &mut partial, &mut kept] {
        assert!(
            read_until_closed(stream, Duration::from_secs(5))
                .await
                .is_some(),
            "a connection stayed open"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_body_gets_408_in_json() {
    let server = start(Options {
        config: config(quick_limits()),
        ..Options::default()
    })
    .await;
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    stream
        .write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
              Content-Length: 1000\r\n\r\n{\"messages\": [",
        )
        .await
        .unwrap();
    let raw = read_until_closed(&mut stream, Duration::from_secs(5))
        .await
        .expect("closed");
    assert_eq!(status_of(&raw), 408, "{raw}");
    assert!(body_of(&raw)["error"]["message"].is_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_over_the_cap_get_503_and_the_server_recovers() {
    let server = start(Options {
        config: config(Limits {
            max_connections: 3,
            ..quick_limits()
        }),
        ..Options::default()
    })
    .await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(TcpStream::connect(server.addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut extra = TcpStream::connect(server.addr).await.unwrap();
    let raw = read_until_closed(&mut extra, Duration::from_secs(2))
        .await
        .expect("refused at once");
    assert_eq!(status_of(&raw), 503, "{raw}");
    assert_eq!(body_of(&raw)["error"]["code"], "server_overloaded");
    // The idle ones time out; then everyone is served again.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(get(server.addr, "/health").await.status, 200);
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_stops_reading_is_dropped_and_its_work_cancelled() {
    let server = start(Options {
        config: config(quick_limits()),
        max_context: 1 << 20,
        ..Options::default()
    })
    .await;
    let body = json!({"messages": user("long 100000"), "stream": true,
                      "chat_template_kwargs": {"enable_thinking": false}})
    .to_string();
    // A small receive window, so the server's writes stall after a few thousand tokens.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(server.addr).await.unwrap();
    let head = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body.as_bytes()).await.unwrap();
    // Not reading. The socket buffers fill, the write stalls, the server gives up: it cancels the
    // generation if that is still running (the engine may already have finished: its output waits
    // in memory) and closes the connection, so the stream never reaches its end.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let received = read_until_closed(&mut stream, Duration::from_secs(20))
        .await
        .expect("the server closed the stalled connection");
    assert!(
        !received.trim_end().ends_with("data: [DONE]"),
        "the whole stream was delivered ({} bytes): the stalled connection was kept",
        received.len()
    );
    let cancelled = server
        .state
        .metrics
        .requests_cancelled
        .load(Ordering::SeqCst);
    let steps = server.steps.load(Ordering::SeqCst);
    assert!(cancelled == 1 || steps >= 100_000, "{cancelled} {steps}");
    drop(stream);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_does_not_wait_past_its_deadline_for_a_half_sent_request() {
    let state = AppState::new(config(quick_limits()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(calla_server::serve(listener, Arc::clone(&state), async {
        let _ = rx.await;
    }));
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
              Content-Length: 100000\r\n\r\n{\"prompt\": \"",
        )
        .await
        .unwrap();
    // Keep the body trickling so no read timeout fires before the shutdown.
    let trickle = tokio::spawn(async move {
        for _ in 0..100 {
            if stream.write_all(b"a").await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let asked = Instant::now();
    let _ = tx.send(());
    tokio::time::timeout(Duration::from_secs(5), serving)
        .await
        .expect("shutdown hung")
        .unwrap()
        .unwrap();
    assert!(asked.elapsed() < Duration::from_secs(3));
    trickle.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn web_pages_cannot_drive_the_server() {
    let server = start(Options::default()).await;
    let addr = server.addr;
    let body = json!({"messages": user("hi"), "max_tokens": 2}).to_string();
    let raw = |headers: &'static [(&'static str, &'static str)], content_type: &'static str| {
        let body = body.clone();
        async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            let mut head = format!("POST {CHAT} HTTP/1.0\r\nContent-Length: {}\r\n", body.len());
            if !content_type.is_empty() {
                head.push_str(&format!("Content-Type: {content_type}\r\n"));
            }
            for (k, v) in headers {
                head.push_str(&format!("{k}: {v}\r\n"));
            }
            head.push_str("\r\n");
            stream.write_all(head.as_bytes()).await.unwrap();
            stream.write_all(body.as_bytes()).await.unwrap();
            read_until_closed(&mut stream, Duration::from_secs(5))
                .await
                .unwrap()
        }
    };
    const LOCAL: &[(&str, &str)] = &[("Host", "127.0.0.1")];
    // A cross-site "simple" request: text/plain.
    let r = raw(LOCAL, "text/plain").await;
    assert_eq!(status_of(&r), 415, "{r}");
    assert!(body_of(&r)["error"]["message"].is_string());
    let r = raw(LOCAL, "").await;
    assert_eq!(status_of(&r), 415, "{r}");
    // DNS rebinding: the page's own name in Host.
    let r = raw(&[("Host", "evil.example:8000")], "application/json").await;
    assert_eq!(status_of(&r), 403, "{r}");
    assert_eq!(body_of(&r)["error"]["type"], "permission_error");
    // Another site's page.
    let r = raw(
        &[("Host", "localhost"), ("Origin", "https://evil.example")],
        "application/json",
    )
    .await;
    assert_eq!(status_of(&r), 403, "{r}");
    let r = raw(
        &[("Host", "localhost"), ("Origin", "null")],
        "application/json",
    )
    .await;
    assert_eq!(status_of(&r), 403, "{r}");
    // The server's own names, with and without an Origin, and JSON with a charset.
    let r = raw(
        &[
            ("Host", "localhost:8000"),
            ("Origin", "http://localhost:8000"),
        ],
        "application/json; charset=utf-8",
    )
    .await;
    assert_eq!(status_of(&r), 200, "{r}");
    let r = raw(&[("Host", "[::1]:8000")], "application/json").await;
    assert_eq!(status_of(&r), 200, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cors_origins_and_any_host_binds() {
    let server = start(Options {
        config: ServerConfig {
            served_model_name: "test-model".into(),
            allowed_hosts: None,
            cors_origins: vec!["https://app.example".into()],
            ..ServerConfig::default()
        },
        ..Options::default()
    })
    .await;
    let body = json!({"messages": user("hi"), "max_tokens": 2});
    let r = request(
        server.addr,
        "POST",
        CHAT,
        &[("Origin", "https://app.example")],
        body.to_string().as_bytes(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = request(
        server.addr,
        "POST",
        CHAT,
        &[("Origin", "https://other.example")],
        body.to_string().as_bytes(),
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_layer_errors_have_json_bodies() {
    let server = start(Options::default()).await;
    let addr = server.addr;
    let long_path = format!("/v1/models?{}", "a".repeat(10_000));
    let r = get(addr, &long_path).await;
    assert_eq!(r.status, 414);
    assert!(r.json()["error"]["message"].is_string());
    let big = "b".repeat(40_000);
    let r = request(addr, "GET", "/health", &[("X-Big", &big)], b"").await;
    assert_eq!(r.status, 431);
    assert!(r.json()["error"]["message"].is_string());
    for (method, path) in [("GET", CHAT), ("DELETE", "/v1/models"), ("PUT", "/health")] {
        let r = request(addr, method, path, &[], b"").await;
        assert_eq!(r.status, 405, "{method} {path}");
        assert!(r.json()["error"]["message"].is_string(), "{}", r.body);
    }
    let r = request(addr, "POST", "/nowhere", &[], b"{}").await;
    assert_eq!(r.status, 404);
    assert!(r.json()["error"]["message"].is_string());
}

/// The byte codec, slowly (a tokenizer on a huge prompt).
struct SlowCodec(Duration);
impl calla_server::TextCodec for SlowCodec {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        std::thread::sleep(self.0);
        ByteCodec.encode(text)
    }
    fn decode(&self, ids: &[u32]) -> String {
        ByteCodec.decode(ids)
    }
    fn token_text(&self, id: u32) -> String {
        ByteCodec.token_text(id)
    }
    fn vocab_size(&self) -> usize {
        257
    }
}

/// /health answers within `within` while `busy` runs.
async fn health_stays_up_during(
    addr: std::net::SocketAddr,
    busy: Vec<tokio::task::JoinHandle<Response>>,
) -> Vec<Response> {
    tokio::time::sleep(Duration::from_millis(100)).await;
    for _ in 0..3 {
        let asked = Instant::now();
        let health = tokio::time::timeout(Duration::from_secs(1), get(addr, "/health"))
            .await
            .expect("/health did not answer within 1 s while requests were being prepared");
        assert_eq!(health.status, 200);
        assert!(asked.elapsed() < Duration::from_millis(900));
    }
    let mut out = Vec::new();
    for b in busy {
        out.push(b.await.unwrap());
    }
    out
}

// One async worker: tokenizing on it would stop everything else.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn tokenizing_does_not_stop_the_async_workers() {
    let server = start(Options {
        codec: Some(Arc::new(SlowCodec(Duration::from_millis(1500)))),
        ..Options::default()
    })
    .await;
    let addr = server.addr;
    let busy = (0..2)
        .map(|i| {
            tokio::spawn(async move {
                post(
                    addr,
                    "/v1/completions",
                    &json!({"prompt": format!("p{i}"), "max_tokens": 1}),
                )
                .await
            })
        })
        .collect();
    for r in health_stays_up_during(addr, busy).await {
        assert_eq!(r.status, 200, "{}", r.body);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_over_the_byte_limit_are_refused_before_tokenizing() {
    let server = start(Options {
        // Would take 1000 s to tokenize if it were tried.
        codec: Some(Arc::new(SlowCodec(Duration::from_secs(1000)))),
        config: ServerConfig {
            served_model_name: "test-model".into(),
            max_prompt_bytes: 1 << 20,
            ..ServerConfig::default()
        },
        ..Options::default()
    })
    .await;
    let huge = "x".repeat(3 << 20);
    let started = Instant::now();
    let r = post(server.addr, "/v1/completions", &json!({"prompt": huge})).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    let r = post(server.addr, CHAT, &json!({"messages": user(&huge)})).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "messages");
    let split: Vec<Json> = (0..4)
        .map(|_| json!({"role": "user", "content": "y".repeat(300 << 10)}))
        .collect();
    let r = post(server.addr, CHAT, &json!({"messages": split})).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_runaway_template_is_stopped_and_the_server_keeps_serving() {
    let template = calla_chat::ChatTemplate::new(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}".into(),
        Default::default(),
    )
    .unwrap();
    let server = start(Options {
        template: Some(template),
        ..Options::default()
    })
    .await;
    let addr = server.addr;
    let busy = vec![tokio::spawn(async move {
        post(addr, CHAT, &json!({"messages": user("hi")})).await
    })];
    let replies = health_stays_up_during(addr, busy).await;
    assert_eq!(replies[0].status, 400, "{}", replies[0].body);
    assert!(replies[0].json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("budget")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_chat_template_is_a_400() {
    let template = calla_chat::ChatTemplate::new(String::new(), Default::default()).unwrap();
    let server = start(Options {
        template: Some(template),
        ..Options::default()
    })
    .await;
    let r = post(server.addr, CHAT, &json!({"messages": user("hi")})).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "messages");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loader_panic_is_a_load_failure_not_success() {
    let state = AppState::new(ServerConfig::default());
    let report =
        calla_server::load_in_background(Arc::clone(&state), || panic!("blob range out of bounds"))
            .await;
    let err = calla_server::load_outcome(report).unwrap_err();
    assert!(
        err.to_string()
            .contains("panicked: blob range out of bounds"),
        "{err}"
    );
    assert!(!state.is_ready());
    let report = calla_server::load_in_background(Arc::clone(&state), || {
        anyhow::bail!("config.json: broken")
    })
    .await;
    assert!(calla_server::load_outcome(report).is_err());
    assert!(!state.is_ready());
}

#[test]
fn a_tokenizer_larger_than_the_vocabulary_fails_at_start() {
    // The fixture's tokenizer has 512 tokens; the scripted model 257.
    let dir = repo_root().join("tests/fixtures/models/qwen35moe-causal-perexpert");
    let err = calla_server::start_runtime(
        &dir,
        Box::new(script_backend(64)),
        Default::default(),
        &calla_server::RuntimeOptions::default(),
    )
    .err()
    .expect("a tokenizer larger than the vocabulary must not load");
    assert!(err.to_string().contains("vocab_size 257"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_can_never_fit_the_queue_is_a_400_not_a_429() {
    let server = start(Options {
        max_queue: 2,
        ..Options::default()
    })
    .await;
    let r = post(
        server.addr,
        CHAT,
        &json!({"messages": user("x"), "n": 3, "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "n");
    let r = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": ["a", "b"], "n": 2, "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    // What fits is served.
    let r = post(
        server.addr,
        CHAT,
        &json!({"messages": user("x"), "n": 2, "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn a_queue_of_zero_fails_at_start() {
    let dir = repo_root().join("tests/fixtures/chat");
    let err = calla_server::start_runtime(
        &dir,
        Box::new(script_backend(64)),
        Default::default(),
        &calla_server::RuntimeOptions {
            max_queue: 0,
            ..Default::default()
        },
    )
    .err()
    .expect("--max-queue 0 must not start");
    assert!(err.to_string().contains("--max-queue"), "{err}");
}

/// hyper answers requests it cannot parse itself (400, 414 past its buffer, 505): with a JSON body
/// too, and the connection closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unparsable_requests_get_json_errors_too() {
    let server = start(Options::default()).await;
    let long_target = format!(
        "GET /{} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        "a".repeat(300_000)
    );
    for raw in [
        "GARBAGE\r\n\r\n".to_string(),
        "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n".into(),
        "GET /health HTTP/9.9\r\nHost: 127.0.0.1\r\n\r\n".into(),
        long_target,
    ] {
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        let _ = stream.write_all(raw.as_bytes()).await;
        let out = read_until_closed(&mut stream, Duration::from_secs(5))
            .await
            .expect("answered and closed");
        let status = status_of(&out);
        assert!((400..500).contains(&status) || status == 505, "{out}");
        assert!(body_of(&out)["error"]["message"].is_string(), "{out}");
    }
    // Expect: 100-continue still works (the interim head is not mistaken for an error).
    let body = json!({"messages": user("hi"), "max_tokens": 2}).to_string();
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    let head = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Expect: 100-continue\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut interim = [0u8; 25];
    stream.read_exact(&mut interim).await.unwrap();
    assert!(
        interim.starts_with(b"HTTP/1.1 100"),
        "{:?}",
        String::from_utf8_lossy(&interim)
    );
    stream.write_all(body.as_bytes()).await.unwrap();
    let out = read_until_closed(&mut stream, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(status_of(out.trim_start()), 200, "{out}");
}

/// FIFOs in place of tokenizer.json or chat_template.jinja: an error at start, not a hang.
#[cfg(unix)]
#[test]
fn fifos_in_place_of_the_tokenizer_or_template_do_not_hang() {
    let fixture = repo_root().join("tests/fixtures/models/qwen35moe-causal-perexpert");
    for name in ["tokenizer.json", "chat_template.jinja"] {
        let dir = std::env::temp_dir().join(format!("calla-fifo-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for entry in std::fs::read_dir(&fixture).unwrap() {
            let entry = entry.unwrap();
            if entry.file_name() != name {
                std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
            }
        }
        let made = std::process::Command::new("mkfifo")
            .arg(dir.join(name))
            .status();
        if !made.is_ok_and(|s| s.success()) {
            eprintln!("mkfifo unavailable: skipped");
            return;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let d = dir.clone();
        std::thread::spawn(move || {
            let r = calla_server::start_runtime(
                &d,
                Box::new(script_backend(64)),
                Default::default(),
                &calla_server::RuntimeOptions::default(),
            );
            let _ = tx.send(r.err().map(|e| format!("{e:#}")));
        });
        let err = rx
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("start_runtime hung on a FIFO {name}"));
        let err = err.expect("must not start");
        assert!(err.contains("regular file"), "{name}: {err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
