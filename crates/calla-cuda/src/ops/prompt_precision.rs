//! The precision policy of the batched prompt path: which weight products run in fast precision
//! (bf16 activations × bf16 weights, one product) and which in split (hi + lo activations, ≈ f32),
//! chosen per product group instead of one switch for the whole prompt.
//!
//! Why: fast everywhere is ~1.8× faster at 8K tokens but misses the 2e-2 log-probability parity
//! tolerance at the real shape (3.1e-2 vs the CPU engine, 3.9e-2 vs transformers;
//! docs/performance.md, "Prefill optimisations"). About half of fast's GEMM time is the routed
//! experts' grouped GEMMs; the hypothesis behind `mixed` is that rounding there costs less accuracy
//! than in the mixers' projections, so the experts alone run fast. The MoE router always runs split
//! (routing must agree with the f32 reference), as does everything outside the prompt path (the
//! decode step and the lm_head of the last prompt token are f32 matvecs).
//!
//! Every combination is consistent between stages: a GEMM that writes bf16 planes (the gate/up
//! SwiGLU output) writes the lo plane whenever its consumer runs split, whatever its own precision
//! (the epilogue splits the f32 accumulator), and the layer inputs x̂ always carry both planes.
//!
//! Names (`--prompt-precision`, [`ENV`]): a preset ([`PRESETS`]), or a comma list of presets and
//! `group=choice` overrides applied left to right on top of split (e.g. `mixed,shared=auto`);
//! groups in [`GROUPS`], choices fast | split | auto (by the weights' format: split for f32/f16,
//! fast for bf16 and quantised). The partial presets (mixed, experts-up, experts-down, ffn) make
//! their groups auto: fast for every real checkpoint (bf16, q4, q8), still split for the f32
//! reference fixtures; `group=fast` forces fast over any format.

use std::fmt;
use std::str::FromStr;

use crate::ops::weights::Format;

/// Which products a prompt GEMM runs (gemm.rs's module header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// bf16 activations × bf16 (dequantised) weights, f32 accumulation.
    Fast,
    /// bf16 hi + lo splits of both operands: ~f32 accuracy at 3× the tensor-core work.
    Split,
    /// f16 activations × f16 dequantised weights (each rounded once, ~2⁻¹² relative), f32
    /// accumulation: one product on the tensor cores at 8× less rounding than fast. q4 weights in
    /// groups of 64 on sm_90a only (`gemm_q4_wgh`); elsewhere gemm.rs `runnable` turns it into split.
    Half,
}

impl Precision {
    pub(crate) fn suffix(self) -> &'static str {
        match self {
            Precision::Fast => "fast",
            Precision::Split => "split",
            Precision::Half => "half",
        }
    }
    /// The precision to run a matrix in when the caller has no preference: f32/f16 weights are a
    /// reference-precision model (fixtures), so they get split; bf16 and quantised weights fast.
    pub fn for_format(format: Format) -> Precision {
        match format {
            Format::F32 | Format::F16 => Precision::Split,
            Format::Bf16 | Format::Q4 | Format::Q8 => Precision::Fast,
        }
    }
}

/// A weight product of the prompt path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Product {
    /// DeltaNet in_proj_{qkv, z, b, a}
    DeltaNetIn,
    /// attention q (+ gate), k, v
    AttentionIn,
    /// DeltaNet out_proj; attention o_proj, and with it flash attention over an f32 KV cache
    MixerOut,
    /// the MoE router: always split
    Router,
    /// routed experts' gate/up (+ SwiGLU), grouped over all experts
    ExpertGateUp,
    /// routed experts' down, grouped
    ExpertDown,
    /// the shared expert (gate/up and down); the dense MLP of dense models
    Shared,
}

/// One choice per product group; None: by the weights' format ([`Precision::for_format`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptPrecision {
    pub deltanet_in: Option<Precision>,
    pub attention_in: Option<Precision>,
    pub mixer_out: Option<Precision>,
    pub expert_gate_up: Option<Precision>,
    pub expert_down: Option<Precision>,
    pub shared: Option<Precision>,
}

const S: Option<Precision> = Some(Precision::Split);
const F: Option<Precision> = Some(Precision::Fast);
const H: Option<Precision> = Some(Precision::Half);

