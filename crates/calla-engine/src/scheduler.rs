//! The engine thread: one thread owns the backend and runs requests from a bounded FIFO queue, one
//! sequence at a time (first come, first served: fair, and simple enough to be obviously right).
//!
//! A request ([`Job`]) talks back through its [`JobSink`], called on the engine thread: `on_start`
//! when it leaves the queue, `on_token` per emitted token (Break = stop: a stop string, or a client
//! that went away), `is_cancelled` before every step (so a disconnected client stops its generation
//! within one decode step), and `on_finish` exactly once. The sequence state is dropped when the job
//! ends, whatever the reason.
//!
//! Prefill and the prefix cache: a prompt of P tokens runs as [cached..P-1] then [P-1]; the state after
//! P-1 tokens is saved in the [`PrefixCache`], so a later prompt that repeats it (retry, n-th choice)
//! restores it and runs only what is new. Jobs may name more prefixes to save (a chat's history
//! before its generation prompt, which the next turn extends); the prefill then runs in chunks ending
//! there. Chunks depend only on the prompt and the restored length, not on whether the cache is on.
//!
//! Stop tokens follow [`crate::generate`]: the token that ends generation (a stop id, or EOS unless
//! `ignore_eos`) is not emitted but counts towards `max_tokens`.

use std::collections::VecDeque;
use std::ops::ControlFlow;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::{Backend, Selection, Sequence, TokenChoice};
use crate::constraint::TokenConstraint;
use crate::generate::{generate_constrained_on, FinishReason, GenerateRequest};
use crate::prefix_cache::{PrefixCache, PrefixCacheStats};
use crate::sampling::SamplingParams;

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Requests that may wait for the engine; more are refused ([`QueueFull`]).
    pub max_queue: usize,
    /// Memory for saved sequence states (0 = no prefix cache).
    pub prefix_cache_bytes: usize,
    /// Longest sequence (prompt + generated) the engine runs; generation stops there with `Length`.
    pub max_context: usize,
}

pub struct Job {
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (the stop token included).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Extra stop tokens, on top of the model's EOS ids.
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub top_logprobs: usize,
    /// Prompt lengths at which to save the state in the prefix cache, besides the prompt minus its
    /// last token (which is always saved). A chat server passes the end of the conversation before
    /// the generation prompt: the next turn renders that same text, then diverges.
    pub save_prefixes: Vec<usize>,
    /// Grammar-constrained decoding (structured output, forced tool calls); None: unconstrained.
    pub constraint: Option<Box<dyn TokenConstraint>>,
    pub sink: Box<dyn JobSink>,
}

