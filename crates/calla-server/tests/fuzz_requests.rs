//! Property test of the request parser (bounded fuzzing, run by `cargo test`): random JSON bodies
//! built from the real field names with values of every type, and random bytes, never give a 5xx,
//! and every refusal is an OpenAI-shaped JSON error (issue 33). PROPTEST_CASES raises the count.

mod common;

use std::sync::OnceLock;

use common::*;
use proptest::prelude::*;
use serde_json::{json, Map, Value as Json};

struct Fixture {
    rt: tokio::runtime::Runtime,
    server: TestServer,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let server = rt.block_on(start(Options {
            max_context: 512,
            ..Options::default()
        }));
        Fixture { rt, server }
    })
}

fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Any JSON value, small.
fn value() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        any::<i64>().prop_map(|v| json!(v)),
        (-3i64..40).prop_map(|v| json!(v)),
        any::<f64>().prop_map(|v| json!(v)),
        "[a-z<>|{}\\\\\"\u{e9}\u{1F600} ]{0,12}".prop_map(Json::String),
        prop_oneof![
            Just("user"),
            Just("assistant"),
            Just("system"),
            Just("tool"),
            Just("function"),
            Just("auto"),
            Just("none"),
            Just("required"),
            Just("text"),
            Just("test-model")
        ]
        .prop_map(|s| json!(s)),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Json::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("role"),
                    Just("content"),
                    Just("type"),
                    Just("text"),
                    Just("name"),
                    Just("function"),
                    Just("arguments"),
                    Just("tool_calls"),
                    Just("id"),
                    Just("image_url"),
                    Just("parameters"),
                    Just("reasoning_content")
                ]
                .prop_map(String::from),
                inner,
                0..4,
            )
            .prop_map(|m| Json::Object(m.into_iter().collect())),
        ]
    })
}

const FIELDS: [&str; 24] = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "echo",
];

fn body() -> impl Strategy<Value = Json> {
    let user = json!([{"role": "user", "content": "hi"}]);
    (
        prop::collection::vec((0..FIELDS.len(), value()), 0..6),
        any::<bool>(),
    )
        .prop_map(move |(fields, with_messages)| {
            let mut body = Map::new();
            if with_messages {
                body.insert("messages".into(), user.clone());
                body.insert("prompt".into(), json!("hi"));
                body.insert("max_tokens".into(), json!(4));
            }
            for (i, v) in fields {
                body.insert(FIELDS[i].into(), v);
            }
            Json::Object(body)
        })
}

fn check(path: &str, status: u16, text: &str) -> Result<(), TestCaseError> {
    prop_assert!(status < 500, "{path}: {status} {text}");
    if status >= 400 {
        let v: Json = serde_json::from_str(text)
            .map_err(|e| TestCaseError::fail(format!("{path}: {status} not JSON ({e}): {text}")))?;
        prop_assert!(v["error"]["message"].is_string(), "{path}: {text}");
        prop_assert!(v["error"]["type"].is_string(), "{path}: {text}");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(150), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_json_bodies_never_give_a_5xx(body in body(), chat in any::<bool>()) {
        let f = fixture();
        let path = if chat { "/v1/chat/completions" } else { "/v1/completions" };
        let mut body = body;
        if body.get("stream") == Some(&json!(true)) {
            // Streams answer 200 then report errors in-band; keep them short.
            body["max_tokens"] = json!(2);
        }
        let r = f.rt.block_on(post(f.server.addr, path, &body));
        check(path, r.status, &r.body)?;
    }

    #[test]
    fn random_bytes_never_give_a_5xx(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let f = fixture();
        let r = f.rt.block_on(request(f.server.addr, "POST", "/v1/chat/completions", &[], &bytes));
        check("bytes", r.status, &r.body)?;
    }
}
