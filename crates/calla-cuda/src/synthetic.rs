//! Synthetic models made directly on the GPU (the benchmark at the real shape: no 20 GB of host
//! arrays). Every tensor is seeded random data from fill.cu; scales keep activations of
//! order one through the layers and spread the routing over all experts.
//!
//! Formats mirror the published MLX 4-bit checkpoint when `Format::Q4` is asked for: every matrix
//! q4/g64 with bf16 (scale, bias), the router 8-bit; or everything bf16.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use calla_model::{FeedForwardSpec, LayerKind, ModelSpec};

use crate::ops::weights::{
    rope_inv_freq, DevAttention, DevDeltaNet, DevFfn, DevLayer, DevMatrix, DevMixer, DevMlp,
    DevModel, DevMoe, Format,
};
use crate::runtime::gpu::{DPtr, Gpu};
use crate::runtime::pool::Arena;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct FillParams {
    pub ptr: u64,
    pub n: u64,
    pub seed: u64,
    pub a: f32,
    pub b: f32,
    pub c: f32,
    pub pad: i32,
}

pub struct Filler<'a> {
    gpu: &'a Arc<Gpu>,
    arena: &'a mut Arena,
    seed: u64,
    grid: u32,
}

impl<'a> Filler<'a> {
    /// Random tensors in `arena`, seeded (the same seed gives the same tensors).
    pub fn new(gpu: &'a Arc<Gpu>, arena: &'a mut Arena, seed: u64) -> Filler<'a> {
        let grid = (gpu.sm_count as u32) * 8;
        Filler {
            gpu,
            arena,
            seed,
            grid,
        }
    }
    fn next_seed(&mut self) -> u64 {
        self.seed = self
            .seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.seed
    }
    fn fill(&mut self, kernel: &str, ptr: DPtr, n: usize, a: f32, b: f32, c: f32) -> Result<()> {
        let p = FillParams {
            ptr: ptr.0,
            n: n as u64,
            seed: self.next_seed(),
            a,
            b,
            c,
            pad: 0,
        };
        self.gpu.launch(kernel, (self.grid, 1, 1), 256, 0, &p)
    }
    /// f32 vector, uniform in [lo, hi).
    pub fn vector(&mut self, n: usize, lo: f32, hi: f32) -> Result<DPtr> {
        let p = self.arena.alloc(n * 4)?;
        self.fill("fill_f32", p, n, lo, hi, 0.0)?;
        Ok(p)
    }
    /// A random matrix with entries of standard deviation ≈ `std`.
    pub fn matrix(
        &mut self,
        rows: usize,
        cols: usize,
        format: Format,
        std: f32,
    ) -> Result<DevMatrix> {
        let group_size = if format.is_affine() { 64 } else { 0 };
        let mut m = DevMatrix {
            rows,
            cols,
            format,
            group_size,
            param_f32: false,
            data: DPtr::NULL,
            params: DPtr::NULL,
        };
        m.data = self.arena.alloc(rows * m.row_bytes())?;
        match format {
            Format::Q4 | Format::Q8 => {
                self.fill("fill_u32", m.data, rows * m.row_bytes() / 4, 0.0, 0.0, 0.0)?;
                m.params = self.arena.alloc(m.param_bytes())?;
                // codes uniform on 0..L: std(q) = √((L+1)²−1)/√12; w = s·(q − L/2)
                let levels = if format == Format::Q4 { 15.0f32 } else { 255.0 };
                let q_std = (((levels + 1.0) * (levels + 1.0) - 1.0) / 12.0).sqrt();
                let s = std / q_std;
                self.fill(
                    "fill_affine_bf16",
                    m.params,
                    rows * m.groups_per_row(),
                    0.8 * s,
                    1.2 * s,
                    levels / 2.0,
                )?;
            }
            Format::Bf16 => {
                let r = std * 3f32.sqrt();
                self.fill("fill_bf16", m.data, rows * cols, -r, r, 0.0)?;
            }
            Format::F32 => {
                let r = std * 3f32.sqrt();
                self.fill("fill_f32", m.data, rows * cols, -r, r, 0.0)?;
            }
            Format::F16 => bail!("synthetic f16 weights are not provided"),
        }
        Ok(m)
    }
}

