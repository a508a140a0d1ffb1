//! OpenAI Responses input → the chat shape: items (messages with text parts, function_call,
//! function_call_output, reasoning), function tools and tool_choice.

use serde_json::{json, Value as Json};

use crate::chat::ToolChoice;
use crate::errors::ApiError;

pub(crate) fn part_text(part: &Json, param: &str) -> Result<String, ApiError> {
    match part.get("type").and_then(Json::as_str) {
        Some("input_text")
        | Some("output_text")
        | Some("text")
        | Some("summary_text")
        | Some("reasoning_text") => Ok(part["text"].as_str().unwrap_or_default().to_string()),
        Some("refusal") => Ok(part["refusal"].as_str().unwrap_or_default().to_string()),
        other => Err(ApiError::bad_param(
            format!("{param}.type"),
            format!("{param}: content of type {other:?} is not supported (text only)"),
        )),
    }
}

pub(crate) fn content_text(content: &Json, param: &str) -> Result<String, ApiError> {
    match content {
        Json::String(s) => Ok(s.clone()),
        Json::Array(parts) => parts
            .iter()
            .enumerate()
            .map(|(i, p)| part_text(p, &format!("{param}[{i}]")))
            .collect(),
        Json::Null => Ok(String::new()),
        _ => Err(ApiError::bad_param(
            param,
            format!("'{param}' must be a string or a list of parts"),
        )),
    }
}

/// Responses input items → chat messages (appended to `out`).
pub fn input_messages(input: &Json, out: &mut Vec<Json>) -> Result<(), ApiError> {
    let items = match input {
        Json::String(s) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(());
        }
        Json::Array(items) => items,
        _ => {
            return Err(ApiError::bad_param(
                "input",
                "'input' must be a string or a list of items",
            ))
        }
    };
    let mut reasoning = String::new();
    for (i, item) in items.iter().enumerate() {
        let param = format!("input[{i}]");
        let kind = item.get("type").and_then(Json::as_str).unwrap_or("message");
        match kind {
            "message" => {
                let role = item.get("role").and_then(Json::as_str).unwrap_or_default();
                if !["user", "system", "developer", "assistant"].contains(&role) {
                    return Err(ApiError::bad_param(
                        format!("{param}.role"),
                        format!("{param}.role must be user, system, developer or assistant"),
                    ));
                }
                let text = content_text(item.get("content").unwrap_or(&Json::Null), &format!("{param}.content"))?;
                let mut msg = json!({"role": role, "content": text});
                if role == "assistant" && !reasoning.is_empty() {
                    msg["reasoning_content"] = Json::from(std::mem::take(&mut reasoning));
                }
                out.push(msg);
            }
            "reasoning" => {
                for key in ["content", "summary"] {
                    if let Some(parts) = item.get(key).filter(|p| p.is_array()) {
                        let text = content_text(parts, &format!("{param}.{key}"))?;
                        if !text.is_empty() {
                            reasoning = text;
                            break;
                        }
                    }
                }
            }
            "function_call" => {
                let name = item["name"].as_str().ok_or_else(|| {
                    ApiError::bad_param(format!("{param}.name"), format!("{param} needs 'name'"))
                })?;
                let call = json!({"id": item["call_id"], "type": "function", "function": {
                    "name": name, "arguments": item["arguments"].as_str().unwrap_or("{}")}});
                // Calls of one turn join the assistant message before them.
                let joins = out.last().is_some_and(|m| {
                    m["role"] == "assistant"
                        && m.get("tool_calls").is_none_or(|c| c.is_array())
                });
                if joins {
                    let last = out.last_mut().expect("checked");
                    match last.get_mut("tool_calls").and_then(Json::as_array_mut) {
                        Some(calls) => calls.push(call),
                        None => last["tool_calls"] = json!([call]),
                    }
                } else {
                    let mut msg = json!({"role": "assistant", "content": "", "tool_calls": [call]});
                    if !reasoning.is_empty() {
                        msg["reasoning_content"] = Json::from(std::mem::take(&mut reasoning));
                    }
                    out.push(msg);
                }
            }
            "function_call_output" => {
                let output = content_text(item.get("output").unwrap_or(&Json::Null), &format!("{param}.output"))?;
                out.push(json!({"role": "tool", "tool_call_id": item["call_id"], "content": output}));
            }
            other => {
                return Err(ApiError::bad_param(
                    format!("{param}.type"),
                    format!("{param}: items of type '{other}' are not supported (message, function_call, function_call_output, reasoning)"),
                ))
            }
        }
    }
    Ok(())
}

pub(crate) fn to_chat_tools(tools: Option<&Json>) -> Result<Vec<Json>, ApiError> {
    let Some(tools) = tools.filter(|t| !t.is_null()) else {
        return Ok(Vec::new());
    };
    let tools = tools
        .as_array()
        .ok_or_else(|| ApiError::bad_param("tools", "'tools' must be a list"))?;
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| match (t["type"].as_str(), t["name"].as_str()) {
            (Some("function"), Some(name)) => Ok(json!({"type": "function", "function": {
                "name": name, "description": t.get("description").cloned().unwrap_or(Json::Null),
                "parameters": t.get("parameters").cloned().unwrap_or(json!({"type": "object"}))}})),
            (kind, _) => Err(ApiError::bad_param(
                format!("tools[{i}]"),
                format!("tools[{i}]: only function tools {{\"type\": \"function\", \"name\", \"parameters\"}} are supported (got {kind:?})"),
            )),
        })
        .collect()
}

pub(crate) fn to_tool_choice(value: Option<&Json>, tools: &[Json]) -> Result<ToolChoice, ApiError> {
    let default = if tools.is_empty() {
        ToolChoice::None
    } else {
        ToolChoice::Auto
    };
    let choice = match value {
        None | Some(Json::Null) => default,
        Some(Json::String(s)) => match s.as_str() {
            "auto" => default,
            "none" => ToolChoice::None,
            "required" if !tools.is_empty() => ToolChoice::Required,
            other => {
                return Err(ApiError::bad_param(
                    "tool_choice",
                    format!("tool_choice '{other}' is not one of none, auto, required (required needs tools)"),
                ))
            }
        },
        Some(v) if v["type"] == "function" => {
            let name = v["name"].as_str().unwrap_or_default();
            if !tools.iter().any(|t| t["function"]["name"] == name) {
                return Err(ApiError::bad_param(
                    "tool_choice",
                    format!("tool_choice names '{name}', which is not among the tools"),
                ));
            }
            ToolChoice::Function(name.to_string())
        }
        Some(_) => {
            return Err(ApiError::bad_param(
                "tool_choice",
                "tool_choice must be none, auto, required or {\"type\": \"function\", \"name\"}",
            ))
        }
    };
    Ok(choice)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_become_chat_messages() {
        let input = json!([
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{\"city\":\"Rome\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"role": "user", "content": "thanks", "type": "message"},
        ]);
        let mut out = Vec::new();
        input_messages(&input, &mut out).unwrap();
        assert_eq!(out.len(), 4);
        assert_eq!(out[1]["reasoning_content"], "hmm");
        assert_eq!(out[1]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(
            out[2],
            json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"})
        );
        let mut out = Vec::new();
        let e = input_messages(&json!([{"type": "input_image"}]), &mut out).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[0].type"));
    }
}
