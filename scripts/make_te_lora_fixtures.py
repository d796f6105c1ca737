#!/usr/bin/env python3
"""Fixtures for tests/text_lora_t5_qwen3.rs: transformers' T5 encoder and Qwen3 with a peft
LoRA on every Linear, their outputs and the LoRA factors' gradients.

Reads the tiny random encoders of tests/fixtures/encoders/t5/ (scripts/make_encoder_fixtures.py)
and tests/fixtures/qwen3/text_encoder/ (scripts/make_qwen3_fixtures.py) and writes
tests/fixtures/text_lora/:
  t5_qwen3_lora.safetensors  the LoRA in the PEFT layout FLAME writes: T5's under
                             text_encoder_2. (Flux's folder of T5) in T5EncoderModel's module
                             names (encoder.block.N.layer.0.SelfAttention.q, ...,
                             layer.1.DenseReluDense.wi_0, wi_1, wo), Qwen3's under
                             text_encoder. in Qwen3ForCausalLM's (model.layers.N.self_attn.q_proj,
                             ..., mlp.gate_proj, up_proj, down_proj); rank 4, lora_alpha 4
                             (scale 1), every factor random (peft starts B at zero; N(0, 0.1²))
  t5_qwen3_outputs.safetensors
                             t5.ids (2, 7, u32), t5.out (last hidden state), t5.w (weights of the
                             loss sum(out * w)), and t5.grad.<file name> for every factor;
                             qwen3.ids (2, 9, u32), qwen3.mask (u32, right padding), qwen3.h2 and
                             qwen3.h4 (hidden_states[2] and the final normed [4]), qwen3.w2,
                             qwen3.w4 and qwen3.grad.<file name> for loss
                             sum(h2 * w2) + sum(h4 * w4)
Every input f32-representable (the factors and loss weights rounded to f32), computed in
f64, stored in f32. Deterministic (fixed seeds, one thread).
Run: python3 scripts/make_te_lora_fixtures.py
Made with torch 2.15.0, transformers 5.24.0, peft 0.21.2.
"""

import os

import torch
from peft import LoraConfig, get_peft_model
import numpy as np
from safetensors.numpy import save_file
from transformers import Qwen3ForCausalLM, T5EncoderModel

torch.set_num_threads(1)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "text_lora")
RANK = 4
T5_TARGETS = ["q", "k", "v", "o", "wi_0", "wi_1", "wo"]
QWEN3_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def with_lora(model, targets, seed):
    cfg = LoraConfig(r=RANK, lora_alpha=RANK, target_modules=targets, init_lora_weights=True)
    m = get_peft_model(model.double(), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(m.named_parameters()):
            if "lora_" in name:
                p.copy_((torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1).float().double())
    return m.eval()


def lora_params(m, prefix):
    """(file name, parameter) of every LoRA factor: peft's names without the wrapper's
    `base_model.model.` and the adapter name, under `prefix`."""
    out = []
    for name, p in m.named_parameters():
        if "lora_" not in name:
            continue
        n = name.removeprefix("base_model.model.").replace(".default", "")
        out.append((f"{prefix}.{n}", p))
    return out


def main():
    lora, io = {}, {}
    g = torch.Generator().manual_seed(11)

    t5 = T5EncoderModel.from_pretrained(os.path.join(ROOT, "tests/fixtures/encoders/t5"))
    t5 = with_lora(t5, T5_TARGETS, 5)
    ids = torch.randint(0, 100, (2, 7), generator=g)
    out = t5(input_ids=ids).last_hidden_state
    w = torch.randn(out.shape, generator=g, dtype=torch.float64).float().double()
    (out * w).sum().backward()
    io["t5.ids"] = ids
    io["t5.out"] = out.detach()
    io["t5.w"] = w
    for n, p in lora_params(t5, "text_encoder_2"):
        lora[n] = p.detach()
        io[f"t5.grad.{n}"] = p.grad

    q = Qwen3ForCausalLM.from_pretrained(os.path.join(ROOT, "tests/fixtures/qwen3/text_encoder"))
    q = with_lora(q, QWEN3_TARGETS, 6)
    ids = torch.randint(0, 320, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.int64)
    mask[1, 6:] = 0
    ids[1, 6:] = 320
    hs = q(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    h2, h4 = hs[2], hs[4]
    w2 = torch.randn(h2.shape, generator=g, dtype=torch.float64).float().double()
    w4 = torch.randn(h4.shape, generator=g, dtype=torch.float64).float().double()
    ((h2 * w2).sum() + (h4 * w4).sum()).backward()
    io["qwen3.ids"] = ids
    io["qwen3.mask"] = mask
    io["qwen3.h2"] = h2.detach()
    io["qwen3.h4"] = h4.detach()
    io["qwen3.w2"] = w2
    io["qwen3.w4"] = w4
    for n, p in lora_params(q, "text_encoder"):
        lora[n] = p.detach()
        io[f"qwen3.grad.{n}"] = p.grad

    # Floats in f32, ids and masks in u32 (what FLAME reads).
    def arrays(d):
        return {k: (v.detach().to(torch.float32).numpy() if v.is_floating_point()
                    else v.numpy().astype(np.uint32)) for k, v in d.items()}

    os.makedirs(OUT, exist_ok=True)
    save_file(arrays(lora), os.path.join(OUT, "t5_qwen3_lora.safetensors"))
    save_file(arrays(io), os.path.join(OUT, "t5_qwen3_outputs.safetensors"))


if __name__ == "__main__":
    main()
