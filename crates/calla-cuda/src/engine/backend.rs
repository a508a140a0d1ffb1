//! `CudaBackend`: calla_engine::Backend on one NVIDIA GPU.
//!
//! Construction: probe the driver and NVRTC, compile the kernels (cached), upload and repack the
//! weights, allocate scratch, build the step's launch chain and capture it as CUDA graphs:
//!   `token`  = embed + all layers (prompt tokens),
//!   `decode` = embed + all layers + lm_head + select (one generated token, cursor advanced on device),
//!   `decode_greedy` = embed + all layers + lm_head with plain greedy fused in (where lm_head runs on
//!            the tensor cores: matvec::head_greedy; replayed while the selection is plain greedy),
//!   `logits` = final norm + lm_head (forward_logits).
//! A step uploads the 16-byte cursor only when the device's copy is not already right (during
//! decode it never is needed: the select kernel moved it), replays, and reads back the chosen token.
//! `step_pipelined` replays the next step's graph before it waits for this one's token (two steps
//! in flight): the selection kernel writes each step's result into its own slot of mapped host
//! memory (the position's parity), so the device goes from one token to the next without waiting
//! for the host, and nothing is queued between two steps to copy a result out.

mod prompt;

use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, ensure, Context, Result};
use calla_engine::constraint::TokenMask;
use calla_engine::{Backend, Selection, Sequence, TokenChoice};
use calla_model::{ModelSpec, Weights};

use crate::engine::decode::{self, Scratch, StateLayout};
use crate::ops::attention::{self, KvDtype};
use crate::ops::deltanet;
use crate::runtime::choices::KernelChoices;
use crate::runtime::gpu::{Gpu, Launch, ReadbackSlots};
use crate::runtime::graph::StepGraph;
use crate::runtime::pool::{Arena, DEFAULT_BLOCK};

use crate::engine::sequence::{CudaSequence, FailedSnapshot};
use crate::ops::prompt_precision::PromptPrecision;
use crate::ops::select::{SelectResult, Selector};
use crate::ops::weights::{self, DevModel};

/// The K/V cache element type when the caller does not choose (CudaOptions::default, `calla bench`).
/// bf16: half the bytes of f32 (0.67 GB instead of 1.35 at 32K positions of the real shape), what
/// issue 5's 22 GB at 32K needs; the decode and prompt kernels read it natively. Switching this
/// default needs the GPU parity run (scripts/gpu-parity.sh: engine_matches_transformers_at_real_shapes
/// runs with the default options).
pub const DEFAULT_KV_CACHE: KvDtype = KvDtype::Bf16;

#[derive(Debug, Clone)]
pub struct CudaOptions {
    /// GPU ordinal
    pub device: usize,
    /// Positions per sequence (KV capacity); None = min(max_position_embeddings, 32768).
    pub max_context: Option<usize>,
    /// K/V cache element type ([`DEFAULT_KV_CACHE`] by default). f32 matches the f32 CPU reference
    /// to rounding; bf16 halves the cache's bytes (long contexts, issue 5's memory target).
    pub kv_cache: KvDtype,
    /// Replay captured graphs (true) or launch kernel by kernel (debugging).
    pub use_graphs: bool,
    /// Print an upload progress bar on stderr.
    pub progress: bool,
    /// Prompt tokens per batched prefill chunk (engine/prefill.rs); 0 runs prompts token by token
    /// through the decode chain. 8192 by default: at 2048 each of 256 experts gets ~64 rows, half
    /// a GEMM tile (docs/performance.md, "Prefill optimisations"). The scratch is made for the
    /// prompts seen (backend/prompt.rs `scratch_rows`), at most min(chunk, max_context) tokens, with
    /// buffers of different phases sharing bytes (engine/prefill.rs): 0.74 GB at 8192 tokens of the
    /// real shape (+ 67 MB of residual rows), 2.9 GB before plans.
    pub prompt_chunk: usize,
    /// Precision of the batched prompt's weight products (and of flash attention over an f32
    /// cache), per product group (prompt_precision.rs): balanced by default (f16 products on q4
    /// weights on Hopper, the DeltaNet in-projections split: within the parity tolerance, 1.45×
    /// split's speed at 8K), split everywhere (≈ f32: prompts agree with the f32 decode path and
    /// the CPU reference to ~1e-5), half or fast everywhere (faster, less exact:
    /// docs/experiments.md), or between, e.g. `PromptPrecision::MIXED` (routed experts fast).
    /// The MoE router always runs split.
    pub prompt_precision: PromptPrecision,
    /// Which kernel variants the launchers pick: the measured fastest by default;
    /// [`KernelChoices::shared_gpu`] where the GPU's SMs are partitioned among processes (MPS);
    /// [`KernelChoices::general`] for the tests of the compiled copies.
    pub kernels: KernelChoices,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            device: 0,
            max_context: None,
            kv_cache: DEFAULT_KV_CACHE,
            use_graphs: true,
            progress: false,
            prompt_chunk: 8192,
            prompt_precision: PromptPrecision::default(),
            kernels: KernelChoices::default(),
        }
    }
}

