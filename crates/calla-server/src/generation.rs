//! One request on the engine: its jobs (one per choice), the sink that turns tokens into text on the
//! engine thread, and the log line written when the request ends.
//!
//! The sink decodes incrementally and applies stop strings there, so a stop string ends generation
//! at once; the reasoning and tool-call parsing happens on the handler's side. Each request has one
//! channel; when the handler or its SSE stream is dropped (the client went away) the channel closes,
//! `is_cancelled` turns true, and the engine stops the job before its next step.

use std::ops::ControlFlow;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use calla_chat::{StopMatcher, StopOutcome};
use calla_engine::scheduler::{Job, JobFinish, JobReport, JobSink, JobStart};
use calla_engine::{TokenChoice, TokenConstraint};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::codec::{IncrementalText, TextCodec};
use crate::errors::ApiError;
use crate::params::GenParams;
use crate::state::{AppState, Runtime};

/// One token's log-probability and the best alternatives, as text.
#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

#[derive(Debug)]
pub enum GenEvent {
    Started {
        cached_tokens: usize,
    },
    /// Text released for one token (possibly empty: held back by a possible stop string or an
    /// incomplete character), with the token's log-probabilities when asked for.
    Text {
        text: String,
        logprob: Option<TokenLogprob>,
    },
    Finished(Result<Finished, String>),
}

#[derive(Debug)]
pub struct Finished {
    pub report: JobReport,
    /// A stop string ended generation.
    pub stopped_by_string: bool,
    /// Which one (an index into the request's non-empty stop strings).
    pub stop_string: Option<usize>,
}

impl Finished {
    /// "length" or "stop" (a tool-call reply turns "stop" into "tool_calls" later).
    pub fn finish_reason(&self) -> &'static str {
        match self.report.finish {
            JobFinish::Length => "length",
            JobFinish::Stop | JobFinish::Cancelled => "stop",
        }
    }
}

pub type Events = UnboundedReceiver<(usize, GenEvent)>;

struct TextSink {
    choice: usize,
    tx: UnboundedSender<(usize, GenEvent)>,
    codec: Arc<dyn TextCodec>,
    decoder: IncrementalText,
    stop: StopMatcher,
    stopped_by_string: bool,
    stop_string: Option<usize>,
    want_logprobs: bool,
    state: Arc<AppState>,
    arrival: Instant,
    last_token: Option<Instant>,
}

impl TextSink {
    fn send(&self, event: GenEvent) {
        // A closed channel means the client is gone; is_cancelled reports it to the engine.
        let _ = self.tx.send((self.choice, event));
    }

    fn logprob(&self, choice: &TokenChoice) -> TokenLogprob {
        TokenLogprob {
            token: self.codec.token_text(choice.token),
            logprob: choice.logprob,
            top: choice
                .top
                .iter()
                .map(|&(id, lp)| (self.codec.token_text(id), lp))
                .collect(),
        }
    }
}

impl JobSink for TextSink {
    fn on_start(&mut self, start: &JobStart) {
        self.state
            .metrics
            .queue_time
            .observe(start.queued.as_secs_f64());
        self.send(GenEvent::Started {
            cached_tokens: start.cached_tokens,
        });
    }

    fn on_token(&mut self, choice: &TokenChoice) -> ControlFlow<()> {
        let now = Instant::now();
        let metrics = &self.state.metrics;
        match self.last_token {
            None => metrics
                .time_to_first_token
                .observe((now - self.arrival).as_secs_f64()),
            Some(last) => metrics
                .inter_token_latency
                .observe((now - last).as_secs_f64()),
        }
        self.last_token = Some(now);
        let piece = self.decoder.push(self.codec.as_ref(), choice.token);
        let logprob = self.want_logprobs.then(|| self.logprob(choice));
        match self.stop.push(&piece) {
            StopOutcome::Continue(text) => {
                self.send(GenEvent::Text { text, logprob });
                ControlFlow::Continue(())
            }
            StopOutcome::Stopped { text, stop } => {
                self.send(GenEvent::Text { text, logprob });
                self.stopped_by_string = true;
                self.stop_string = Some(stop);
                ControlFlow::Break(())
            }
        }
    }

    fn is_cancelled(&self) -> bool {
        self.tx.is_closed()
    }

