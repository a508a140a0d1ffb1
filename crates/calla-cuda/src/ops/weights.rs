//! Weights on the GPU: every matrix of the canonical tree uploaded once, repacked at load into the
//! layouts the kernels read (see common.cuh):
//! - dense f32/bf16/f16: row-major as stored (16-byte aligned rows);
//! - MLX affine q4/q8: codes as stored (row-major u32 words, low bits first — already what a warp
//!   reads as 16-byte loads, 512 contiguous bytes per instruction); scale and bias interleaved per
//!   group into one u32 (two bf16) or one float2, so a group's parameters are one load;
//! - experts stacked per layer: `[E·2I, D]` gate/up (expert e's gate rows, then its up rows) and
//!   `[E·D, I]` down, so kernels address an expert by its device id with no gather;
//! - norms as gains `1 + w` (f32), RoPE inverse frequencies, DeltaNet constants as f32.
//!
//! Projections that share an input are launched together as segments of one matvec (matvec.rs).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use calla_model::{
    DType, FeedForwardWeights, LayerWeights, Matrix, MatrixData, MixerWeights, ModelSpec,
    MoeWeights, Weights,
};

use crate::runtime::gpu::{DPtr, Gpu};
use crate::runtime::pool::Arena;

/// A weight format as the kernels know it (kernel name suffix).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    F32,
    Bf16,
    F16,
    Q4,
    Q8,
}

impl Format {
    pub fn suffix(self) -> &'static str {
        match self {
            Format::F32 => "f32",
            Format::Bf16 => "bf16",
            Format::F16 => "f16",
            Format::Q4 => "q4",
            Format::Q8 => "q8",
        }
    }
    /// Weights per 16-byte unit.
    pub fn per_unit(self) -> usize {
        match self {
            Format::F32 => 4,
            Format::Bf16 | Format::F16 => 8,
            Format::Q4 => 32,
            Format::Q8 => 16,
        }
    }
    pub fn is_affine(self) -> bool {
        matches!(self, Format::Q4 | Format::Q8)
    }
}

/// The kernels' view of a matrix (common.cuh `MatrixRef`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct MatrixRef {
    pub data: u64,
    pub params: u64,
    pub row_bytes: i64,
    pub groups_per_row: i32,
    pub param_f32: i32,
}

#[derive(Debug, Clone, Copy)]
pub struct DevMatrix {
    pub rows: usize,
    pub cols: usize,
    pub format: Format,
    /// affine group size (0 for dense)
    pub group_size: usize,
    pub param_f32: bool,
    pub data: DPtr,
    pub params: DPtr,
}

impl DevMatrix {
    pub fn row_bytes(&self) -> usize {
        match self.format {
            Format::F32 => self.cols * 4,
            Format::Bf16 | Format::F16 => self.cols * 2,
            Format::Q4 => self.cols / 2,
            Format::Q8 => self.cols,
        }
    }
    pub fn groups_per_row(&self) -> usize {
        if self.format.is_affine() {
            self.cols / self.group_size
        } else {
            0
        }
    }
    pub fn param_bytes(&self) -> usize {
        self.rows * self.groups_per_row() * if self.param_f32 { 8 } else { 4 }
    }
    /// Device bytes of codes/values and group parameters.
    pub fn bytes(&self) -> usize {
        self.rows * self.row_bytes() + self.param_bytes()
    }
    pub fn kref(&self) -> MatrixRef {
        MatrixRef {
            data: self.data.0,
            params: self.params.0,
            row_bytes: self.row_bytes() as i64,
            groups_per_row: self.groups_per_row() as i32,
            param_f32: self.param_f32 as i32,
        }
    }
    /// Rows `[start, start + count)` (same storage).
    pub fn rows_view(&self, start: usize, count: usize) -> DevMatrix {
        let mut m = *self;
        m.rows = count;
        m.data = self.data.offset(start * self.row_bytes());
        if self.format.is_affine() {
            m.params = self
                .params
                .offset(start * self.groups_per_row() * if self.param_f32 { 8 } else { 4 });
        }
        m
    }
}

/// (format, group size, f32 params) of a host matrix, checked against what the kernels need.
pub fn device_format(name: &str, m: &Matrix) -> Result<(Format, usize, bool)> {
    let (format, group, param_f32) = match &m.data {
        MatrixData::Dense { dtype, .. } => (
            match dtype {
                DType::F32 => Format::F32,
                DType::BF16 => Format::Bf16,
                DType::F16 => Format::F16,
            },
            0,
            false,
        ),
        MatrixData::Affine {
            bits,
            group_size,
            param_dtype,
            ..
        } => {
            let f = match bits {
                4 => Format::Q4,
                8 => Format::Q8,
                b => {
                    bail!("{name}: {b}-bit affine weights are not supported on cuda (4 and 8 are)")
                }
            };
            if group_size % f.per_unit() != 0 {
                bail!(
                    "{name}: affine group size {group_size} must be a multiple of {}",
                    f.per_unit()
                );
            }
            (f, *group_size, *param_dtype != DType::BF16)
        }
    };
    if !m.cols.is_multiple_of(format.per_unit()) {
        bail!(
            "{name}: {} columns; the cuda kernels need a multiple of {} for {}",
            m.cols,
            format.per_unit(),
            format.suffix()
        );
    }
    Ok((format, group, param_f32))
}

