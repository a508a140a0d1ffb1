//! Which parsed tool calls reach the client: only calls to declared tools (a model may name one it
//! was never offered), and with `parallel_tool_calls: false` only the first. Dropped calls leave no
//! gap: the calls kept are renumbered 0, 1, … in order.

use calla_chat::OutputEvent;
use serde_json::Value as Json;

#[derive(Debug, Clone, Default)]
pub struct ToolFilter {
    declared: Vec<String>,
    parallel: bool,
}

/// One choice's progress through the filter.
#[derive(Debug, Clone, Default)]
pub struct ToolCalls {
    /// Parser call index → the index sent, None for a dropped call.
    sent_as: Vec<Option<usize>>,
    kept: usize,
}

impl ToolCalls {
    /// Calls that reach the client.
    pub fn kept(&self) -> usize {
        self.kept
    }
}

impl ToolFilter {
    /// `tools`: OpenAI function tools (`{"type": "function", "function": {"name", …}}`).
    pub fn new(tools: &[Json], parallel: bool) -> ToolFilter {
        ToolFilter {
            declared: tools
                .iter()
                .filter_map(|t| t["function"]["name"].as_str().map(str::to_owned))
                .collect(),
            parallel,
        }
    }

    pub fn filter(&self, calls: &mut ToolCalls, events: Vec<OutputEvent>) -> Vec<OutputEvent> {
        let mut out = Vec::with_capacity(events.len());
        for event in events {
            match event {
                OutputEvent::ToolCallStart { index, name } => {
                    let keep = self.declared.contains(&name) && (self.parallel || calls.kept == 0);
                    if calls.sent_as.len() <= index {
                        calls.sent_as.resize(index + 1, None);
                    }
                    if keep {
                        calls.sent_as[index] = Some(calls.kept);
                        out.push(OutputEvent::ToolCallStart {
                            index: calls.kept,
                            name,
                        });
                        calls.kept += 1;
                    } else {
                        tracing::info!(
                            target: "calla::request",
                            "dropped a call to '{name}' ({})",
                            if self.declared.contains(&name) { "parallel_tool_calls is false" } else { "not a declared tool" }
                        );
                    }
                }
                OutputEvent::ToolCallArguments { index, fragment } => {
                    if let Some(Some(sent)) = calls.sent_as.get(index) {
                        out.push(OutputEvent::ToolCallArguments {
                            index: *sent,
                            fragment,
                        });
                    }
                }
                other => out.push(other),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn start(index: usize, name: &str) -> OutputEvent {
        OutputEvent::ToolCallStart {
            index,
            name: name.into(),
        }
    }
    fn args(index: usize, fragment: &str) -> OutputEvent {
        OutputEvent::ToolCallArguments {
            index,
            fragment: fragment.into(),
        }
    }

    #[test]
    fn undeclared_and_extra_calls_are_dropped_and_the_rest_renumbered() {
        let tools = [json!({"type": "function", "function": {"name": "a"}})];
        let events = vec![
            start(0, "nope"),
            args(0, "{}"),
            start(1, "a"),
            args(1, "{}"),
            start(2, "a"),
        ];
        let mut calls = ToolCalls::default();
        let out = ToolFilter::new(&tools, true).filter(&mut calls, events.clone());
        assert_eq!(out, vec![start(0, "a"), args(0, "{}"), start(1, "a")]);
        assert_eq!(calls.kept(), 2);
        let mut calls = ToolCalls::default();
        let out = ToolFilter::new(&tools, false).filter(&mut calls, events);
        assert_eq!(out, vec![start(0, "a"), args(0, "{}")]);
    }
}