/// The device cursor (common.cuh `Cursor`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cursor {
    pub state_base: u64,
    pub pos: i32,
    pub token: i32,
}

const RAN_AHEAD: &str =
    "this sequence ran a step ahead (step_pipelined) whose token was never taken: \
                         it can only be dropped";

/// A decode step started before its caller asked for it (`step_pipelined`).
struct InFlight {
    /// the sequence it runs on (CudaSequence::id)
    seq_id: u64,
    /// the readback slot its selection is written into (its position's parity)
    slot: usize,
    /// its input: the token the step before chose
    token: u32,
}

struct Graphs {
    token: StepGraph,
    decode: StepGraph,
    decode_greedy: Option<StepGraph>,
    logits: StepGraph,
}

/// Device bytes reserved by an engine (what `used` memory they account for; the CUDA context,
/// kernel modules and graphs come on top).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct MemoryUse {
    /// the weights' arena (codes, group parameters, norms)
    pub weights: usize,
    /// decode step activations and the token selector
    pub decode_scratch: usize,
    /// the batched prompt path (0 until the first prompt)
    pub prompt_scratch: usize,
    /// one sequence's state: DeltaNet conv rings and states, K/V caches at max_context
    pub sequence_state: usize,
}

/// Start-up facts for logs and reports.
#[derive(Debug, Clone)]
pub struct CudaLoadReport {
    pub device: String,
    pub libraries: String,
    pub weight_bytes: usize,
    pub upload_seconds: f64,
    pub kernel_modules: Vec<(String, usize, bool, f64)>,
    /// a plain-greedy decode step's launches (other selections add one where lm_head chooses greedy
    /// tokens itself)
    pub launches_per_token: usize,
    pub state_bytes_per_sequence: usize,
}

pub struct CudaBackend {
    gpu: Arc<Gpu>,
    spec: ModelSpec,
    pub model: DevModel,
    pub scratch: Scratch,
    pub selector: Selector,
    pub layout: StateLayout,
    /// the layout and layer kinds every sequence of this engine carries (compact snapshots)
    state_layout: Arc<(StateLayout, Vec<calla_model::LayerKind>)>,
    body: Vec<Launch>,
    head: Vec<Launch>,
    select_advance: Launch,
    /// lm_head with plain greedy selection fused in, where the formats allow (head + select_advance
    /// in one launch for plain greedy)
    head_greedy: Option<Launch>,
    graphs: Option<Graphs>,
    cursor_mirror: Option<Cursor>,
    /// each step's selection result, written by the selection kernel into slot pos & 1
    readback: ReadbackSlots<SelectResult>,
    /// the step `step_pipelined` started ahead and has not returned yet
    in_flight: Option<InFlight>,
    pub report: CudaLoadReport,
    pub(crate) prompt_chunk: usize,
    pub(crate) prompt_precision: PromptPrecision,
    /// the batched prompt path (with its own arena), made on the first prompt (backend/prompt.rs)
    pub(crate) prompt: Option<prompt::PromptPath>,
    // Arenas last: dropped after everything that points into them.
    _scratch_arena: Arena,
    _weights_arena: Arena,
}