impl PromptPrecision {
    /// The same choice for every product.
    pub const fn uniform(p: Option<Precision>) -> PromptPrecision {
        PromptPrecision {
            deltanet_in: p,
            attention_in: p,
            mixer_out: p,
            expert_gate_up: p,
            expert_down: p,
            shared: p,
        }
    }
    /// ≈ f32 everywhere (prompts agree with the f32 reference to ~1e-5).
    pub const SPLIT: PromptPrecision = PromptPrecision::uniform(S);
    /// bf16 activations everywhere (misses the parity tolerance at the real shape).
    pub const FAST: PromptPrecision = PromptPrecision::uniform(F);
    /// f16 activations × f16-dequantised q4 weights everywhere the device runs it (q4 in groups of
    /// 64 on sm_90a), split elsewhere; the router split.
    pub const HALF: PromptPrecision = PromptPrecision::uniform(H);
    /// Half everywhere but the DeltaNet in-projections, which run split: the cheapest mix that
    /// passes `scripts/gpu-parity.sh` whole. (Half alone misses the tiny mlx4 fixture's prefill
    /// rows at 2.4× the tolerance; split DeltaNet in-projections alone bring it to 0.43×, the
    /// attention in-projections or the other groups alone do not: docs/experiments.md.)
    pub const BALANCED: PromptPrecision = PromptPrecision {
        deltanet_in: S,
        ..PromptPrecision::HALF
    };
    /// By each matrix's format.
    pub const AUTO: PromptPrecision = PromptPrecision::uniform(None);
    // The partial presets run their fast groups "auto": fast over bf16 and quantised weights (every
    // real checkpoint), split over f32/f16 weights, which only reference-precision models (the
    // f32 fixtures) have; `group=fast` forces fast there too.
    /// Routed experts (gate/up and down) fast, everything else split.
    pub const MIXED: PromptPrecision = PromptPrecision {
        expert_gate_up: None,
        expert_down: None,
        ..PromptPrecision::SPLIT
    };
    /// Only the routed experts' gate/up fast.
    pub const EXPERTS_UP: PromptPrecision = PromptPrecision {
        expert_gate_up: None,
        ..PromptPrecision::SPLIT
    };
    /// Only the routed experts' down fast.
    pub const EXPERTS_DOWN: PromptPrecision = PromptPrecision {
        expert_down: None,
        ..PromptPrecision::SPLIT
    };
    /// The whole feed-forward (routed and shared experts, dense MLP) fast; mixers and router split.
    pub const FFN: PromptPrecision = PromptPrecision {
        expert_gate_up: None,
        expert_down: None,
        shared: None,
        ..PromptPrecision::SPLIT
    };

    /// The choice for `product` (None: by the weights' format); the router is always split.
    pub fn choice(&self, product: Product) -> Option<Precision> {
        match product {
            Product::DeltaNetIn => self.deltanet_in,
            Product::AttentionIn => self.attention_in,
            Product::MixerOut => self.mixer_out,
            Product::Router => S,
            Product::ExpertGateUp => self.expert_gate_up,
            Product::ExpertDown => self.expert_down,
            Product::Shared => self.shared,
        }
    }

    /// The precision `product` runs in over weights of `format`.
    pub fn resolve(&self, product: Product, format: Format) -> Precision {
        self.choice(product)
            .unwrap_or_else(|| Precision::for_format(format))
    }

    fn slot(&mut self, group: &str) -> Option<Vec<&mut Option<Precision>>> {
        Some(match group {
            "deltanet-in" => vec![&mut self.deltanet_in],
            "attention-in" => vec![&mut self.attention_in],
            "mixer-in" => vec![&mut self.deltanet_in, &mut self.attention_in],
            "mixer-out" => vec![&mut self.mixer_out],
            "mixer" => vec![
                &mut self.deltanet_in,
                &mut self.attention_in,
                &mut self.mixer_out,
            ],
            "experts-gate-up" => vec![&mut self.expert_gate_up],
            "experts-down" => vec![&mut self.expert_down],
            "experts" => vec![&mut self.expert_gate_up, &mut self.expert_down],
            "shared" => vec![&mut self.shared],
            _ => return None,
        })
    }
}

