//! Generated text → what an OpenAI reply carries: reasoning, content, tool calls.
//!
//! The reasoning parser runs first; its content goes through the tool-call parser when the request
//! has tools. Both are incremental, so streaming and non-streaming replies are the same parse: a
//! non-streamed reply is the streamed events folded into a [`ParsedOutput`].

use serde_json::Value as Json;

use crate::reasoning::{ReasoningParser, Segment};
use crate::tool_parser::{ToolCallParser, ToolEvent};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputEvent {
    Reasoning(String),
    Content(String),
    ToolCallStart { index: usize, name: String },
    ToolCallArguments { index: usize, fragment: String },
}

#[derive(Debug, Clone, Default)]
pub struct OutputConfig {
    /// The prompt ends inside an open `<think>` block ([`crate::reasoning::prompt_opens_thinking`]).
    pub starts_in_reasoning: bool,
    /// Tool definitions whose calls are to be parsed; None = no tool parsing (no tools, or
    /// tool_choice "none").
    pub tools: Option<Vec<Json>>,
}

#[derive(Debug, Clone)]
pub struct OutputParser {
    reasoning: ReasoningParser,
    tools: Option<ToolCallParser>,
}

impl OutputParser {
    pub fn new(config: &OutputConfig) -> OutputParser {
        OutputParser {
            reasoning: ReasoningParser::new(config.starts_in_reasoning, config.tools.is_some()),
            tools: config.tools.as_deref().map(ToolCallParser::new),
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<OutputEvent> {
        let segments = self.reasoning.push(text);
        self.route(segments, false)
    }

    pub fn finish(&mut self) -> Vec<OutputEvent> {
        let segments = self.reasoning.finish();
        self.route(segments, true)
    }

    /// Tool calls started so far.
    pub fn tool_calls(&self) -> usize {
        self.tools.as_ref().map_or(0, ToolCallParser::calls)
    }

    fn route(&mut self, segments: Vec<Segment>, finish: bool) -> Vec<OutputEvent> {
        let mut out = Vec::new();
        for segment in segments {
            match segment {
                Segment::Reasoning(text) => out.push(OutputEvent::Reasoning(text)),
                Segment::Content(text) => match &mut self.tools {
                    Some(tools) => out.extend(tools.push(&text).into_iter().map(from_tool_event)),
                    None => out.push(OutputEvent::Content(text)),
                },
            }
        }
        if finish {
            if let Some(tools) = &mut self.tools {
                out.extend(tools.finish().into_iter().map(from_tool_event));
            }
        }
        out
    }
}

fn from_tool_event(event: ToolEvent) -> OutputEvent {
    match event {
        ToolEvent::Content(text) => OutputEvent::Content(text),
        ToolEvent::CallStart { index, name } => OutputEvent::ToolCallStart { index, name },
        ToolEvent::CallArguments { index, fragment } => {
            OutputEvent::ToolCallArguments { index, fragment }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedToolCall {
    pub name: String,
    /// JSON text of the arguments object.
    pub arguments: String,
}

/// A whole reply, folded from events.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedOutput {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ParsedToolCall>,
}

impl ParsedOutput {
    pub fn absorb(&mut self, event: OutputEvent) {
        match event {
            OutputEvent::Reasoning(text) => self.reasoning.push_str(&text),
            OutputEvent::Content(text) => self.content.push_str(&text),
            OutputEvent::ToolCallStart { name, .. } => self.tool_calls.push(ParsedToolCall {
                name,
                arguments: String::new(),
            }),
            OutputEvent::ToolCallArguments { index, fragment } => {
                if let Some(call) = self.tool_calls.get_mut(index) {
                    call.arguments.push_str(&fragment);
                }
            }
        }
    }

    /// Parse a complete text in one go.
    pub fn parse(text: &str, config: &OutputConfig) -> ParsedOutput {
        let mut parser = OutputParser::new(config);
        let mut parsed = ParsedOutput::default();
        for event in parser.push(text).into_iter().chain(parser.finish()) {
            parsed.absorb(event);
        }
        parsed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn tools() -> Vec<Json> {
        vec![
            json!({"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}}}),
        ]
    }

    fn parse_pieces(pieces: &[&str], config: &OutputConfig) -> ParsedOutput {
        let mut parser = OutputParser::new(config);
        let mut parsed = ParsedOutput::default();
        for piece in pieces {
            for event in parser.push(piece) {
                parsed.absorb(event);
            }
        }
        for event in parser.finish() {
            parsed.absorb(event);
        }
        parsed
    }

    #[test]
    fn reasoning_content_and_call() {
        let config = OutputConfig {
            starts_in_reasoning: true,
            tools: Some(tools()),
        };
        let text = "I need f.\n</think>\n\nCalling.\n\n<tool_call>\n<function=f>\n<parameter=n>\n7\n</parameter>\n<parameter=s>\nhi\nthere\n</parameter>\n</function>\n</tool_call>";
        let parsed = ParsedOutput::parse(text, &config);
        assert_eq!(parsed.reasoning, "I need f.");
        assert_eq!(parsed.content, "Calling.");
        assert_eq!(
            parsed.tool_calls,
            vec![ParsedToolCall {
                name: "f".into(),
                arguments: r#"{"n": 7, "s": "hi\nthere"}"#.into()
            }]
        );
    }

    #[test]
    fn without_tools_calls_are_content() {
        let config = OutputConfig {
            starts_in_reasoning: false,
            tools: None,
        };
        let text = "<tool_call>\n<function=f>\n</function>\n</tool_call>";
        assert_eq!(ParsedOutput::parse(text, &config).content, text);
    }

    // Texts built from the pieces that matter (tags, their prefixes, whitespace, plain and multibyte
    // text), so random texts hit tag boundaries often.
    fn fragment() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec![
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<function=f>",
            "</function>",
            "<parameter=n>",
            "<parameter=s>",
            "</parameter>",
            "\n",
            "\n\n",
            " ",
            "12",
            "x",
            "é",
            "<",
            "</",
            "<tool",
            "<para",
            "null",
            "日本",
        ])
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn any_split_gives_the_whole_text_result(
            parts in prop::collection::vec(fragment(), 0..24),
            cuts in prop::collection::vec(0usize..200, 0..12),
            starts_in_reasoning: bool,
            with_tools: bool,
        ) {
            let text: String = parts.concat();
            let config = OutputConfig {
                starts_in_reasoning,
                tools: with_tools.then(tools),
            };
            let whole = ParsedOutput::parse(&text, &config);
            let mut bounds: Vec<usize> = cuts.into_iter()
                .map(|c| c.min(text.len()))
                .filter(|c| text.is_char_boundary(*c))
                .collect();
            bounds.extend([0, text.len()]);
            bounds.sort();
            bounds.dedup();
            let pieces: Vec<&str> = bounds.windows(2).map(|w| &text[w[0]..w[1]]).collect();
            prop_assert_eq!(parse_pieces(&pieces, &config), whole.clone());
            // one character at a time, the worst case for buffering
            let chars: Vec<String> = text.chars().map(String::from).collect();
            let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
            prop_assert_eq!(parse_pieces(&chars, &config), whole.clone());
            // arguments are always a JSON object
            for call in &whole.tool_calls {
                let parsed: Result<Json, _> = serde_json::from_str(&call.arguments);
                prop_assert!(parsed.map(|v| v.is_object()).unwrap_or(false), "{}", call.arguments);
            }
        }
    }
}
