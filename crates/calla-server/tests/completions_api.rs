//! /v1/completions on the scripted backend: every prompt form, echo, logprobs, streaming, n.

mod common;

use common::*;
use serde_json::{json, Value as Json};

const COMPLETIONS: &str = "/v1/completions";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prompt_forms_and_default_max_tokens() {
    let server = start(Options::default()).await;
    let addr = server.addr;
    // the scripted reply to a raw prompt of L bytes is " continued(L)"
    let r = post(
        addr,
        COMPLETIONS,
        &json!({"model": "test-model", "prompt": "abc", "max_tokens": 50}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let body = r.json();
    assert_eq!(body["object"], "text_completion");
    assert!(body["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(body["choices"][0]["text"], " continued(3)");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["usage"]["prompt_tokens"], 3);
    assert_eq!(
        body["usage"]["completion_tokens"],
        " continued(3)".len() + 1
    );

    // default max_tokens is 16
    let r = post(addr, COMPLETIONS, &json!({"prompt": "long 40"}))
        .await
        .json();
    assert_eq!(r["choices"][0]["text"], "a".repeat(16));
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["usage"]["completion_tokens"], 16);

    let r = post(
        addr,
        COMPLETIONS,
        &json!({"prompt": ["ab", "abcd"], "max_tokens": 50}),
    )
    .await
    .json();
    let texts: Vec<&str> = r["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts, [" continued(2)", " continued(4)"]);
    assert_eq!(r["usage"]["prompt_tokens"], 6);

    let r = post(
        addr,
        COMPLETIONS,
        &json!({"prompt": [104, 105], "max_tokens": 50}),
    )
    .await
    .json();
    assert_eq!(r["choices"][0]["text"], " continued(2)");
    let r = post(
        addr,
        COMPLETIONS,
        &json!({"prompt": [[104], [104, 105, 106]], "max_tokens": 50, "n": 2}),
    )
    .await
    .json();
    let texts: Vec<&str> = r["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(
        texts,
        [
            " continued(1)",
            " continued(1)",
            " continued(3)",
            " continued(3)"
        ]
    );
    let indices: Vec<u64> = r["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indices, [0, 1, 2, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn echo_stop_logprobs_and_streaming() {
    let server = start(Options::default()).await;
    let addr = server.addr;
    let r = post(
        addr,
        COMPLETIONS,
        &json!({"prompt": "xy", "echo": true, "max_tokens": 50, "stop": "ued"}),
    )
    .await
    .json();
    assert_eq!(r["choices"][0]["text"], "xy contin");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");

    let r = post(
        addr,
        COMPLETIONS,
        &json!({"prompt": "xy", "max_tokens": 3, "logprobs": 2}),
    )
    .await
    .json();
    let lp = &r["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"], json!([" ", "c", "o"]));
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 3);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
    assert_eq!(lp["text_offset"], json!([0, 1, 2]));

    let chunks = open_stream(
        addr,
        COMPLETIONS,
        &json!({"prompt": "xyz", "max_tokens": 50, "stream": true,
        "stream_options": {"include_usage": true}}),
    )
    .await
    .collect_json()
    .await;
    let text: String = chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().cloned().unwrap_or_default())
        .map(|c| c["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, " continued(3)");
    let n = chunks.len();
    assert_eq!(chunks[n - 2]["choices"][0]["finish_reason"], "stop");
    assert_eq!(chunks[n - 1]["choices"], json!([]));
    assert_eq!(chunks[n - 1]["usage"]["prompt_tokens"], 3);
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn echoed_logprobs_count_characters_and_padding_ids_are_accepted() {
    let server = start(Options {
        model_vocab: 300,
        ..Options::default()
    })
    .await;
    // "é" is two byte tokens; the echoed prompt's tokens come first, without log-probabilities
    let r = post(
        server.addr,
        COMPLETIONS,
        &json!({"prompt": "é!", "echo": true, "max_tokens": 3, "logprobs": 1}),
    )
    .await
    .json();
    let c = &r["choices"][0];
    assert_eq!(c["text"], "é! co");
    let lp = &c["logprobs"];
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 3 + 3);
    assert_eq!(lp["token_logprobs"][0], Json::Null);
    assert_eq!(lp["top_logprobs"][2], Json::Null);
    assert!(lp["token_logprobs"][3].is_number());
    // character offsets into the text: é (bytes 0, 1) at 0, ! at 1, then " ", "c", "o"
    assert_eq!(lp["text_offset"], json!([0, 0, 1, 2, 3, 4]));

    // streamed: the echo chunk carries the prompt's tokens
    let chunks = open_stream(
        server.addr,
        COMPLETIONS,
        &json!({"prompt": "ab", "echo": true, "max_tokens": 2, "logprobs": 0, "stream": true}),
    )
    .await
    .collect_json()
    .await;
    assert_eq!(chunks[0]["choices"][0]["text"], "ab");
    assert_eq!(
        chunks[0]["choices"][0]["logprobs"]["text_offset"],
        json!([0, 1])
    );
    let later: Vec<Json> = chunks[1..]
        .iter()
        .filter(|c| !c["choices"][0]["logprobs"].is_null())
        .map(|c| c["choices"][0]["logprobs"]["text_offset"][0].clone())
        .collect();
    assert_eq!(later, [json!(2), json!(3)]);

    // ids past the tokenizer but inside the model's embedding are fine; past it, 400
    let r = post(
        server.addr,
        COMPLETIONS,
        &json!({"prompt": [72, 105, 280], "max_tokens": 2}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = post(
        server.addr,
        COMPLETIONS,
        &json!({"prompt": [72, 300], "max_tokens": 2}),
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "prompt");
}
