//! OpenAI chat messages → the shape chat templates expect.
//!
//! Messages pass through as the client wrote them (transformers hands templates the same dicts), with
//! three changes the templates need (as vLLM's and mlx-lm's servers make them): `developer` is a system message,
//! `reasoning` is accepted as `reasoning_content`, and `tool_calls[].function.arguments`, a JSON string
//! on the wire, becomes the mapping the template iterates with `|items`. Everything else is validated
//! here so a bad message is a 400 naming the field, not a template error.

use serde_json::{Map, Value as Json};

/// A message the server must refuse; `param` names the field (`messages[2].content`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct MessageError {
    pub param: String,
    pub message: String,
}

fn err(param: String, message: impl Into<String>) -> MessageError {
    MessageError {
        param,
        message: message.into(),
    }
}

pub const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

pub fn prepare_messages(messages: &[Json]) -> Result<Vec<Json>, MessageError> {
    if messages.is_empty() {
        return Err(err(
            "messages".into(),
            "messages must contain at least one message",
        ));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| prepare_message(i, m))
        .collect()
}

fn prepare_message(index: usize, message: &Json) -> Result<Json, MessageError> {
    let at = |field: &str| format!("messages[{index}]{field}");
    let Json::Object(fields) = message else {
        return Err(err(at(""), format!("messages[{index}] must be an object")));
    };
    let role = match fields.get("role") {
        Some(Json::String(role)) if ROLES.contains(&role.as_str()) => role.as_str(),
        Some(Json::String(role)) => {
            return Err(err(
                at(".role"),
                format!(
                    "messages[{index}].role: unknown role '{role}' (expected one of {})",
                    ROLES.join(", ")
                ),
            ))
        }
        Some(_) => {
            return Err(err(
                at(".role"),
                format!("messages[{index}].role must be a string"),
            ))
        }
        None => return Err(err(at(".role"), format!("messages[{index}] has no role"))),
    };
    let mut out: Map<String, Json> = fields.clone();
    if role == "developer" {
        out.insert("role".into(), Json::from("system"));
    }

    let has_tool_calls =
        matches!(fields.get("tool_calls"), Some(Json::Array(calls)) if !calls.is_empty());
    match fields.get("content") {
        Some(Json::String(_)) => {}
        Some(Json::Array(parts)) => check_parts(index, parts)?,
        None | Some(Json::Null) if role == "assistant" => {}
        None | Some(Json::Null) => {
            return Err(err(
                at(".content"),
                format!("messages[{index}].content is required for a {role} message"),
            ))
        }
        Some(_) => {
            return Err(err(
                at(".content"),
                format!("messages[{index}].content must be a string or an array of text parts"),
            ))
        }
    }
    if role == "assistant" {
        if !out.contains_key("reasoning_content") {
            if let Some(reasoning) = out.get("reasoning").cloned() {
                out.insert("reasoning_content".into(), reasoning);
            }
        }
        out.remove("reasoning");
        match out.get("reasoning_content") {
            None | Some(Json::Null) | Some(Json::String(_)) => {}
            Some(_) => {
                return Err(err(
                    at(".reasoning_content"),
                    format!("messages[{index}].reasoning_content must be a string"),
                ))
            }
        }
        if has_tool_calls {
            let calls = prepare_tool_calls(index, &fields["tool_calls"])?;
            out.insert("tool_calls".into(), calls);
        }
    }
    if role == "tool" {
        if let Some(id) = fields.get("tool_call_id") {
            if !id.is_string() {
                return Err(err(
                    at(".tool_call_id"),
                    format!("messages[{index}].tool_call_id must be a string"),
                ));
            }
        }
    }
    Ok(Json::Object(out))
}

fn check_parts(index: usize, parts: &[Json]) -> Result<(), MessageError> {
    for (j, part) in parts.iter().enumerate() {
        let param = format!("messages[{index}].content[{j}]");
        let kind = part.get("type").and_then(Json::as_str);
        match kind {
            Some("text") if part.get("text").map(Json::is_string) == Some(true) => {}
            Some("text") => {
                return Err(err(param.clone(), format!("{param}.text must be a string")))
            }
            Some(other) => {
                return Err(err(
                    param.clone(),
                    format!(
                        "{param}: content parts of type '{other}' are not supported (text only)"
                    ),
                ))
            }
            None => {
                return Err(err(
                    param.clone(),
                    format!("{param} must be an object with a type"),
                ))
            }
        }
    }
    Ok(())
}

