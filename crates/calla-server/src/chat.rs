//! POST /v1/chat/completions.
//!
//! messages → `prepare_messages` → the checkpoint's template (tools, chat_template_kwargs) → ids →
//! engine; generated text → reasoning / content / tool calls (calla-chat's parsers) → one JSON reply
//! or SSE chunks. Tool choice: "none" renders no tools and parses none; "auto" renders and parses;
//! "required" and a named function constrain the reply to calls of the declared tools (structured.rs),
//! as `response_format` constrains it to JSON. Calls to undeclared tools are dropped, and with
//! `parallel_tool_calls: false` every call after the first (tool_filter.rs).

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json as JsonBody;
use calla_chat::{prepare_messages, prompt_opens_thinking, OutputConfig, RenderInput};
use calla_engine::TokenConstraint;
use serde::Deserialize;
use serde_json::{Map, Value as Json};

use crate::chat_reply::ChatReply;
use crate::errors::ApiError;
use crate::generation::{submit_constrained, Events, RequestLog, Work};
use crate::params::{from_body, GenParams, SamplingFields};
use crate::request::{check_model, check_prompt_bytes, parse_body, text_bytes};
use crate::sse;
use crate::state::{AppState, Runtime};
use crate::structured::{response_format, thinking_requested, OutputGrammar};
use crate::tool_filter::ToolFilter;
use crate::unknown::{warn_unknown_fields, CHAT_FIELDS};

#[derive(Debug, Deserialize)]
struct ChatFields {
    messages: Vec<Json>,
    tools: Option<Vec<Json>>,
    tool_choice: Option<Json>,
    logprobs: Option<bool>,
    top_logprobs: Option<i64>,
    chat_template_kwargs: Option<Map<String, Json>>,
    response_format: Option<Json>,
    parallel_tool_calls: Option<bool>,
}

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Function(String),
}

fn tool_choice(fields: &ChatFields) -> Result<(ToolChoice, Vec<Json>), ApiError> {
    let tools = fields.tools.clone().unwrap_or_default();
    let mut names = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let name = tool
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Json::as_str);
        match (tool.get("type").and_then(Json::as_str), name) {
            (Some("function"), Some(name)) => names.push(name.to_string()),
            _ => {
                return Err(ApiError::bad_param(
                    format!("tools[{i}]"),
                    format!(
                    "tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": …}}}}"
                ),
                ))
            }
        }
    }
    let default = if tools.is_empty() {
        ToolChoice::None
    } else {
        ToolChoice::Auto
    };
    let choice = match &fields.tool_choice {
        None | Some(Json::Null) => default,
        Some(Json::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => default,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::bad_param(
                    "tool_choice",
                    format!("tool_choice '{other}' is not one of none, auto, required"),
                ))
            }
        },
        Some(Json::Object(o)) => match o.get("function").and_then(|f| f.get("name")).and_then(Json::as_str) {
            Some(name) => ToolChoice::Function(name.to_string()),
            None => {
                return Err(ApiError::bad_param(
                    "tool_choice",
                    "tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": …}}",
                ))
            }
        },
        Some(_) => return Err(ApiError::bad_param("tool_choice", "tool_choice must be a string or an object")),
    };
    match &choice {
        ToolChoice::Required if tools.is_empty() => Err(ApiError::bad_param(
            "tool_choice",
            "tool_choice 'required' needs tools",
        )),
        ToolChoice::Function(name) if !names.contains(name) => Err(ApiError::bad_param(
            "tool_choice",
            format!("tool_choice names '{name}', which is not among the tools"),
        )),
        _ => Ok((choice, tools)),
    }
}

/// A validated chat request, ready for the engine.
pub(crate) struct Prepared {
    pub(crate) params: GenParams,
    pub(crate) prompt: ChatPrompt,
    pub(crate) top_logprobs: Option<usize>,
    pub(crate) max_tokens: usize,
    /// One per choice when the reply is constrained (structured.rs), else empty.
    pub(crate) constraints: Vec<Box<dyn TokenConstraint>>,
    /// Which parsed tool calls reach the client.
    pub(crate) tools: ToolFilter,
}

