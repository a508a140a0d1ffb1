#!/usr/bin/env python3
"""Parity check (c), the transformers side; runs on the GPU machine (torch + transformers there).

Makes a random-weight Qwen3_5MoeForCausalLM with the real Qwen3.6-35B-A3B text dimensions but 4
layers (3 Gated DeltaNet + 1 gated attention, all 256 experts, the full 248,320-token vocabulary),
re-draws the weights to be lively (transformers' init gives near-uniform logits), saves it with
save_pretrained as bf16 safetensors, then computes transformers' own outputs in float32 on the
bf16-rounded weights: the prompt's last log-probabilities and a greedy continuation with each
step's top log-probabilities. Writes <out>/reference.json for crates/calla-cuda/tests/gpu/engine.rs.

usage: gpu-real-shape.py OUT_DIR [STEPS]
"""

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402

VOCAB = 248_320
PROMPT_TOKENS = 48
TOP = 20
# logits of std ≈ LM_HEAD_GAIN: clear argmax margins among 248k ids (as tools/fixtures does).
LM_HEAD_GAIN = 4.0


def config() -> Qwen3_5MoeTextConfig:
    return Qwen3_5MoeTextConfig(
        vocab_size=VOCAB,
        hidden_size=2048,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        max_position_embeddings=262_144,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        bos_token_id=None,
        eos_token_id=248_046,
        pad_token_id=None,
    )


def redraw(model: torch.nn.Module, seed: int) -> None:
    """1-D params 0.1·N(0,1) (zero-centred norms → gains 1 ± 0.1; the DeltaNet gated-norm gain
    1 + 0.1·N), A_log / dt_bias kept (HF init), matrices N(0, 1/fan_in), embeddings N(0, 1),
    lm_head × LM_HEAD_GAIN."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            noise = torch.randn(p.shape, generator=gen, device="cuda", dtype=torch.float32)
            if p.dim() == 1:
                value = 0.1 * noise
                if name.endswith("linear_attn.norm.weight"):
                    value = 1.0 + value
            elif name.endswith("embed_tokens.weight"):
                value = noise
            else:
                value = noise / p.shape[-1] ** 0.5
                if name.endswith("lm_head.weight"):
                    value = value * LM_HEAD_GAIN
            p.copy_(value.to(p.dtype))


def top_pairs(logprobs: torch.Tensor, k: int) -> list:
    values, ids = torch.topk(logprobs, k)
    return [[int(i), float(v)] for i, v in zip(ids.tolist(), values.tolist())]


def main() -> None:
    out = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3_5MoeForCausalLM(config()).to(torch.float32).eval()
    redraw(model, seed=2026)
    model.to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out, max_shard_size="4GB")
    print(f"saved bf16 checkpoint to {out} in {time.time() - t0:.1f} s", flush=True)

    model.to(torch.float32)  # the bf16-rounded weights, float32 arithmetic
    gen = torch.Generator(device="cuda").manual_seed(7)
    prompt = torch.randint(0, VOCAB, (1, PROMPT_TOKENS), generator=gen, device="cuda")
    with torch.no_grad():
        prefill = model(input_ids=prompt, use_cache=False).logits[0, -1].float()
        result = model.generate(
            prompt,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
    greedy = result.sequences[0, PROMPT_TOKENS:].tolist()
    tops = [top_pairs(torch.log_softmax(l[0].float(), -1), TOP) for l in result.logits]
    # the generated token must be each step's argmax (ties: lowest id) for a greedy reference
    for step, (tok, top) in enumerate(zip(greedy, tops)):
        assert tok == top[0][0], f"step {step}: generated {tok} but the argmax is {top[0][0]}"
    margins = [t[0][1] - t[1][1] for t in tops]
    reference = {
        "prompt_ids": prompt[0].tolist(),
        "greedy_ids": greedy,
        "top_logprobs": tops,
        "prefill_top": top_pairs(torch.log_softmax(prefill, -1), TOP),
        "min_top1_margin": min(margins),
        "transformers_seconds": time.time() - t0,
    }
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(reference, f)
    print(
        f"reference: {len(greedy)} greedy tokens, smallest top-1 margin {min(margins):.3f}, "
        f"{time.time() - t0:.1f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