/// How a job reports back; every method runs on the engine thread, so keep them short.
pub trait JobSink: Send {
    /// The job leaves the queue: how long it waited and how many prompt tokens the cache supplied.
    fn on_start(&mut self, start: &JobStart);
    /// An emitted token; Break ends generation after it (finish reason `Stop`).
    fn on_token(&mut self, choice: &TokenChoice) -> ControlFlow<()>;
    /// Checked before running the job and before every step.
    fn is_cancelled(&self) -> bool;
    /// Called exactly once: the job's outcome, or the backend's error.
    fn on_finish(&mut self, result: Result<JobReport, String>);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobStart {
    pub queued: Duration,
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobFinish {
    /// `max_tokens` or the context length reached.
    Length,
    /// A stop token, or the sink asked to stop.
    Stop,
    /// The sink reported cancellation (client gone) or the server is shutting down.
    Cancelled,
}

#[derive(Debug, Clone, PartialEq)]
pub struct JobReport {
    pub finish: JobFinish,
    /// Emitted tokens (the stop token excluded).
    pub tokens: Vec<u32>,
    /// The token that ended generation, if a stop token did.
    pub stop_token: Option<u32>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub queued: Duration,
    /// From leaving the queue to the first token chosen.
    pub prefill: Duration,
    /// Every later token.
    pub decode: Duration,
}

impl JobReport {
    /// Tokens generated, the stop token included (OpenAI's `completion_tokens`).
    pub fn completion_tokens(&self) -> usize {
        self.tokens.len() + usize::from(self.stop_token.is_some())
    }
}

/// The queue is full: the request is refused (HTTP 429).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the request queue is full ({capacity} waiting)")]
pub struct QueueFull {
    pub capacity: usize,
}

struct Queue {
    jobs: VecDeque<Queued>,
    shutdown: bool,
}

struct Queued {
    job: Job,
    enqueued: Instant,
}

struct Shared {
    queue: Mutex<Queue>,
    work: Condvar,
    running: AtomicUsize,
    shutdown: AtomicBool,
    cache_stats: Mutex<PrefixCacheStats>,
    max_queue: usize,
}

/// Handle to the engine thread. Dropping it cancels waiting jobs, stops the running one at its next
/// step and joins the thread.
pub struct Scheduler {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    describe: String,
    vocab_size: usize,
    eos_token_ids: Vec<u32>,
}

impl Scheduler {
    pub fn start(backend: Box<dyn Backend>, config: SchedulerConfig) -> Scheduler {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                shutdown: false,
            }),
            work: Condvar::new(),
            running: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            cache_stats: Mutex::new(PrefixCacheStats::default()),
            max_queue: config.max_queue,
        });
        let describe = backend.describe();
        let vocab_size = backend.spec().vocab_size;
        let eos_token_ids = backend.spec().eos_token_ids.clone();
        let engine_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("calla-engine".into())
            .spawn(move || engine_loop(backend, config, engine_shared))
            .expect("spawning the engine thread");
        Scheduler {
            shared,
            thread: Some(thread),
            describe,
            vocab_size,
            eos_token_ids,
        }
    }

    /// The model's vocabulary (its embedding rows: may exceed the tokenizer's, padding rows).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The model's end-of-sequence ids.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// The backend's description ("cpu", "cuda:0 (…)").
    pub fn backend(&self) -> &str {
        &self.describe
    }

    /// Queue `jobs` together (the choices of one request): all are admitted or none. Cancelled jobs
    /// still waiting are purged first to make room.
    pub fn submit(&self, jobs: Vec<Job>) -> Result<(), QueueFull> {
        let mut purged = Vec::new();
        {
            let mut queue = lock(&self.shared.queue);
            if queue.jobs.len() + jobs.len() > self.shared.max_queue {
                let (gone, kept): (Vec<Queued>, Vec<Queued>) = queue
                    .jobs
                    .drain(..)
                    .partition(|q| q.job.sink.is_cancelled());
                queue.jobs = kept.into();
                purged = gone;
            }
            if queue.shutdown || queue.jobs.len() + jobs.len() > self.shared.max_queue {
                drop(queue);
                finish_cancelled(purged);
                // The refused jobs' sinks are dropped unreported: the caller answers 429 itself.
                return Err(QueueFull {
                    capacity: self.shared.max_queue,
                });
            }
            let enqueued = Instant::now();
            queue
                .jobs
                .extend(jobs.into_iter().map(|job| Queued { job, enqueued }));
        }
        self.shared.work.notify_one();
        finish_cancelled(purged);
        Ok(())
    }

    /// Jobs waiting in the queue.
    pub fn waiting(&self) -> usize {
        lock(&self.shared.queue).jobs.len()
    }

    /// Jobs being run (0 or 1).
    pub fn running(&self) -> usize {
        self.shared.running.load(Ordering::Relaxed)
    }

    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        *lock(&self.shared.cache_stats)
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        let waiting: Vec<Queued> = {
            let mut queue = lock(&self.shared.queue);
            queue.shutdown = true;
            queue.jobs.drain(..).collect()
        };
        self.shared.work.notify_all();
        finish_cancelled(waiting);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn finish_cancelled(jobs: Vec<Queued>) {
    for Queued { mut job, enqueued } in jobs {
        let report = cancelled_report(&job, enqueued.elapsed(), 0);
        job.sink.on_finish(Ok(report));
    }
}

fn cancelled_report(job: &Job, queued: Duration, cached_tokens: usize) -> JobReport {
    JobReport {
        finish: JobFinish::Cancelled,
        tokens: Vec::new(),
        stop_token: None,
        prompt_tokens: job.prompt.len(),
        cached_tokens,
        queued,
        prefill: Duration::ZERO,
        decode: Duration::ZERO,
    }
}

/// A poisoned lock only means another thread panicked while holding it; the data is still usable.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn engine_loop(mut backend: Box<dyn Backend>, config: SchedulerConfig, shared: Arc<Shared>) {
    let mut cache = PrefixCache::new(config.prefix_cache_bytes);
    loop {
        let Queued { mut job, enqueued } = {
            let mut queue = lock(&shared.queue);
            loop {
                if queue.shutdown {
                    return;
                }
                if let Some(next) = queue.jobs.pop_front() {
                    break next;
                }
                queue = shared.work.wait(queue).unwrap_or_else(|p| p.into_inner());
            }
        };
        shared.running.store(1, Ordering::Relaxed);
        let queued = enqueued.elapsed();
        let result = catch_unwind(AssertUnwindSafe(|| {
            run_job(
                backend.as_mut(),
                &mut cache,
                &config,
                &shared,
                &mut job,
                queued,
            )
        }));
        let result = match result {
            Ok(Ok(report)) => Ok(report),
            Ok(Err(e)) => Err(format!("{e:#}")),
            Err(panic) => Err(format!(
                "the engine panicked: {}",
                panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("unknown cause")
            )),
        };
        // The cache statistics first: whoever waits on the finish may read them at once.
        *lock(&shared.cache_stats) = cache.stats();
        // A panicking sink must not take the engine down with it.
        let _ = catch_unwind(AssertUnwindSafe(|| job.sink.on_finish(result)));
        shared.running.store(0, Ordering::Relaxed);
    }
}

