//! POST /v1/completions: raw prompts (a string, strings, token ids, lists of token ids), no template,
//! no output parsing; `max_tokens` defaults to 16 as in the OpenAI API.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json as JsonBody;
use serde::Deserialize;
use serde_json::{json, Map, Value as Json};

use crate::codec::{IncrementalText, TextCodec};
use crate::errors::ApiError;
use crate::generation::{submit, GenEvent, RequestLog, TokenLogprob, Work};
use crate::params::{from_body, GenParams, SamplingFields};
use crate::request::{check_model, check_prompt_bytes, parse_body, text_bytes, Usage};
use crate::sse::{self, Flow, Reply};
use crate::state::{unix_now, AppState};
use crate::unknown::{warn_unknown_fields, COMPLETION_FIELDS};

pub const DEFAULT_MAX_TOKENS: usize = 16;

#[derive(Debug, Deserialize)]
struct CompletionFields {
    prompt: Option<Json>,
    logprobs: Option<i64>,
    echo: Option<bool>,
}

struct Prepared {
    params: GenParams,
    /// (text, ids) of each prompt.
    prompts: Vec<(String, Vec<u32>)>,
    /// With echo and logprobs: each prompt's tokens (their log-probabilities are not computed).
    prompt_logprobs: Vec<Vec<LegacyToken>>,
    max_tokens: usize,
    logprobs: Option<usize>,
    echo: bool,
}

/// The OpenAI prompt forms → token ids.
fn prompt_ids(
    prompt: &Json,
    encode: &dyn Fn(&str) -> Result<Vec<u32>, String>,
    vocab: usize,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let bad = || {
        ApiError::bad_param("prompt", "'prompt' must be a string, a list of strings, a list of token ids, or a list of lists of token ids")
    };
    let ids_of = |items: &[Json]| -> Result<Vec<u32>, ApiError> {
        items
            .iter()
            .map(|v| {
                v.as_u64()
                    .filter(|&id| (id as usize) < vocab)
                    .map(|id| id as u32)
                    .ok_or_else(|| {
                        ApiError::bad_param(
                            "prompt",
                            format!("token id {v} is not below the vocabulary size {vocab}"),
                        )
                    })
            })
            .collect()
    };
    let encoded = |text: &str| encode(text).map_err(ApiError::internal);
    match prompt {
        Json::String(text) => Ok(vec![encoded(text)?]),
        Json::Array(items) if items.is_empty() => Err(bad()),
        Json::Array(items) if items.iter().all(Json::is_string) => items
            .iter()
            .map(|t| encoded(t.as_str().unwrap_or_default()))
            .collect(),
        Json::Array(items) if items.iter().all(Json::is_number) => Ok(vec![ids_of(items)?]),
        Json::Array(items) if items.iter().all(Json::is_array) => items
            .iter()
            .map(|inner| ids_of(inner.as_array().map(Vec::as_slice).unwrap_or_default()))
            .collect(),
        _ => Err(bad()),
    }
}

