//! The reply of a chat completion: engine events → reasoning / content / tool-call deltas (SSE
//! chunks) or one `chat.completion` body, with log-probabilities, finish reasons and usage.

use std::sync::Arc;

use calla_chat::{OutputEvent, OutputParser, ParsedOutput};
use serde_json::{json, Value as Json};

use crate::chat::Prepared;
use crate::errors::ApiError;
use crate::generation::{GenEvent, RequestLog, TokenLogprob};
use crate::request::Usage;
use crate::sse::{Flow, Reply};
use crate::state::{unix_now, AppState};
use crate::tool_filter::{ToolCalls, ToolFilter};

struct ChatChoice {
    parser: OutputParser,
    parsed: ParsedOutput,
    /// `call_…` ids, one per tool call started.
    tool_ids: Vec<String>,
    /// Non-streamed: every token's; streamed: those not yet sent.
    logprobs: Vec<TokenLogprob>,
    finish_reason: Option<&'static str>,
    /// The forced tool-call opening's events, sent first when streaming.
    opening: Vec<OutputEvent>,
    /// The tool calls that reach the client (tool_filter.rs).
    calls: ToolCalls,
}

pub(crate) struct ChatReply {
    state: Arc<AppState>,
    id: String,
    created: u64,
    model: String,
    /// Streamed replies send chunks (and their log-probabilities) as events come; others keep all.
    stream: bool,
    include_usage: bool,
    with_logprobs: bool,
    choices: Vec<ChatChoice>,
    tools: ToolFilter,
    usage: Usage,
    log: RequestLog,
}

impl ChatChoice {
    fn absorb(&mut self, state: &AppState, event: &OutputEvent) {
        if let OutputEvent::ToolCallStart { .. } = event {
            self.tool_ids.push(state.new_id("call_"));
        }
        self.parsed.absorb(event.clone());
    }
}

impl ChatReply {
    pub(crate) fn new(
        state: &Arc<AppState>,
        id: String,
        prepared: &Prepared,
        log: RequestLog,
    ) -> ChatReply {
        let mut choices = Vec::new();
        for _ in 0..prepared.params.n {
            let mut choice = ChatChoice {
                parser: OutputParser::new(&prepared.prompt.output),
                parsed: ParsedOutput::default(),
                tool_ids: Vec::new(),
                logprobs: Vec::new(),
                finish_reason: None,
                opening: Vec::new(),
                calls: ToolCalls::default(),
            };
            // The forced opening is part of the reply although the model did not generate it.
            let opening = choice.parser.push(&prepared.prompt.forced);
            for event in &opening {
                choice.absorb(state, event);
            }
            choice.opening = opening;
            choices.push(choice);
        }
        ChatReply {
            state: Arc::clone(state),
            id,
            created: unix_now(),
            model: state.config.served_model_name.clone(),
            stream: prepared.params.stream,
            include_usage: prepared.params.include_usage,
            with_logprobs: prepared.top_logprobs.is_some(),
            choices,
            tools: prepared.tools.clone(),
            usage: Usage::new(prepared.prompt.ids.len()),
            log,
        }
    }

