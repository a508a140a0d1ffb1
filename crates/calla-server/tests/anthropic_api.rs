//! /v1/messages (Anthropic Messages) on the scripted backend: content blocks, thinking, tools,
//! stop sequences, the streaming event sequence, count_tokens, and Anthropic-shaped errors.

mod common;

use common::*;
use serde_json::{json, Value as Json};

const MESSAGES: &str = "/v1/messages";

fn tools() -> Json {
    json!([{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}])
}

/// (event name, data) pairs of an SSE body.
fn events(body: &str) -> Vec<(String, Json)> {
    let mut out = Vec::new();
    let mut name = String::new();
    for line in body.lines() {
        if let Some(n) = line.strip_prefix("event: ") {
            name = n.to_string();
        } else if let Some(d) = line.strip_prefix("data: ") {
            out.push((
                name.clone(),
                serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")),
            ));
        }
    }
    out
}

fn assert_anthropic_error(r: &Response, status: u16, kind: &str) {
    assert_eq!(r.status, status, "{}", r.body);
    let e = r.json();
    assert_eq!(e["type"], "error", "{e}");
    assert_eq!(e["error"]["type"], kind, "{e}");
    assert!(e["error"]["message"]
        .as_str()
        .is_some_and(|m| !m.is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_with_system_thinking_and_stop_sequences() {
    let server = start(Options::default()).await;
    let body = json!({"model": "test-model", "max_tokens": 100, "system": "Be brief.",
        "messages": [{"role": "user", "content": "hi"}]});
    let r = post(server.addr, MESSAGES, &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let m = r.json();
    assert_eq!(m["type"], "message");
    assert_eq!(m["role"], "assistant");
    assert!(m["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(
        m["content"],
        json!([{"type": "text", "text": "You said: hi"}])
    );
    assert_eq!(m["stop_reason"], "end_turn");
    assert_eq!(m["usage"]["output_tokens"], "You said: hi".len() + 1);
    assert!(m["usage"]["input_tokens"].as_u64().unwrap() > 0);

    // thinking enabled: a thinking block first
    let mut thinking = body.clone();
    thinking["thinking"] = json!({"type": "enabled", "budget_tokens": 1024});
    let m = post(server.addr, MESSAGES, &thinking).await.json();
    assert_eq!(m["content"][0]["type"], "thinking", "{m}");
    assert_eq!(m["content"][0]["thinking"], "Let me think about hi.");
    assert_eq!(
        m["content"][1],
        json!({"type": "text", "text": "You said: hi"})
    );

    // a stop sequence
    let mut stop = body.clone();
    stop["stop_sequences"] = json!(["said"]);
    let m = post(server.addr, MESSAGES, &stop).await.json();
    assert_eq!(m["content"][0]["text"], "You ");
    assert_eq!(m["stop_reason"], "stop_sequence");
    assert_eq!(m["stop_sequence"], "said");

    // max_tokens
    let mut short = body.clone();
    short["max_tokens"] = json!(3);
    let m = post(server.addr, MESSAGES, &short).await.json();
    assert_eq!(m["stop_reason"], "max_tokens");
    assert_eq!(m["content"][0]["text"], "You");

    // the base URL without /v1 works too
    let r = post(server.addr, "/messages", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tool_use_and_tool_result_round_trip() {
    let server = start(Options::default()).await;
    let body = json!({"max_tokens": 300, "tools": tools(),
        "messages": [{"role": "user", "content": "weather in Paris?"}]});
    let m = post(server.addr, MESSAGES, &body).await.json();
    assert_eq!(m["stop_reason"], "tool_use", "{m}");
    let blocks = m["content"].as_array().unwrap();
    assert_eq!(blocks[0], json!({"type": "text", "text": "Checking."}));
    assert_eq!(blocks[1]["type"], "tool_use");
    assert_eq!(blocks[1]["name"], "get_weather");
    assert_eq!(blocks[1]["input"], json!({"city": "Paris", "days": 3}));
    let id = blocks[1]["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("toolu_"));

    // the result goes back as a tool_result block
    let follow = json!({"max_tokens": 300, "tools": tools(), "messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": blocks},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": id, "content": "sunny"},
                                     {"type": "text", "text": "and now?"}]}]});
    let r = post(server.addr, MESSAGES, &follow).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["content"][0]["text"], "You said: and now?");

    // tool_choice any: enforced, parallel off
    let mut any = body.clone();
    any["tool_choice"] = json!({"type": "any", "disable_parallel_tool_use": true});
    any["messages"] = json!([{"role": "user", "content": "weather twice"}]);
    let m = post(server.addr, MESSAGES, &any).await.json();
    let uses: Vec<&Json> = m["content"]
        .as_array()
        .unwrap_or_else(|| panic!("no content: {m}"))
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .collect();
    assert_eq!(uses.len(), 1, "{m}");
    assert_eq!(uses[0]["input"], json!({"city": "Paris", "days": 3}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streaming_follows_anthropics_event_sequence() {
    let server = start(Options::default()).await;
    let body = json!({"max_tokens": 300, "stream": true, "tools": tools(),
        "thinking": {"type": "enabled", "budget_tokens": 100},
        "messages": [{"role": "user", "content": "weather in Paris?"}]});
    let r = post(server.addr, MESSAGES, &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    assert!(!r.body.contains("[DONE]"));
    let events = events(&r.body);
    for (name, data) in &events {
        assert_eq!(
            name,
            data["type"].as_str().unwrap(),
            "the event name is the data's type"
        );
    }
    let kinds: Vec<&str> = events
        .iter()
        .map(|(n, _)| n.as_str())
        .filter(|n| *n != "ping")
        .collect();
    assert_eq!(kinds.first(), Some(&"message_start"));
    assert_eq!(&kinds[kinds.len() - 2..], ["message_delta", "message_stop"]);
    // blocks: thinking, text, tool_use, each start → deltas → stop with increasing indices
    let starts: Vec<&Json> = events
        .iter()
        .filter(|(n, _)| n == "content_block_start")
        .map(|(_, d)| d)
        .collect();
    let types: Vec<&str> = starts
        .iter()
        .map(|d| d["content_block"]["type"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["thinking", "text", "tool_use"]);
    let mut open: Option<u64> = None;
    let mut text = String::new();
    let mut json_args = String::new();
    for (name, d) in &events {
        match name.as_str() {
            "content_block_start" => {
                assert!(open.is_none());
                open = d["index"].as_u64();
            }
            "content_block_delta" => {
                assert_eq!(d["index"].as_u64(), open);
                match d["delta"]["type"].as_str().unwrap() {
                    "text_delta" => text.push_str(d["delta"]["text"].as_str().unwrap()),
                    "input_json_delta" => {
                        json_args.push_str(d["delta"]["partial_json"].as_str().unwrap())
                    }
                    "thinking_delta" => {}
                    other => panic!("{other}"),
                }
            }
            "content_block_stop" => {
                assert_eq!(d["index"].as_u64(), open);
                open = None;
            }
            _ => {}
        }
    }
    assert_eq!(text, "Checking.");
    assert_eq!(
        serde_json::from_str::<Json>(&json_args).unwrap(),
        json!({"city": "Paris", "days": 3})
    );
    let delta = &events.iter().find(|(n, _)| n == "message_delta").unwrap().1;
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");
    assert!(delta["usage"]["output_tokens"].as_u64().unwrap() > 0);
    assert_eq!(events[0].1["message"]["content"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn count_tokens_and_errors_in_anthropic_shape() {
    let server = start(Options::default()).await;
    let body = json!({"model": "test-model", "messages": [{"role": "user", "content": "hi"}]});
    let r = post(server.addr, "/v1/messages/count_tokens", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let n = r.json()["input_tokens"].as_u64().unwrap();
    let mut full = body.clone();
    full["max_tokens"] = json!(10);
    let m = post(server.addr, MESSAGES, &full).await.json();
    assert_eq!(m["usage"]["input_tokens"].as_u64().unwrap(), n);

    // max_tokens is required; bad blocks, roles, models and JSON are 400/404 in Anthropic's shape
    assert_anthropic_error(
        &post(server.addr, MESSAGES, &body).await,
        400,
        "invalid_request_error",
    );
    let image = json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]});
    assert_anthropic_error(
        &post(server.addr, MESSAGES, &image).await,
        400,
        "invalid_request_error",
    );
    let role = json!({"max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]});
    assert_anthropic_error(
        &post(server.addr, MESSAGES, &role).await,
        400,
        "invalid_request_error",
    );
    let model =
        json!({"model": "other", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]});
    assert_anthropic_error(
        &post(server.addr, MESSAGES, &model).await,
        404,
        "not_found_error",
    );
    let r = request(server.addr, "POST", MESSAGES, &[], b"{not json").await;
    assert_anthropic_error(&r, 400, "invalid_request_error");
    let r = request(server.addr, "GET", MESSAGES, &[], b"").await;
    assert_anthropic_error(&r, 405, "invalid_request_error");
    let r = post(server.addr, "/v1/messages/nope", &body).await;
    assert_anthropic_error(&r, 404, "not_found_error");
    // OpenAI routes keep OpenAI's shape
    let r = post(server.addr, "/v1/chat/completions", &json!({"messages": 5})).await;
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"].is_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn x_api_key_authenticates_and_failures_are_anthropic_shaped() {
    let mut opts = Options::default();
    opts.config.api_key = Some("sk-test".into());
    let server = start(opts).await;
    let body = json!({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]});
    let bytes = body.to_string();
    let r = request(server.addr, "POST", MESSAGES, &[], bytes.as_bytes()).await;
    assert_anthropic_error(&r, 401, "authentication_error");
    let r = request(
        server.addr,
        "POST",
        MESSAGES,
        &[("x-api-key", "wrong")],
        bytes.as_bytes(),
    )
    .await;
    assert_anthropic_error(&r, 401, "authentication_error");
    let r = request(
        server.addr,
        "POST",
        MESSAGES,
        &[
            ("x-api-key", "sk-test"),
            ("anthropic-version", "2023-06-01"),
        ],
        bytes.as_bytes(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
}
