//! Splits generated text into reasoning (between `<think>` and `</think>`) and content, incrementally.
//!
//! Qwen3.5/3.6 prompts with thinking on end inside `<think>\n`, so generation starts in reasoning and the
//! model closes it with `</think>\n\n`; with thinking off the prompt already holds the empty block and
//! generation starts in content. A model that opens `<think>` itself at the start of its reply is
//! handled too. Whitespace around the tags is the template's framing, not text: it is dropped at the
//! start of each part and at the end of the reasoning (the template trims both when it re-renders them).
//! With tools, `<tool_call>` inside reasoning ends it: the call goes to the tool parser instead of being
//! lost in the thinking (a known failure of other servers).

use crate::scan::{find_first, may_start_with, partial_tag_suffix, split_trailing_whitespace};

pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";
const TOOL_CALL_OPEN: &str = "<tool_call>";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    Reasoning(String),
    Content(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Reasoning,
    Content,
}

#[derive(Debug, Clone)]
pub struct ReasoningParser {
    mode: Mode,
    /// Nothing released yet in this mode: leading whitespace (and, where allowed, `<think>`) is skipped.
    at_start: bool,
    /// Content may still open a think block (only before any content and before any `</think>`).
    content_may_open_think: bool,
    tool_call_ends_reasoning: bool,
    pending: String,
}

/// Whether a rendered prompt leaves the model inside an open `<think>` block.
pub fn prompt_opens_thinking(prompt: &str) -> bool {
    match (prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)) {
        (Some(open), Some(close)) => open > close,
        (Some(_), None) => true,
        _ => false,
    }
}

impl ReasoningParser {
    pub fn new(starts_in_reasoning: bool, tool_call_ends_reasoning: bool) -> ReasoningParser {
        ReasoningParser {
            mode: if starts_in_reasoning {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            at_start: true,
            content_may_open_think: !starts_in_reasoning,
            tool_call_ends_reasoning,
            pending: String::new(),
        }
    }

    pub fn in_reasoning(&self) -> bool {
        self.mode == Mode::Reasoning
    }

    pub fn push(&mut self, text: &str) -> Vec<Segment> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        self.process(&mut out);
        out
    }

    pub fn finish(&mut self) -> Vec<Segment> {
        let rest = std::mem::take(&mut self.pending);
        let mut out = Vec::new();
        match self.mode {
            Mode::Reasoning => {
                let body = if self.at_start {
                    rest.trim()
                } else {
                    rest.trim_end()
                };
                if !body.is_empty() {
                    out.push(Segment::Reasoning(body.to_string()));
                }
            }
            Mode::Content => {
                let body = if self.at_start {
                    rest.trim_start()
                } else {
                    &rest
                };
                if !body.is_empty() {
                    out.push(Segment::Content(body.to_string()));
                }
            }
        }
        out
    }

    fn process(&mut self, out: &mut Vec<Segment>) {
        loop {
            if self.at_start {
                let skipped = self.pending.len() - self.pending.trim_start().len();
                self.pending.drain(..skipped);
                if self.pending.is_empty() {
                    return;
                }
                let think_opens = self.mode == Mode::Reasoning || self.content_may_open_think;
                if think_opens && may_start_with(&self.pending, THINK_OPEN) {
                    if !self.pending.starts_with(THINK_OPEN) {
                        return; // wait: it may still become <think>
                    }
                    self.pending.drain(..THINK_OPEN.len());
                    self.mode = Mode::Reasoning;
                    self.content_may_open_think = false;
                    continue;
                }
                self.at_start = false;
                self.content_may_open_think = false;
            }
            match self.mode {
                Mode::Content => {
                    if !self.pending.is_empty() {
                        out.push(Segment::Content(std::mem::take(&mut self.pending)));
                    }
                    return;
                }
                Mode::Reasoning => {
                    let tags: &[&str] = if self.tool_call_ends_reasoning {
                        &[THINK_CLOSE, TOOL_CALL_OPEN]
                    } else {
                        &[THINK_CLOSE]
                    };
                    if let Some((at, tag)) = find_first(&self.pending, tags) {
                        let body = self.pending[..at].trim_end();
                        if !body.is_empty() {
                            out.push(Segment::Reasoning(body.to_string()));
                        }
                        // </think> is consumed; <tool_call> stays for the tool parser.
                        let consumed = if tag == 0 { at + THINK_CLOSE.len() } else { at };
                        self.pending.drain(..consumed);
                        self.mode = Mode::Content;
                        self.at_start = true;
                        continue;
                    }
                    let releasable = self.pending.len() - partial_tag_suffix(&self.pending, tags);
                    let (body, _) = split_trailing_whitespace(&self.pending[..releasable]);
                    if !body.is_empty() {
                        out.push(Segment::Reasoning(body.to_string()));
                        let n = body.len();
                        self.pending.drain(..n);
                    }
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(start_in_reasoning: bool, pieces: &[&str]) -> (String, String) {
        let mut p = ReasoningParser::new(start_in_reasoning, true);
        let mut segments = Vec::new();
        for piece in pieces {
            segments.extend(p.push(piece));
        }
        segments.extend(p.finish());
        let (mut reasoning, mut content) = (String::new(), String::new());
        for s in segments {
            match s {
                Segment::Reasoning(t) => reasoning.push_str(&t),
                Segment::Content(t) => content.push_str(&t),
            }
        }
        (reasoning, content)
    }

    #[test]
    fn thinking_prompt_starts_in_reasoning() {
        assert_eq!(
            parse(
                true,
                &[
                    "Let me",
                    " think.\n",
                    "</thi",
                    "nk>\n\nThe answer",
                    " is 4."
                ]
            ),
            ("Let me think.".into(), "The answer is 4.".into())
        );
    }

    #[test]
    fn model_opened_think_block() {
        assert_eq!(
            parse(false, &["<th", "ink>\nhmm\n</think>\n\nok"]),
            ("hmm".into(), "ok".into())
        );
        // <think> later in content is plain text
        assert_eq!(
            parse(false, &["a <think>b</think>"]),
            (String::new(), "a <think>b</think>".into())
        );
    }

    #[test]
    fn unterminated_reasoning_stays_reasoning() {
        assert_eq!(
            parse(true, &["still thinking </thi"]),
            ("still thinking </thi".into(), String::new())
        );
    }

    #[test]
    fn tool_call_inside_thinking_ends_it() {
        assert_eq!(
            parse(true, &["I should call it.\n\n<tool_call>\n<function=f>"]),
            (
                "I should call it.".into(),
                "<tool_call>\n<function=f>".into()
            )
        );
    }

    #[test]
    fn prompt_state() {
        assert!(prompt_opens_thinking("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_thinking(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!prompt_opens_thinking("<|im_start|>assistant\n"));
    }
}