    fn chunk(
        &self,
        index: usize,
        delta: Json,
        logprobs: Json,
        finish_reason: Option<&str>,
    ) -> Json {
        let mut chunk = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
        });
        if self.include_usage {
            chunk["usage"] = Json::Null;
        }
        chunk
    }

    /// The role first, then any forced opening, for every choice.
    pub(crate) fn opening_chunks(&mut self) -> Vec<Json> {
        let mut chunks = Vec::new();
        for index in 0..self.choices.len() {
            chunks.push(self.chunk(
                index,
                json!({"role": "assistant", "content": ""}),
                Json::Null,
                None,
            ));
            let opening = std::mem::take(&mut self.choices[index].opening);
            chunks.extend(self.delta_chunks(index, &opening));
        }
        chunks
    }

    /// Output events → delta chunks, consecutive events of one kind merged; pending log-probabilities
    /// ride on the first chunk.
    fn delta_chunks(&mut self, index: usize, events: &[OutputEvent]) -> Vec<Json> {
        if !self.stream {
            return Vec::new();
        }
        let mut deltas: Vec<Json> = Vec::new();
        for event in events {
            let merged = deltas
                .last_mut()
                .is_some_and(|last| merge_delta(last, event));
            if !merged {
                let ids = &self.choices[index].tool_ids;
                deltas.push(match event {
                    OutputEvent::Content(t) => json!({"content": t}),
                    OutputEvent::Reasoning(t) => json!({"reasoning_content": t, "reasoning": t}),
                    OutputEvent::ToolCallStart { index: i, name } => json!({"tool_calls": [{
                        "index": i, "id": ids.get(*i), "type": "function",
                        "function": {"name": name, "arguments": ""}}]}),
                    OutputEvent::ToolCallArguments { index: i, fragment } => {
                        json!({"tool_calls": [{"index": i, "function": {"arguments": fragment}}]})
                    }
                });
            }
        }
        deltas
            .into_iter()
            .map(|delta| {
                let logprobs = self.take_logprobs(index);
                self.chunk(index, delta, logprobs, None)
            })
            .collect()
    }

    fn take_logprobs(&mut self, index: usize) -> Json {
        let pending = std::mem::take(&mut self.choices[index].logprobs);
        if !self.with_logprobs || pending.is_empty() {
            return Json::Null;
        }
        json!({"content": pending.iter().map(chat_logprob).collect::<Vec<_>>()})
    }

    fn usage_chunk(&self) -> Json {
        json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage.to_json(),
        })
    }

    pub(crate) fn response(&mut self) -> Json {
        let mut choices = Vec::new();
        for index in 0..self.choices.len() {
            let logprobs = self.take_logprobs(index);
            let choice = &self.choices[index];
            let parsed = &choice.parsed;
            let mut message = json!({"role": "assistant"});
            message["content"] = if parsed.content.is_empty() && !parsed.tool_calls.is_empty() {
                Json::Null
            } else {
                Json::from(parsed.content.clone())
            };
            if !parsed.reasoning.is_empty() {
                message["reasoning_content"] = Json::from(parsed.reasoning.clone());
                message["reasoning"] = Json::from(parsed.reasoning.clone());
            }
            if !parsed.tool_calls.is_empty() {
                message["tool_calls"] = parsed
                    .tool_calls
                    .iter()
                    .zip(&choice.tool_ids)
                    .map(|(call, id)| {
                        json!({"id": id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                    })
                    .collect();
            }
            choices.push(json!({
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason.unwrap_or("stop"),
            }));
        }
        json!({
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage.to_json(),
        })
    }
}

/// Extend `last` with `event` when they are of one kind (text of the same field, arguments of the
/// same call).
fn merge_delta(last: &mut Json, event: &OutputEvent) -> bool {
    match event {
        OutputEvent::Content(t) => match last
            .get_mut("content")
            .and_then(|c| c.as_str().map(str::to_owned))
        {
            Some(prev) => {
                last["content"] = Json::from(prev + t);
                true
            }
            None => false,
        },
        OutputEvent::Reasoning(t) => match last.get("reasoning_content").and_then(Json::as_str) {
            Some(prev) => {
                let joined = format!("{prev}{t}");
                last["reasoning_content"] = Json::from(joined.clone());
                last["reasoning"] = Json::from(joined);
                true
            }
            None => false,
        },
        OutputEvent::ToolCallArguments { index, fragment } => {
            let Some(call) = last.get_mut("tool_calls").and_then(|c| c.get_mut(0)) else {
                return false;
            };
            // The call's first delta carries its name with empty arguments; fragments follow it.
            if call["index"] != json!(index) || call["function"].get("name").is_some() {
                return false;
            }
            let prev = call["function"]["arguments"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            call["function"]["arguments"] = Json::from(prev + fragment);
            true
        }
        OutputEvent::ToolCallStart { .. } => false,
    }
}

fn chat_logprob(lp: &TokenLogprob) -> Json {
    let entry = |token: &str, logprob: f32| json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()});
    let mut item = entry(&lp.token, lp.logprob);
    item["top_logprobs"] = lp.top.iter().map(|(t, l)| entry(t, *l)).collect();
    item
}

impl Reply for ChatReply {
    fn on_event(&mut self, index: usize, event: GenEvent) -> Flow {
        self.log.observe(index, &event);
        match event {
            GenEvent::Started { cached_tokens } => {
                self.usage.started(index == 0, cached_tokens);
                Flow::Chunks(Vec::new())
            }
            GenEvent::Text { text, logprob } => {
                let choice = &mut self.choices[index];
                choice.logprobs.extend(logprob);
                let events = choice.parser.push(&text);
                let events = self.tools.filter(&mut choice.calls, events);
                for event in &events {
                    self.choices[index].absorb(&self.state, event);
                }
                Flow::Chunks(self.delta_chunks(index, &events))
            }
            GenEvent::Finished(Err(e)) => {
                Flow::Failed(ApiError::internal(format!("generation failed: {e}")))
            }
            GenEvent::Finished(Ok(finished)) => {
                let choice = &mut self.choices[index];
                let events = choice.parser.finish();
                let events = self.tools.filter(&mut choice.calls, events);
                for event in &events {
                    self.choices[index].absorb(&self.state, event);
                }
                let mut chunks = self.delta_chunks(index, &events);
                let choice = &mut self.choices[index];
                let reason = match finished.finish_reason() {
                    "stop" if choice.calls.kept() > 0 => "tool_calls",
                    reason => reason,
                };
                choice.finish_reason = Some(reason);
                self.usage.completion_tokens += finished.report.completion_tokens();
                self.log.finish_reasons.push(reason);
                if self.stream {
                    let logprobs = self.take_logprobs(index);
                    chunks.push(self.chunk(index, json!({}), logprobs, Some(reason)));
                }
                if self.choices.iter().all(|c| c.finish_reason.is_some()) {
                    self.log.complete = true;
                    if self.include_usage {
                        chunks.push(self.usage_chunk());
                    }
                    return Flow::Done(chunks);
                }
                Flow::Chunks(chunks)
            }
        }
    }
}
