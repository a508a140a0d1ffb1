//! Anthropic Messages requests → the OpenAI chat shape calla's template path takes: system, content
//! blocks (text, thinking, tool_use, tool_result), tools (`input_schema`) and tool_choice.

use serde_json::{json, Value as Json};

use crate::chat::ToolChoice;
use crate::errors::ApiError;

/// Text of a `system` or `tool_result` content: a string or text blocks.
pub(crate) fn block_text(value: &Json, param: &str) -> Result<String, ApiError> {
    match value {
        Json::Null => Ok(String::new()),
        Json::String(s) => Ok(s.clone()),
        Json::Array(blocks) => {
            let mut text = String::new();
            for (i, b) in blocks.iter().enumerate() {
                match b.get("type").and_then(Json::as_str) {
                    Some("text") => text.push_str(b["text"].as_str().unwrap_or_default()),
                    other => {
                        return Err(ApiError::bad_param(
                            format!("{param}[{i}].type"),
                            format!("{param}[{i}]: blocks of type {other:?} are not supported here (text only)"),
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(ApiError::bad_param(
            param,
            format!("'{param}' must be a string or a list of text blocks"),
        )),
    }
}

/// Anthropic messages (+ system) → OpenAI chat messages.
pub fn to_openai_messages(system: Option<&Json>, messages: &Json) -> Result<Vec<Json>, ApiError> {
    let mut out = Vec::new();
    if let Some(system) = system {
        let text = block_text(system, "system")?;
        if !text.is_empty() {
            out.push(json!({"role": "system", "content": text}));
        }
    }
    let messages = messages
        .as_array()
        .ok_or_else(|| ApiError::bad_param("messages", "'messages' must be a list"))?;
    if messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "'messages' must not be empty",
        ));
    }
    for (m, message) in messages.iter().enumerate() {
        let role = message.get("role").and_then(Json::as_str);
        let param = format!("messages[{m}]");
        let blocks = match message.get("content") {
            Some(Json::String(s)) => vec![json!({"type": "text", "text": s})],
            Some(Json::Array(blocks)) => blocks.clone(),
            _ => {
                return Err(ApiError::bad_param(
                    format!("{param}.content"),
                    format!("{param}.content must be a string or a list of content blocks"),
                ))
            }
        };
        let mut text = String::new();
        let mut reasoning = String::new();
        let mut calls = Vec::new();
        let mut results = Vec::new();
        for (b, block) in blocks.iter().enumerate() {
            let bparam = format!("{param}.content[{b}]");
            let kind = block.get("type").and_then(Json::as_str).unwrap_or_default();
            match (role, kind) {
                (_, "text") => text.push_str(block["text"].as_str().ok_or_else(|| {
                    ApiError::bad_param(format!("{bparam}.text"), format!("{bparam} needs 'text'"))
                })?),
                (Some("assistant"), "thinking") => {
                    reasoning.push_str(block["thinking"].as_str().unwrap_or_default())
                }
                (Some("assistant"), "redacted_thinking") => {}
                (Some("assistant"), "tool_use") => {
                    let name = block["name"].as_str().ok_or_else(|| {
                        ApiError::bad_param(format!("{bparam}.name"), format!("{bparam} needs 'name'"))
                    })?;
                    calls.push(json!({"id": block["id"], "type": "function", "function": {
                        "name": name, "arguments": block.get("input").cloned().unwrap_or(json!({})).to_string()}}));
                }
                (Some("user"), "tool_result") => {
                    let mut content = block_text(block.get("content").unwrap_or(&Json::Null), &format!("{bparam}.content"))?;
                    if block["is_error"].as_bool() == Some(true) && !content.starts_with("Error") {
                        content = format!("Error: {content}");
                    }
                    results.push(json!({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}));
                }
                (_, other) => {
                    return Err(ApiError::bad_param(
                        format!("{bparam}.type"),
                        format!("{bparam}: content blocks of type '{other}' are not supported in {} messages (text, thinking, tool_use, tool_result)", role.unwrap_or("these")),
                    ))
                }
            }
        }
        match role {
            Some("user") => {
                out.extend(results);
                if !text.is_empty() || blocks.is_empty() {
                    out.push(json!({"role": "user", "content": text}));
                }
            }
            Some("assistant") => {
                let mut msg = json!({"role": "assistant", "content": text});
                if !reasoning.is_empty() {
                    msg["reasoning_content"] = Json::from(reasoning);
                }
                if !calls.is_empty() {
                    msg["tool_calls"] = Json::from(calls);
                }
                out.push(msg);
            }
            _ => {
                return Err(ApiError::bad_param(
                    format!("{param}.role"),
                    format!("{param}.role must be 'user' or 'assistant'"),
                ))
            }
        }
    }
    Ok(out)
}

/// Anthropic tools → OpenAI function tools (server tools such as web_search are refused).
pub(crate) fn to_openai_tools(tools: Option<&Json>) -> Result<Vec<Json>, ApiError> {
    let Some(tools) = tools.filter(|t| !t.is_null()) else {
        return Ok(Vec::new());
    };
    let tools = tools
        .as_array()
        .ok_or_else(|| ApiError::bad_param("tools", "'tools' must be a list"))?;
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let name = t.get("name").and_then(Json::as_str);
            let custom = matches!(t.get("type").and_then(Json::as_str), None | Some("custom"));
            match name {
                Some(name) if custom => Ok(json!({"type": "function", "function": {
                    "name": name,
                    "description": t.get("description").cloned().unwrap_or(Json::Null),
                    "parameters": t.get("input_schema").cloned().unwrap_or(json!({"type": "object"})),
                }})),
                _ => Err(ApiError::bad_param(
                    format!("tools[{i}]"),
                    format!("tools[{i}] must be a custom tool {{\"name\", \"input_schema\"}} (server tools are not supported)"),
                )),
            }
        })
        .collect()
}

pub(crate) fn to_tool_choice(
    value: Option<&Json>,
    tools: &[Json],
) -> Result<(ToolChoice, bool), ApiError> {
    let default = if tools.is_empty() {
        ToolChoice::None
    } else {
        ToolChoice::Auto
    };
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok((default, true));
    };
    let parallel = value["disable_parallel_tool_use"].as_bool() != Some(true);
    let choice = match value.get("type").and_then(Json::as_str) {
        Some("auto") => default,
        Some("none") => ToolChoice::None,
        Some("any") if !tools.is_empty() => ToolChoice::Required,
        Some("tool") => {
            let name = value["name"].as_str().unwrap_or_default();
            if !tools.iter().any(|t| t["function"]["name"] == name) {
                return Err(ApiError::bad_param(
                    "tool_choice.name",
                    format!("tool_choice names '{name}', which is not among the tools"),
                ));
            }
            ToolChoice::Function(name.to_string())
        }
        _ => {
            return Err(ApiError::bad_param(
                "tool_choice",
                "tool_choice must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"} (any and tool need tools)",
            ))
        }
    };
    Ok((choice, parallel))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_translate_to_the_chat_shape() {
        let messages = json!([
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "x"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "thanks"}]},
        ]);
        let out = to_openai_messages(Some(&json!("Be brief.")), &messages).unwrap();
        assert_eq!(out[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(out[2]["reasoning_content"], "hmm");
        assert_eq!(
            out[2]["tool_calls"][0]["function"]["arguments"],
            r#"{"city":"Paris"}"#
        );
        assert_eq!(
            out[3],
            json!({"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"})
        );
        assert_eq!(out[4], json!({"role": "user", "content": "thanks"}));
        let bad = json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]);
        assert_eq!(
            to_openai_messages(None, &bad).unwrap_err().param.as_deref(),
            Some("messages[0].content[0].type")
        );
        assert!(to_openai_messages(None, &json!([])).is_err());
        assert!(to_openai_messages(None, &json!([{"role": "system", "content": "x"}])).is_err());
    }
}
