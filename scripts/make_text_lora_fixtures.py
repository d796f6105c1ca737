#!/usr/bin/env python3
"""Fixtures for tests/text_lora.rs: transformers' CLIP text encoders with a peft LoRA on their
Linears, and what they return.

Reads the tiny random encoders of tests/fixtures/encoders/ (scripts/make_encoder_fixtures.py:
clip_l/, clip_g/) and writes tests/fixtures/text_lora/:
  lora.safetensors      a LoRA on both encoders in the diffusers layout that
                        StableDiffusionXLLoraLoaderMixin.load_lora_weights reads:
                        text_encoder.<module>.lora_A.weight / lora_B.weight for CLIP-L,
                        text_encoder_2.<module>... for bigG, modules q_proj, k_proj, v_proj,
                        out_proj, fc1, fc2 of every layer (rank 4, lora_alpha 4: scale 1, as
                        diffusers assumes without an adapter_config.json), every factor random
                        (peft starts B at zero; a random B makes every factor matter)
  outputs.safetensors   the ids and transformers + peft's outputs with the LoRA: last_hidden,
                        penultimate (hidden_states[-2]), pooled, and bigG's projected
                        (computed in f64, stored in f32)

Deterministic (fixed seeds, one thread). Run: python3 scripts/make_text_lora_fixtures.py
Made with torch 2.15.0, transformers 5.24.0, peft (PyPI).
"""

import os

import numpy as np
import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.numpy import save_file
from transformers import CLIPTextModel, CLIPTextModelWithProjection

torch.set_num_threads(1)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ENC = os.path.join(ROOT, "tests", "fixtures", "encoders")
OUT = os.path.join(ROOT, "tests", "fixtures", "text_lora")
RANK = 4
# peft's target names for CLIP (kohya's CLIPAttention and CLIPMLP Linears).
TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def with_lora(model, seed):
    cfg = LoraConfig(r=RANK, lora_alpha=RANK, target_modules=TARGETS, init_lora_weights=True)
    m = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(m.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    return m.double().eval()


def ids(vocab, lens, length, bos, eos, pad, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lens:
        body = torch.randint(0, vocab - 2, (n,), generator=g).tolist()
        row = [bos] + body + [eos]
        rows.append(row + [pad] * (length - len(row)))
    return torch.tensor(rows)


def main():
    print("transformers", transformers.__version__, "torch", torch.__version__, "peft",
          peft.__version__)
    os.makedirs(OUT, exist_ok=True)
    lora, out = {}, {}
    V = 100
    for name, cls, prefix, seed, (bos, eos, pad) in [
        ("clip_l", CLIPTextModel, "text_encoder", 11, (V - 2, V - 1, V - 1)),
        ("clip_g", CLIPTextModelWithProjection, "text_encoder_2", 12, (V - 1, V - 2, 0)),
    ]:
        base = cls.from_pretrained(os.path.join(ENC, name), torch_dtype=torch.float64)
        m = with_lora(base, seed)
        for k, v in get_peft_model_state_dict(m).items():
            # transformers 5 flattens CLIPTextModel (no "text_model."); diffusers reads the
            # keys with the prefix into either (lora_base.py, _load_lora_into_text_encoder).
            k = k.removeprefix("base_model.model.")
            k = k if k.startswith("text_model.") else f"text_model.{k}"
            lora[f"{prefix}.{k}"] = v.float().contiguous().numpy()
        x = ids(V, [7, 30], 40, bos, eos, pad, seed)
        with torch.no_grad():
            o = m(input_ids=x, output_hidden_states=True)
            inner = m.base_model.model
            pooled = (inner.text_model(input_ids=x) if hasattr(inner, "text_model") else o)
            pooled = pooled.pooler_output
        out[f"{name}.ids"] = x.numpy().astype(np.uint32)
        out[f"{name}.last_hidden"] = o.last_hidden_state
        out[f"{name}.penultimate"] = o.hidden_states[-2]
        out[f"{name}.pooled"] = pooled
        if name == "clip_g":
            out[f"{name}.projected"] = o.text_embeds
    save_file(lora, os.path.join(OUT, "lora.safetensors"), metadata={"format": "pt"})
    arrays = {k: (v if isinstance(v, np.ndarray) else v.detach().float().contiguous().numpy())
              for k, v in out.items()}
    save_file(arrays, os.path.join(OUT, "outputs.safetensors"))
    print("wrote", OUT, sorted(lora)[:3], len(lora), "LoRA tensors")


if __name__ == "__main__":
    main()
