//! Qwen3.5/3.6 tool calls (the `qwen3_coder` format) → OpenAI tool calls, incrementally.
//!
//! ```text
//! <tool_call>
//! <function=NAME>
//! <parameter=ARG>
//! VALUE
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//! As vLLM's and mlx-lm's `qwen3_coder` parsers do: one leading and one trailing `\n`
//! of a value are framing; a value ends at `</parameter>`, or at the next `<parameter=` or
//! `</function>` when the model forgot to close it; the value is typed by the tool's JSON schema
//! (integer, number, boolean, object/array as JSON, "null" → null, anything else a string). Streaming
//! emits the call's name first, then `{`, one `"name": value` fragment per completed parameter, and `}`,
//! so the fragments concatenate to `json.dumps(arguments)`. Content before a call loses its trailing
//! whitespace (the template's `\n\n` separator); whitespace between and after calls is dropped.

use std::collections::HashMap;

use serde_json::{Map, Value as Json};

use crate::pyjson;
use crate::scan::{find_first, may_start_with, partial_tag_suffix};

const TOOL_CALL_OPEN: &str = "<tool_call>";
const TOOL_CALL_CLOSE: &str = "</tool_call>";
const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAMETER_OPEN: &str = "<parameter=";
const PARAMETER_CLOSE: &str = "</parameter>";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    Content(String),
    /// A new call: its position among this reply's calls and the function name.
    CallStart {
        index: usize,
        name: String,
    },
    /// The next piece of the call's JSON arguments.
    CallArguments {
        index: usize,
        fragment: String,
    },
}

#[derive(Debug, Clone)]
enum State {
    /// Plain content; `after_call` drops the whitespace that follows a call.
    Text { after_call: bool },
    /// After `<tool_call>`, waiting for `<function=NAME>`; `raw` is what was consumed, released as
    /// content if no function follows.
    Open { raw: String },
    /// Inside `<function=…>`, between parameters.
    Arguments {
        index: usize,
        function: String,
        first: bool,
    },
    /// Inside `<parameter=NAME>`, waiting for the value's end.
    Value {
        index: usize,
        function: String,
        parameter: String,
        first: bool,
    },
    /// After `</function>`, expecting `</tool_call>`.
    AfterFunction,
}

#[derive(Debug, Clone)]
pub struct ToolCallParser {
    /// tool name → JSON schema `properties`
    properties: HashMap<String, Map<String, Json>>,
    state: State,
    pending: String,
    calls: usize,
}

impl ToolCallParser {
    /// `tools`: OpenAI tool definitions (`{"type": "function", "function": {"name", "parameters"}}`).
    pub fn new(tools: &[Json]) -> ToolCallParser {
        let mut properties = HashMap::new();
        for tool in tools {
            let function = tool.get("function").unwrap_or(tool);
            if let Some(name) = function.get("name").and_then(Json::as_str) {
                let props = function
                    .get("parameters")
                    .and_then(|p| p.get("properties"))
                    .and_then(Json::as_object)
                    .cloned()
                    .unwrap_or_default();
                properties.insert(name.to_string(), props);
            }
        }
        ToolCallParser {
            properties,
            state: State::Text { after_call: false },
            pending: String::new(),
            calls: 0,
        }
    }

