//! /v1/chat/completions on the scripted backend: replies, SSE invariants, reasoning, tool calls,
//! stop strings, n, logprobs, usage and the prefix cache.

mod common;

use common::*;
use serde_json::{json, Value as Json};

const CHAT: &str = "/v1/chat/completions";

fn weather_tools() -> Json {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn non_streamed_reply_splits_reasoning_from_content() {
    let server = start(Options::default()).await;
    let r = post(
        server.addr,
        CHAT,
        &json!({"model": "test-model", "messages": user("hello")}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let body = r.json();
    assert_eq!(body["object"], "chat.completion");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["model"], "test-model");
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], "You said: hello");
    assert_eq!(
        choice["message"]["reasoning_content"],
        "Let me think about hello."
    );
    assert_eq!(choice["message"]["reasoning"], "Let me think about hello.");
    assert_eq!(choice["finish_reason"], "stop");
    let reply = script(&prompt_of(&user("hello"), true));
    let usage = &body["usage"];
    assert_eq!(
        usage["completion_tokens"],
        reply.len() + 1,
        "the reply's bytes and EOS"
    );
    assert_eq!(
        usage["prompt_tokens"],
        prompt_of(&user("hello"), true).len()
    );
    assert_eq!(
        usage["total_tokens"],
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);

    // thinking off through chat_template_kwargs: no reasoning at all
    let r = post(
        server.addr,
        CHAT,
        &json!({"messages": user("hi"),
        "chat_template_kwargs": {"enable_thinking": false}}),
    )
    .await;
    let message = &r.json()["choices"][0]["message"];
    assert_eq!(message["content"], "You said: hi");
    assert!(message.get("reasoning_content").is_none());
}

