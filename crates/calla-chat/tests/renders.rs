//! The checkpoint's chat template rendered by calla-chat must be byte-identical to transformers'
//! `apply_chat_template` on the committed conversations (tests/fixtures/chat/renders.json and
//! errors.json, written by tools/fixtures/make_chat.py with transformers). Messages go through
//! `prepare_messages` first, as the server does.

use std::path::{Path, PathBuf};

use calla_chat::{prepare_messages, ChatTemplate, RenderInput};
use serde_json::{Map, Value as Json};

fn chat_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/chat")
}

fn read_cases(name: &str) -> Vec<Json> {
    let path = chat_fixtures().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The template the renders were made with (the same file every fixture model ships).
fn template() -> ChatTemplate {
    ChatTemplate::from_dir(&chat_fixtures()).expect("tests/fixtures/chat/chat_template.jinja loads")
}

/// Render one case: (add_generation_prompt, other kwargs) split as transformers splits them.
fn render(template: &ChatTemplate, case: &Json) -> Result<String, String> {
    let messages = prepare_messages(case["messages"].as_array().expect("messages"))
        .map_err(|e| e.to_string())?;
    let tools = case
        .get("tools")
        .and_then(Json::as_array)
        .map(Vec::as_slice);
    let mut kwargs: Map<String, Json> = case["kwargs"].as_object().cloned().unwrap_or_default();
    let add_generation_prompt = kwargs
        .remove("add_generation_prompt")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    template
        .render(&RenderInput {
            messages: &messages,
            tools,
            add_generation_prompt,
            kwargs: Some(&kwargs),
        })
        .map_err(|e| e.to_string())
}

#[test]
fn renders_match_transformers_byte_for_byte() {
    let template = template();
    let cases = read_cases("renders.json");
    assert!(cases.len() >= 10, "renders.json has {} cases", cases.len());
    for case in &cases {
        let name = case["name"].as_str().unwrap_or("?");
        let want = case["render"].as_str().expect("render");
        match render(&template, case) {
            Ok(got) => assert_eq!(got, want, "case {name}"),
            Err(e) => panic!("case {name}: {e}"),
        }
    }
    eprintln!("{} renders identical to transformers'", cases.len());
}

#[test]
fn rejected_conversations_are_rejected_with_the_template_message() {
    let template = template();
    for case in read_cases("errors.json") {
        let name = case["name"].as_str().unwrap_or("?");
        let want = case["error"].as_str().expect("error");
        let err = render(&template, &case).expect_err(name);
        if case["raised_by"] == "template" && !err.starts_with("messages[") {
            // The template's own words reach the client.
            assert!(
                err.ends_with(want),
                "case {name}: {err:?} should carry {want:?}"
            );
        }
    }
}