fn prepare_tool_calls(index: usize, calls: &Json) -> Result<Json, MessageError> {
    let Json::Array(calls) = calls else {
        unreachable!("checked by the caller")
    };
    let mut out = Vec::with_capacity(calls.len());
    for (j, call) in calls.iter().enumerate() {
        let param = format!("messages[{index}].tool_calls[{j}]");
        let Some(mut call) = call.as_object().cloned() else {
            return Err(err(param.clone(), format!("{param} must be an object")));
        };
        // OpenAI nests name and arguments in `function`; transformers also accepts them at the top
        // level of the call (the template reads `tool_call.function` when it is defined).
        let wrapped = call.contains_key("function");
        let mut function = match call.get("function") {
            Some(Json::Object(function)) => function.clone(),
            None if call.contains_key("name") => call.clone(),
            _ => {
                return Err(err(
                    format!("{param}.function"),
                    format!("{param}.function must be an object"),
                ))
            }
        };
        let param = if wrapped {
            format!("{param}.function")
        } else {
            param
        };
        if !function.get("name").map(Json::is_string).unwrap_or(false) {
            return Err(err(
                format!("{param}.name"),
                format!("{param}.name must be a string"),
            ));
        }
        let arguments = match function.get("arguments") {
            Some(Json::String(text)) if text.trim().is_empty() => Json::Object(Map::new()),
            Some(Json::String(text)) => match serde_json::from_str::<Json>(text) {
                Ok(Json::Object(map)) => Json::Object(map),
                Ok(_) => {
                    return Err(err(
                        format!("{param}.arguments"),
                        format!("{param}.arguments must encode a JSON object"),
                    ))
                }
                Err(e) => {
                    return Err(err(
                        format!("{param}.arguments"),
                        format!("{param}.arguments is not valid JSON: {e}"),
                    ))
                }
            },
            Some(Json::Object(map)) => Json::Object(map.clone()),
            None | Some(Json::Null) => Json::Object(Map::new()),
            Some(_) => {
                return Err(err(
                    format!("{param}.arguments"),
                    format!("{param}.arguments must be a JSON string"),
                ))
            }
        };
        function.insert("arguments".into(), arguments);
        if wrapped {
            call.insert("function".into(), Json::Object(function));
        } else {
            call = function;
        }
        out.push(Json::Object(call));
    }
    Ok(Json::Array(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn arguments_become_mappings_and_reasoning_is_renamed() {
        let out = prepare_messages(&[
            json!({"role": "developer", "content": "be brief"}),
            json!({"role": "user", "content": [{"type": "text", "text": "hi"}]}),
            json!({"role": "assistant", "content": null, "reasoning": "think",
                   "tool_calls": [{"id": "call_1", "type": "function",
                                   "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": [2]}"}}]}),
            json!({"role": "tool", "tool_call_id": "call_1", "content": "42"}),
        ])
        .unwrap();
        assert_eq!(out[0]["role"], "system");
        assert_eq!(out[2]["reasoning_content"], "think");
        assert!(out[2].get("reasoning").is_none());
        let args = &out[2]["tool_calls"][0]["function"]["arguments"];
        // key order survives (templates iterate it with |items)
        let keys: Vec<&String> = args.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["b", "a"]);
    }

    #[test]
    fn bad_messages_name_the_field() {
        let cases = [
            (json!([]), "messages"),
            (json!(["hello"]), "messages[0]"),
            (
                json!([{"role": "wizard", "content": "x"}]),
                "messages[0].role",
            ),
            (json!([{"role": 3, "content": "x"}]), "messages[0].role"),
            (json!([{"content": "x"}]), "messages[0].role"),
            (json!([{"role": "user"}]), "messages[0].content"),
            (
                json!([{"role": "user", "content": 5}]),
                "messages[0].content",
            ),
            (
                json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
                "messages[0].content[0]",
            ),
            (
                json!([{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                     "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]),
                "messages[1].tool_calls[0].function.arguments",
            ),
            (
                json!([{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                     "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]),
                "messages[1].tool_calls[0].function.arguments",
            ),
        ];
        for (messages, param) in cases {
            let e = prepare_messages(messages.as_array().unwrap()).unwrap_err();
            assert_eq!(e.param, param, "{messages}: {e}");
        }
    }
}