fn prepare(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Prepared, ApiError> {
    let runtime = state.runtime()?;
    let body = parse_body(body)?;
    warn_unknown_fields(&body, COMPLETION_FIELDS, "/v1/completions");
    let common: SamplingFields = from_body(&body)?;
    let fields: CompletionFields = from_body(&body)?;
    check_model(state, common.model.as_deref())?;
    let params = common.resolve(
        &runtime.defaults,
        runtime.codec.vocab_size(),
        state.config.max_n,
        state.random_u64(),
    )?;
    let prompt = fields
        .prompt
        .as_ref()
        .ok_or_else(|| ApiError::bad_param("prompt", "'prompt' is required"))?;
    check_prompt_bytes(
        text_bytes(std::slice::from_ref(prompt)),
        state.config.max_prompt_bytes,
        "prompt",
    )?;
    let codec = Arc::clone(&runtime.codec);
    let encode = move |text: &str| codec.encode(text);
    // Ids up to the model's vocabulary: its embedding may have padding rows past the tokenizer's.
    let vocab = runtime
        .scheduler
        .vocab_size()
        .max(runtime.codec.vocab_size());
    let ids = prompt_ids(prompt, &encode, vocab)?;
    let mut prompts = Vec::new();
    let mut longest = 0;
    for ids in ids {
        if ids.is_empty() {
            return Err(ApiError::bad_param(
                "prompt",
                "the prompt is empty (this model has no BOS token to start from)",
            ));
        }
        if ids.len() >= runtime.max_context {
            return Err(ApiError::context_length(
                ids.len(),
                runtime.max_context,
                "prompt",
            ));
        }
        longest = longest.max(ids.len());
        prompts.push((runtime.codec.decode(&ids), ids));
    }
    let logprobs = match fields.logprobs {
        None => None,
        Some(k) if (0..=20).contains(&k) => Some(k as usize),
        Some(k) => {
            return Err(ApiError::bad_param(
                "logprobs",
                format!("'logprobs' must be between 0 and 20 (got {k})"),
            ))
        }
    };
    let max_tokens = params
        .max_tokens
        .unwrap_or(DEFAULT_MAX_TOKENS)
        .min(runtime.max_context - longest);
    let echo = fields.echo.unwrap_or(false);
    let prompt_logprobs = if echo && logprobs.is_some() {
        prompts
            .iter()
            .map(|(_, ids)| prompt_tokens(runtime.codec.as_ref(), ids))
            .collect()
    } else {
        Vec::new()
    };
    Ok(Prepared {
        params,
        prompts,
        prompt_logprobs,
        max_tokens,
        logprobs,
        echo,
    })
}

/// A prompt's tokens for echoed log-probabilities: the text each adds to the echoed prompt and
/// where it starts; no log-probabilities (calla does not score prompts), as OpenAI's first token.
fn prompt_tokens(codec: &dyn TextCodec, ids: &[u32]) -> Vec<LegacyToken> {
    let mut decoder = IncrementalText::new();
    let mut offset = 0;
    ids.iter()
        .map(|&id| {
            let piece = decoder.push(codec, id);
            let token = LegacyToken {
                token: codec.token_text(id),
                logprob: None,
                top: None,
                offset,
            };
            offset += piece.chars().count();
            token
        })
        .collect()
}

pub async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrival = Instant::now();
    let id = state.new_id("cmpl-");
    let prepared = match state
        .prepare({
            let state = Arc::clone(&state);
            move || prepare(&state, body)
        })
        .await
    {
        Ok(p) => p,
        Err(e) => {
            tracing::info!(target: "calla::request", "{id} completions refused: {e}");
            return e.into_response();
        }
    };
    let Ok(runtime) = state.runtime() else {
        return ApiError::loading().into_response();
    };
    let n = prepared.params.n;
    let mut work = Vec::new();
    for (p, (_, ids)) in prepared.prompts.iter().enumerate() {
        for i in 0..n {
            work.push(Work {
                choice: p * n + i,
                prompt: ids.clone(),
                save_prefixes: Vec::new(),
            });
        }
    }
    let events = match submit(
        &state,
        &runtime,
        work,
        &prepared.params,
        prepared.max_tokens,
        prepared.logprobs,
        arrival,
    ) {
        Ok(events) => events,
        Err(e) => {
            tracing::info!(target: "calla::request", "{id} completions refused: {e}");
            return e.into_response();
        }
    };
    let prompt_tokens: usize = prepared.prompts.iter().map(|(_, ids)| ids.len()).sum();
    let mut log = RequestLog::new(id.clone(), "completions", arrival, prepared.params.stream);
    log.prompt_tokens = prompt_tokens;
    if state.config.log_text {
        let text: Vec<&str> = prepared.prompts.iter().map(|(t, _)| t.as_str()).collect();
        log.keep_text(text.join("\n---\n"), prepared.prompts.len() * n);
    }
    let mut reply = CompletionReply {
        id,
        created: unix_now(),
        model: state.config.served_model_name.clone(),
        n,
        include_usage: prepared.params.include_usage,
        with_logprobs: prepared.logprobs.is_some(),
        choices: (0..prepared.prompts.len() * n)
            .map(|c| CompletionChoice {
                text: if prepared.echo {
                    prepared.prompts[c / n].0.clone()
                } else {
                    String::new()
                },
                logprobs: prepared
                    .prompt_logprobs
                    .get(c / n)
                    .cloned()
                    .unwrap_or_default(),
                sent_logprobs: 0,
                finish_reason: None,
            })
            .collect(),
        usage: Usage::new(prompt_tokens),
        log,
    };
    if prepared.params.stream {
        let first = reply.echo_chunks();
        sse::stream(events, reply, first)
    } else {
        let mut events = events;
        match sse::collect(&mut events, &mut reply).await {
            Ok(()) => JsonBody(reply.response()).into_response(),
            Err(e) => e.into_response(),
        }
    }
}

/// One token of the legacy log-probability object.
#[derive(Debug, Clone)]
struct LegacyToken {
    token: String,
    /// None for echoed prompt tokens.
    logprob: Option<f32>,
    top: Option<Vec<(String, f32)>>,
    /// Characters of the choice's text before this token's text.
    offset: usize,
}

impl LegacyToken {
    fn generated(lp: TokenLogprob, offset: usize) -> LegacyToken {
        LegacyToken {
            token: lp.token,
            logprob: Some(lp.logprob),
            top: Some(lp.top),
            offset,
        }
    }
}

