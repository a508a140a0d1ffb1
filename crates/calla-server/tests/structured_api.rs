//! Structured output and tool-call enforcement on the scripted backend: the grammar lets a valid
//! script through, overrides an invalid one, and refuses bad formats with 400; calls to undeclared
//! tools and extra calls under `parallel_tool_calls: false` never reach the client.

mod common;

use common::*;
use serde_json::{json, Value as Json};

const CHAT: &str = "/v1/chat/completions";

fn weather_tools() -> Json {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}])
}

fn level_tool() -> Json {
    json!([{"type": "function", "function": {"name": "set_level",
        "parameters": {"type": "object", "properties": {
            "level": {"type": "integer", "minimum": 1, "maximum": 5},
            "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["level", "unit"]}}}])
}

fn content(r: &Json) -> String {
    r["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn json_formats_are_enforced() {
    let server = start(Options::default()).await;
    // a script that is valid JSON passes (its preamble is not JSON and is skipped)
    let body = json!({"messages": user(r#"json {"a": 1, "b": [true, null]}"#),
        "response_format": {"type": "json_object"}, "max_tokens": 100});
    let r = post(server.addr, CHAT, &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(content(&r.json()), r#"{"a": 1, "b": [true, null]}"#);

    // a script that breaks the schema is overridden: the output still validates
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}},
        "required": ["a"], "additionalProperties": false});
    let body = json!({"messages": user(r#"json {"a": "text"}"#), "max_tokens": 100,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}});
    let r = post(server.addr, CHAT, &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let value: Json = serde_json::from_str(&content(&r.json())).unwrap();
    let a = value["a"].as_f64().unwrap_or_else(|| panic!("{value}"));
    assert_eq!(a.fract(), 0.0);
    assert_eq!(value.as_object().unwrap().len(), 1);

    // text is no constraint
    let body = json!({"messages": user("hi"), "response_format": {"type": "text"}});
    assert_eq!(
        content(&post(server.addr, CHAT, &body).await.json()),
        "You said: hi"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_formats_are_400_in_openai_shape() {
    let server = start(Options::default()).await;
    for (format, param) in [
        (json!({"type": "bogus"}), "response_format.type"),
        (json!("json"), "response_format.type"),
        (
            json!({"type": "json_schema"}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"schema": {"type": "object", "required": 5}}}),
            "response_format",
        ),
    ] {
        let body = json!({"messages": user("hi"), "response_format": format});
        let r = post(server.addr, CHAT, &body).await;
        assert_eq!(r.status, 400, "{format}: {}", r.body);
        let e = r.json();
        assert_eq!(e["error"]["type"], "invalid_request_error");
        assert_eq!(e["error"]["param"], param, "{}", r.body);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forced_tool_calls_name_a_declared_tool_with_valid_arguments() {
    let server = start(Options::default()).await;
    // off script ("You said: …"): the grammar still makes a call to the one tool, all required
    // arguments present and typed
    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "set_level"}}),
    ] {
        let body = json!({"messages": user("anything"), "tools": level_tool(), "tool_choice": choice,
            "max_tokens": 200});
        let r = post(server.addr, CHAT, &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let r = r.json();
        assert_eq!(r["choices"][0]["finish_reason"], "tool_calls", "{r}");
        let calls = r["choices"][0]["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["function"]["name"], "set_level");
        let args: Json =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        let level = args["level"].as_i64().unwrap_or_else(|| panic!("{args}"));
        assert!((1..=5).contains(&level), "{args}");
        assert!(
            ["c", "f"].contains(&args["unit"].as_str().unwrap()),
            "{args}"
        );
    }
    // required + parallel_tool_calls false: one call although the script makes two
    let body = json!({"messages": user("weather twice"), "tools": weather_tools(),
        "tool_choice": "required", "parallel_tool_calls": false});
    let r = post(server.addr, CHAT, &body).await.json();
    let calls = r["choices"][0]["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{r}");
    assert_eq!(
        calls[0]["function"]["arguments"],
        r#"{"city": "Paris", "days": 3}"#
    );
    // streamed: the same call, name first
    let mut body = body.clone();
    body["stream"] = json!(true);
    let chunks = open_stream(server.addr, CHAT, &body)
        .await
        .collect_json()
        .await;
    let names: Vec<&str> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"][0]["function"]["name"].as_str())
        .collect();
    assert_eq!(names, ["get_weather"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn undeclared_and_extra_calls_are_dropped_under_auto() {
    let server = start(Options::default()).await;
    let body = json!({"messages": user("undeclared weather"), "tools": weather_tools()});
    let r = post(server.addr, CHAT, &body).await.json();
    let calls = r["choices"][0]["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{r}");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(
        calls[0]["function"]["arguments"],
        r#"{"city": "Rome", "days": 3}"#
    );

    let body = json!({"messages": user("weather twice"), "tools": weather_tools()});
    let r = post(server.addr, CHAT, &body).await.json();
    assert_eq!(
        r["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    let body = json!({"messages": user("weather twice"), "tools": weather_tools(), "parallel_tool_calls": false});
    let r = post(server.addr, CHAT, &body).await.json();
    assert_eq!(
        r["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap()
            .len(),
        1,
        "{r}"
    );
    assert_eq!(r["choices"][0]["finish_reason"], "tool_calls");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forced_tool_arguments_may_use_the_parameters_definitions() {
    let server = start(Options::default()).await;
    let tools = json!([{"type": "function", "function": {"name": "ship", "parameters": {
        "type": "object", "$defs": {"Addr": {"type": "object",
            "properties": {"zip": {"type": "integer", "minimum": 10, "maximum": 99}},
            "required": ["zip"], "additionalProperties": false}},
        "properties": {"to": {"$ref": "#/$defs/Addr"}}, "required": ["to"]}}}]);
    let body = json!({"messages": user("anything"), "tools": tools, "tool_choice": "required",
        "parallel_tool_calls": false, "max_tokens": 200});
    let r = post(server.addr, CHAT, &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = r.json();
    let call = &r["choices"][0]["message"]["tool_calls"][0]["function"];
    let args: Json = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    let zip = args["to"]["zip"]
        .as_i64()
        .unwrap_or_else(|| panic!("{args}"));
    assert!((10..=99).contains(&zip));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn explicit_thinking_reasons_first_then_the_constraint_applies() {
    let server = start(Options::default()).await;
    let body = json!({"messages": user(r#"raw {"a": 1}"#), "max_tokens": 200,
        "chat_template_kwargs": {"enable_thinking": true},
        "response_format": {"type": "json_object"}});
    let r = post(server.addr, CHAT, &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = r.json();
    let message = &r["choices"][0]["message"];
    assert_eq!(
        message["reasoning_content"], r#"Let me think about raw {"a": 1}."#,
        "{r}"
    );
    assert_eq!(message["content"], r#"{"a": 1}"#);
    // without the explicit ask the think block is closed first: no reasoning
    let body = json!({"messages": user(r#"raw {"a": 1}"#), "max_tokens": 200,
        "response_format": {"type": "json_object"}});
    let r = post(server.addr, CHAT, &body).await.json();
    assert!(
        r["choices"][0]["message"]
            .get("reasoning_content")
            .is_none(),
        "{r}"
    );
    assert_eq!(r["choices"][0]["message"]["content"], r#"{"a": 1}"#);
    // the same for a forced tool call
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}}]);
    let body = json!({"messages": user("weather in Paris?"), "tools": tools, "tool_choice": "required",
        "chat_template_kwargs": {"enable_thinking": true}, "parallel_tool_calls": false});
    let r = post(server.addr, CHAT, &body).await.json();
    let message = &r["choices"][0]["message"];
    assert_eq!(
        message["reasoning_content"], "Let me think about weather in Paris?.",
        "{r}"
    );
    assert_eq!(
        message["tool_calls"][0]["function"]["arguments"],
        r#"{"city": "Paris", "days": 3}"#
    );
}