/// The most prompt tokens one prefill step runs: cancellation is checked between steps. Equal to
/// the CUDA backend's default `prompt_chunk`, so its batched chunks are the ones it ran before.
pub const PREFILL_CHUNK: usize = 8192;

fn run_job(
    backend: &mut dyn Backend,
    cache: &mut PrefixCache,
    config: &SchedulerConfig,
    shared: &Shared,
    job: &mut Job,
    queued: Duration,
) -> anyhow::Result<JobReport> {
    let cancelled = |job: &Job| job.sink.is_cancelled() || shared.shutdown.load(Ordering::Relaxed);
    if cancelled(job) {
        return Ok(cancelled_report(job, queued, 0));
    }
    let prompt = std::mem::take(&mut job.prompt);
    anyhow::ensure!(!prompt.is_empty(), "the prompt is empty");
    anyhow::ensure!(
        prompt.len() < config.max_context,
        "the prompt has {} tokens; the context holds {}",
        prompt.len(),
        config.max_context
    );
    let started = Instant::now();
    let (mut seq, cached_tokens): (Box<dyn Sequence>, usize) = match cache.lookup(&prompt) {
        Some((len, state)) => (state, len),
        None => (backend.new_sequence()?, 0),
    };
    job.sink.on_start(&JobStart {
        queued,
        cached_tokens,
    });

    // Everything but the last prompt token, in chunks that end where states are saved; the tokens
    // chosen here are not used. The chunks depend only on the prompt and the cached length.
    let prompt_len = prompt.len();
    let last = prompt_len - 1;
    let mut save_at: Vec<usize> = job
        .save_prefixes
        .iter()
        .copied()
        .chain([last])
        .filter(|&at| at > cached_tokens && at <= last)
        .collect();
    save_at.sort_unstable();
    save_at.dedup();
    let greedy = SamplingParams::greedy();
    let mut done = cached_tokens;
    for at in save_at {
        let sel = Selection {
            params: &greedy,
            prompt: &prompt,
            generated: &[],
            step: 0,
            top_logprobs: 0,
        };
        // At most PREFILL_CHUNK tokens per step, ending on multiples of it, so that a client that
        // left during a long prompt stops it within one chunk.
        while done < at {
            if cancelled(job) {
                let mut report = cancelled_report(job, queued, cached_tokens);
                report.prompt_tokens = prompt_len;
                return Ok(report);
            }
            let end = at.min((done / PREFILL_CHUNK + 1) * PREFILL_CHUNK);
            backend.step(seq.as_mut(), &prompt[done..end], &sel)?;
            done = end;
        }
        if cache.budget_bytes() > 0 {
            cache.insert(prompt[..at].to_vec(), seq.snapshot());
        }
    }

    let req = GenerateRequest {
        prompt,
        max_tokens: job.max_tokens.min(config.max_context - prompt_len),
        sampling: job.sampling.clone(),
        stop_token_ids: job.stop_token_ids.clone(),
        ignore_eos: job.ignore_eos,
        top_logprobs: job.top_logprobs,
    };
    let mut report = JobReport {
        finish: JobFinish::Cancelled,
        tokens: Vec::new(),
        stop_token: None,
        prompt_tokens: prompt_len,
        cached_tokens,
        queued,
        prefill: Duration::ZERO,
        decode: Duration::ZERO,
    };
    if cancelled(job) {
        return Ok(report);
    }
    // The sink may stop generation after any token; a client that went away is checked there too, so
    // a cancelled request stops within one decode step.
    let mut constraint = job.constraint.take();
    let out = generate_constrained_on(
        backend,
        seq.as_mut(),
        &req,
        constraint
            .as_deref_mut()
            .map(|c| c as &mut dyn TokenConstraint),
        started,
        |choice| {
            if job.sink.on_token(choice).is_break() || cancelled(job) {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        },
    )?;
    report.finish = match out.finish_reason {
        FinishReason::Length => JobFinish::Length,
        FinishReason::Stop if out.stop_token.is_none() && cancelled(job) => JobFinish::Cancelled,
        FinishReason::Stop => JobFinish::Stop,
    };
    report.stop_token = out.stop_token.map(|choice| choice.token);
    report.tokens = out.tokens;
    report.prefill = Duration::from_secs_f64(out.timings.prefill_s);
    report.decode = Duration::from_secs_f64(out.timings.decode_s);
    Ok(report)
}

#[cfg(test)]
mod tests;