    fn on_finish(&mut self, result: Result<JobReport, String>) {
        let state = Arc::clone(&self.state);
        let metrics = &state.metrics;
        let result = result.map(|report| {
            if !self.stopped_by_string {
                // Text held back at the end: an incomplete character, a possible stop-string prefix.
                let tail = self.decoder.finish(self.codec.as_ref());
                let mut text = match self.stop.push(&tail) {
                    StopOutcome::Continue(text) => text,
                    StopOutcome::Stopped { text, stop } => {
                        self.stopped_by_string = true;
                        self.stop_string = Some(stop);
                        text
                    }
                };
                if !self.stopped_by_string {
                    text.push_str(&self.stop.finish());
                }
                if !text.is_empty() {
                    self.send(GenEvent::Text {
                        text,
                        logprob: None,
                    });
                }
            }
            metrics
                .prompt_tokens
                .fetch_add(report.prompt_tokens as u64, Relaxed);
            metrics
                .generation_tokens
                .fetch_add(report.completion_tokens() as u64, Relaxed);
            let counter = match report.finish {
                JobFinish::Cancelled => &metrics.requests_cancelled,
                _ => &metrics.requests_succeeded,
            };
            counter.fetch_add(1, Relaxed);
            metrics
                .e2e_request_latency
                .observe(self.arrival.elapsed().as_secs_f64());
            Finished {
                report,
                stopped_by_string: self.stopped_by_string,
                stop_string: self.stop_string,
            }
        });
        if result.is_err() {
            metrics.requests_failed.fetch_add(1, Relaxed);
        }
        self.send(GenEvent::Finished(result));
    }
}

/// One prompt to run: the choice index it reports under, and prefixes worth saving for later
/// requests (the scheduler always saves the prompt minus its last token).
pub struct Work {
    pub choice: usize,
    pub prompt: Vec<u32>,
    pub save_prefixes: Vec<usize>,
}

/// Queue every choice of a request (all or none) and return the channel their events arrive on.
pub fn submit(
    state: &Arc<AppState>,
    runtime: &Runtime,
    work: Vec<Work>,
    params: &GenParams,
    max_tokens: usize,
    top_logprobs: Option<usize>,
    arrival: Instant,
) -> Result<Events, ApiError> {
    submit_constrained(
        state,
        runtime,
        work,
        Vec::new(),
        params,
        max_tokens,
        top_logprobs,
        arrival,
    )
}

/// `submit`, the i-th work item under the i-th constraint (structured.rs; missing ones: none).
#[allow(clippy::too_many_arguments)]
pub fn submit_constrained(
    state: &Arc<AppState>,
    runtime: &Runtime,
    work: Vec<Work>,
    constraints: Vec<Box<dyn TokenConstraint>>,
    params: &GenParams,
    max_tokens: usize,
    top_logprobs: Option<usize>,
    arrival: Instant,
) -> Result<Events, ApiError> {
    let mut constraints = constraints.into_iter();
    let (tx, rx) = unbounded_channel();
    let jobs: Vec<Job> = work
        .into_iter()
        .map(|w| {
            let mut sampling = params.sampling.clone();
            // Each choice draws its own tokens; choice 0 keeps the request's seed.
            sampling.seed = sampling.seed.wrapping_add(w.choice as u64);
            Job {
                prompt: w.prompt,
                max_tokens,
                sampling,
                stop_token_ids: Vec::new(),
                ignore_eos: params.ignore_eos,
                top_logprobs: top_logprobs.unwrap_or(0),
                save_prefixes: w.save_prefixes,
                constraint: constraints.next(),
                sink: Box::new(TextSink {
                    choice: w.choice,
                    tx: tx.clone(),
                    codec: Arc::clone(&runtime.codec),
                    decoder: IncrementalText::new(),
                    stop: StopMatcher::new(&params.stop),
                    stopped_by_string: false,
                    stop_string: None,
                    want_logprobs: top_logprobs.is_some(),
                    state: Arc::clone(state),
                    arrival,
                    last_token: None,
                }),
            }
        })
        .collect();
    let count = jobs.len();
    runtime.scheduler.submit(jobs).map_err(|full| {
        if count > full.capacity {
            // Not "retry later": this request can never fit, however idle the server is.
            ApiError::bad_param(
                "n",
                format!(
                    "This request asks for {count} generations (prompts × n), more than the \
                     {} the server's queue holds (--max-queue).",
                    full.capacity
                ),
            )
        } else {
            ApiError::queue_full(full.capacity)
        }
    })?;
    Ok(rx)
}

