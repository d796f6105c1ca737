#!/usr/bin/env python3
"""PEFT's per-module scales as fixtures: LoRA files whose adapter_config.json carries
rank_pattern / alpha_pattern, or use_rslora, made by PEFT on the adapter fixtures' tiny model.

Usage:  python3 scripts/make_peft_pattern_fixtures.py [OUT_DIR]
        (default OUT_DIR: tests/fixtures/adapters; needs torch, peft and safetensors)

The base model is tests/fixtures/adapters/base.safetensors (read, not made here): lin
nn.Linear(12, 10), conv nn.Conv2d(4, 6, 3, padding=1), pw nn.Conv2d(4, 6, 1), float64.

Cases, one folder each under OUT_DIR, all LoraConfig(r=4, lora_alpha=8,
target_modules=["lin", "conv", "pw"], lora_dropout=0) plus:
  lora_patterns  rank_pattern={"lin": 2}, alpha_pattern={"c.nv": 12, "p.": 5}
                 (patterns are regular expressions: PEFT matches one against the module's
                 name whole or a dot-separated suffix of it, so "c.nv" matches "conv" and
                 "p." matches "pw" but neither "lin" nor "conv"; the first in the file wins)
  lora_rslora    use_rslora=True (scale alpha / sqrt(r))
After get_peft_model every lora_A / lora_B is overwritten with 0.3 * N(0, 1) from numpy's
PCG64 (seed 7 + case index), so nothing is zero.

Files per case:
  adapter_model.safetensors, adapter_config.json   what save_pretrained writes
  delta.safetensors   f64: delta.<m> = merged weight - base weight (PEFT's merge_and_unload),
                      and scale.<m> = the scaling PEFT gave the module
"""

import copy
import os
import sys

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

OUT = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/adapters"
BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests/fixtures/adapters/base.safetensors")


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(12, 10)
        self.conv = torch.nn.Conv2d(4, 6, 3, padding=1)
        self.pw = torch.nn.Conv2d(4, 6, 1)


def base_model():
    m = Tiny().double()
    m.load_state_dict(load_file(BASE))
    return m


CASES = [
    ("lora_patterns", dict(rank_pattern={"lin": 2}, alpha_pattern={"c.nv": 12, "p.": 5})),
    ("lora_rslora", dict(use_rslora=True)),
]


def main():
    torch.set_num_threads(1)
    for i, (name, extra) in enumerate(CASES):
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["lin", "conv", "pw"], lora_dropout=0.0, **extra)
        model = get_peft_model(base_model(), cfg)
        rng = np.random.default_rng(7 + i)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.from_numpy(0.3 * rng.standard_normal(tuple(p.shape))))
        d = os.path.join(OUT, name)
        os.makedirs(d, exist_ok=True)
        model.save_pretrained(d, safe_serialization=True)
        scales = {m: getattr(model.base_model.model, m).scaling["default"] for m in ["lin", "conv", "pw"]}
        merged = copy.deepcopy(model).merge_and_unload()
        base = base_model()
        out = {}
        for m in ["lin", "conv", "pw"]:
            out[f"delta.{m}"] = (getattr(merged, m).weight - getattr(base, m).weight).detach().contiguous()
            out[f"scale.{m}"] = torch.tensor([float(scales[m])], dtype=torch.float64)
        save_file(out, os.path.join(d, "delta.safetensors"))
        # The model card save_pretrained adds is not a fixture.
        if os.path.exists(os.path.join(d, "README.md")):
            os.remove(os.path.join(d, "README.md"))
        print(name, {m: scales[m] for m in scales}, sorted(os.listdir(d)))


if __name__ == "__main__":
    main()
