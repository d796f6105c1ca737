#!/usr/bin/env python3
"""Loads a FLAME-written PEFT-layout LoRA of T5's and Qwen3's adapters (`text_encoder_2.*`
for Flux's T5, `text_encoder.model.*` for Qwen3) into transformers' T5EncoderModel and
Qwen3ForCausalLM: Qwen3's part with diffusers' own text-encoder loader,
`FluxLoraLoaderMixin.load_lora_into_text_encoder` (what `load_lora_weights` calls for each
encoder it takes), T5's with peft's `set_peft_model_state_dict` after the prefix (diffusers'
loader infers the layout from CLIP's module names and cannot read T5's). Checks that every
tensor is taken (no unexpected or missing key; as many LoRA tensors held as the file has)
and that the encoders then give transformers + peft's outputs with the same LoRA
(tests/fixtures/text_lora/t5_qwen3_outputs.safetensors, scripts/make_te_lora_fixtures.py).

diffusers 0.42.1's pipelines do not load these encoders' adapters (FluxLoraLoaderMixin's
`_lora_loadable_modules` are transformer and text_encoder, SD3's add text_encoder_2,
Flux2's and ZImage's the transformer only): this checks that the layout is the one its
loader and peft read, where a pipeline gets to load it.

Usage: check_t5_qwen3_lora_diffusers.py [LORA.safetensors]
(default: tests/fixtures/text_lora/t5_qwen3_lora.safetensors). Runs in float64 on the CPU;
exits 1 when a key is left over or missing or max |diff| / max |peft| exceeds 1e-5. Called by
the ignored test diffusers_loader_reads_t5_and_qwen3_adapters in tests/text_lora_t5_qwen3.rs.
Checked with torch 2.15.0, transformers 5.24.0, diffusers 0.42.1, peft 0.21.2.
"""
import logging
import os
import sys
import types

import torch

if not hasattr(torch, "accelerator"):  # diffusers 0.42 probes it; torch < 2.6 lacks it
    torch.accelerator = types.SimpleNamespace(
        is_available=lambda: False, current_accelerator=lambda *a, **k: None, device_count=lambda: 0)

from diffusers.loaders import FluxLoraLoaderMixin  # noqa: E402
from diffusers.utils import logging as dlogging  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict  # noqa: E402
from transformers import Qwen3ForCausalLM, T5EncoderModel  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIX = os.path.join(ROOT, "tests", "fixtures")
TOL = 1e-5


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen = []

    def emit(self, record):
        self.seen.append(record.getMessage())


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else f"{FIX}/text_lora/t5_qwen3_lora.safetensors"
    sd = load_file(path)
    io = load_file(f"{FIX}/text_lora/t5_qwen3_outputs.safetensors")
    caught = Warnings()
    dlogging.get_logger("diffusers").addHandler(caught)
    logging.getLogger("peft").addHandler(caught)
    ok = True

    # T5: diffusers' text-encoder loader infers the layout from CLIP's names (q_proj, ...)
    # and cannot read T5's; peft's own loading of the part after its prefix, as diffusers'
    # loader ends by doing.
    t5 = T5EncoderModel.from_pretrained(f"{FIX}/encoders/t5", torch_dtype=torch.float64)
    part = {k.removeprefix("text_encoder_2."): v.double() for k, v in sd.items()
            if k.startswith("text_encoder_2.")}
    cfg = LoraConfig(r=4, lora_alpha=4, target_modules=sorted({k.split(".")[-3] for k in part}))
    inject_adapter_in_model(cfg, t5)
    res = set_peft_model_state_dict(t5, part)
    for k in res.unexpected_keys:
        print("peft: unexpected", k)
    ok &= not res.unexpected_keys
    q = Qwen3ForCausalLM.from_pretrained(f"{FIX}/qwen3/text_encoder", torch_dtype=torch.float64)
    FluxLoraLoaderMixin.load_lora_into_text_encoder(sd, None, q, prefix="text_encoder")
    for name, model, prefix in [("t5", t5, "text_encoder_2"), ("qwen3", q, "text_encoder")]:
        held = sum(1 for n, _ in model.named_parameters() if "lora_" in n)
        want = sum(1 for k in sd if k.startswith(prefix + "."))
        print(f"{name}: {held} LoRA tensors loaded, {want} in the file under {prefix}.")
        ok &= held == want
    bad = [w for w in caught.seen if "unexpected" in w.lower() or "missing" in w.lower()]
    for w in bad:
        print("loader:", w)
    ok &= not bad

    with torch.no_grad():
        out = t5(input_ids=io["t5.ids"].long()).last_hidden_state
        e = rel(out, io["t5.out"].double())
        print(f"t5 out: {e:.2e}")
        ok &= e <= TOL
        hs = q(input_ids=io["qwen3.ids"].long(), attention_mask=io["qwen3.mask"].long(),
               output_hidden_states=True).hidden_states
        for i in (2, 4):
            e = rel(hs[i], io[f"qwen3.h{i}"].double())
            print(f"qwen3 hidden {i}: {e:.2e}")
            ok &= e <= TOL
    print("ok" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