impl CudaBackend {
    /// Upload `weights` (any mix of f32/bf16/f16/q4/q8 matrices) and prepare the engine.
    pub fn new(spec: &ModelSpec, weights: &Weights, opts: &CudaOptions) -> Result<CudaBackend> {
        let gpu = Gpu::new(opts.device)?;
        gpu.set_choices(opts.kernels);
        deltanet::check_dims(spec)?;
        attention::check_dims(spec)?;
        let mut arena = Arena::new(&gpu, DEFAULT_BLOCK);
        let bar = opts.progress.then(ProgressLine::new);
        let progress = |done: usize, total: usize| {
            if let Some(b) = &bar {
                b.update(done, total);
            }
        };
        let model = weights::upload_model(&gpu, &mut arena, spec, weights, Some(&progress))?;
        if let Some(b) = &bar {
            b.finish();
        }
        tracing::info!(
            "cuda: {:.2} GB of weights uploaded in {:.2} s ({:.2} GB/s) to {}",
            model.bytes as f64 / 1e9,
            model.upload_seconds,
            model.bytes as f64 / 1e9 / model.upload_seconds.max(1e-9),
            gpu.describe()
        );
        Self::from_device_model(gpu, spec, model, arena, opts)
    }

    /// Build the engine around weights already on the device (synthetic benchmark models).
    pub fn from_device_model(
        gpu: Arc<Gpu>,
        spec: &ModelSpec,
        model: DevModel,
        weights_arena: Arena,
        opts: &CudaOptions,
    ) -> Result<CudaBackend> {
        gpu.set_choices(opts.kernels);
        tracing::info!(
            "cuda: prompt precision {} (router split)",
            opts.prompt_precision
        );
        let max_ctx = opts
            .max_context
            .unwrap_or(spec.max_position_embeddings.min(32768))
            .max(1);
        let layout = StateLayout::new(spec, max_ctx, opts.kv_cache);
        let mut scratch_arena = Arena::new(&gpu, DEFAULT_BLOCK);
        let scratch = Scratch::new(&mut scratch_arena, spec, max_ctx)?;
        let selector = Selector::new(&mut scratch_arena, spec.vocab_size, max_ctx + 1)?;
        let body = decode::body_launches(&gpu, spec, &model, &layout, &scratch)?;
        let head = decode::head_launches(&gpu, spec, &model, &scratch)?;
        let readback = ReadbackSlots::new(&gpu, 2)?;
        let select_advance = selector.launch(
            &gpu,
            scratch.logits,
            scratch.cursor,
            true,
            Some(readback.device_ptr()),
        )?;
        let head_greedy = decode::head_greedy_launch(
            &gpu,
            spec,
            &model,
            &scratch,
            &selector,
            selector.token_out(scratch.cursor, true, Some(readback.device_ptr())),
        )?;
        let report = CudaLoadReport {
            device: gpu.describe(),
            libraries: gpu.libraries.clone(),
            weight_bytes: model.bytes,
            upload_seconds: model.upload_seconds,
            kernel_modules: gpu
                .modules_report
                .iter()
                .map(|m| {
                    (
                        m.name.to_string(),
                        m.cubin_bytes,
                        m.from_cache,
                        m.compile_seconds,
                    )
                })
                .collect(),
            launches_per_token: body.len()
                + if head_greedy.is_some() {
                    1
                } else {
                    head.len() + 1
                },
            state_bytes_per_sequence: layout.bytes,
        };
        let mut backend = CudaBackend {
            gpu,
            spec: spec.clone(),
            model,
            scratch,
            selector,
            state_layout: Arc::new((layout.clone(), spec.layers.clone())),
            layout,
            body,
            head,
            select_advance,
            head_greedy,
            graphs: None,
            cursor_mirror: None,
            readback,
            in_flight: None,
            report,
            prompt: None,
            prompt_chunk: opts.prompt_chunk,
            prompt_precision: opts.prompt_precision,
            _scratch_arena: scratch_arena,
            _weights_arena: weights_arena,
        };
        if opts.use_graphs {
            backend.capture()?;
        }
        Ok(backend)
    }