    /// Calls started so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        self.process(&mut out);
        out
    }

    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let rest = std::mem::take(&mut self.pending);
        let mut out = Vec::new();
        match std::mem::replace(&mut self.state, State::Text { after_call: false }) {
            State::Text { after_call } => {
                let body = if after_call { rest.trim_start() } else { &rest };
                if !body.is_empty() {
                    out.push(ToolEvent::Content(body.to_string()));
                }
            }
            State::Open { raw } => out.push(ToolEvent::Content(raw + &rest)),
            State::Arguments { index, .. } => out.push(ToolEvent::CallArguments {
                index,
                fragment: "}".into(),
            }),
            State::Value {
                index,
                function,
                parameter,
                first,
            } => {
                let fragment = self.parameter_fragment(&function, &parameter, &rest, first);
                out.push(ToolEvent::CallArguments { index, fragment });
                out.push(ToolEvent::CallArguments {
                    index,
                    fragment: "}".into(),
                });
            }
            State::AfterFunction => {}
        }
        out
    }

    fn drop_leading_whitespace(&mut self) {
        let n = self.pending.len() - self.pending.trim_start().len();
        self.pending.drain(..n);
    }

    fn process(&mut self, out: &mut Vec<ToolEvent>) {
        loop {
            let state = std::mem::replace(&mut self.state, State::Text { after_call: false });
            let (next, wait) = self.step(state, out);
            self.state = next;
            if wait {
                return;
            }
        }
    }

    /// One transition: the next state, and whether more text is needed before going on.
    fn step(&mut self, state: State, out: &mut Vec<ToolEvent>) -> (State, bool) {
        match state {
            State::Text { after_call } => {
                if after_call {
                    self.drop_leading_whitespace();
                    if self.pending.is_empty() {
                        return (State::Text { after_call: true }, true);
                    }
                }
                if let Some((at, _)) = find_first(&self.pending, &[TOOL_CALL_OPEN]) {
                    let body = self.pending[..at].trim_end();
                    if !body.is_empty() {
                        out.push(ToolEvent::Content(body.to_string()));
                    }
                    // The separating whitespace is kept in `raw` in case this is not a call.
                    let body_len = body.len();
                    self.pending.drain(..body_len);
                    let raw: String = self
                        .pending
                        .drain(..at - body_len + TOOL_CALL_OPEN.len())
                        .collect();
                    return (State::Open { raw }, false);
                }
                // Hold back a possible start of <tool_call> and the whitespace before it.
                let releasable =
                    self.pending.len() - partial_tag_suffix(&self.pending, &[TOOL_CALL_OPEN]);
                let body = self.pending[..releasable].trim_end();
                if !body.is_empty() {
                    out.push(ToolEvent::Content(body.to_string()));
                    let n = body.len();
                    self.pending.drain(..n);
                }
                (State::Text { after_call: false }, true)
            }
            State::Open { mut raw } => {
                let n = self.pending.len() - self.pending.trim_start().len();
                raw.extend(self.pending.drain(..n));
                if self.pending.is_empty() {
                    return (State::Open { raw }, true);
                }
                if self.pending.starts_with(FUNCTION_OPEN) {
                    let Some(close) = self.pending.find('>') else {
                        return (State::Open { raw }, true);
                    };
                    let function = self.pending[FUNCTION_OPEN.len()..close].trim().to_string();
                    self.pending.drain(..close + 1);
                    let index = self.calls;
                    self.calls += 1;
                    out.push(ToolEvent::CallStart {
                        index,
                        name: function.clone(),
                    });
                    out.push(ToolEvent::CallArguments {
                        index,
                        fragment: "{".into(),
                    });
                    return (
                        State::Arguments {
                            index,
                            function,
                            first: true,
                        },
                        false,
                    );
                }
                if may_start_with(&self.pending, FUNCTION_OPEN) {
                    return (State::Open { raw }, true);
                }
                // Not a call after all: what was consumed is content.
                out.push(ToolEvent::Content(raw));
                (State::Text { after_call: false }, false)
            }
            State::Arguments {
                index,
                function,
                first,
            } => {
                self.drop_leading_whitespace();
                let waiting = State::Arguments {
                    index,
                    function: function.clone(),
                    first,
                };
                if self.pending.is_empty() {
                    return (waiting, true);
                }
                if self.pending.starts_with(PARAMETER_OPEN) {
                    let Some(close) = self.pending.find('>') else {
                        return (waiting, true);
                    };
                    let parameter = self.pending[PARAMETER_OPEN.len()..close].trim().to_string();
                    self.pending.drain(..close + 1);
                    return (
                        State::Value {
                            index,
                            function,
                            parameter,
                            first,
                        },
                        false,
                    );
                }
                if self.pending.starts_with(FUNCTION_CLOSE) {
                    self.pending.drain(..FUNCTION_CLOSE.len());
                    out.push(ToolEvent::CallArguments {
                        index,
                        fragment: "}".into(),
                    });
                    return (State::AfterFunction, false);
                }
                if may_start_with(&self.pending, PARAMETER_OPEN)
                    || may_start_with(&self.pending, FUNCTION_CLOSE)
                {
                    return (waiting, true);
                }
                // Stray text between parameters carries nothing: skip one character.
                let skip = self.pending.chars().next().map_or(0, char::len_utf8);
                self.pending.drain(..skip);
                (waiting, false)
            }
            State::Value {
                index,
                function,
                parameter,
                first,
            } => {
                let ends = [PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE];
                let Some((at, end)) = find_first(&self.pending, &ends) else {
                    // The value is typed as a whole: wait for its end.
                    let waiting = State::Value {
                        index,
                        function,
                        parameter,
                        first,
                    };
                    return (waiting, true);
                };
                let raw_value: String = self.pending.drain(..at).collect();
                if end == 0 {
                    self.pending.drain(..PARAMETER_CLOSE.len());
                }
                let fragment = self.parameter_fragment(&function, &parameter, &raw_value, first);
                out.push(ToolEvent::CallArguments { index, fragment });
                (
                    State::Arguments {
                        index,
                        function,
                        first: false,
                    },
                    false,
                )
            }
            State::AfterFunction => {
                self.drop_leading_whitespace();
                if self.pending.is_empty() {
                    return (State::AfterFunction, true);
                }
                if self.pending.starts_with(TOOL_CALL_CLOSE) {
                    self.pending.drain(..TOOL_CALL_CLOSE.len());
                    return (State::Text { after_call: true }, false);
                }
                if self.pending.starts_with(TOOL_CALL_OPEN) {
                    // </tool_call> forgotten: the next call starts directly.
                    self.pending.drain(..TOOL_CALL_OPEN.len());
                    let raw = TOOL_CALL_OPEN.to_string();
                    return (State::Open { raw }, false);
                }
                if may_start_with(&self.pending, TOOL_CALL_CLOSE)
                    || may_start_with(&self.pending, TOOL_CALL_OPEN)
                {
                    return (State::AfterFunction, true);
                }
                (State::Text { after_call: true }, false)
            }
        }
    }

    /// `"name": value` (with `, ` before all but the first), the value typed by the schema.
    fn parameter_fragment(
        &self,
        function: &str,
        parameter: &str,
        raw: &str,
        first: bool,
    ) -> String {
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let schema = self
            .properties
            .get(function)
            .and_then(|props| props.get(parameter));
        let value = convert_parameter(raw, schema);
        format!(
            "{}{}: {}",
            if first { "" } else { ", " },
            pyjson::dumps(&Json::from(parameter)),
            pyjson::dumps(&value)
        )
    }
}

