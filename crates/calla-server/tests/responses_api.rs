//! /v1/responses (OpenAI Responses) on the scripted backend: text and item input, reasoning and
//! function-call items, text.format, previous_response_id, retrieval, and the streaming events;
//! plus the small endpoints of issue 29: GET /v1/models/{id}, CORS, unknown fields.

mod common;

use common::*;
use serde_json::{json, Value as Json};

const RESPONSES: &str = "/v1/responses";

fn tools() -> Json {
    json!([{"type": "function", "name": "get_weather", "description": "Weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}])
}

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

fn output_text(r: &Json) -> String {
    r["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "message")
        .flat_map(|i| i["content"].as_array().unwrap().clone())
        .filter_map(|c| c["text"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn text_input_with_instructions_and_reasoning() {
    let server = start(Options::default()).await;
    let r = post(
        server.addr,
        RESPONSES,
        &json!({"model": "test-model", "input": "hi",
        "instructions": "Be brief."}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = r.json();
    assert_eq!(r["object"], "response");
    assert_eq!(r["status"], "completed");
    assert!(r["id"].as_str().unwrap().starts_with("resp_"));
    // thinking is on by default in the template: a reasoning item, then the message
    assert_eq!(r["output"][0]["type"], "reasoning", "{r}");
    assert_eq!(
        r["output"][0]["content"][0]["text"],
        "Let me think about hi."
    );
    assert_eq!(output_text(&r), "You said: hi");
    assert_eq!(r["instructions"], "Be brief.");
    assert!(r["usage"]["input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(
        r["usage"]["output_tokens"].as_u64().unwrap() as usize,
        "Let me think about hi.\n</think>\n\nYou said: hi".len() + 1
    );

    // reasoning effort none: no thinking
    let r = post(
        server.addr,
        RESPONSES,
        &json!({"input": "hi", "reasoning": {"effort": "none"}}),
    )
    .await
    .json();
    assert_eq!(r["output"].as_array().unwrap().len(), 1, "{r}");
    assert_eq!(output_text(&r), "You said: hi");

    // max_output_tokens: incomplete
    let r = post(
        server.addr,
        RESPONSES,
        &json!({"input": "hi", "max_output_tokens": 4,
        "reasoning": {"effort": "none"}}),
    )
    .await
    .json();
    assert_eq!(r["status"], "incomplete");
    assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");

    // retrieval
    let id = r["id"].as_str().unwrap();
    let got = get(server.addr, &format!("{RESPONSES}/{id}")).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.json()["id"], id);
    assert_eq!(
        get(server.addr, &format!("{RESPONSES}/resp_nope"))
            .await
            .status,
        404
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn function_calls_and_previous_response_id() {
    let server = start(Options::default()).await;
    let r = post(
        server.addr,
        RESPONSES,
        &json!({"input": "weather in Paris?", "tools": tools()}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = r.json();
    let call = r["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap()
        .clone();
    assert_eq!(call["name"], "get_weather");
    assert_eq!(
        serde_json::from_str::<Json>(call["arguments"].as_str().unwrap()).unwrap(),
        json!({"city": "Paris", "days": 3})
    );
    let call_id = call["call_id"].as_str().unwrap();

    // the follow-up sends only the tool's output
    let follow = json!({"previous_response_id": r["id"], "tools": tools(), "input": [
        {"type": "function_call_output", "call_id": call_id, "output": "sunny"},
        {"role": "user", "content": [{"type": "input_text", "text": "thanks"}]}]});
    let f = post(server.addr, RESPONSES, &follow).await;
    assert_eq!(f.status, 200, "{}", f.body);
    let f = f.json();
    assert!(output_text(&f).ends_with("You said: thanks"), "{f}");
    assert!(f["usage"]["input_tokens"].as_u64() > r["usage"]["input_tokens"].as_u64());
    assert_eq!(f["previous_response_id"], r["id"]);

    // the same conversation sent whole renders the same prompt
    let mut input = vec![json!({"role": "user", "content": "weather in Paris?"})];
    input.extend(r["output"].as_array().unwrap().iter().cloned());
    input.push(json!({"type": "function_call_output", "call_id": call_id, "output": "sunny"}));
    input.push(json!({"role": "user", "content": "thanks"}));
    let whole = json!({"tools": tools(), "input": input});
    let w = post(server.addr, RESPONSES, &whole).await.json();
    assert_eq!(
        w["usage"]["input_tokens"], f["usage"]["input_tokens"],
        "{w}"
    );

    let bad = post(
        server.addr,
        RESPONSES,
        &json!({"previous_response_id": "resp_x", "input": "hi"}),
    )
    .await;
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"]["param"], "previous_response_id");

    // tool_choice required with parallel off
    let r = post(
        server.addr,
        RESPONSES,
        &json!({"input": "weather twice", "tools": tools(),
        "tool_choice": "required", "parallel_tool_calls": false}),
    )
    .await
    .json();
    let calls = r["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "function_call")
        .count();
    assert_eq!(calls, 1, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn text_format_and_errors() {
    let server = start(Options::default()).await;
    let schema =
        json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    let r = post(server.addr, RESPONSES, &json!({"input": r#"json {"a": 7}"#,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": true}}})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = r.json();
    assert_eq!(output_text(&r), r#"{"a": 7}"#);

    for (body, param) in [
        (
            json!({"input": "hi", "text": {"format": {"type": "bogus"}}}),
            "text.format.type",
        ),
        (json!({"input": 5}), "input"),
        (json!({"input": [{"type": "input_image"}]}), "input[0].type"),
        (
            json!({"input": "hi", "tools": [{"type": "web_search"}]}),
            "tools[0]",
        ),
        (
            json!({"input": "hi", "tool_choice": "required"}),
            "tool_choice",
        ),
    ] {
        let r = post(server.addr, RESPONSES, &body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{}", r.body);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streaming_events_in_order() {
    let server = start(Options::default()).await;
    let r = post(
        server.addr,
        RESPONSES,
        &json!({"input": "weather in Paris?", "tools": tools(),
        "stream": true}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let events = events(&r.body);
    let kinds: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert!(kinds.len() >= 2, "{:?}", r.body);
    assert_eq!(&kinds[..2], ["response.created", "response.in_progress"]);
    assert_eq!(kinds.last(), Some(&"response.completed"));
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!(name, data["type"].as_str().unwrap());
        assert_eq!(data["sequence_number"], i, "{data}");
    }
    for kind in [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.reasoning_text.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ] {
        assert!(kinds.contains(&kind), "{kind} missing: {kinds:?}");
    }
    let text: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, "Checking.");
    let args: String = events
        .iter()
        .filter(|(n, _)| n == "response.function_call_arguments.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap().to_string())
        .collect();
    let done = &events.last().unwrap().1["response"];
    let call = done["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap();
    assert_eq!(call["arguments"], args);
    // every item added is done, with the same id, at the same index
    let added: Vec<(u64, Json)> = events
        .iter()
        .filter(|(n, _)| n == "response.output_item.added")
        .map(|(_, d)| (d["output_index"].as_u64().unwrap(), d["item"]["id"].clone()))
        .collect();
    let finished: Vec<(u64, Json)> = events
        .iter()
        .filter(|(n, _)| n == "response.output_item.done")
        .map(|(_, d)| (d["output_index"].as_u64().unwrap(), d["item"]["id"].clone()))
        .collect();
    assert_eq!(added, finished);
    assert_eq!(done["output"].as_array().unwrap().len(), added.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn model_by_id_cors_and_unknown_fields() {
    let mut opts = Options::default();
    opts.config.cors_origins = vec!["http://app.example".into()];
    opts.config.api_key = Some("k".into());
    let server = start(opts).await;
    let auth = [("authorization", "Bearer k")];
    let r = request(server.addr, "GET", "/v1/models/test-model", &auth, b"").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["id"], "test-model");
    let r = request(server.addr, "GET", "/v1/models/org/other", &auth, b"").await;
    assert_eq!(r.status, 404);
    assert_eq!(
        r.json()["error"]["code"],
        "model_not_found",
        "ids may hold a slash"
    );
    let r = request(server.addr, "GET", "/v1/models/other", &auth, b"").await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "model_not_found");

    // a preflight from an allowed origin is answered without a key
    let pre = [
        ("origin", "http://app.example"),
        ("access-control-request-method", "POST"),
        (
            "access-control-request-headers",
            "authorization, content-type",
        ),
    ];
    let r = request(server.addr, "OPTIONS", "/v1/chat/completions", &pre, b"").await;
    assert_eq!(r.status, 204);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://app.example")
    );
    assert!(r
        .header("access-control-allow-methods")
        .unwrap()
        .contains("POST"));
    assert_eq!(
        r.header("access-control-allow-headers"),
        Some("authorization, content-type")
    );
    // responses to an allowed origin carry the header, others none
    let with_origin = [
        ("authorization", "Bearer k"),
        ("origin", "http://app.example"),
    ];
    let r = request(server.addr, "GET", "/v1/models", &with_origin, b"").await;
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://app.example")
    );
    let other = [
        ("authorization", "Bearer k"),
        ("origin", "http://evil.example"),
    ];
    let r = request(server.addr, "GET", "/v1/models", &other, b"").await;
    assert!(r.header("access-control-allow-origin").is_none());
    let r = request(
        server.addr,
        "OPTIONS",
        "/v1/models",
        &[
            ("origin", "http://evil.example"),
            ("access-control-request-method", "GET"),
        ],
        b"",
    )
    .await;
    assert!(r.header("access-control-allow-origin").is_none());

    // unknown fields are accepted (and logged)
    let body = json!({"messages": user("hi"), "frobnicate": true}).to_string();
    let r = request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &auth,
        body.as_bytes(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_cors_headers_by_default() {
    let server = start(Options::default()).await;
    let r = request(
        server.addr,
        "GET",
        "/v1/models",
        &[("origin", "http://app.example")],
        b"",
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(r.header("access-control-allow-origin").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokenize_and_detokenize() {
    let server = start(Options::default()).await;
    let r = post(server.addr, "/tokenize", &json!({"prompt": "hi"}))
        .await
        .json();
    assert_eq!(r["tokens"], json!([104, 105]));
    assert_eq!(r["count"], 2);
    let chat = post(server.addr, "/tokenize", &json!({"messages": user("hi")}))
        .await
        .json();
    assert!(chat["count"].as_u64().unwrap() > 2);
    let r = post(server.addr, "/detokenize", &json!({"tokens": [104, 105]}))
        .await
        .json();
    assert_eq!(r["prompt"], "hi");
    let r = post(server.addr, "/detokenize", &json!({"tokens": [104, 9999]})).await;
    assert_eq!(r.status, 400);
    assert_eq!(post(server.addr, "/tokenize", &json!({})).await.status, 400);
}