    fn capture(&mut self) -> Result<()> {
        let start = Instant::now();
        let decode = self.decode_launches(false);
        let decode_greedy = match self.head_greedy {
            Some(_) => Some(StepGraph::capture(&self.gpu, &self.decode_launches(true))?),
            None => None,
        };
        self.graphs = Some(Graphs {
            token: StepGraph::capture(&self.gpu, &self.body)?,
            decode: StepGraph::capture(&self.gpu, &decode)?,
            decode_greedy,
            logits: StepGraph::capture(&self.gpu, &self.head)?,
        });
        tracing::info!(
            "cuda: decode step captured as one graph of {} launches in {:.1} ms",
            decode.len(),
            start.elapsed().as_secs_f64() * 1e3
        );
        Ok(())
    }

    /// One decode step's launches: the layers, then lm_head and the selection, or (`fused_greedy`,
    /// where head_greedy exists) lm_head with plain greedy fused in.
    fn decode_launches(&self, fused_greedy: bool) -> Vec<Launch> {
        let mut out = self.body.clone();
        match (&self.head_greedy, fused_greedy) {
            (Some(l), true) => out.push(l.clone()),
            _ => {
                out.extend(self.head.iter().cloned());
                out.push(self.select_advance.clone());
            }
        }
        out
    }

    /// Whether plain greedy steps choose inside lm_head (one launch fewer per token), i.e. lm_head
    /// takes matvec::head_greedy's kernel.
    pub fn fuses_greedy_selection(&self) -> bool {
        self.head_greedy.is_some()
    }