/// The default is [`PromptPrecision::BALANCED`]: on q4 weights and Hopper it meets the 30K tok/s
/// prefill target at 8K (30.6K, against split's 21K) and passes every row of
/// `scripts/gpu-parity.sh` (real shape vs transformers at 14.5% of the tolerance). Over other
/// formats or GPUs its half groups fall back to split. `split` stays one flag away for prompts
/// that must agree with the f32 reference to ~1e-5.
impl Default for PromptPrecision {
    fn default() -> Self {
        PromptPrecision::BALANCED
    }
}

/// One choice for every product (the old `Option<Precision>` option: None = by format).
impl From<Option<Precision>> for PromptPrecision {
    fn from(p: Option<Precision>) -> Self {
        PromptPrecision::uniform(p)
    }
}

impl From<Precision> for PromptPrecision {
    fn from(p: Precision) -> Self {
        PromptPrecision::uniform(Some(p))
    }
}

/// The named policies, with what each runs fast.
pub const PRESETS: [(&str, PromptPrecision, &str); 9] = [
    ("split", PromptPrecision::SPLIT, "≈ f32 everywhere"),
    ("fast", PromptPrecision::FAST, "bf16 activations everywhere"),
    (
        "half",
        PromptPrecision::HALF,
        "f16 activations × f16 q4 weights (sm_90a), split elsewhere",
    ),
    (
        "balanced",
        PromptPrecision::BALANCED,
        "half, but the DeltaNet in-projections split (default)",
    ),
    (
        "auto",
        PromptPrecision::AUTO,
        "by weight format (fast for bf16/quantised)",
    ),
    (
        "mixed",
        PromptPrecision::MIXED,
        "routed experts fast, the rest split",
    ),
    (
        "experts-up",
        PromptPrecision::EXPERTS_UP,
        "routed gate/up fast, the rest split",
    ),
    (
        "experts-down",
        PromptPrecision::EXPERTS_DOWN,
        "routed down fast, the rest split",
    ),
    (
        "ffn",
        PromptPrecision::FFN,
        "routed + shared experts fast, mixers split",
    ),
];

/// Groups of `group=choice` overrides (`mixer-in` = both in-projection groups, `mixer` = all three
/// mixer groups, `experts` = both expert ones).
pub const GROUPS: [&str; 9] = [
    "deltanet-in",
    "attention-in",
    "mixer-in",
    "mixer-out",
    "mixer",
    "experts-gate-up",
    "experts-down",
    "experts",
    "shared",
];

fn choice_name(c: Option<Precision>) -> &'static str {
    match c {
        Some(Precision::Fast) => "fast",
        Some(Precision::Split) => "split",
        Some(Precision::Half) => "half",
        None => "auto",
    }
}

impl FromStr for PromptPrecision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut policy = PromptPrecision::SPLIT;
        let mut any = false;
        for item in s.split(',').map(str::trim) {
            if item.is_empty() {
                continue;
            }
            any = true;
            let item = item.to_ascii_lowercase();
            match item.split_once('=') {
                None => {
                    policy = PRESETS
                        .iter()
                        .find(|(name, _, _)| *name == item)
                        .map(|(_, p, _)| *p)
                        .ok_or_else(|| {
                            let names: Vec<&str> = PRESETS.iter().map(|(n, _, _)| *n).collect();
                            format!(
                                "unknown prompt precision {item:?}: expected one of {} or \
                                 GROUP=fast|split|half|auto with GROUP one of {}",
                                names.join(", "),
                                GROUPS.join(", ")
                            )
                        })?;
                }
                Some((group, value)) => {
                    let choice = match value.trim() {
                        "fast" => F,
                        "split" => S,
                        "half" => H,
                        "auto" => None,
                        other => {
                            return Err(format!(
                                "{group}={other:?}: expected fast, split, half or auto"
                            ))
                        }
                    };
                    let slots = policy.slot(group.trim()).ok_or_else(|| {
                        format!(
                            "unknown product group {:?} in {item:?}: expected one of {}",
                            group.trim(),
                            GROUPS.join(", ")
                        )
                    })?;
                    for slot in slots {
                        *slot = choice;
                    }
                }
            }
        }
        if !any {
            return Err("empty prompt precision".to_string());
        }
        Ok(policy)
    }
}