/// Interleave a matrix's (scale, bias) per group: bf16 pairs in a u32, or f32 pairs.
fn interleaved_params(m: &Matrix, param_f32: bool) -> Vec<u8> {
    let MatrixData::Affine {
        scales,
        biases,
        param_dtype,
        ..
    } = &m.data
    else {
        return Vec::new();
    };
    let (s, b) = (scales.bytes(), biases.bytes());
    let n = s.len() / param_dtype.size();
    let mut out = Vec::with_capacity(n * if param_f32 { 8 } else { 4 });
    for i in 0..n {
        if param_f32 {
            out.extend_from_slice(&param_dtype.read(s, i).to_le_bytes());
            out.extend_from_slice(&param_dtype.read(b, i).to_le_bytes());
        } else {
            out.extend_from_slice(&s[2 * i..2 * i + 2]);
            out.extend_from_slice(&b[2 * i..2 * i + 2]);
        }
    }
    out
}

fn values_bytes(m: &Matrix) -> &[u8] {
    match &m.data {
        MatrixData::Dense { data, .. } => data.bytes(),
        MatrixData::Affine { codes, .. } => codes.bytes(),
    }
}

/// Counts bytes uploaded, for the load report/progress.
pub struct Uploader<'a> {
    pub gpu: &'a Arc<Gpu>,
    pub arena: &'a mut Arena,
    pub bytes: usize,
    pub total: usize,
    pub progress: Option<&'a (dyn Fn(usize, usize) + Sync)>,
}

impl Uploader<'_> {
    /// Upload the row-concatenation of `parts` (same columns and format) as one device matrix.
    pub fn stacked(&mut self, name: &str, parts: &[&Matrix]) -> Result<DevMatrix> {
        ensure!(!parts.is_empty(), "{name}: nothing to upload");
        let (format, group_size, param_f32) = device_format(name, parts[0])?;
        let cols = parts[0].cols;
        for p in parts {
            let f = device_format(name, p)?;
            ensure!(
                p.cols == cols && f == (format, group_size, param_f32),
                "{name}: stacked parts differ in shape or format ({}×{} {} vs {}×{} {})",
                p.rows,
                p.cols,
                p.format_name(),
                parts[0].rows,
                cols,
                parts[0].format_name()
            );
        }
        let rows: usize = parts.iter().map(|p| p.rows).sum();
        let mut m = DevMatrix {
            rows,
            cols,
            format,
            group_size,
            param_f32,
            data: DPtr::NULL,
            params: DPtr::NULL,
        };
        m.data = self.arena.alloc(rows * m.row_bytes())?;
        if format.is_affine() {
            m.params = self.arena.alloc(m.param_bytes())?;
        }
        let (mut row, mut prow) = (0usize, 0usize);
        for p in parts {
            let values = values_bytes(p);
            ensure!(
                values.len() == p.rows * m.row_bytes(),
                "{name}: {} bytes of values for {}×{} {}",
                values.len(),
                p.rows,
                p.cols,
                format.suffix()
            );
            self.gpu.htod(m.data.offset(row), values)?;
            row += values.len();
            if format.is_affine() {
                let params = interleaved_params(p, param_f32);
                self.gpu.htod(m.params.offset(prow), &params)?;
                prow += params.len();
            }
            self.bytes += p.byte_size();
            if let Some(cb) = self.progress {
                cb(self.bytes, self.total);
            }
        }
        Ok(m)
    }

    pub fn matrix(&mut self, name: &str, m: &Matrix) -> Result<DevMatrix> {
        self.stacked(name, &[m])
    }

    pub fn f32s(&mut self, values: &[f32]) -> Result<DPtr> {
        self.arena.upload(values)
    }

    /// A zero-centred norm's gain `1 + w` (f32, as the CPU computes it).
    pub fn gain(&mut self, name: &str, w: &[f32], len: usize) -> Result<DPtr> {
        ensure!(w.len() == len, "{name}: {} values, expected {len}", w.len());
        let g: Vec<f32> = w.iter().map(|v| 1.0 + v).collect();
        self.arena.upload(&g)
    }
}

pub struct DevDeltaNet {
    /// in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (read the same normalised input)
    pub in_proj: [DevMatrix; 4],
    pub conv_w: DPtr,
    pub a_log: DPtr,
    pub dt_bias: DPtr,
    pub norm_w: DPtr,
    pub out_proj: DevMatrix,
}