struct CompletionChoice {
    text: String,
    logprobs: Vec<LegacyToken>,
    /// Log-probabilities already streamed.
    sent_logprobs: usize,
    finish_reason: Option<&'static str>,
}

struct CompletionReply {
    id: String,
    created: u64,
    model: String,
    n: usize,
    include_usage: bool,
    with_logprobs: bool,
    choices: Vec<CompletionChoice>,
    usage: Usage,
    log: RequestLog,
}

/// The legacy completions log-probability object for `tokens`: `text_offset` counts characters
/// of the choice's text (echoed prompt included) where each token's text begins, as OpenAI's.
fn legacy_logprobs(tokens: &[LegacyToken]) -> Json {
    json!({
        "tokens": tokens.iter().map(|t| t.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": tokens.iter().map(|t| match &t.top {
            Some(top) => Json::Object(top.iter().map(|(tok, lp)| (tok.clone(), json!(lp))).collect::<Map<String, Json>>()),
            None => Json::Null,
        }).collect::<Vec<_>>(),
        "text_offset": tokens.iter().map(|t| t.offset).collect::<Vec<_>>(),
    })
}

impl CompletionReply {
    fn chunk(&self, index: usize, text: &str, logprobs: Json, finish_reason: Option<&str>) -> Json {
        let mut chunk = json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
        });
        if self.include_usage {
            chunk["usage"] = Json::Null;
        }
        chunk
    }

    /// The echoed prompts (with their tokens when log-probabilities are asked for).
    fn echo_chunks(&mut self) -> Vec<Json> {
        let mut chunks = Vec::new();
        for i in 0..self.choices.len() {
            if !self.choices[i].text.is_empty() {
                let logprobs = self.pending_logprobs(i);
                let text = self.choices[i].text.clone();
                chunks.push(self.chunk(i, &text, logprobs, None));
            }
        }
        chunks
    }

    fn pending_logprobs(&mut self, index: usize) -> Json {
        let choice = &mut self.choices[index];
        if !self.with_logprobs || choice.sent_logprobs == choice.logprobs.len() {
            return Json::Null;
        }
        let json = legacy_logprobs(&choice.logprobs[choice.sent_logprobs..]);
        choice.sent_logprobs = choice.logprobs.len();
        json
    }

    fn response(&mut self) -> Json {
        let choices: Vec<Json> = self
            .choices
            .iter()
            .enumerate()
            .map(|(index, c)| {
                json!({
                    "index": index,
                    "text": c.text,
                    "logprobs": if self.with_logprobs { legacy_logprobs(&c.logprobs) } else { Json::Null },
                    "finish_reason": c.finish_reason.unwrap_or("stop"),
                })
            })
            .collect();
        json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage.to_json(),
        })
    }
}

impl Reply for CompletionReply {
    fn on_event(&mut self, index: usize, event: GenEvent) -> Flow {
        self.log.observe(index, &event);
        match event {
            GenEvent::Started { cached_tokens } => {
                // The first choice of each prompt (is_multiple_of is newer than the workspace's rust-version).
                #[allow(clippy::manual_is_multiple_of)]
                let first_of_prompt = index % self.n == 0;
                self.usage.started(first_of_prompt, cached_tokens);
                Flow::Chunks(Vec::new())
            }
            GenEvent::Text { text, logprob } => {
                let choice = &mut self.choices[index];
                let offset = choice.text.chars().count();
                choice
                    .logprobs
                    .extend(logprob.map(|lp| LegacyToken::generated(lp, offset)));
                choice.text.push_str(&text);
                if text.is_empty() {
                    return Flow::Chunks(Vec::new());
                }
                let logprobs = self.pending_logprobs(index);
                Flow::Chunks(vec![self.chunk(index, &text, logprobs, None)])
            }
            GenEvent::Finished(Err(e)) => {
                Flow::Failed(ApiError::internal(format!("generation failed: {e}")))
            }
            GenEvent::Finished(Ok(finished)) => {
                let reason = finished.finish_reason();
                self.choices[index].finish_reason = Some(reason);
                self.usage.completion_tokens += finished.report.completion_tokens();
                self.log.finish_reasons.push(reason);
                let logprobs = self.pending_logprobs(index);
                let mut chunks = vec![self.chunk(index, "", logprobs, Some(reason))];
                if self.choices.iter().all(|c| c.finish_reason.is_some()) {
                    self.log.complete = true;
                    if self.include_usage {
                        chunks.push(json!({
                            "id": self.id, "object": "text_completion", "created": self.created,
                            "model": self.model, "choices": [], "usage": self.usage.to_json(),
                        }));
                    }
                    return Flow::Done(chunks);
                }
                Flow::Chunks(chunks)
            }
        }
    }
}
