//! Scheduler mechanics on a test-double backend whose next token depends on every token the sequence
//! has consumed, so a wrongly restored state shows up as a different output.

use super::*;
use calla_model::{Family, FeedForwardSpec, ModelSpec};
use std::any::Any;
use std::sync::mpsc;

const VOCAB: u32 = 97;
const EOS: u32 = 96;

struct History(Vec<u32>);
impl Sequence for History {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn snapshot(&self) -> Box<dyn Sequence> {
        Box::new(History(self.0.clone()))
    }
    fn byte_size(&self) -> usize {
        4 * self.0.len()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// Next token = a hash of the whole history (never EOS unless the history ends in `eos_after`).
struct HashBackend {
    spec: ModelSpec,
    forwarded: Arc<AtomicUsize>,
    step_delay: Duration,
    /// Emit EOS once this token has been consumed.
    eos_after: Option<u32>,
    fail_on: Option<u32>,
    panic_on: Option<u32>,
}

fn spec() -> ModelSpec {
    ModelSpec {
        family: Family::Qwen35Moe,
        vocab_size: VOCAB as usize,
        hidden_size: 8,
        layers: vec![],
        rms_norm_eps: 1e-6,
        num_attention_heads: 1,
        num_key_value_heads: 1,
        head_dim: 8,
        rotary_dim: 2,
        rope_theta: 1e4,
        attn_output_gate: true,
        linear_num_key_heads: 1,
        linear_num_value_heads: 1,
        linear_key_head_dim: 8,
        linear_value_head_dim: 8,
        linear_conv_kernel_dim: 4,
        feed_forward: FeedForwardSpec::Dense { intermediate: 8 },
        tie_word_embeddings: false,
        max_position_embeddings: 64,
        eos_token_ids: vec![EOS],
    }
}

fn backend() -> (HashBackend, Arc<AtomicUsize>) {
    let forwarded = Arc::new(AtomicUsize::new(0));
    (
        HashBackend {
            spec: spec(),
            forwarded: Arc::clone(&forwarded),
            step_delay: Duration::ZERO,
            eos_after: None,
            fail_on: None,
            panic_on: None,
        },
        forwarded,
    )
}

impl Backend for HashBackend {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }
    fn describe(&self) -> String {
        "hash".into()
    }
    fn new_sequence(&mut self) -> anyhow::Result<Box<dyn Sequence>> {
        Ok(Box::new(History(Vec::new())))
    }
    fn step(
        &mut self,
        seq: &mut dyn Sequence,
        tokens: &[u32],
        _sel: &Selection,
    ) -> anyhow::Result<TokenChoice> {
        std::thread::sleep(self.step_delay);
        if self.fail_on.is_some_and(|t| tokens.contains(&t)) {
            anyhow::bail!("backend failure on purpose");
        }
        if self.panic_on.is_some_and(|t| tokens.contains(&t)) {
            panic!("backend panic on purpose");
        }
        self.forwarded.fetch_add(tokens.len(), Ordering::SeqCst);
        let history = &mut seq.as_any_mut().downcast_mut::<History>().unwrap().0;
        history.extend_from_slice(tokens);
        let token = if self.eos_after.is_some_and(|t| history.last() == Some(&t)) {
            EOS
        } else {
            let h = history
                .iter()
                .fold(17u64, |h, &t| h.wrapping_mul(31).wrapping_add(t as u64 + 1));
            (h % (VOCAB as u64 - 1)) as u32
        };
        Ok(TokenChoice {
            token,
            logprob: -0.5,
            top: vec![],
        })
    }
    fn forward_logits(&mut self, _: &mut dyn Sequence, _: &[u32]) -> anyhow::Result<Vec<f32>> {
        anyhow::bail!("not used")
    }
}

#[derive(Debug)]
enum Event {
    Start(JobStart),
    Token(u32),
    Finish(Result<JobReport, String>),
}

struct ChannelSink {
    id: usize,
    tx: mpsc::Sender<(usize, Event)>,
    cancel: Arc<AtomicBool>,
    stop_at: Option<u32>,
}

impl JobSink for ChannelSink {
    fn on_start(&mut self, start: &JobStart) {
        let _ = self.tx.send((self.id, Event::Start(*start)));
    }
    fn on_token(&mut self, choice: &TokenChoice) -> ControlFlow<()> {
        let _ = self.tx.send((self.id, Event::Token(choice.token)));
        if Some(choice.token) == self.stop_at {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    }
    fn is_cancelled(&self) -> bool {
        self.cancel.load(Ordering::SeqCst)
    }
    fn on_finish(&mut self, result: Result<JobReport, String>) {
        let _ = self.tx.send((self.id, Event::Finish(result)));
    }
}

fn config(cache_bytes: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_queue: 8,
        prefix_cache_bytes: cache_bytes,
        max_context: 64,
    }
}

fn job(
    id: usize,
    prompt: Vec<u32>,
    max_tokens: usize,
    tx: &mpsc::Sender<(usize, Event)>,
) -> (Job, Arc<AtomicBool>) {
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job {
        prompt,
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        ignore_eos: false,
        top_logprobs: 0,
        save_prefixes: vec![],
        constraint: None,
        sink: Box::new(ChannelSink {
            id,
            tx: tx.clone(),
            cancel: Arc::clone(&cancel),
            stop_at: None,
        }),
    };
    (job, cancel)
}

/// Everything job `id` reported, in order, until its Finish.
fn collect(rx: &mpsc::Receiver<(usize, Event)>, id: usize) -> (Vec<u32>, JobStart, JobReport) {
    let (mut tokens, mut start) = (Vec::new(), None);
    loop {
        let (from, event) = rx.recv_timeout(Duration::from_secs(10)).expect("an event");
        assert_eq!(from, id, "events of one job at a time (FIFO, one sequence)");
        match event {
            Event::Start(s) => start = Some(s),
            Event::Token(t) => tokens.push(t),
            Event::Finish(r) => return (tokens, start.expect("started"), r.expect("no error")),
        }
    }
}

fn run_alone(prompt: Vec<u32>, max_tokens: usize) -> Vec<u32> {
    let (b, _) = backend();
    let scheduler = Scheduler::start(Box::new(b), config(0));
    let (tx, rx) = mpsc::channel();
    scheduler
        .submit(vec![job(0, prompt, max_tokens, &tx).0])
        .unwrap();
    collect(&rx, 0).0
}

#[test]
fn jobs_run_first_come_first_served() {
    let (b, _) = backend();
    let scheduler = Scheduler::start(Box::new(b), config(0));
    let (tx, rx) = mpsc::channel();
    for id in 0..4 {
        scheduler
            .submit(vec![job(id, vec![id as u32 + 1, 5, 6], 6, &tx).0])
            .unwrap();
    }
    for id in 0..4 {
        let (tokens, _, report) = collect(&rx, id);
        assert_eq!(tokens, report.tokens);
        assert_eq!(tokens, run_alone(vec![id as u32 + 1, 5, 6], 6));
        assert_eq!(report.finish, JobFinish::Length);
    }
}

#[test]
fn prefix_cache_restores_and_runs_only_new_tokens_with_identical_output() {
    let (b, forwarded) = backend();
    let scheduler = Scheduler::start(Box::new(b), config(1 << 20));
    let (tx, rx) = mpsc::channel();
    let turn1: Vec<u32> = (1..=10).collect();
    scheduler
        .submit(vec![job(0, turn1.clone(), 4, &tx).0])
        .unwrap();
    let (out1, start1, _) = collect(&rx, 0);
    assert_eq!(start1.cached_tokens, 0);
    assert_eq!(forwarded.load(Ordering::SeqCst), 10 + 3); // prompt + 3 fed-back tokens

    // the next turn extends the first prompt
    let mut turn2 = turn1.clone();
    turn2.extend(&out1);
    turn2.extend([40, 41]);
    forwarded.store(0, Ordering::SeqCst);
    scheduler
        .submit(vec![job(1, turn2.clone(), 4, &tx).0])
        .unwrap();
    let (out2, start2, report2) = collect(&rx, 1);
    assert_eq!(start2.cached_tokens, 9);
    assert_eq!(report2.cached_tokens, 9);
    assert_eq!(forwarded.load(Ordering::SeqCst), turn2.len() - 9 + 3);
    assert_eq!(
        out2,
        run_alone(turn2.clone(), 4),
        "same output as without the cache"
    );

    // the same prompt again reuses all but its last token
    scheduler
        .submit(vec![job(2, turn2.clone(), 4, &tx).0])
        .unwrap();
    let (out3, start3, _) = collect(&rx, 2);
    assert_eq!(start3.cached_tokens, turn2.len() - 1);
    assert_eq!(out3, out2);
    let stats = scheduler.prefix_cache_stats();
    assert_eq!((stats.queries, stats.hits), (3, 2));
}

#[test]
fn extra_save_points_serve_prompts_that_diverge_after_them() {
    let (b, forwarded) = backend();
    let scheduler = Scheduler::start(Box::new(b), config(1 << 20));
    let (tx, rx) = mpsc::channel();
    // history [1..=6], then a generation prompt [7, 8] the next turn will not repeat
    let (mut j, _) = job(0, (1..=8).collect(), 2, &tx);
    j.save_prefixes = vec![6, 99, 0];
    scheduler.submit(vec![j]).unwrap();
    collect(&rx, 0);
    let next_turn: Vec<u32> = (1..=6).chain([20, 21, 22, 7, 8]).collect();
    forwarded.store(0, Ordering::SeqCst);
    scheduler
        .submit(vec![job(1, next_turn.clone(), 3, &tx).0])
        .unwrap();
    let (out, start, _) = collect(&rx, 1);
    assert_eq!(start.cached_tokens, 6);
    assert_eq!(forwarded.load(Ordering::SeqCst), next_turn.len() - 6 + 2);
    assert_eq!(out, run_alone(next_turn, 3));
}

#[test]
fn cancellation_stops_within_one_step() {
    let (mut b, forwarded) = backend();
    b.step_delay = Duration::from_millis(5);
    let scheduler = Scheduler::start(Box::new(b), config(0));
    let (tx, rx) = mpsc::channel();
    let (j, cancel) = job(0, vec![1, 2, 3], 10_000, &tx);
    scheduler.submit(vec![j]).unwrap();
    let mut seen = 0;
    let report = loop {
        match rx.recv_timeout(Duration::from_secs(10)).unwrap().1 {
            Event::Start(_) => {}
            Event::Token(_) => {
                seen += 1;
                if seen == 3 {
                    cancel.store(true, Ordering::SeqCst);
                }
            }
            Event::Finish(r) => break r.unwrap(),
        }
    };
    assert_eq!(report.finish, JobFinish::Cancelled);
    // The flag may be set while the next step already runs: at most that one step follows.
    assert!(
        seen <= 4,
        "{seen} tokens: more than one step after the cancellation"
    );
    assert!(forwarded.load(Ordering::SeqCst) <= 3 + 4);
    // the engine is free again
    scheduler.submit(vec![job(1, vec![4], 2, &tx).0]).unwrap();
    assert_eq!(collect(&rx, 1).0.len(), 2);
}

#[test]
fn bounded_queue_refuses_and_purges_cancelled() {
    let (mut b, _) = backend();
    b.step_delay = Duration::from_millis(20);
    let scheduler = Scheduler::start(
        Box::new(b),
        SchedulerConfig {
            max_queue: 2,
            ..config(0)
        },
    );
    let (tx, rx) = mpsc::channel();
    let (running, cancel_running) = job(0, vec![1], 1000, &tx);
    scheduler.submit(vec![running]).unwrap();
    assert!(matches!(
        rx.recv_timeout(Duration::from_secs(10)).unwrap(),
        (0, Event::Start(_))
    ));
    assert_eq!(scheduler.running(), 1);
    let (waiting1, cancel1) = job(1, vec![2], 3, &tx);
    let (waiting2, _) = job(2, vec![3], 3, &tx);
    scheduler.submit(vec![waiting1]).unwrap();
    scheduler.submit(vec![waiting2]).unwrap();
    assert_eq!(scheduler.waiting(), 2);
    // full: both of a two-choice request are refused
    let (a, _) = job(3, vec![4], 1, &tx);
    let (b2, _) = job(4, vec![4], 1, &tx);
    assert_eq!(
        scheduler.submit(vec![a, b2]),
        Err(QueueFull { capacity: 2 })
    );
    // a waiting client goes away: its slot is reclaimed on the next submit
    cancel1.store(true, Ordering::SeqCst);
    let (c, _) = job(5, vec![5], 1, &tx);
    scheduler.submit(vec![c]).unwrap();
    cancel_running.store(true, Ordering::SeqCst);
    let mut finished = std::collections::BTreeMap::new();
    while finished.len() < 4 {
        if let (id, Event::Finish(r)) = rx.recv_timeout(Duration::from_secs(10)).unwrap() {
            finished.insert(id, r.unwrap().finish);
        }
    }
    assert_eq!(finished[&0], JobFinish::Cancelled);
    assert_eq!(finished[&1], JobFinish::Cancelled);
    assert_eq!(finished[&2], JobFinish::Length);
    assert_eq!(finished[&5], JobFinish::Length);
}

#[test]
fn stop_tokens_and_limits() {
    let (mut b, _) = backend();
    let plain = run_alone(vec![7, 8], 5);
    b.eos_after = Some(plain[1]); // EOS is chosen right after the second token
    let scheduler = Scheduler::start(Box::new(b), config(0));
    let (tx, rx) = mpsc::channel();
    scheduler
        .submit(vec![job(0, vec![7, 8], 5, &tx).0])
        .unwrap();
    let (tokens, _, report) = collect(&rx, 0);
    assert_eq!(tokens, plain[..2]);
    assert_eq!(report.finish, JobFinish::Stop);
    assert_eq!(report.stop_token, Some(EOS));
    assert_eq!(report.completion_tokens(), 3);

    let (mut j, _) = job(1, vec![7, 8], 5, &tx);
    j.ignore_eos = true;
    scheduler.submit(vec![j]).unwrap();
    let (tokens, _, report) = collect(&rx, 1);
    assert_eq!((tokens.len(), report.finish), (5, JobFinish::Length));
    assert_eq!(tokens[2], EOS);

    // the sink's Break (a stop string) ends with Stop after that token
    let (mut j, _) = job(2, vec![7, 8], 5, &tx);
    j.sink = Box::new(ChannelSink {
        id: 2,
        tx: tx.clone(),
        cancel: Arc::new(AtomicBool::new(false)),
        stop_at: Some(plain[0]),
    });
    scheduler.submit(vec![j]).unwrap();
    let (tokens, _, report) = collect(&rx, 2);
    assert_eq!((tokens, report.finish), (vec![plain[0]], JobFinish::Stop));

    // generation stops at the context length (64)
    let prompt: Vec<u32> = (0..60).map(|i| i % 90).collect();
    let (mut j, _) = job(3, prompt, 100, &tx);
    j.ignore_eos = true;
    scheduler.submit(vec![j]).unwrap();
    let (tokens, _, report) = collect(&rx, 3);
    assert_eq!((tokens.len(), report.finish), (4, JobFinish::Length));
}

#[test]
fn backend_errors_and_panics_are_reported_and_the_engine_goes_on() {
    let (mut b, _) = backend();
    b.fail_on = Some(50);
    b.panic_on = Some(51);
    let scheduler = Scheduler::start(Box::new(b), config(0));
    let (tx, rx) = mpsc::channel();
    scheduler
        .submit(vec![job(0, vec![1, 50], 3, &tx).0])
        .unwrap();
    scheduler
        .submit(vec![job(1, vec![1, 51], 3, &tx).0])
        .unwrap();
    scheduler.submit(vec![job(2, vec![], 3, &tx).0]).unwrap();
    scheduler
        .submit(vec![job(3, vec![1, 2], 3, &tx).0])
        .unwrap();
    let mut results = Vec::new();
    while results.len() < 4 {
        if let (id, Event::Finish(r)) = rx.recv_timeout(Duration::from_secs(10)).unwrap() {
            results.push((id, r));
        }
    }
    assert!(results[0].1.as_ref().unwrap_err().contains("on purpose"));
    assert!(results[1].1.as_ref().unwrap_err().contains("panicked"));
    assert!(results[2].1.as_ref().unwrap_err().contains("empty"));
    assert_eq!(results[3].1.as_ref().unwrap().tokens.len(), 3);
}

#[test]
fn dropping_the_scheduler_cancels_and_joins() {
    let (mut b, _) = backend();
    b.step_delay = Duration::from_millis(5);
    let scheduler = Scheduler::start(Box::new(b), config(0));
    let (tx, rx) = mpsc::channel();
    scheduler
        .submit(vec![job(0, vec![1], 100_000, &tx).0])
        .unwrap();
    scheduler.submit(vec![job(1, vec![1], 5, &tx).0]).unwrap();
    assert!(matches!(
        rx.recv_timeout(Duration::from_secs(10)).unwrap(),
        (0, Event::Start(_))
    ));
    drop(scheduler);
    let finishes: Vec<JobFinish> = rx
        .try_iter()
        .filter_map(|(_, e)| match e {
            Event::Finish(r) => Some(r.unwrap().finish),
            _ => None,
        })
        .collect();
    assert_eq!(finishes, vec![JobFinish::Cancelled, JobFinish::Cancelled]);
}

/// A client that leaves during a long prompt stops it within one prefill chunk (issue 33 defect 9).
#[test]
fn cancellation_stops_a_long_prefill_between_chunks() {
    let (mut b, forwarded) = backend();
    b.step_delay = Duration::from_millis(50);
    let scheduler = Scheduler::start(
        Box::new(b),
        SchedulerConfig {
            max_context: 40 * PREFILL_CHUNK,
            ..config(0)
        },
    );
    let (tx, rx) = mpsc::channel();
    let prompt: Vec<u32> = (0..20 * PREFILL_CHUNK as u32)
        .map(|i| i % (VOCAB - 1))
        .collect();
    let (j, cancel) = job(0, prompt.clone(), 10, &tx);
    scheduler.submit(vec![j]).unwrap();
    let report = loop {
        match rx.recv_timeout(Duration::from_secs(10)).unwrap().1 {
            Event::Start(_) => cancel.store(true, Ordering::SeqCst),
            Event::Token(_) => panic!("a token after the cancellation"),
            Event::Finish(r) => break r.unwrap(),
        }
    };
    assert_eq!(report.finish, JobFinish::Cancelled);
    assert_eq!(report.prompt_tokens, prompt.len());
    let ran = forwarded.load(Ordering::SeqCst);
    assert!(
        ran <= 2 * PREFILL_CHUNK,
        "{ran} prompt tokens ran after the cancellation"
    );
}