/// A random model of `spec`'s shape on the GPU, every projection in `format` (Q4 or Bf16).
pub fn synthetic_model(
    gpu: &Arc<Gpu>,
    arena: &mut Arena,
    spec: &ModelSpec,
    format: Format,
    seed: u64,
) -> Result<DevModel> {
    if !matches!(format, Format::Q4 | Format::Bf16) {
        bail!("synthetic models are q4 or bf16");
    }
    let start = Instant::now();
    let before = arena.used;
    let mut f = Filler::new(gpu, arena, seed);
    let d = spec.hidden_size;
    let proj = |cols: usize| 1.0 / (cols as f32).sqrt();
    let router_format = if format == Format::Q4 {
        Format::Q8
    } else {
        format
    };
    let embed = f.matrix(spec.vocab_size, d, format, 1.0)?;
    let mut layers = Vec::new();
    for kind in &spec.layers {
        let mixer = match kind {
            LayerKind::DeltaNet => {
                let (c, hv, vd) = (
                    spec.linear_conv_dim(),
                    spec.linear_num_value_heads,
                    spec.linear_value_dim(),
                );
                let k = spec.linear_conv_kernel_dim;
                DevMixer::DeltaNet(DevDeltaNet {
                    in_proj: [
                        f.matrix(c, d, format, proj(d))?,
                        f.matrix(vd, d, format, proj(d))?,
                        f.matrix(hv, d, format, proj(d))?,
                        f.matrix(hv, d, format, proj(d))?,
                    ],
                    conv_w: f.vector(c * k, -(3.0 / k as f32).sqrt(), (3.0 / k as f32).sqrt())?,
                    a_log: f.vector(hv, 0.0, 16f32.ln())?,
                    dt_bias: f.vector(hv, -1.0, 1.0)?,
                    norm_w: f.vector(spec.linear_value_head_dim, 0.8, 1.2)?,
                    out_proj: f.matrix(d, vd, format, proj(vd))?,
                })
            }
            LayerKind::Attention => {
                let dh = spec.head_dim;
                DevMixer::Attention(DevAttention {
                    in_proj: [
                        f.matrix(spec.q_proj_rows(), d, format, proj(d))?,
                        f.matrix(spec.kv_dim(), d, format, proj(d))?,
                        f.matrix(spec.kv_dim(), d, format, proj(d))?,
                    ],
                    o_proj: f.matrix(
                        d,
                        spec.num_attention_heads * dh,
                        format,
                        proj(spec.num_attention_heads * dh),
                    )?,
                    q_gain: f.vector(dh, 0.9, 1.1)?,
                    k_gain: f.vector(dh, 0.9, 1.1)?,
                })
            }
        };
        let ffn = match &spec.feed_forward {
            FeedForwardSpec::Moe {
                num_experts,
                expert_intermediate,
                shared_intermediate,
                ..
            } => {
                let (e, i, is) = (*num_experts, *expert_intermediate, *shared_intermediate);
                DevFfn::Moe(DevMoe {
                    router: f.matrix(e, d, router_format, proj(d))?,
                    gate_up: f.matrix(e * 2 * i, d, format, proj(d))?,
                    down: f.matrix(e * d, i, format, proj(i))?,
                    shared: if is > 0 {
                        Some((
                            f.matrix(2 * is, d, format, proj(d))?,
                            f.matrix(d, is, format, proj(is))?,
                        ))
                    } else {
                        None
                    },
                    shared_gate: if is > 0 {
                        Some(f.vector(d, -proj(d), proj(d))?)
                    } else {
                        None
                    },
                })
            }
            FeedForwardSpec::Dense { intermediate } => DevFfn::Dense(DevMlp {
                gate_up: f.matrix(2 * intermediate, d, format, proj(d))?,
                down: f.matrix(d, *intermediate, format, proj(*intermediate))?,
            }),
        };
        layers.push(DevLayer {
            input_gain: f.vector(d, 0.9, 1.1)?,
            post_gain: f.vector(d, 0.9, 1.1)?,
            mixer,
            ffn,
        });
    }
    let lm_head = f.matrix(spec.vocab_size, d, format, proj(d))?;
    let final_gain = f.vector(d, 0.9, 1.1)?;
    let inv_freq = f
        .arena
        .upload(&rope_inv_freq(spec.rotary_dim.max(2), spec.rope_theta))?;
    gpu.sync()?;
    Ok(DevModel {
        embed,
        lm_head,
        final_gain,
        layers,
        inv_freq,
        bytes: arena.used - before,
        upload_seconds: start.elapsed().as_secs_f64(),
    })
}

/// Fill a device region of `n` f32 with uniform values in [lo, hi) (test inputs, fake context).
pub fn fill_f32(gpu: &Arc<Gpu>, ptr: DPtr, n: usize, lo: f32, hi: f32, seed: u64) -> Result<()> {
    let p = FillParams {
        ptr: ptr.0,
        n: n as u64,
        seed,
        a: lo,
        b: hi,
        c: 0.0,
        pad: 0,
    };
    gpu.launch("fill_f32", ((gpu.sm_count as u32) * 8, 1, 1), 256, 0, &p)
}

/// Fill a device region of `n` bf16 with uniform values in [lo, hi).
pub fn fill_bf16(gpu: &Arc<Gpu>, ptr: DPtr, n: usize, lo: f32, hi: f32, seed: u64) -> Result<()> {
    let p = FillParams {
        ptr: ptr.0,
        n: n as u64,
        seed,
        a: lo,
        b: hi,
        c: 0.0,
        pad: 0,
    };
    gpu.launch("fill_bf16", ((gpu.sm_count as u32) * 8, 1, 1), 256, 0, &p)
}
