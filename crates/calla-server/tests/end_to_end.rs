//! The whole path on the real CPU engine and the tiny fixture checkpoint (random weights: the text
//! means nothing, but every token is checked): tokenizer, template, scheduler, prefix cache, sampler.

mod common;

use std::path::PathBuf;

use calla_cpu::CpuBackend;
use calla_model::load::{load_model, LoadOptions};
use calla_server::{start_runtime, RuntimeOptions, ServerConfig};
use common::*;
use serde_json::{json, Value as Json};

const MODEL: &str = "qwen35moe-causal-perexpert";

fn model_dir() -> PathBuf {
    repo_root().join("tests/fixtures/models").join(MODEL)
}

async fn cpu_server(prefix_cache_bytes: usize) -> TestServer {
    let dir = model_dir();
    let loaded = load_model(&dir, &LoadOptions::default()).expect("fixture loads");
    let backend = CpuBackend::new(loaded.spec, loaded.weights).expect("cpu backend");
    let runtime = start_runtime(
        &dir,
        Box::new(backend),
        loaded.generation,
        &RuntimeOptions {
            max_queue: 16,
            max_context: None,
            prefix_cache_bytes,
        },
    )
    .expect("runtime");
    let config = ServerConfig {
        served_model_name: "demo".into(),
        ..ServerConfig::default()
    };
    serve_runtime(config, runtime, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn greedy_completion_matches_transformers_golden() {
    let golden: Json = serde_json::from_str(
        &std::fs::read_to_string(
            repo_root()
                .join("tests/fixtures/goldens")
                .join(format!("{MODEL}.json")),
        )
        .unwrap(),
    )
    .unwrap();
    let greedy: Vec<u32> = serde_json::from_value(golden["greedy_ids"].clone()).unwrap();
    let server = cpu_server(1 << 24).await;
    let body = json!({"model": "demo", "prompt": golden["prompt_ids"], "max_tokens": greedy.len(),
                      "temperature": 0, "ignore_eos": true, "logprobs": 1});
    let r = post(server.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = r.json();
    let tokenizer = calla_model::tokenizer::Tokenizer::from_dir(&model_dir()).unwrap();
    assert_eq!(r["choices"][0]["text"], tokenizer.decode(&greedy, true));
    assert_eq!(r["usage"]["completion_tokens"], greedy.len());
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    // one log-probability per token, each the text of the golden token
    let tokens: Vec<String> =
        serde_json::from_value(r["choices"][0]["logprobs"]["tokens"].clone()).unwrap();
    let want: Vec<String> = greedy
        .iter()
        .map(|&id| tokenizer.decode(&[id], false))
        .collect();
    assert_eq!(tokens, want);
    // the golden's first-step log-probability of the chosen token
    let first_lp = r["choices"][0]["logprobs"]["token_logprobs"][0]
        .as_f64()
        .unwrap();
    let golden_lp = golden["top_logprobs"][0][0][1].as_f64().unwrap();
    assert!(
        (first_lp - golden_lp).abs() < 1e-3,
        "{first_lp} vs {golden_lp}"
    );
}

fn chat_body(messages: Json, extra: Json) -> Json {
    let mut body =
        json!({"model": "demo", "messages": messages, "max_tokens": 24, "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chat_turns_are_identical_with_and_without_the_prefix_cache() {
    let cached = cpu_server(1 << 26).await;
    let uncached = cpu_server(0).await;
    for kwargs in [json!({"enable_thinking": false}), json!({})] {
        let mut messages = vec![
            json!({"role": "system", "content": "You are a test."}),
            json!({"role": "user", "content": "Hello there, how are you?"}),
        ];
        for turn in 0..3 {
            let body = chat_body(json!(messages), json!({"chat_template_kwargs": kwargs}));
            let a = post(cached.addr, "/v1/chat/completions", &body)
                .await
                .json();
            let b = post(uncached.addr, "/v1/chat/completions", &body)
                .await
                .json();
            assert_eq!(
                a["choices"],
                b["choices"].clone().tap_ids(&a["choices"]),
                "turn {turn} {kwargs}"
            );
            assert_eq!(
                a["usage"]["completion_tokens"],
                b["usage"]["completion_tokens"]
            );
            assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
            let hit = a["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            if turn > 0 {
                assert!(hit > 20, "turn {turn}: only {hit} cached tokens");
            }
            let message = &a["choices"][0]["message"];
            let mut assistant = json!({"role": "assistant", "content": message["content"]});
            if let Some(r) = message.get("reasoning_content") {
                assistant["reasoning_content"] = r.clone();
            }
            messages.push(assistant);
            messages.push(json!({"role": "user", "content": format!("Tell me more ({turn}).")}));
        }
    }
}

/// Tool-call ids are random per reply; compare everything else.
trait TapIds {
    fn tap_ids(self, other: &Json) -> Json;
}
impl TapIds for Json {
    fn tap_ids(mut self, other: &Json) -> Json {
        if let (Some(mine), Some(theirs)) = (self.as_array_mut(), other.as_array()) {
            for (m, t) in mine.iter_mut().zip(theirs) {
                let calls = m.get_mut("message").and_then(|m| m.get_mut("tool_calls"));
                let their_calls = t["message"].get("tool_calls").and_then(Json::as_array);
                if let (Some(Json::Array(calls)), Some(their_calls)) = (calls, their_calls) {
                    for (c, tc) in calls.iter_mut().zip(their_calls) {
                        c["id"] = tc["id"].clone();
                    }
                }
            }
        }
        self
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streamed_and_seeded_sampling_match_the_plain_reply() {
    let server = cpu_server(1 << 24).await;
    let messages = json!([{"role": "user", "content": "Write something."}]);
    let sampled = chat_body(
        messages.clone(),
        json!({"temperature": 1.0, "top_p": 0.9, "seed": 7, "max_tokens": 32}),
    );
    let plain = post(server.addr, "/v1/chat/completions", &sampled)
        .await
        .json();
    let again = post(server.addr, "/v1/chat/completions", &sampled)
        .await
        .json();
    assert_eq!(
        plain["choices"], again["choices"],
        "a seed makes sampling repeatable"
    );
    let mut streamed = sampled.clone();
    streamed["stream"] = json!(true);
    let chunks = open_stream(server.addr, "/v1/chat/completions", &streamed)
        .await
        .collect_json()
        .await;
    let message = &plain["choices"][0]["message"];
    assert_eq!(
        delta_text(&chunks, 0, "content"),
        message["content"].as_str().unwrap_or("")
    );
    assert_eq!(
        delta_text(&chunks, 0, "reasoning_content"),
        message["reasoning_content"].as_str().unwrap_or("")
    );
    let finish = chunks
        .iter()
        .rev()
        .find_map(|c| c["choices"][0]["finish_reason"].as_str())
        .unwrap();
    assert_eq!(finish, plain["choices"][0]["finish_reason"]);

    let mut other_seed = sampled.clone();
    other_seed["seed"] = json!(8);
    let other = post(server.addr, "/v1/chat/completions", &other_seed)
        .await
        .json();
    assert_ne!(
        other["choices"][0]["message"], plain["choices"][0]["message"],
        "another seed, another draw"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn logit_bias_and_stop_strings_reach_the_engine() {
    let server = cpu_server(0).await;
    let tokenizer = calla_model::tokenizer::Tokenizer::from_dir(&model_dir()).unwrap();
    // +100 on one token makes it the only choice at every step
    let body = json!({"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": true,
                      "logit_bias": {"70": 100}});
    let r = post(server.addr, "/v1/completions", &body).await.json();
    assert_eq!(r["choices"][0]["text"], tokenizer.decode(&[70; 6], true));
    // a stop string made of that token's text, twice: generation stops before it
    let piece = tokenizer.decode(&[70], true);
    let mut stopped = body.clone();
    stopped["stop"] = json!(format!("{piece}{piece}"));
    let r = post(server.addr, "/v1/completions", &stopped).await.json();
    assert_eq!(r["choices"][0]["text"], "");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    assert_eq!(r["usage"]["completion_tokens"], 2);
}