/// The preset's name when the policy is one, else every group spelled out (parses back).
impl fmt::Display for PromptPrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some((name, _, _)) = PRESETS.iter().find(|(_, p, _)| p == self) {
            return f.write_str(name);
        }
        write!(
            f,
            "deltanet-in={},attention-in={},mixer-out={},experts-gate-up={},experts-down={},shared={}",
            choice_name(self.deltanet_in),
            choice_name(self.attention_in),
            choice_name(self.mixer_out),
            choice_name(self.expert_gate_up),
            choice_name(self.expert_down),
            choice_name(self.shared)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PromptPrecision {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn presets_parse_and_print_back() {
        for (name, policy, _) in PRESETS {
            assert_eq!(p(name), policy, "{name}");
            assert_eq!(policy.to_string(), name);
            assert_eq!(p(&name.to_ascii_uppercase()), policy, "case-insensitive");
        }
        // the presets are distinct (Display would name the wrong one otherwise)
        for (i, (a, pa, _)) in PRESETS.iter().enumerate() {
            for (b, pb, _) in &PRESETS[i + 1..] {
                assert_ne!(pa, pb, "{a} = {b}");
            }
        }
    }

    #[test]
    fn mixed_runs_only_the_routed_experts_fast() {
        let m = p("mixed");
        for (product, want) in [
            (Product::DeltaNetIn, Precision::Split),
            (Product::AttentionIn, Precision::Split),
            (Product::MixerOut, Precision::Split),
            (Product::Router, Precision::Split),
            (Product::ExpertGateUp, Precision::Fast),
            (Product::ExpertDown, Precision::Fast),
            (Product::Shared, Precision::Split),
        ] {
            for format in [Format::Q4, Format::Q8, Format::Bf16] {
                assert_eq!(m.resolve(product, format), want, "{product:?} {format:?}");
            }
            // reference-precision (f32/f16) weights stay split everywhere
            for format in [Format::F32, Format::F16] {
                assert_eq!(
                    m.resolve(product, format),
                    Precision::Split,
                    "{product:?} {format:?}"
                );
            }
        }
        // forced fast over f32 weights too
        let forced = p("experts=fast");
        assert_eq!(
            forced.resolve(Product::ExpertDown, Format::F32),
            Precision::Fast
        );
        assert_eq!(
            forced.resolve(Product::Shared, Format::F32),
            Precision::Split
        );
        let up = p("experts-up");
        assert_eq!(
            up.resolve(Product::ExpertGateUp, Format::Q4),
            Precision::Fast
        );
        assert_eq!(
            up.resolve(Product::ExpertDown, Format::Q4),
            Precision::Split
        );
        let down = p("experts-down");
        assert_eq!(
            down.resolve(Product::ExpertGateUp, Format::Q4),
            Precision::Split
        );
        assert_eq!(
            down.resolve(Product::ExpertDown, Format::Q4),
            Precision::Fast
        );
        assert_eq!(
            p("ffn").resolve(Product::Shared, Format::Q4),
            Precision::Fast
        );
        assert_eq!(
            p("ffn").resolve(Product::DeltaNetIn, Format::Q4),
            Precision::Split
        );
        assert_eq!(
            p("ffn").resolve(Product::Shared, Format::F32),
            Precision::Split
        );
    }

    #[test]
    fn balanced_is_half_but_the_deltanet_in_projections() {
        let b = p("balanced");
        assert_eq!(b, p("half,deltanet-in=split"));
        for (product, want) in [
            (Product::DeltaNetIn, Precision::Split),
            (Product::AttentionIn, Precision::Half),
            (Product::MixerOut, Precision::Half),
            (Product::Router, Precision::Split),
            (Product::ExpertGateUp, Precision::Half),
            (Product::ExpertDown, Precision::Half),
            (Product::Shared, Precision::Half),
        ] {
            assert_eq!(b.resolve(product, Format::Q4), want, "{product:?}");
        }
        // mixer-in covers both in-projection groups, mixer all three mixer groups
        let m = p("half,mixer-in=split");
        assert_eq!(m.deltanet_in, Some(Precision::Split));
        assert_eq!(m.attention_in, Some(Precision::Split));
        assert_eq!(m.mixer_out, Some(Precision::Half));
        assert_eq!(p("half,mixer=split"), p("split,experts=half,shared=half"));
        // a policy that is no preset prints every group and parses back
        let odd = p("balanced,attention-in=fast");
        assert_eq!(p(&odd.to_string()), odd);
    }

    #[test]
    fn the_router_is_split_whatever_the_policy() {
        for (name, policy, _) in PRESETS {
            for format in [
                Format::Q4,
                Format::Q8,
                Format::Bf16,
                Format::F16,
                Format::F32,
            ] {
                assert_eq!(
                    policy.resolve(Product::Router, format),
                    Precision::Split,
                    "{name} {format:?}"
                );
            }
        }
    }

    #[test]
    fn auto_follows_the_weight_format() {
        let a = p("auto");
        assert_eq!(
            a.resolve(Product::DeltaNetIn, Format::F32),
            Precision::Split
        );
        assert_eq!(
            a.resolve(Product::DeltaNetIn, Format::F16),
            Precision::Split
        );
        assert_eq!(a.resolve(Product::ExpertDown, Format::Q4), Precision::Fast);
        assert_eq!(a.resolve(Product::Shared, Format::Bf16), Precision::Fast);
        let by_group = p("split,experts=auto");
        assert_eq!(
            by_group.resolve(Product::ExpertDown, Format::Q8),
            Precision::Fast
        );
        assert_eq!(
            by_group.resolve(Product::ExpertDown, Format::F32),
            Precision::Split
        );
        assert_eq!(
            by_group.resolve(Product::MixerOut, Format::Q8),
            Precision::Split
        );
    }

    #[test]
    fn overrides_apply_left_to_right_on_top_of_split() {
        assert_eq!(p("mixed,shared=auto"), PromptPrecision::FFN);
        assert_eq!(p("experts-up, experts-down=auto"), PromptPrecision::MIXED);
        assert_eq!(p("experts=auto"), PromptPrecision::MIXED);
        assert_eq!(p("auto,mixer=split,shared=split"), PromptPrecision::MIXED);
        let forced = p("fast,mixer=split,shared=split");
        assert_eq!((forced.expert_gate_up, forced.expert_down), (F, F));
        assert_eq!(
            (
                forced.deltanet_in,
                forced.attention_in,
                forced.mixer_out,
                forced.shared
            ),
            (S, S, S, S)
        );
        // a later preset replaces everything before it
        assert_eq!(p("experts=fast,split"), PromptPrecision::SPLIT);
        let custom = p("mixer-in=fast");
        assert_eq!((custom.deltanet_in, custom.attention_in), (F, F));
        assert_eq!(custom.mixer_out, S);
        assert_eq!(
            custom.to_string(),
            "deltanet-in=fast,attention-in=fast,mixer-out=split,experts-gate-up=split,\
             experts-down=split,shared=split"
        );
        assert_eq!(p(&custom.to_string()), custom, "Display parses back");
    }

    #[test]
    fn bad_names_are_errors_that_say_what_is_accepted() {
        let e = "mixd".parse::<PromptPrecision>().unwrap_err();
        assert!(
            e.contains("mixd") && e.contains("mixed") && e.contains("experts-gate-up"),
            "{e}"
        );
        let e = "experts=quarter".parse::<PromptPrecision>().unwrap_err();
        assert!(
            e.contains("quarter") && e.contains("fast, split, half or auto"),
            "{e}"
        );
        // half is a group choice too, and its preset prints back
        let h = p("split,experts=half");
        assert_eq!((h.expert_gate_up, h.expert_down, h.deltanet_in), (H, H, S));
        assert_eq!(p(&h.to_string()), h);
        let e = "router=fast".parse::<PromptPrecision>().unwrap_err();
        assert!(e.contains("router") && e.contains("shared"), "{e}");
        assert!("".parse::<PromptPrecision>().is_err());
        assert!(" , ".parse::<PromptPrecision>().is_err());
    }

    #[test]
    fn the_old_uniform_option_converts() {
        assert_eq!(PromptPrecision::from(None), PromptPrecision::AUTO);
        assert_eq!(
            PromptPrecision::from(Some(Precision::Fast)),
            PromptPrecision::FAST
        );
        assert_eq!(
            PromptPrecision::from(Precision::Split),
            PromptPrecision::SPLIT
        );
        assert_eq!(PromptPrecision::default(), PromptPrecision::BALANCED);
    }
}