pub struct DevAttention {
    /// q_proj (per head [q | gate]), k_proj, v_proj
    pub in_proj: [DevMatrix; 3],
    pub o_proj: DevMatrix,
    pub q_gain: DPtr,
    pub k_gain: DPtr,
}

pub enum DevMixer {
    DeltaNet(DevDeltaNet),
    Attention(DevAttention),
}

pub struct DevMoe {
    pub router: DevMatrix,
    /// `[E·2I, D]`
    pub gate_up: DevMatrix,
    /// `[E·D, I]`
    pub down: DevMatrix,
    /// shared expert `[2Is, D]` and `[D, Is]`
    pub shared: Option<(DevMatrix, DevMatrix)>,
    /// `[D]` f32
    pub shared_gate: Option<DPtr>,
}

/// A dense SwiGLU MLP: `[2I, D]` gate/up and `[D, I]` down.
pub struct DevMlp {
    pub gate_up: DevMatrix,
    pub down: DevMatrix,
}

pub enum DevFfn {
    Moe(DevMoe),
    Dense(DevMlp),
}

pub struct DevLayer {
    pub input_gain: DPtr,
    pub post_gain: DPtr,
    pub mixer: DevMixer,
    pub ffn: DevFfn,
}

pub struct DevModel {
    pub embed: DevMatrix,
    pub lm_head: DevMatrix,
    pub final_gain: DPtr,
    pub layers: Vec<DevLayer>,
    /// RoPE inverse frequencies `[rotary_dim/2]`, computed as the CPU reference does
    pub inv_freq: DPtr,
    /// bytes of weights on the device
    pub bytes: usize,
    pub upload_seconds: f64,
}

/// RoPE inverse frequencies as calla_cpu::attention::Rope computes them (f32 powf).
pub fn rope_inv_freq(rotary_dim: usize, theta: f64) -> Vec<f32> {
    (0..rotary_dim / 2)
        .map(|i| {
            let exponent = (2 * i) as f32 / rotary_dim as f32;
            1.0 / (theta as f32).powf(exponent)
        })
        .collect()
}

fn total_bytes(w: &Weights) -> usize {
    let mut n = w.embed_tokens.byte_size() + w.lm_head.byte_size();
    for l in &w.layers {
        n += match &l.mixer {
            MixerWeights::DeltaNet(d) => {
                d.in_proj_qkv.byte_size()
                    + d.in_proj_z.byte_size()
                    + d.in_proj_a.byte_size()
                    + d.in_proj_b.byte_size()
                    + d.out_proj.byte_size()
            }
            MixerWeights::Attention(a) => {
                a.q_proj.byte_size()
                    + a.k_proj.byte_size()
                    + a.v_proj.byte_size()
                    + a.o_proj.byte_size()
            }
        };
        n += match &l.feed_forward {
            FeedForwardWeights::Moe(m) => {
                m.router.byte_size()
                    + m.experts
                        .iter()
                        .chain(m.shared_expert.iter())
                        .map(|e| {
                            e.gate_proj.byte_size()
                                + e.up_proj.byte_size()
                                + e.down_proj.byte_size()
                        })
                        .sum::<usize>()
            }
            FeedForwardWeights::Dense(m) => {
                m.gate_proj.byte_size() + m.up_proj.byte_size() + m.down_proj.byte_size()
            }
        };
    }
    n
}

fn upload_moe(up: &mut Uploader, spec: &ModelSpec, i: usize, m: &MoeWeights) -> Result<DevMoe> {
    let n = |s: &str| format!("layers.{i}.mlp.{s}");
    let d = spec.hidden_size;
    ensure!(!m.experts.is_empty(), "{}: no experts", n("experts"));
    let gate_up: Vec<&Matrix> = m
        .experts
        .iter()
        .flat_map(|e| [&e.gate_proj, &e.up_proj])
        .collect();
    let down: Vec<&Matrix> = m.experts.iter().map(|e| &e.down_proj).collect();
    let shared = match &m.shared_expert {
        Some(s) => Some((
            up.stacked(
                &n("shared_expert.gate_proj|up_proj"),
                &[&s.gate_proj, &s.up_proj],
            )?,
            up.matrix(&n("shared_expert.down_proj"), &s.down_proj)?,
        )),
        None => None,
    };
    let shared_gate = match &m.shared_expert_gate {
        Some(g) => {
            ensure!(
                g.rows == 1 && g.cols == d,
                "{}: {}×{}, expected 1×{d}",
                n("shared_expert_gate"),
                g.rows,
                g.cols
            );
            Some(up.f32s(&g.to_f32())?)
        }
        None => None,
    };
    Ok(DevMoe {
        router: up.matrix(&n("gate"), &m.router)?,
        gate_up: up.stacked(&n("experts.gate_up_proj"), &gate_up)?,
        down: up.stacked(&n("experts.down_proj"), &down)?,
        shared,
        shared_gate,
    })
}