    /// Whether this step's selection runs inside lm_head: the device's configuration is plain
    /// greedy and lm_head takes that path.
    fn fused_greedy(&self) -> bool {
        self.head_greedy.is_some() && self.selector.plain_greedy()
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Device bytes this engine holds, by use (sequences are counted by their owners).
    pub fn memory(&self) -> MemoryUse {
        MemoryUse {
            weights: self._weights_arena.reserved(),
            decode_scratch: self._scratch_arena.reserved(),
            prompt_scratch: self.prompt.as_ref().map(|p| p.reserved()).unwrap_or(0),
            sequence_state: self.layout.bytes,
        }
    }

    pub fn layout(&self) -> &StateLayout {
        &self.layout
    }

    pub fn max_context(&self) -> usize {
        self.layout.max_ctx
    }

    /// Point the device cursor at (sequence, position, token), uploading only on change.
    pub fn set_cursor(&mut self, seq: &CudaSequence, pos: usize, token: u32) -> Result<()> {
        let want = Cursor {
            state_base: seq.base().0,
            pos: pos as i32,
            token: token as i32,
        };
        if self.cursor_mirror != Some(want) {
            self.gpu
                .htod(self.scratch.cursor, std::slice::from_ref(&want))?;
            self.cursor_mirror = Some(want);
        }
        Ok(())
    }

    /// One prompt token through the layers (no head).
    pub(crate) fn run_token(&mut self) -> Result<()> {
        match &self.graphs {
            Some(g) => g.token.replay(&self.gpu),
            None => self.body.iter().try_for_each(|l| l.run(&self.gpu)),
        }
    }

    /// One token through layers + head + selection; the device cursor advances.
    pub(crate) fn run_decode(&mut self) -> Result<()> {
        let fused = self.fused_greedy();
        match &self.graphs {
            Some(g) => match (&g.decode_greedy, fused) {
                (Some(greedy), true) => greedy.replay(&self.gpu)?,
                _ => g.decode.replay(&self.gpu)?,
            },
            None => {
                for l in &self.decode_launches(fused) {
                    l.run(&self.gpu)?;
                }
            }
        }
        if let Some(c) = self.cursor_mirror.as_mut() {
            c.pos += 1;
            c.token = -1; // chosen on the device; set after the result is read
        }
        Ok(())
    }

    pub(crate) fn run_logits(&mut self) -> Result<()> {
        match &self.graphs {
            Some(g) => g.logits.replay(&self.gpu),
            None => self.head.iter().try_for_each(|l| l.run(&self.gpu)),
        }
    }

    /// Queue `tokens` on `seq`: the prompt part through the layers, the last token through the
    /// decode graph, its selection written into a readback slot (returned). The decode step is not
    /// waited for.
    fn start_step(
        &mut self,
        seq: &mut CudaSequence,
        tokens: &[u32],
        sel: &Selection,
        allowed: Option<&TokenMask>,
    ) -> Result<usize> {
        self.check_tokens(seq, tokens)?;
        match allowed {
            Some(mask) => self.selector.prepare_masked(&self.gpu, sel, mask)?,
            None => self.selector.prepare(&self.gpu, sel)?,
        }
        let (prompt, last) = tokens.split_at(tokens.len() - 1);
        prompt::run_prompt_tokens(self, seq, prompt)?;
        let pos = seq.len + prompt.len();
        self.set_cursor(seq, pos, last[0])?;
        let slot = self.queue_decode(pos)?;
        seq.len += tokens.len();
        Ok(slot)
    }

    /// Replay the decode graph for the token the device cursor holds, at position `pos`; its
    /// selection lands in readback slot pos & 1 (two slots: the two steps that can be outstanding
    /// are at consecutive positions).
    fn queue_decode(&mut self, pos: usize) -> Result<usize> {
        let slot = pos & 1;
        self.run_decode()?;
        self.readback.record(slot)?;
        Ok(slot)
    }

    /// Wait for the step whose selection goes into `slot`, and account for it (in launch order).
    fn collect(&mut self, slot: usize) -> Result<TokenChoice> {
        let r = self.readback.wait(slot)?;
        self.selector.account(r)
    }

    /// Finish a step started ahead whose caller went elsewhere (its sequence has consumed its token;
    /// the selector's mirrors advance as the device's did). Anything but the step it anticipated
    /// settles first.
    fn settle(&mut self) -> Result<()> {
        if let Some(f) = self.in_flight.take() {
            self.collect(f.slot)?;
        }
        Ok(())
    }

    fn check_tokens(&self, seq: &CudaSequence, tokens: &[u32]) -> Result<()> {
        ensure!(!tokens.is_empty(), "no tokens to run");
        let v = self.spec.vocab_size;
        if let Some(t) = tokens.iter().find(|t| **t as usize >= v) {
            anyhow::bail!("token id {t} is outside the vocabulary ({v} entries)");
        }
        ensure!(
            seq.len + tokens.len() <= self.layout.max_ctx,
            "context full: {} + {} tokens exceed the {} positions this engine was sized for",
            seq.len,
            tokens.len(),
            self.layout.max_ctx
        );
        Ok(())
    }
}

impl CudaBackend {
    /// Time every launch of one decode step on its own: each launch is captured `REPS` times into
    /// a graph and replayed between two events, so the time is the kernel's (plus ~1 µs of graph
    /// node), not the host's launch rate. Returns (kernel name, launches per step, µs per step)
    /// summed by name, slowest first, then a row "= decode step (graph, back to back)": the whole
    /// step's graph replayed `rounds` times without a host round trip. The sequence's state is
    /// garbage afterwards (every kernel ran REPS times): profile last.
    pub fn profile_decode(
        &mut self,
        seq: &mut dyn Sequence,
        token: u32,
        rounds: usize,
    ) -> Result<Vec<(String, usize, f64)>> {
        use cudarc::driver::sys::CUevent_flags;
        const REPS: usize = 20;
        self.settle()?;
        let seq = cuda_sequence(seq)?;
        ensure!(!seq.ran_ahead, RAN_AHEAD);
        let chain = self.decode_launches(self.fused_greedy());
        let event = || {
            self.gpu
                .ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        };
        let (start, stop) = (event()?, event()?);
        self.check_tokens(seq, &[token])?;
        self.set_cursor(seq, seq.len, token)?;
        let mut totals: std::collections::BTreeMap<String, (usize, f64)> = Default::default();
        for l in &chain {
            let reps = vec![l.clone(); REPS];
            let graph = StepGraph::capture(&self.gpu, &reps)?;
            graph.replay(&self.gpu)?;
            start.record(&self.gpu.stream)?;
            graph.replay(&self.gpu)?;
            stop.record(&self.gpu.stream)?;
            self.gpu.sync()?;
            let us = start.elapsed_ms(&stop)? as f64 * 1e3 / REPS as f64;
            let t = totals.entry(l.name.clone()).or_default();
            t.0 += 1;
            t.1 += us;
        }
        let mut out: Vec<(String, usize, f64)> =
            totals.into_iter().map(|(k, (n, us))| (k, n, us)).collect();
        out.sort_by(|a, b| b.2.total_cmp(&a.2));
        let step = StepGraph::capture(&self.gpu, &chain)?;
        step.replay(&self.gpu)?;
        start.record(&self.gpu.stream)?;
        for _ in 0..rounds.max(1) {
            step.replay(&self.gpu)?;
        }
        stop.record(&self.gpu.stream)?;
        self.gpu.sync()?;
        let us = start.elapsed_ms(&stop)? as f64 * 1e3 / rounds.max(1) as f64;
        out.push((
            "= decode step (graph, back to back)".into(),
            chain.len(),
            us,
        ));
        // The cursor advanced on the device; the host mirror no longer knows where.
        self.cursor_mirror = None;
        seq.len += 1;
        Ok(out)
    }
}

fn cuda_sequence(seq: &mut dyn Sequence) -> Result<&mut CudaSequence> {
    if let Some(f) = seq.as_any().downcast_ref::<FailedSnapshot>() {
        return Err(anyhow!("this sequence is a snapshot that failed: {}", f.0));
    }
    let seq = seq
        .as_any_mut()
        .downcast_mut::<CudaSequence>()
        .ok_or_else(|| anyhow!("the sequence was not made by the cuda backend"))?;
    seq.make_full()?;
    Ok(seq)
}

impl Backend for CudaBackend {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn describe(&self) -> String {
        self.gpu.describe()
    }

