//! Launcher for select.cu: token selection on the device (calla_engine::sampling rules),
//! plus the device-side state it reads: the per-request configuration and the penalty tables.

use anyhow::{bail, ensure, Result};
use calla_engine::constraint::TokenMask;
use calla_engine::{Selection, TokenChoice};

use crate::runtime::gpu::{DPtr, Gpu, Launch};
use crate::runtime::pool::Arena;

pub const THREADS: u32 = 256;
pub const MAX_LOGPROBS: usize = 20;
pub const MAX_CANDIDATES: usize = 64;
const MAX_BLOCKS: usize = 64;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SelectConfig {
    pub temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub rep_penalty: f32,
    pub presence: f32,
    pub frequency: f32,
    pub top_k: i32,
    pub n_logprobs: i32,
    pub seed_lo: u32,
    pub seed_hi: u32,
    pub step_lo: u32,
    pub step_hi: u32,
    pub use_bias: i32,
    pub use_seen: i32,
    pub use_counts: i32,
    pub pad: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SelectResult {
    pub token: i32,
    pub logprob: f32,
    pub n_top: i32,
    pub sampled: i32,
    pub top_ids: [i32; MAX_LOGPROBS],
    pub top_logprobs: [f32; MAX_LOGPROBS],
}

impl Default for SelectResult {
    fn default() -> Self {
        SelectResult {
            token: -1,
            logprob: 0.0,
            n_top: 0,
            sampled: 0,
            top_ids: [0; MAX_LOGPROBS],
            top_logprobs: [0.0; MAX_LOGPROBS],
        }
    }
}

/// common.cuh TokenOut: where a chosen token goes (the selection kernel's fields of the same names;
/// lm_head with plain greedy fused in, matvec.rs `head_greedy`, takes it whole).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct TokenOut {
    pub config: u64,
    pub result: u64,
    /// [2] SelectResult in mapped page-locked host memory (slot pos & 1), or 0
    pub result_host: u64,
    pub cursor: u64,
    pub counts: u64,
    pub seen: u64,
    pub advance: i32,
    pub pad: i32,
}

/// matvec_tc.cu GREEDY_HEAD_MAX_BLOCKS: the fused greedy head's partials per field.
pub const GREEDY_HEAD_MAX_BLOCKS: usize = 1024;