/// The Qwen template's render of `messages` (what the scripted backend sees).
fn prompt_of(messages: &Json, thinking: bool) -> String {
    let template = qwen_template();
    let messages = calla_chat::prepare_messages(messages.as_array().unwrap()).unwrap();
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("enable_thinking".into(), json!(thinking));
    template
        .render(&calla_chat::RenderInput {
            messages: &messages,
            tools: None,
            add_generation_prompt: true,
            kwargs: Some(&kwargs),
        })
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streamed_reply_follows_the_openai_chunk_contract() {
    let server = start(Options::default()).await;
    let body = json!({"messages": user("stream me"), "stream": true,
                      "stream_options": {"include_usage": true}});
    let stream = open_stream(server.addr, CHAT, &body).await;
    assert_eq!(stream.status, 200);
    let chunks = stream.collect_json().await;
    let id = chunks[0]["id"].as_str().unwrap().to_string();
    assert!(chunks.iter().all(|c| c["id"] == id.as_str()), "one id");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    // role first, and only there
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks[1..].iter().all(|c| c["choices"]
        .as_array()
        .unwrap()
        .iter()
        .all(|ch| ch["delta"].get("role").is_none())));
    // the finish chunk: empty delta, then the usage chunk with no choices
    let n = chunks.len();
    let finish = &chunks[n - 2]["choices"][0];
    assert_eq!(finish["delta"], json!({}));
    assert_eq!(finish["finish_reason"], "stop");
    assert_eq!(chunks[n - 1]["choices"], json!([]));
    assert!(
        chunks[n - 1]["usage"]["completion_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert!(chunks[..n - 1].iter().all(|c| c["usage"].is_null()));
    assert!(chunks[..n - 2]
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));
    // the same text as the non-streamed reply
    assert_eq!(delta_text(&chunks, 0, "content"), "You said: stream me");
    assert_eq!(
        delta_text(&chunks, 0, "reasoning_content"),
        "Let me think about stream me."
    );
    assert_eq!(
        delta_text(&chunks, 0, "reasoning"),
        "Let me think about stream me."
    );
    // without include_usage there is no usage anywhere
    let chunks = open_stream(
        server.addr,
        CHAT,
        &json!({"messages": user("x"), "stream": true}),
    )
    .await
    .collect_json()
    .await;
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tool_calls_are_parsed_typed_and_streamed_name_first() {
    let server = start(Options::default()).await;
    let body = json!({"messages": user("weather in Paris?"), "tools": weather_tools(),
                      "chat_template_kwargs": {"enable_thinking": false}});
    let r = post(server.addr, CHAT, &body).await.json();
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], "Checking.");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Json = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(
        args,
        json!({"city": "Paris", "days": 3}),
        "days typed as an integer"
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = open_stream(server.addr, CHAT, &streamed)
        .await
        .collect_json()
        .await;
    let calls: Vec<&Json> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
        .collect();
    let first = &calls[0][0];
    assert_eq!(first["index"], 0);
    assert_eq!(first["function"]["name"], "get_weather");
    assert_eq!(first["function"]["arguments"], "");
    assert!(first["id"].as_str().unwrap().starts_with("call_"));
    let fragments: String = calls[1..]
        .iter()
        .map(|c| {
            assert!(c[0]["function"].get("name").is_none());
            c[0]["function"]["arguments"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(fragments, call["function"]["arguments"].as_str().unwrap());
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );

    // tool_choice none: no tools in the prompt, nothing parsed
    let mut none = body.clone();
    none["tool_choice"] = json!("none");
    let r = post(server.addr, CHAT, &none).await.json();
    assert_eq!(
        r["choices"][0]["message"]["content"],
        "You said: weather in Paris?"
    );
    assert!(r["choices"][0]["message"].get("tool_calls").is_none());

    // a named function: the grammar skips the model's preamble and keeps the call
    let mut named = body.clone();
    named["tool_choice"] = json!({"type": "function", "function": {"name": "get_weather"}});
    let r = post(server.addr, CHAT, &named).await.json();
    let call = &r["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather");
    assert_eq!(
        call["function"]["arguments"],
        r#"{"city": "Paris", "days": 3}"#
    );
    assert_eq!(r["choices"][0]["finish_reason"], "tool_calls");
    assert!(r["choices"][0]["message"]["content"].is_null());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tool_results_round_trip_through_the_template() {
    let server = start(Options::default()).await;
    let messages = json!([
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "tomorrow?"}]},
    ]);
    let r = post(
        server.addr,
        CHAT,
        &json!({"messages": messages, "tools": weather_tools(),
        "chat_template_kwargs": {"enable_thinking": false}}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["choices"][0]["message"]["content"],
        "You said: and tomorrow?"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stop_strings_max_tokens_n_and_logprobs() {
    let server = start(Options::default()).await;
    let thinking_off = json!({"enable_thinking": false});
    // "You said: hello world": the stop string spans many byte tokens and is not emitted
    let r = post(
        server.addr,
        CHAT,
        &json!({"messages": user("hello world"), "stop": ["o w", "zzz"],
        "chat_template_kwargs": thinking_off}),
    )
    .await
    .json();
    assert_eq!(r["choices"][0]["message"]["content"], "You said: hell");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    let chunks = open_stream(
        server.addr,
        CHAT,
        &json!({"messages": user("hello world"), "stop": "o w",
        "stream": true, "chat_template_kwargs": thinking_off}),
    )
    .await
    .collect_json()
    .await;
    assert_eq!(delta_text(&chunks, 0, "content"), "You said: hell");

    let r = post(
        server.addr,
        CHAT,
        &json!({"messages": user("hello"), "max_tokens": 5,
        "chat_template_kwargs": thinking_off}),
    )
    .await
    .json();
    assert_eq!(r["choices"][0]["message"]["content"], "You s");
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["usage"]["completion_tokens"], 5);
    let r = post(
        server.addr,
        CHAT,
        &json!({"messages": user("hello"), "max_completion_tokens": 3,
        "chat_template_kwargs": thinking_off}),
    )
    .await
    .json();
    assert_eq!(r["choices"][0]["message"]["content"], "You");

    let r = post(
        server.addr,
        CHAT,
        &json!({"messages": user("two"), "n": 2,
        "chat_template_kwargs": thinking_off}),
    )
    .await
    .json();
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(
        (choices[0]["index"].as_u64(), choices[1]["index"].as_u64()),
        (Some(0), Some(1))
    );
    assert!(choices
        .iter()
        .all(|c| c["message"]["content"] == "You said: two"));
    assert_eq!(
        r["usage"]["completion_tokens"],
        2 * ("You said: two".len() + 1)
    );

    let r = post(
        server.addr,
        CHAT,
        &json!({"messages": user("lp"), "logprobs": true, "top_logprobs": 2,
        "max_tokens": 4, "chat_template_kwargs": thinking_off}),
    )
    .await
    .json();
    let content = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let tokens: String = content
        .iter()
        .map(|t| t["token"].as_str().unwrap())
        .collect();
    assert_eq!(tokens, "You ");
    assert!(content
        .iter()
        .all(|t| t["top_logprobs"].as_array().unwrap().len() == 2));
    assert!(content
        .iter()
        .all(|t| t["logprob"].as_f64().unwrap() <= 0.0));
    assert_eq!(content[0]["bytes"], json!([89]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn next_turn_reuses_the_saved_prompt_state() {
    let server = start(Options::default()).await;
    let turn1 = json!([{"role": "user", "content": "first"}]);
    let off = json!({"enable_thinking": false});
    let r1 = post(
        server.addr,
        CHAT,
        &json!({"messages": turn1, "chat_template_kwargs": off}),
    )
    .await
    .json();
    assert_eq!(r1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let reply = r1["choices"][0]["message"]["content"].clone();
    let turn2 = json!([{"role": "user", "content": "first"}, {"role": "assistant", "content": reply},
                       {"role": "user", "content": "second"}]);
    let r2 = post(
        server.addr,
        CHAT,
        &json!({"messages": turn2, "chat_template_kwargs": off}),
    )
    .await
    .json();
    let cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // the first conversation up to its generation prompt, which the second turn renders differently
    let first_prompt = r1["usage"]["prompt_tokens"].as_u64().unwrap();
    let generation_prompt = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
    assert_eq!(cached, first_prompt - generation_prompt.len() as u64);
    assert_eq!(r2["choices"][0]["message"]["content"], "You said: second");
    let metrics = get(server.addr, "/metrics").await.body;
    assert!(
        metrics.contains("calla:prefix_cache_hits_total{model_name=\"test-model\"} 1"),
        "{metrics}"
    );
}