fn prepare(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Prepared, ApiError> {
    let runtime = state.runtime()?;
    let body = parse_body(body)?;
    warn_unknown_fields(&body, CHAT_FIELDS, "/v1/chat/completions");
    let common: SamplingFields = from_body(&body)?;
    let fields: ChatFields = from_body(&body)?;
    check_prompt_bytes(
        text_bytes(&fields.messages) + fields.tools.as_deref().map_or(0, text_bytes),
        state.config.max_prompt_bytes,
        "messages",
    )?;
    check_model(state, common.model.as_deref())?;
    let params = common.resolve(
        &runtime.defaults,
        runtime.codec.vocab_size(),
        state.config.max_n,
        state.random_u64(),
    )?;
    let top_logprobs = match (fields.logprobs.unwrap_or(false), fields.top_logprobs) {
        (false, Some(k)) if k > 0 => {
            return Err(ApiError::bad_param(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ))
        }
        (false, _) => None,
        (true, None) => Some(0),
        (true, Some(k)) if (0..=20).contains(&k) => Some(k as usize),
        (true, Some(k)) => {
            return Err(ApiError::bad_param(
                "top_logprobs",
                format!("top_logprobs must be between 0 and 20 (got {k})"),
            ))
        }
    };
    let (choice, tools) = tool_choice(&fields)?;
    let parallel = fields.parallel_tool_calls.unwrap_or(true);
    let format = response_format(fields.response_format.as_ref(), "response_format")?;
    let (grammar, param) = match forced_tools(&choice, &tools, parallel) {
        Some(g) => (Some(g), "tool_choice"),
        None => (format, "response_format"),
    };
    // Thinking asked for explicitly: reason first, constrain after (structured.rs).
    let thinks = thinking_requested(fields.chat_template_kwargs.as_ref());
    let prompt = chat_prompt_constrained(
        &runtime,
        &fields.messages,
        &tools,
        &choice,
        fields.chat_template_kwargs.as_ref(),
        grammar.is_some() && !thinks,
    )?;
    let constraints = match &grammar {
        Some(g) => state.grammars.constraints(
            &runtime,
            g,
            prompt.output.starts_in_reasoning,
            params.n,
            param,
        )?,
        None => Vec::new(),
    };
    let room = runtime.max_context - prompt.ids.len();
    let max_tokens = params.max_tokens.unwrap_or(room).min(room);
    Ok(Prepared {
        params,
        prompt,
        top_logprobs,
        max_tokens,
        constraints,
        tools: ToolFilter::new(&tools, parallel),
    })
}

/// `tool_choice` required or named → the grammar of the calls it allows.
pub fn forced_tools(choice: &ToolChoice, tools: &[Json], parallel: bool) -> Option<OutputGrammar> {
    let tools = match choice {
        ToolChoice::Required => tools.to_vec(),
        ToolChoice::Function(name) => tools
            .iter()
            .filter(|t| t["function"]["name"].as_str() == Some(name))
            .cloned()
            .collect(),
        ToolChoice::None | ToolChoice::Auto => return None,
    };
    Some(OutputGrammar::ToolCalls { tools, parallel })
}

/// A conversation rendered and encoded for the engine.
pub struct ChatPrompt {
    pub text: String,
    pub ids: Vec<u32>,
    /// Text the reply starts with that the model does not generate (forced tool-call tags).
    pub forced: String,
    /// Tokens of the conversation before the generation prompt, when `ids` start with them: the
    /// next turn renders the same text, so the state there is worth saving.
    pub history_tokens: Option<usize>,
    /// How to parse the reply.
    pub output: OutputConfig,
}

/// OpenAI messages (+ tools, tool choice, template kwargs) → the prompt, through the checkpoint's
/// template. Errors are 400s naming the field.
pub fn chat_prompt(
    runtime: &Runtime,
    messages: &[Json],
    tools: &[Json],
    choice: &ToolChoice,
    kwargs: Option<&Map<String, Json>>,
) -> Result<ChatPrompt, ApiError> {
    let constrained = matches!(choice, ToolChoice::Required | ToolChoice::Function(_));
    chat_prompt_constrained(runtime, messages, tools, choice, kwargs, constrained)
}

/// `chat_prompt` for a reply under a grammar (`constrained`: an open think block is closed first).
pub fn chat_prompt_constrained(
    runtime: &Runtime,
    messages: &[Json],
    tools: &[Json],
    choice: &ToolChoice,
    kwargs: Option<&Map<String, Json>>,
    constrained: bool,
) -> Result<ChatPrompt, ApiError> {
    let messages =
        prepare_messages(messages).map_err(|e| ApiError::bad_param(e.param, e.message))?;
    let template = runtime.template.as_ref().ok_or_else(|| {
        ApiError::bad_request("This checkpoint has no chat template; use /v1/completions.")
    })?;
    let with_tools = *choice != ToolChoice::None && !tools.is_empty();
    let render = |add_generation_prompt| {
        template.render(&RenderInput {
            messages: &messages,
            tools: with_tools.then_some(tools),
            add_generation_prompt,
            kwargs,
        })
    };
    let mut text = render(true).map_err(|e| ApiError::bad_param("messages", e.to_string()))?;
    if text.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "The chat template rendered an empty prompt for these messages.",
        ));
    }
    // Forced tool calls are a grammar now (structured.rs); nothing is forced into the prompt.
    let forced = String::new();
    if constrained && prompt_opens_thinking(&text) {
        // The constrained reply comes first: close the think block the generation prompt opened,
        // as the template renders an empty one.
        text.push_str("\n</think>\n\n");
    }
    let ids = runtime.codec.encode(&text).map_err(ApiError::internal)?;
    if ids.len() >= runtime.max_context {
        return Err(ApiError::context_length(
            ids.len(),
            runtime.max_context,
            "messages",
        ));
    }
    // The history ends where the generation prompt (`<|im_start|>assistant\n<think>…`) starts; Qwen
    // templates drop earlier turns' thinking, so the next turn shares this prefix, not the whole prompt.
    let history_tokens = render(false)
        .ok()
        .filter(|history| text.starts_with(history.as_str()) && !history.is_empty())
        .and_then(|history| runtime.codec.encode(&history).ok())
        .filter(|history| ids.starts_with(history))
        .map(|history| history.len());
    let output = OutputConfig {
        starts_in_reasoning: prompt_opens_thinking(&text),
        tools: with_tools.then(|| tools.to_vec()),
    };
    Ok(ChatPrompt {
        text,
        ids,
        forced,
        history_tokens,
        output,
    })
}

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrival = Instant::now();
    let id = state.new_id("chatcmpl-");
    let mut prepared = match state
        .prepare({
            let state = Arc::clone(&state);
            move || prepare(&state, body)
        })
        .await
    {
        Ok(p) => p,
        Err(e) => {
            tracing::info!(target: "calla::request", "{id} chat refused: {e}");
            return e.into_response();
        }
    };
    let Ok(runtime) = state.runtime() else {
        return ApiError::loading().into_response();
    };
    let n = prepared.params.n;
    let constraints = std::mem::take(&mut prepared.constraints);
    let work = (0..n)
        .map(|choice| Work {
            choice,
            prompt: prepared.prompt.ids.clone(),
            save_prefixes: prepared.prompt.history_tokens.into_iter().collect(),
        })
        .collect();
    let events = match submit_constrained(
        &state,
        &runtime,
        work,
        constraints,
        &prepared.params,
        prepared.max_tokens,
        prepared.top_logprobs,
        arrival,
    ) {
        Ok(events) => events,
        Err(e) => {
            tracing::info!(target: "calla::request", "{id} chat refused: {e}");
            return e.into_response();
        }
    };
    let mut log = RequestLog::new(id.clone(), "chat", arrival, prepared.params.stream);
    log.prompt_tokens = prepared.prompt.ids.len();
    if state.config.log_text {
        log.keep_text(prepared.prompt.text.clone(), n);
    }
    let mut reply = ChatReply::new(&state, id, &prepared, log);
    if prepared.params.stream {
        let first = reply.opening_chunks();
        sse::stream(events, reply, first)
    } else {
        respond(events, reply).await
    }
}

async fn respond(mut events: Events, mut reply: ChatReply) -> Response {
    // Dropping this future (client gone) drops `events`, which cancels the engine's work.
    match sse::collect(&mut events, &mut reply).await {
        Ok(()) => JsonBody(reply.response()).into_response(),
        Err(e) => e.into_response(),
    }
}