/// select.cu SelectPartial: 8 words + 20 + 20 + 64 + 64.
const PARTIAL_BYTES: usize = 4 * (9 + 2 * MAX_LOGPROBS + 2 * MAX_CANDIDATES);

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct SelectParams {
    pub logits: u64,
    pub config: u64,
    pub partials: u64,
    pub counter: u64,
    pub result: u64,
    pub cursor: u64,
    pub bias: u64,
    pub seen: u64,
    pub counts: u64,
    /// [2] SelectResult in mapped page-locked host memory (slot pos & 1), or 0
    pub result_host: u64,
    /// the grid draw's barrier counter and per-block rows
    pub grid: u64,
    pub v: i32,
    pub chunk: i32,
    pub advance: i32,
    /// > 0: sampled tokens are drawn by the whole grid over subtrees of 2^sub_log2 ids
    pub sub_log2: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct PenaltyParams {
    pub prompt_ids: u64,
    pub output_ids: u64,
    pub seen: u64,
    pub counts: u64,
    pub n_prompt: i32,
    pub n_output: i32,
    pub v: i32,
    pub pad: i32,
}

/// Floats in each of select.cu's two shared arrays (`arr` there).
fn shared_floats(chunk: usize, blocks: usize) -> usize {
    chunk
        .max(blocks * MAX_CANDIDATES)
        .max(blocks * MAX_LOGPROBS)
        .max(THREADS as usize + 1)
}

/// select.cu's SEL_GRID_ROWS: the grid draw's per-block rows.
const GRID_ROWS: usize = 45;

/// The grid draw's global scratch (select.cu `sel_grid_row`, `sel_grid_hist`, `sel_grid_list`): the
/// barrier's counter and the drawn id (16 bytes), GRID_ROWS rows of one f32 per block, then (16-byte
/// aligned) two 256-bin histograms of 64 i32 (one per block, MAX_BLOCKS), the candidates' count and
/// their 64 keys.
fn grid_bytes(blocks: usize) -> usize {
    (16 + GRID_ROWS * blocks * 4).next_multiple_of(16)
        + 2 * 256 * MAX_BLOCKS * 4
        + 16
        + MAX_CANDIDATES * 8
}

/// log2 of the subtree each block of the grid draw owns (select.cu "sampling on the whole grid"), or
/// None where that draw does not apply: the weight tree's N = 2^⌈log2 V⌉ leaves as the largest power
/// of two of subtrees that `blocks` covers, each 256 to 16·256 ids (whole leaves per thread, in
/// registers).
fn subtree_log2(vocab: usize, blocks: usize) -> Option<i32> {
    let n = vocab.next_power_of_two();
    let subtrees = 1usize << blocks.max(1).ilog2();
    let size = (n / subtrees).max(1);
    (THREADS as usize..=16 * THREADS as usize)
        .contains(&size)
        .then(|| size.ilog2() as i32)
}

/// Whether select.cu's `tree_shape` finds groups of 32·G ids, G ≤ TREE_MAX_G (8), whose heap, tie
/// counts and one group's subtree fit `words` floats of shared memory.
fn weight_tree_fits(vocab: usize, words: usize) -> bool {
    let n = vocab.next_power_of_two();
    (0..4).map(|k| 1usize << k).any(|g| {
        let (gs, ng) = (32 * g, (n / (32 * g)).max(1));
        3 * ng + 2 * gs <= words || ng == 1
    })
}

/// The device buffers of token selection, and host mirrors of what they hold (so uploads happen
/// only when a request's settings change).
pub struct Selector {
    pub vocab: usize,
    pub config: DPtr,
    pub partials: DPtr,
    pub counter: DPtr,
    pub result: DPtr,
    /// the grid draw's barrier counter and rows
    pub grid: DPtr,
    pub bias: DPtr,
    pub seen: DPtr,
    pub counts: DPtr,
    /// the fused greedy head's partials (4 × GREEDY_HEAD_MAX_BLOCKS words) and its ticket
    pub greedy_partials: DPtr,
    pub greedy_counter: DPtr,
    /// staging for penalty id lists
    ids: DPtr,
    ids_capacity: usize,
    blocks: usize,
    chunk: usize,
    /// log2 of the grid draw's subtree (= chunk), where it applies
    subtree: Option<i32>,
    config_mirror: Option<SelectConfig>,
    bias_mirror: Vec<(u32, f32)>,
    /// the device's bias table also holds a token mask (−∞ for the disallowed ids): the next
    /// unmasked selection uploads its own table
    bias_masked: bool,
    /// (prompt, generated) the penalty tables reflect
    penalty_mirror: Option<(Vec<u32>, Vec<u32>)>,
}

impl Selector {
    pub fn new(arena: &mut Arena, vocab: usize, max_ids: usize) -> Result<Selector> {
        let default_blocks = vocab.div_ceil(1024).clamp(1, MAX_BLOCKS);
        // The grid draw (select.cu "sampling on the whole grid") gives each block one subtree of the
        // weight tree as its chunk, so phase 1 leaves it the subtree's z values.
        let subtree = subtree_log2(vocab, default_blocks);
        let (blocks, chunk) = match subtree {
            Some(l) => (vocab.div_ceil(1 << l), 1usize << l),
            None => (default_blocks, vocab.div_ceil(default_blocks)),
        };
        ensure!(
            weight_tree_fits(vocab, 2 * shared_floats(chunk, blocks)),
            "a vocabulary of {vocab} is too large for the CUDA sampler's weight tree"
        );
        Ok(Selector {
            vocab,
            config: arena.alloc_zeroed(std::mem::size_of::<SelectConfig>())?,
            partials: arena.alloc_zeroed(blocks * PARTIAL_BYTES)?,
            counter: arena.alloc_zeroed(4)?,
            result: arena.alloc_zeroed(std::mem::size_of::<SelectResult>())?,
            grid: arena.alloc_zeroed(grid_bytes(blocks))?,
            bias: arena.alloc_zeroed(vocab * 4)?,
            seen: arena.alloc_zeroed(vocab)?,
            counts: arena.alloc_zeroed(vocab * 4)?,
            greedy_partials: arena.alloc_zeroed(4 * GREEDY_HEAD_MAX_BLOCKS * 4)?,
            greedy_counter: arena.alloc_zeroed(4)?,
            ids: arena.alloc(max_ids * 4)?,
            ids_capacity: max_ids,
            blocks,
            chunk,
            subtree,
            config_mirror: None,
            bias_mirror: Vec::new(),
            bias_masked: false,
            penalty_mirror: None,
        })
    }

    /// Shared memory: two arrays of max(chunk, merged candidates, threads + 1) floats (with the grid
    /// draw the chunk is the subtree, whose z values and then leaves stay in the second).
    fn smem(&self) -> usize {
        2 * shared_floats(self.chunk, self.blocks) * 4
    }

    /// The grid draw's subtree size (log2), where every block of the launch fits on the device at
    /// once (its blocks wait for each other); else 0, and the last block draws alone. As for
    /// attention's merge (attention.rs `barrier_merge`), the check assumes calla's stream has the SMs
    /// to itself; where SMs are partitioned among processes (MPS, `--shared-gpu`: no
    /// `KernelChoices::co_resident_grids`), the last-block draw needs no co-residency.
    fn grid_draw(&self, gpu: &Gpu) -> Result<i32> {
        let Some(log2) = self.subtree else {
            return Ok(0);
        };
        if !gpu.choices().co_resident_grids {
            return Ok(0);
        }
        let per_sm = gpu.resident_blocks("select_token", THREADS, self.smem() as u32)?;
        Ok(if per_sm * gpu.sm_count.max(0) as usize >= self.blocks {
            log2
        } else {
            0
        })
    }

    /// The selection launch: reads logits [V], writes the result (also into `result_host`'s slot
    /// pos & 1 when given: two SelectResults of mapped host memory); `advance` moves the cursor to
    /// the chosen token at the next position.
    pub fn launch(
        &self,
        gpu: &Gpu,
        logits: DPtr,
        cursor: DPtr,
        advance: bool,
        result_host: Option<DPtr>,
    ) -> Result<Launch> {
        let p = SelectParams {
            logits: logits.0,
            config: self.config.0,
            partials: self.partials.0,
            counter: self.counter.0,
            result: self.result.0,
            cursor: cursor.0,
            bias: self.bias.0,
            seen: self.seen.0,
            counts: self.counts.0,
            result_host: result_host.map_or(0, |p| p.0),
            grid: self.grid.0,
            v: self.vocab as i32,
            chunk: self.chunk as i32,
            advance: advance as i32,
            sub_log2: self.grid_draw(gpu)?,
        };
        Launch::new(
            gpu,
            "select_token",
            (self.blocks as u32, 1, 1),
            THREADS,
            self.smem() as u32,
            &p,
        )
    }

    /// Where a selection launch (or lm_head with greedy fused in) puts the chosen token.
    pub fn token_out(&self, cursor: DPtr, advance: bool, result_host: Option<DPtr>) -> TokenOut {
        TokenOut {
            config: self.config.0,
            result: self.result.0,
            result_host: result_host.map_or(0, |p| p.0),
            cursor: cursor.0,
            counts: self.counts.0,
            seen: self.seen.0,
            advance: advance as i32,
            pad: 0,
        }
    }

    /// Whether the device's configuration (the last one `prepare` uploaded) is plain greedy: T = 0
    /// without logit bias, penalties or top logprobs, which lm_head with greedy fused in
    /// (matvec_tc.cu `matvec_tc_q4_c2_s1_greedy`) chooses exactly as select.cu would.
    pub fn plain_greedy(&self) -> bool {
        self.config_mirror.is_some_and(|c| {
            c.temperature <= 0.0
                && c.n_logprobs <= 0
                && c.use_bias == 0
                && c.use_seen == 0
                && c.use_counts == 0
        })
    }

    /// Make the device configuration and tables match `sel` (uploads only what changed).
    pub fn prepare(&mut self, gpu: &Gpu, sel: &Selection) -> Result<()> {
        let config = self.config_for(sel)?;
        let p = sel.params;
        if self.config_mirror != Some(config) {
            gpu.htod(self.config, std::slice::from_ref(&config))?;
            self.config_mirror = Some(config);
        }
        if p.logit_bias != self.bias_mirror || self.bias_masked {
            gpu.htod(self.bias, &self.dense_bias(&p.logit_bias))?;
            self.bias_mirror = p.logit_bias.clone();
            self.bias_masked = false;
        }
        self.prepare_penalties(gpu, sel, config)
    }

    /// [`prepare`](Self::prepare), choosing only among the tokens `allowed`: the mask travels in
    /// the logit-bias table as −∞ for every disallowed id (added to the raw logit first; the
    /// penalties keep −∞, so this is the reference's "−∞ after the adjustments"), uploaded for
    /// every masked step. Log-probabilities stay those of the raw logits.
    pub fn prepare_masked(
        &mut self,
        gpu: &Gpu,
        sel: &Selection,
        allowed: &TokenMask,
    ) -> Result<()> {
        let mut config = self.config_for(sel)?;
        config.use_bias = 1;
        if self.config_mirror != Some(config) {
            gpu.htod(self.config, std::slice::from_ref(&config))?;
            self.config_mirror = Some(config);
        }
        let mut dense = self.dense_bias(&sel.params.logit_bias);
        allowed.apply(&mut dense);
        gpu.htod(self.bias, &dense)?;
        self.bias_mirror = sel.params.logit_bias.clone();
        self.bias_masked = true;
        self.prepare_penalties(gpu, sel, config)
    }

    fn dense_bias(&self, bias: &[(u32, f32)]) -> Vec<f32> {
        let mut dense = vec![0f32; self.vocab];
        for (id, b) in bias {
            dense[*id as usize] += b;
        }
        dense
    }

    fn prepare_penalties(
        &mut self,
        gpu: &Gpu,
        sel: &Selection,
        config: SelectConfig,
    ) -> Result<()> {
        if config.use_seen != 0 || config.use_counts != 0 {
            if !self.penalties_current(sel) {
                self.rebuild_penalties(gpu, sel.prompt, sel.generated)?;
            }
        } else {
            self.penalty_mirror = None;
        }
        Ok(())
    }

    /// Whether the device already holds what `sel` asks for (`prepare` would upload nothing): true
    /// for the step after a selection when `sel` is the same request advanced by that token, since
    /// the selection kernel advances the draw step and the penalty tables itself.
    pub fn is_current(&self, sel: &Selection) -> Result<bool> {
        let config = self.config_for(sel)?;
        let penalties = config.use_seen != 0 || config.use_counts != 0;
        Ok(self.config_mirror == Some(config)
            && !self.bias_masked
            && sel.params.logit_bias == self.bias_mirror
            && (!penalties || self.penalties_current(sel)))
    }

    fn penalties_current(&self, sel: &Selection) -> bool {
        self.penalty_mirror
            .as_ref()
            .is_some_and(|(pr, gen)| pr.as_slice() == sel.prompt && gen.as_slice() == sel.generated)
    }

    /// The device configuration for `sel`, after checking what the sampler supports.
    fn config_for(&self, sel: &Selection) -> Result<SelectConfig> {
        let p = sel.params;
        ensure!(
            sel.top_logprobs <= MAX_LOGPROBS,
            "top_logprobs {} > {MAX_LOGPROBS}: the cuda engine returns at most {MAX_LOGPROBS}",
            sel.top_logprobs
        );
        if !p.is_greedy() && p.top_k > MAX_CANDIDATES {
            bail!("top_k {} is not supported by the cuda sampler (1..={MAX_CANDIDATES}, or 0 for none)", p.top_k);
        }
        for (id, b) in &p.logit_bias {
            ensure!(
                (*id as usize) < self.vocab,
                "logit_bias: token {id} outside the vocabulary of {}",
                self.vocab
            );
            ensure!(b.is_finite(), "logit_bias for token {id} is not finite");
        }
        let use_seen = p.repetition_penalty != 1.0;
        let use_counts = p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        Ok(SelectConfig {
            temperature: p.temperature.max(0.0),
            top_p: p.top_p,
            min_p: p.min_p,
            rep_penalty: p.repetition_penalty,
            presence: p.presence_penalty,
            frequency: p.frequency_penalty,
            top_k: p.top_k as i32,
            n_logprobs: sel.top_logprobs as i32,
            seed_lo: p.seed as u32,
            seed_hi: (p.seed >> 32) as u32,
            step_lo: sel.step as u32,
            step_hi: (sel.step >> 32) as u32,
            use_bias: !p.logit_bias.is_empty() as i32,
            use_seen: use_seen as i32,
            use_counts: use_counts as i32,
            pad: 0,
        })
    }

    fn rebuild_penalties(&mut self, gpu: &Gpu, prompt: &[u32], generated: &[u32]) -> Result<()> {
        gpu.memset_zero(self.seen, self.vocab)?;
        gpu.memset_zero(self.counts, self.vocab * 4)?;
        let n = prompt.len() + generated.len();
        ensure!(
            n <= self.ids_capacity,
            "{n} tokens of penalty history exceed the context"
        );
        if n > 0 {
            let ids: Vec<i32> = prompt.iter().chain(generated).map(|t| *t as i32).collect();
            gpu.htod(self.ids, &ids)?;
            let p = PenaltyParams {
                prompt_ids: self.ids.0,
                output_ids: self.ids.offset(prompt.len() * 4).0,
                seen: self.seen.0,
                counts: self.counts.0,
                n_prompt: prompt.len() as i32,
                n_output: generated.len() as i32,
                v: self.vocab as i32,
                pad: 0,
            };
            gpu.launch("penalty_tables", (n.div_ceil(256) as u32, 1, 1), 256, 0, &p)?;
        }
        self.penalty_mirror = Some((prompt.to_vec(), generated.to_vec()));
        Ok(())
    }

    /// After a selection launch ran: read the result; account for what the kernel advanced.
    pub fn finish(&mut self, gpu: &Gpu) -> Result<TokenChoice> {
        let mut r = [SelectResult::default()];
        gpu.dtoh(self.result, &mut r)?;
        self.account(r[0])
    }

    /// A selection's result, read back: the choice, and the host mirrors advanced as the kernel
    /// advanced the device's (draw step, penalty tables). Results are accounted in launch order.
    pub fn account(&mut self, r: SelectResult) -> Result<TokenChoice> {
        ensure!(
            r.token >= 0 && (r.token as usize) < self.vocab,
            "token selection returned {}",
            r.token
        );
        if let Some(c) = self.config_mirror.as_mut() {
            let step = ((c.step_hi as u64) << 32 | c.step_lo as u64) + 1;
            c.step_lo = step as u32;
            c.step_hi = (step >> 32) as u32;
            if c.use_seen != 0 || c.use_counts != 0 {
                if let Some((_, gen)) = self.penalty_mirror.as_mut() {
                    gen.push(r.token as u32);
                }
            }
        }
        let n = (r.n_top.max(0) as usize).min(MAX_LOGPROBS);
        Ok(TokenChoice {
            token: r.token as u32,
            logprob: r.logprob,
            top: (0..n)
                .map(|i| (r.top_ids[i] as u32, r.top_logprobs[i]))
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_weight_tree_fits_the_family_vocabularies_and_refuses_huge_ones() {
        for vocab in [2usize, 512, 1000, 151_936, 248_320, 1 << 19] {
            let blocks = vocab.div_ceil(1024).clamp(1, MAX_BLOCKS);
            let chunk = vocab.div_ceil(blocks);
            assert!(
                weight_tree_fits(vocab, 2 * shared_floats(chunk, blocks)),
                "{vocab}"
            );
        }
        assert!(!weight_tree_fits(1 << 24, 2 * 4096));
    }

    #[test]
    fn the_grid_draw_takes_whole_subtrees_of_256_to_4096_ids() {
        // (vocabulary, subtree log2): the subtrees tile the tree's 2^⌈log2 V⌉ leaves, at most one
        // per block of the launch
        for (vocab, want) in [
            (248_320usize, Some(12)),
            (151_936, Some(12)),
            (1000, Some(10)),
            (4096, Some(10)),
            (100, None),
            (1 << 20, None),
        ] {
            let blocks = vocab.div_ceil(1024).clamp(1, MAX_BLOCKS);
            let got = subtree_log2(vocab, blocks);
            assert_eq!(got, want, "{vocab}");
            if let Some(l) = got {
                let subtrees = vocab.next_power_of_two() >> l;
                assert!(subtrees <= blocks && subtrees.is_power_of_two(), "{vocab}");
                let grid_blocks = vocab.div_ceil(1 << l);
                assert!(grid_blocks <= subtrees && shared_floats(1 << l, grid_blocks) >= 1 << l);
            }
        }
    }
}