/// What one request did, logged once when it ends (finished, failed or abandoned by its client).
pub struct RequestLog {
    pub id: String,
    pub endpoint: &'static str,
    pub arrival: Instant,
    pub stream: bool,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// Token texts received: what a client that went away was sent (its jobs never report).
    pub tokens_seen: usize,
    pub queued: Option<Duration>,
    pub first_token: Option<Duration>,
    pub finish_reasons: Vec<&'static str>,
    pub error: Option<String>,
    /// Prompt and output text, kept only with --log-text.
    pub text: Option<(String, Vec<String>)>,
    pub complete: bool,
}

impl RequestLog {
    pub fn new(id: String, endpoint: &'static str, arrival: Instant, stream: bool) -> RequestLog {
        RequestLog {
            id,
            endpoint,
            arrival,
            stream,
            prompt_tokens: 0,
            cached_tokens: 0,
            completion_tokens: 0,
            tokens_seen: 0,
            queued: None,
            first_token: None,
            finish_reasons: Vec::new(),
            error: None,
            text: None,
            complete: false,
        }
    }

    /// The completion tokens the log line reports: the engine's count, or for a request abandoned
    /// mid-stream (its jobs never report back here) the tokens it was sent.
    pub fn reported_completion_tokens(&self) -> usize {
        if self.complete {
            self.completion_tokens
        } else {
            self.completion_tokens.max(self.tokens_seen)
        }
    }

    pub fn keep_text(&mut self, prompt: String, choices: usize) {
        self.text = Some((prompt, vec![String::new(); choices]));
    }

    pub fn observe(&mut self, choice: usize, event: &GenEvent) {
        match event {
            GenEvent::Started { cached_tokens } => {
                if self.queued.is_none() {
                    self.queued = Some(self.arrival.elapsed());
                    self.cached_tokens = *cached_tokens;
                }
            }
            GenEvent::Text { text, .. } => {
                self.tokens_seen += 1;
                if self.first_token.is_none() {
                    self.first_token = Some(self.arrival.elapsed());
                }
                if let Some((_, outputs)) = &mut self.text {
                    if let Some(out) = outputs.get_mut(choice) {
                        out.push_str(text);
                    }
                }
            }
            GenEvent::Finished(Ok(f)) => {
                self.completion_tokens += f.report.completion_tokens();
            }
            GenEvent::Finished(Err(e)) => self.error = Some(e.clone()),
        }
    }
}

impl Drop for RequestLog {
    fn drop(&mut self) {
        self.completion_tokens = self.reported_completion_tokens();
        let total = self.arrival.elapsed();
        let ms = |d: Option<Duration>| {
            d.map_or("-".to_string(), |d| format!("{:.1}", d.as_secs_f64() * 1e3))
        };
        let decode_s = total
            .saturating_sub(self.first_token.unwrap_or(total))
            .as_secs_f64();
        let rate = if decode_s > 0.0 && self.completion_tokens > 1 {
            format!("{:.1}", (self.completion_tokens - 1) as f64 / decode_s)
        } else {
            "-".into()
        };
        let outcome = match (&self.error, self.complete) {
            (Some(e), _) => format!("error: {e}"),
            (None, true) => self.finish_reasons.join(","),
            (None, false) => "cancelled (client gone)".into(),
        };
        tracing::info!(
            target: "calla::request",
            "{} {}{} prompt={} cached={} completion={} queue_ms={} ttft_ms={} total_ms={:.1} decode_tok_s={} finish={}",
            self.id,
            self.endpoint,
            if self.stream { " stream" } else { "" },
            self.prompt_tokens,
            self.cached_tokens,
            self.completion_tokens,
            ms(self.queued),
            ms(self.first_token),
            total.as_secs_f64() * 1e3,
            rate,
            outcome,
        );
        if let Some((prompt, outputs)) = &self.text {
            tracing::info!(target: "calla::request", "{} prompt: {:?}", self.id, prompt);
            for (i, out) in outputs.iter().enumerate() {
                tracing::info!(target: "calla::request", "{} output[{i}]: {:?}", self.id, out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_abandoned_stream_logs_the_tokens_it_was_sent() {
        let mut log = RequestLog::new("x".into(), "chat", Instant::now(), true);
        for _ in 0..5 {
            let text = GenEvent::Text {
                text: "a".into(),
                logprob: None,
            };
            log.observe(0, &text);
        }
        assert_eq!(log.reported_completion_tokens(), 5);
        log.completion_tokens = 6;
        log.complete = true;
        assert_eq!(log.reported_completion_tokens(), 6);
    }
}