/// A parameter's text typed by its JSON schema, as vLLM's `qwen3_coder` `_convert_param_value`.
pub fn convert_parameter(raw: &str, schema: Option<&Json>) -> Json {
    if raw.eq_ignore_ascii_case("null") {
        return Json::Null;
    }
    let Some(schema) = schema else {
        return Json::from(raw);
    };
    let kind = match schema.get("type") {
        Some(Json::String(t)) => t.trim().to_ascii_lowercase(),
        // ["integer", "null"]: the first non-null type
        Some(Json::Array(types)) => types
            .iter()
            .filter_map(Json::as_str)
            .find(|t| *t != "null")
            .unwrap_or("string")
            .to_ascii_lowercase(),
        // No type but a structure ($ref, anyOf, properties, …): the value is JSON.
        None if ["$ref", "anyOf", "oneOf", "allOf", "properties", "items"]
            .iter()
            .any(|k| schema.get(k).is_some()) =>
        {
            "object".into()
        }
        _ => "string".into(),
    };
    let text = raw.trim();
    match kind.as_str() {
        "string" | "str" | "text" | "varchar" | "char" | "enum" => Json::from(raw),
        k if ["int", "uint", "long", "short", "unsigned"]
            .iter()
            .any(|p| k.starts_with(p)) =>
        {
            text.parse::<i64>()
                .map(Json::from)
                .unwrap_or_else(|_| Json::from(raw))
        }
        k if k.starts_with("num") || k.starts_with("float") => match text.parse::<f64>() {
            Ok(x) if x.is_finite() => {
                if x.fract() == 0.0 && x.abs() < 9.0e15 {
                    Json::from(x as i64)
                } else {
                    Json::from(x)
                }
            }
            _ => Json::from(raw),
        },
        "boolean" | "bool" | "binary" => Json::from(text.eq_ignore_ascii_case("true")),
        _ => serde_json::from_str::<Json>(text).unwrap_or_else(|_| Json::from(raw)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather_tools() -> Vec<Json> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                           "metric": {"type": "boolean"}, "scale": {"type": "number"},
                           "extra": {"type": "object"}, "tags": {"type": ["array", "null"]}}}}}),
        ]
    }

    fn collect(events: Vec<ToolEvent>) -> (String, Vec<(String, String)>) {
        let mut content = String::new();
        let mut calls: Vec<(String, String)> = Vec::new();
        for e in events {
            match e {
                ToolEvent::Content(t) => content.push_str(&t),
                ToolEvent::CallStart { index, name } => {
                    assert_eq!(index, calls.len());
                    calls.push((name, String::new()));
                }
                ToolEvent::CallArguments { index, fragment } => calls[index].1.push_str(&fragment),
            }
        }
        (content, calls)
    }

    fn parse(text: &str) -> (String, Vec<(String, String)>) {
        let mut p = ToolCallParser::new(&weather_tools());
        let mut events = p.push(text);
        events.extend(p.finish());
        collect(events)
    }

    #[test]
    fn typed_arguments_from_the_schema() {
        let text = "Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=scale>\n2.50\n</parameter>\n<parameter=extra>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=tags>\nnull\n</parameter>\n<parameter=unknown>\n 7 \n</parameter>\n</function>\n</tool_call>";
        let (content, calls) = parse(text);
        assert_eq!(content, "Let me check.");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].0, "get_weather");
        assert_eq!(
            calls[0].1,
            r#"{"city": "San Francisco", "days": 3, "metric": true, "scale": 2.5, "extra": {"a": [1, 2]}, "tags": null, "unknown": " 7 "}"#
        );
        let parsed: Json = serde_json::from_str(&calls[0].1).unwrap();
        assert_eq!(parsed["days"], 3);
    }

    #[test]
    fn two_calls_and_unclosed_parameter() {
        let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\nx\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n</function>\n</tool_call>\n";
        let (content, calls) = parse(text);
        assert_eq!(content, "");
        assert_eq!(
            calls,
            vec![
                (
                    "get_weather".to_string(),
                    r#"{"city": "Paris", "days": "x"}"#.to_string()
                ),
                ("get_weather".to_string(), "{}".to_string())
            ]
        );
    }

    #[test]
    fn not_a_call_is_content() {
        assert_eq!(parse("a <tool_call> b"), ("a <tool_call> b".into(), vec![]));
        assert_eq!(parse("x <tool_c"), ("x <tool_c".into(), vec![]));
    }

    #[test]
    fn truncated_call_is_closed() {
        let (_, calls) = parse("<tool_call>\n<function=get_weather>\n<parameter=city>\nRo");
        assert_eq!(
            calls,
            vec![("get_weather".into(), r#"{"city": "Ro"}"#.into())]
        );
    }

    #[test]
    fn streaming_emits_name_before_arguments() {
        let mut p = ToolCallParser::new(&weather_tools());
        let mut events = p.push("<tool_call>\n<function=get_we");
        assert!(events.is_empty());
        events = p.push("ather>\n<parameter=days>\n4");
        assert_eq!(
            events,
            vec![
                ToolEvent::CallStart {
                    index: 0,
                    name: "get_weather".into()
                },
                ToolEvent::CallArguments {
                    index: 0,
                    fragment: "{".into()
                },
            ]
        );
        events = p.push("\n</parameter>\n");
        assert_eq!(
            events,
            vec![ToolEvent::CallArguments {
                index: 0,
                fragment: "\"days\": 4".into()
            }]
        );
    }

    #[test]
    fn conversions() {
        let s = |t: &str| json!({"type": t});
        assert_eq!(convert_parameter("12", Some(&s("integer"))), json!(12));
        let by_ref = json!({"$ref": "#/$defs/Addr"});
        assert_eq!(
            convert_parameter("{\"zip\": 1}", Some(&by_ref)),
            json!({"zip": 1})
        );
        assert_eq!(convert_parameter("plain", Some(&by_ref)), json!("plain"));
        assert_eq!(convert_parameter("12a", Some(&s("integer"))), json!("12a"));
        assert_eq!(convert_parameter("1.0", Some(&s("number"))), json!(1));
        assert_eq!(convert_parameter("1.5", Some(&s("number"))), json!(1.5));
        assert_eq!(
            convert_parameter("false", Some(&s("boolean"))),
            json!(false)
        );
        assert_eq!(
            convert_parameter("[1, 2]", Some(&s("array"))),
            json!([1, 2])
        );
        assert_eq!(
            convert_parameter("[1, 2", Some(&s("array"))),
            json!("[1, 2")
        );
        assert_eq!(convert_parameter("NULL", Some(&s("string"))), json!(null));
        assert_eq!(convert_parameter("42", None), json!("42"));
    }
}