fn upload_layer(
    up: &mut Uploader,
    spec: &ModelSpec,
    i: usize,
    l: &LayerWeights,
) -> Result<DevLayer> {
    let d = spec.hidden_size;
    let mixer = match &l.mixer {
        MixerWeights::DeltaNet(w) => {
            let n = |s: &str| format!("layers.{i}.linear_attn.{s}");
            let (c, k) = (spec.linear_conv_dim(), spec.linear_conv_kernel_dim);
            let hv = spec.linear_num_value_heads;
            for (name, len, want) in [
                ("conv1d.weight", w.conv1d.len(), c * k),
                ("A_log", w.a_log.len(), hv),
                ("dt_bias", w.dt_bias.len(), hv),
                ("norm.weight", w.norm.len(), spec.linear_value_head_dim),
            ] {
                ensure!(len == want, "{}: {len} values, expected {want}", n(name));
            }
            DevMixer::DeltaNet(DevDeltaNet {
                in_proj: [
                    up.matrix(&n("in_proj_qkv"), &w.in_proj_qkv)?,
                    up.matrix(&n("in_proj_z"), &w.in_proj_z)?,
                    up.matrix(&n("in_proj_b"), &w.in_proj_b)?,
                    up.matrix(&n("in_proj_a"), &w.in_proj_a)?,
                ],
                conv_w: up.f32s(&w.conv1d)?,
                a_log: up.f32s(&w.a_log)?,
                dt_bias: up.f32s(&w.dt_bias)?,
                norm_w: up.f32s(&w.norm)?,
                out_proj: up.matrix(&n("out_proj"), &w.out_proj)?,
            })
        }
        MixerWeights::Attention(w) => {
            let n = |s: &str| format!("layers.{i}.self_attn.{s}");
            DevMixer::Attention(DevAttention {
                in_proj: [
                    up.matrix(&n("q_proj"), &w.q_proj)?,
                    up.matrix(&n("k_proj"), &w.k_proj)?,
                    up.matrix(&n("v_proj"), &w.v_proj)?,
                ],
                o_proj: up.matrix(&n("o_proj"), &w.o_proj)?,
                q_gain: up.gain(&n("q_norm"), &w.q_norm, spec.head_dim)?,
                k_gain: up.gain(&n("k_norm"), &w.k_norm, spec.head_dim)?,
            })
        }
    };
    let ffn = match &l.feed_forward {
        FeedForwardWeights::Moe(m) => DevFfn::Moe(upload_moe(up, spec, i, m)?),
        FeedForwardWeights::Dense(m) => {
            let n = |s: &str| format!("layers.{i}.mlp.{s}");
            DevFfn::Dense(DevMlp {
                gate_up: up.stacked(&n("gate_proj|up_proj"), &[&m.gate_proj, &m.up_proj])?,
                down: up.matrix(&n("down_proj"), &m.down_proj)?,
            })
        }
    };
    Ok(DevLayer {
        input_gain: up.gain(
            &format!("layers.{i}.input_layernorm"),
            &l.input_layernorm,
            d,
        )?,
        post_gain: up.gain(
            &format!("layers.{i}.post_attention_layernorm"),
            &l.post_attention_layernorm,
            d,
        )?,
        mixer,
        ffn,
    })
}

/// Upload every weight; `progress(done_bytes, total_bytes)` is called as matrices land.
pub fn upload_model(
    gpu: &Arc<Gpu>,
    arena: &mut Arena,
    spec: &ModelSpec,
    w: &Weights,
    progress: Option<&(dyn Fn(usize, usize) + Sync)>,
) -> Result<DevModel> {
    ensure!(
        w.layers.len() == spec.num_layers(),
        "weights have {} layers, the config {}",
        w.layers.len(),
        spec.num_layers()
    );
    let start = Instant::now();
    let before = arena.used;
    let total = total_bytes(w);
    let mut up = Uploader {
        gpu,
        arena,
        bytes: 0,
        total,
        progress,
    };
    let embed = up.matrix("embed_tokens", &w.embed_tokens)?;
    let mut layers = Vec::with_capacity(w.layers.len());
    for (i, l) in w.layers.iter().enumerate() {
        layers.push(
            upload_layer(&mut up, spec, i, l).with_context(|| format!("uploading layer {i}"))?,
        );
    }
    let lm_head = up.matrix("lm_head", &w.lm_head)?;
    let final_gain = up.gain("norm", &w.final_norm, spec.hidden_size)?;
    let inv_freq = up.f32s(&rope_inv_freq(spec.rotary_dim.max(2), spec.rope_theta))?;
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
