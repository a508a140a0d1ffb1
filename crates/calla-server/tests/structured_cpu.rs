//! Constrained decoding on the real CPU engine, the tiny fixture checkpoint (random weights) and its
//! real Qwen tokenizer: only a constrained decoder makes this model write valid JSON or a valid tool
//! call, so every reply is parsed and validated against its schema, over several seeds.

mod common;

use calla_cpu::CpuBackend;
use calla_model::load::{load_model, LoadOptions};
use calla_server::{start_runtime, RuntimeOptions, ServerConfig};
use common::*;
use serde_json::{json, Value as Json};

const MODEL: &str = "qwen35moe-causal-perexpert";

async fn cpu_server() -> TestServer {
    let dir = repo_root().join("tests/fixtures/models").join(MODEL);
    let loaded = load_model(&dir, &LoadOptions::default()).expect("fixture loads");
    let backend = CpuBackend::new(loaded.spec, loaded.weights).expect("cpu backend");
    let runtime = start_runtime(
        &dir,
        Box::new(backend),
        loaded.generation,
        &RuntimeOptions {
            max_queue: 16,
            max_context: None,
            prefix_cache_bytes: 1 << 24,
        },
    )
    .expect("runtime");
    let config = ServerConfig {
        served_model_name: "demo".into(),
        ..ServerConfig::default()
    };
    serve_runtime(config, runtime, true).await
}

fn person_schema() -> Json {
    json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]}},
        "required": ["name", "age", "admin", "color"], "additionalProperties": false})
}

/// The few checks the schemas here need.
fn validate_person(v: &Json) -> Result<(), String> {
    let o = v.as_object().ok_or("not an object")?;
    if o.len() != 4 {
        return Err(format!("{} keys", o.len()));
    }
    let name = o["name"].as_str().ok_or("name")?;
    if name.chars().count() > 6 {
        return Err("name too long".into());
    }
    let age = o["age"].as_i64().ok_or("age")?;
    if !(0..=120).contains(&age) {
        return Err("age out of range".into());
    }
    o["admin"].as_bool().ok_or("admin")?;
    if !["red", "green", "blue"].contains(&o["color"].as_str().ok_or("color")?) {
        return Err("color".into());
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn json_schema_replies_of_a_random_model_parse_and_validate() {
    let server = cpu_server().await;
    for seed in 0..4 {
        let body = json!({"model": "demo", "messages": user("Describe a person."), "seed": seed,
            "temperature": 1.0, "max_tokens": 120,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person",
                "schema": person_schema(), "strict": true}}});
        let r = post(server.addr, "/v1/chat/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let r = r.json();
        let text = r["choices"][0]["message"]["content"].as_str().unwrap();
        let value: Json =
            serde_json::from_str(text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text:?}"));
        validate_person(&value).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
        assert_eq!(r["choices"][0]["finish_reason"], "stop");
    }
    // json_object: some object
    let body = json!({"messages": user("json"), "max_tokens": 60, "temperature": 0,
        "response_format": {"type": "json_object"}});
    let r = post(server.addr, "/v1/chat/completions", &body)
        .await
        .json();
    let text = r["choices"][0]["message"]["content"].as_str().unwrap();
    if r["choices"][0]["finish_reason"] == "stop" {
        assert!(
            serde_json::from_str::<Json>(text).unwrap().is_object(),
            "{text}"
        );
    } else {
        assert!(text.starts_with('{'), "{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forced_tool_calls_of_a_random_model_are_declared_and_valid() {
    let server = cpu_server().await;
    let tools = json!([
        {"type": "function", "function": {"name": "set_person", "parameters": person_schema()}},
        {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]);
    for seed in 0..3 {
        let body = json!({"messages": user("Call a tool."), "tools": tools, "tool_choice":
            {"type": "function", "function": {"name": "set_person"}}, "seed": seed, "temperature": 1.0,
            "parallel_tool_calls": false, "max_tokens": 150});
        let r = post(server.addr, "/v1/chat/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let r = r.json();
        let calls = r["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap_or_else(|| panic!("{r}"));
        assert_eq!(calls.len(), 1);
        for call in calls {
            assert_eq!(call["function"]["name"], "set_person");
            let args: Json =
                serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
            validate_person(&args).unwrap_or_else(|e| panic!("seed {seed}: {e}: {args} in {r}"));
        }
        assert_eq!(r["choices"][0]["finish_reason"], "tool_calls");
    }
    // required: one of the declared tools, one call with parallel off
    let body = json!({"messages": user("Call a tool."), "tools": tools, "tool_choice": "required",
        "parallel_tool_calls": false, "temperature": 1.0, "seed": 7, "max_tokens": 150});
    let r = post(server.addr, "/v1/chat/completions", &body)
        .await
        .json();
    let calls = r["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap_or_else(|| panic!("{r}"));
    assert_eq!(calls.len(), 1);
    assert!(["set_person", "ping"].contains(&calls[0]["function"]["name"].as_str().unwrap()));
}