    fn new_sequence(&mut self) -> Result<Box<dyn Sequence>> {
        let state = self
            .gpu
            .alloc(self.layout.bytes)
            .context("allocating a sequence's state")?;
        Ok(Box::new(CudaSequence::new(
            state,
            self.state_layout.clone(),
        )?))
    }

    fn step(
        &mut self,
        seq: &mut dyn Sequence,
        tokens: &[u32],
        sel: &Selection,
    ) -> Result<TokenChoice> {
        self.step_pipelined(seq, tokens, sel, false)
    }

    fn supports_token_mask(&self) -> bool {
        true
    }

    /// The mask goes to the device with the step (select.rs `prepare_masked`): the selection
    /// launch chooses among the allowed tokens, as for any other request; no logits cross to the
    /// host. Never runs ahead (the next mask depends on this token).
    fn step_masked(
        &mut self,
        seq: &mut dyn Sequence,
        tokens: &[u32],
        sel: &Selection,
        allowed: &TokenMask,
    ) -> Result<TokenChoice> {
        let seq = cuda_sequence(seq)?;
        ensure!(!seq.ran_ahead, RAN_AHEAD);
        self.settle()?;
        let slot = self.start_step(seq, tokens, sel, Some(allowed))?;
        let choice = self.collect(slot)?;
        if let Some(c) = self.cursor_mirror.as_mut() {
            c.token = choice.token as i32;
        }
        ensure!(
            allowed.allows(choice.token),
            "the constraint allows no token with a finite logit ({} allowed of {})",
            allowed.count(),
            allowed.len()
        );
        Ok(choice)
    }

