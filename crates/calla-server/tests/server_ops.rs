//! Operations on the scripted backend: OpenAI-shaped errors (and the server keeps serving), auth,
//! health while loading, metrics, the bounded queue, client disconnects, concurrent streams.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use calla_server::ServerConfig;
use common::*;
use serde_json::{json, Value as Json};
use tokio::io::AsyncWriteExt;

const CHAT: &str = "/v1/chat/completions";

fn assert_openai_error(r: &Response, status: u16, param: Option<&str>, code: Option<&str>) {
    assert_eq!(r.status, status, "{}", r.body);
    let body = r.json();
    let error = &body["error"];
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(error["type"].is_string(), "{body}");
    assert!(
        error.get("param").is_some() && error.get("code").is_some(),
        "{body}"
    );
    if let Some(param) = param {
        assert_eq!(error["param"], param, "{body}");
    }
    if let Some(code) = code {
        assert_eq!(error["code"], code, "{body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let server = start(Options {
        max_context: 200,
        config: ServerConfig {
            served_model_name: "test-model".into(),
            max_body_bytes: 4096,
            ..ServerConfig::default()
        },
        ..Options::default()
    })
    .await;
    let addr = server.addr;
    let malformed = request(addr, "POST", CHAT, &[], b"{\"messages\": [").await;
    assert_openai_error(&malformed, 400, None, None);
    let not_object = request(addr, "POST", CHAT, &[], b"[1, 2]").await;
    assert_openai_error(&not_object, 400, None, None);
    let cases: Vec<(Json, u16, Option<&str>, Option<&str>)> = vec![
        (json!({}), 400, None, None),
        (json!({"messages": "hello"}), 400, Some("messages"), None),
        (json!({"messages": []}), 400, Some("messages"), None),
        (json!({"messages": [123]}), 400, Some("messages[0]"), None),
        (
            json!({"messages": [{}]}),
            400,
            Some("messages[0].role"),
            None,
        ),
        (
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            400,
            Some("messages[0].role"),
            None,
        ),
        (
            json!({"messages": [{"role": "user", "content": {"a": 1}}]}),
            400,
            Some("messages[0].content"),
            None,
        ),
        (
            json!({"messages": user("x"), "temperature": "warm"}),
            400,
            Some("temperature"),
            None,
        ),
        (
            json!({"messages": user("x"), "max_tokens": -1}),
            400,
            Some("max_tokens"),
            None,
        ),
        (
            json!({"messages": user("x"), "stream": "yes"}),
            400,
            Some("stream"),
            None,
        ),
        (json!({"messages": user("x"), "n": 0}), 400, Some("n"), None),
        (
            json!({"messages": user("x"), "tool_choice": "required"}),
            400,
            Some("tool_choice"),
            None,
        ),
        (
            json!({"messages": user("x"), "top_logprobs": 3}),
            400,
            Some("top_logprobs"),
            None,
        ),
        (
            json!({"messages": [{"role": "assistant", "content": "no user query"}]}),
            400,
            Some("messages"),
            None,
        ),
        (
            json!({"messages": user(&"y".repeat(300))}),
            400,
            Some("messages"),
            Some("context_length_exceeded"),
        ),
        (
            json!({"model": "gpt-4", "messages": user("x")}),
            404,
            Some("model"),
            Some("model_not_found"),
        ),
    ];
    for (body, status, param, code) in cases {
        let r = post(addr, CHAT, &body).await;
        assert_openai_error(&r, status, param, code);
        // a streaming request is validated before the 200 header too
        if let Json::Object(mut streamed) = body.clone() {
            if streamed.contains_key("stream") {
                continue;
            }
            streamed.insert("stream".into(), json!(true));
            let r = post(addr, CHAT, &Json::Object(streamed)).await;
            assert_eq!(r.status, status, "{}", r.body);
        }
    }
    let too_large = json!({"messages": user(&"z".repeat(5000))});
    assert_openai_error(&post(addr, CHAT, &too_large).await, 413, None, None);
    assert_openai_error(&get(addr, "/v1/nothing").await, 404, None, None);
    assert_openai_error(&get(addr, CHAT).await, 405, None, None);
    assert_openai_error(
        &post(addr, "/v1/completions", &json!({"prompt": ""})).await,
        400,
        Some("prompt"),
        None,
    );
    assert_openai_error(
        &post(addr, "/v1/completions", &json!({"prompt": [1, 999]})).await,
        400,
        Some("prompt"),
        None,
    );
    assert_openai_error(
        &post(addr, "/v1/completions", &json!({"prompt": {"x": 1}})).await,
        400,
        Some("prompt"),
        None,
    );
    assert_openai_error(
        &post(addr, "/v1/completions", &json!({"max_tokens": 3})).await,
        400,
        Some("prompt"),
        None,
    );
    assert_openai_error(
        &post(addr, "/v1/completions", &json!({"prompt": "q".repeat(250)})).await,
        400,
        Some("prompt"),
        Some("context_length_exceeded"),
    );
    // still serving
    let ok = post(addr, CHAT, &json!({"messages": user("still here")})).await;
    assert_eq!(ok.status, 200);
    assert_eq!(
        ok.json()["choices"][0]["message"]["content"],
        "You said: still here"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn api_key_guards_the_api_but_not_health_or_metrics() {
    let server = start(Options {
        config: ServerConfig {
            served_model_name: "test-model".into(),
            api_key: Some("sk-test-123".into()),
            ..ServerConfig::default()
        },
        ..Options::default()
    })
    .await;
    let body = json!({"messages": user("hi")}).to_string();
    let body = body.as_bytes();
    let addr = server.addr;
    assert_openai_error(
        &request(addr, "POST", CHAT, &[], body).await,
        401,
        None,
        Some("invalid_api_key"),
    );
    let wrong = request(
        addr,
        "POST",
        CHAT,
        &[("Authorization", "Bearer sk-test-124")],
        body,
    )
    .await;
    assert_openai_error(&wrong, 401, None, Some("invalid_api_key"));
    assert_openai_error(
        &request(addr, "GET", "/v1/models", &[], b"").await,
        401,
        None,
        None,
    );
    let bearer = request(
        addr,
        "POST",
        CHAT,
        &[("Authorization", "Bearer sk-test-123")],
        body,
    )
    .await;
    assert_eq!(bearer.status, 200, "{}", bearer.body);
    let x_api_key = request(
        addr,
        "GET",
        "/v1/models",
        &[("X-Api-Key", "sk-test-123")],
        b"",
    )
    .await;
    assert_eq!(x_api_key.status, 200);
    assert_eq!(get(addr, "/health").await.status, 200);
    assert_eq!(get(addr, "/metrics").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn health_is_503_while_loading_then_200() {
    let mut server = start(Options {
        ready: false,
        ..Options::default()
    })
    .await;
    let r = get(server.addr, "/health").await;
    assert_openai_error(&r, 503, None, Some("model_loading"));
    assert_openai_error(
        &post(server.addr, CHAT, &json!({"messages": user("x")})).await,
        503,
        None,
        None,
    );
    server.make_ready();
    let r = get(server.addr, "/health").await;
    assert_eq!((r.status, r.json()), (200, json!({"status": "ok"})));
    let models = get(server.addr, "/v1/models").await.json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "test-model");
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(models["data"][0]["max_model_len"], 4096);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_count_requests_tokens_and_latencies() {
    let server = start(Options::default()).await;
    for i in 0..3 {
        let r = post(
            server.addr,
            CHAT,
            &json!({"messages": user(&format!("m{i}")), "max_tokens": 4}),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    let text = get(server.addr, "/metrics").await.body;
    let value = |name: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(&format!("{name}{{")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
    };
    assert_eq!(value("calla:generation_tokens_total"), 12.0);
    assert!(value("calla:prompt_tokens_total") > 30.0);
    assert_eq!(value("calla:request_success_total"), 3.0);
    assert_eq!(value("calla:time_to_first_token_seconds_count"), 3.0);
    assert_eq!(value("calla:inter_token_latency_seconds_count"), 9.0);
    assert_eq!(value("calla:e2e_request_latency_seconds_count"), 3.0);
    assert_eq!(value("calla:num_requests_running"), 0.0);
    assert_eq!(value("calla:num_requests_waiting"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn full_queue_answers_429() {
    let server = start(Options {
        step_delay: Duration::from_millis(5),
        max_queue: 1,
        ..Options::default()
    })
    .await;
    let addr = server.addr;
    // one running, one waiting
    let long =
        json!({"messages": user("long 400"), "chat_template_kwargs": {"enable_thinking": false}});
    let running = tokio::spawn(async move { post(addr, CHAT, &long).await });
    while server.state.runtime().unwrap().scheduler.running() == 0 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let waiting = tokio::spawn(async move {
        post(addr, CHAT, &json!({"messages": user("w"), "max_tokens": 2})).await
    });
    while server.state.runtime().unwrap().scheduler.waiting() == 0 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let refused = post(addr, CHAT, &json!({"messages": user("x")})).await;
    assert_openai_error(&refused, 429, None, Some("queue_full"));
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(running.await.unwrap().status, 200);
    assert_eq!(waiting.await.unwrap().status, 200);
    assert_eq!(
        post(addr, CHAT, &json!({"messages": user("x"), "max_tokens": 2}))
            .await
            .status,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_disconnects_mid_stream_stops_its_generation() {
    let step = Duration::from_millis(10);
    let server = start(Options {
        step_delay: step,
        ..Options::default()
    })
    .await;
    let addr = server.addr;
    let runtime = server.state.runtime().unwrap();
    let long = json!({"messages": user("long 5000"), "stream": true,
                      "chat_template_kwargs": {"enable_thinking": false}});
    let mut stream = open_stream(addr, CHAT, &long).await;
    for _ in 0..5 {
        stream.next_data().await.expect("a chunk");
    }
    // another client's request is queued behind the long one and must still complete
    let other = tokio::spawn(async move {
        post(
            addr,
            CHAT,
            &json!({"messages": user("after"), "max_tokens": 3}),
        )
        .await
    });
    drop(stream); // the client goes away
    let dropped_at = Instant::now();
    while runtime.scheduler.running() == 1 && server.steps.load(Ordering::SeqCst) > 0 {
        let r = other.is_finished();
        if r || dropped_at.elapsed() > Duration::from_secs(5) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let other = other.await.unwrap();
    assert_eq!(other.status, 200);
    assert_eq!(other.json()["choices"][0]["finish_reason"], "length");
    let steps = server.steps.load(Ordering::SeqCst);
    // 5000 bytes were asked for; the generation ended soon after the disconnect
    assert!(
        steps < 500,
        "{steps} steps: the abandoned generation kept running"
    );
    assert!(dropped_at.elapsed() < Duration::from_secs(3));
    let metrics = get(addr, "/metrics").await.body;
    assert!(
        metrics.contains("calla:request_cancelled_total{model_name=\"test-model\"} 1"),
        "{metrics}"
    );
    assert_eq!(runtime.scheduler.running() + runtime.scheduler.waiting(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_non_streaming_client_that_disconnects_is_cancelled_too() {
    let server = start(Options {
        step_delay: Duration::from_millis(5),
        ..Options::default()
    })
    .await;
    let runtime = server.state.runtime().unwrap();
    let body =
        json!({"messages": user("long 5000"), "chat_template_kwargs": {"enable_thinking": false}})
            .to_string();
    let mut socket = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let head = format!(
        "POST {CHAT} HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    socket.write_all(head.as_bytes()).await.unwrap();
    socket.write_all(body.as_bytes()).await.unwrap();
    while runtime.scheduler.running() == 0 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(socket);
    let dropped_at = Instant::now();
    while runtime.scheduler.running() == 1 && dropped_at.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(
        dropped_at.elapsed() < Duration::from_secs(2),
        "generation went on after the disconnect"
    );
    assert!(server.steps.load(Ordering::SeqCst) < 1000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_concurrent_streams_each_get_their_own_tokens() {
    let server = start(Options::default()).await;
    let addr = server.addr;
    let clients: Vec<_> = (0..32)
        .map(|i| {
            tokio::spawn(async move {
                let body = json!({"messages": user(&format!("client {i}")), "stream": true,
                                  "stream_options": {"include_usage": true}});
                let chunks = open_stream(addr, CHAT, &body).await.collect_json().await;
                (i, chunks)
            })
        })
        .collect();
    let mut ids = std::collections::HashSet::new();
    for client in clients {
        let (i, chunks) = tokio::time::timeout(Duration::from_secs(60), client)
            .await
            .unwrap()
            .unwrap();
        let id = chunks[0]["id"].as_str().unwrap().to_string();
        assert!(
            chunks.iter().all(|c| c["id"] == id.as_str()),
            "one id per stream"
        );
        assert!(ids.insert(id), "ids are unique across streams");
        assert_eq!(
            delta_text(&chunks, 0, "content"),
            format!("You said: client {i}")
        );
        assert_eq!(
            delta_text(&chunks, 0, "reasoning_content"),
            format!("Let me think about client {i}.")
        );
        let usage = &chunks.last().unwrap()["usage"];
        assert!(usage["completion_tokens"].as_u64().unwrap() > 10);
    }
}