    fn step_pipelined(
        &mut self,
        seq: &mut dyn Sequence,
        tokens: &[u32],
        sel: &Selection,
        continue_after: bool,
    ) -> Result<TokenChoice> {
        let seq = cuda_sequence(seq)?;
        let slot = if seq.ran_ahead {
            // this call's step is already running: it must be the one started
            let current = self.selector.is_current(sel);
            let f = match self.in_flight.take() {
                Some(f) if f.seq_id == seq.id => f,
                other => {
                    self.in_flight = other;
                    bail!(RAN_AHEAD);
                }
            };
            let expected = f.token;
            if tokens != [expected] || !matches!(current, Ok(true)) {
                // the step stays in flight (settled by whatever runs next)
                self.in_flight = Some(f);
                current?;
                bail!(
                    "this sequence's next step (token {expected}, the same selection one draw on) is \
                     already running; asked for another"
                );
            }
            seq.ran_ahead = false;
            f.slot
        } else {
            self.settle()?;
            self.start_step(seq, tokens, sel, None)?
        };
        // The next step reads its token, position and selection state from the device, where this
        // step's selection leaves them: it can be queued before this step's token is known.
        let ahead = if continue_after && seq.len < self.layout.max_ctx {
            let s = self.queue_decode(seq.len)?;
            seq.len += 1;
            seq.ran_ahead = true;
            Some(s)
        } else {
            None
        };
        let choice = self.collect(slot)?;
        match ahead {
            Some(s) => {
                self.in_flight = Some(InFlight {
                    seq_id: seq.id,
                    slot: s,
                    token: choice.token,
                })
            }
            None => {
                if let Some(c) = self.cursor_mirror.as_mut() {
                    c.token = choice.token as i32;
                }
            }
        }
        Ok(choice)
    }

    fn forward_logits(&mut self, seq: &mut dyn Sequence, tokens: &[u32]) -> Result<Vec<f32>> {
        self.settle()?;
        let seq = cuda_sequence(seq)?;
        ensure!(!seq.ran_ahead, RAN_AHEAD);
        self.check_tokens(seq, tokens)?;
        prompt::run_prompt_tokens(self, seq, tokens)?;
        self.run_logits()?;
        let mut logits = vec![0f32; self.spec.vocab_size];
        self.gpu.dtoh(self.scratch.logits, &mut logits)?;
        seq.len += tokens.len();
        Ok(logits)
    }
}

/// A one-line progress indicator on stderr for the weight upload.
struct ProgressLine {
    start: Instant,
    last: std::sync::Mutex<f64>,
}

impl ProgressLine {
    fn new() -> ProgressLine {
        ProgressLine {
            start: Instant::now(),
            last: std::sync::Mutex::new(-1.0),
        }
    }
    fn update(&self, done: usize, total: usize) {
        let frac = done as f64 / total.max(1) as f64;
        if let Ok(mut last) = self.last.lock() {
            if frac - *last >= 0.02 || done == total {
                *last = frac;
                eprint!(
                    "\rloading weights to the GPU: {:5.1}% ({:.2}/{:.2} GB, {:.1} s)",
                    frac * 100.0,
                    done as f64 / 1e9,
                    total as f64 / 1e9,
                    self.start.elapsed().as_secs_f64()
                );
            }
        }
    }
    fn finish(&self) {
        eprintln!();
    }
}
