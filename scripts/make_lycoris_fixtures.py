#!/usr/bin/env python3
"""Fixtures of adapter files written by LyCORIS itself, for the merge (`nn::LoraMerge`): its
Tucker forms (`lora_mid`, `hada_t1`/`hada_t2`, `lokr_t2`), DoRA's per-column `dora_scale`,
and full fine-tuning's `diff` / `diff_b`, each beside the change LyCORIS computes for it.

Usage:  PYTHONPATH=/tmp/pysite2:/tmp/pysite python3 scripts/make_lycoris_fixtures.py [OUT]
        (default OUT: tests/fixtures/adapters/lycoris)

Made with lycoris-lora 4.1.3 and torch 2.15.0 on the CPU, float64:
    pip install --target /tmp/pysite2 torch numpy
    pip install --target /tmp/pysite --no-deps lycoris-lora==4.1.3
Nothing is downloaded by the script. Every number comes from numpy's PCG64
(`numpy.random.default_rng`): the base weights from SEED, each adapter's values from SEED + 1
+ its index. LyCORIS initialises one factor of each adapter at zero; the script overwrites every
adapter tensor with random values so the change is not zero.

Base layers (float64; weights N(0, (0.7/sqrt(fan_in))^2), biases 0.1 * N(0, 1)):
  lin   nn.Linear(12, 20)
  conv  nn.Conv2d(16, 32, kernel_size=3, padding=1)
  pw    nn.Conv2d(16, 32, kernel_size=1)

Files (kohya names: `lora_unet_<layer>.<tensor>`, as LyCORIS's kohya wrapper writes for a
UNet), one per case:
  locon_tucker   LoConModule(lora_dim=4, alpha=2, use_tucker=True): conv gets lora_mid
  loha_tucker    LohaModule(lora_dim=4, alpha=2, use_tucker=True): conv gets hada_t1, hada_t2
  lokr_tucker    LokrModule(lora_dim=2, alpha=1, factor=4, use_tucker=True,
                 decompose_both=False): conv gets lokr_t2 (w2 low-rank)
  dora_columns   LoConModule(lora_dim=4, alpha=2, weight_decompose=True, wd_on_out=False):
                 on lin only: its dora_scale is (1, in), per input column
  full           FullModule: diff and diff_b (the bias's change)
  loha_dora      LohaModule(lora_dim=4, alpha=2, weight_decompose=True): dora_scale a row
  lokr_dora      LokrModule(lora_dim=2, alpha=1, factor=4, weight_decompose=True)
  loha_dora_in   loha_dora with wd_on_out=False: dora_scale per input channel, (1, in) for
                 lin, (1, cin, 1, 1) for the convolutions
  lokr_dora_in   lokr_dora with wd_on_out=False
Every other case adapts every layer above. Beside them, base.safetensors (`<layer>.weight`, `<layer>.bias`) and, for each case,
<case>_delta.safetensors: `<layer>.weight` = the change LyCORIS's forward adds, ΔW: for LoCon
`get_diff_weight(multiplier=1)`; for LoHa and LoKr `get_weight(shape) * scalar`, what their
forward adds (4.1.3's `get_diff_weight` multiplies those two by alpha / r a second time, which
their forward does not); for DoRA the merged weight less the base (`get_merged_weight`; for LoHa
and LoKr with magnitudes, their forward's change decomposed, `apply_weight_decompose`); and for
full `<layer>.bias` = its diff_b.
"""

import os
import sys

import numpy as np
import torch
from safetensors.torch import save_file

from lycoris.modules.full import FullModule
from lycoris.modules.locon import LoConModule
from lycoris.modules.loha import LohaModule
from lycoris.modules.lokr import LokrModule

SEED = 20261128
torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)
# LyCORIS initialises some tensors from torch's generator before the script overwrites them.
torch.manual_seed(SEED)


def rand(rng, shape, scale=1.0):
    return torch.from_numpy(rng.standard_normal(shape) * scale)


def base_layers():
    rng = np.random.default_rng(SEED)
    layers = {
        "lin": torch.nn.Linear(12, 20),
        "conv": torch.nn.Conv2d(16, 32, kernel_size=3, padding=1),
        "pw": torch.nn.Conv2d(16, 32, kernel_size=1),
    }
    for m in layers.values():
        fan_in = m.weight[0].numel()
        with torch.no_grad():
            m.weight.copy_(rand(rng, tuple(m.weight.shape), 0.7 / fan_in**0.5))
            m.bias.copy_(rand(rng, tuple(m.bias.shape), 0.1))
    return layers


CASES = [
    ("locon_tucker", LoConModule, dict(lora_dim=4, alpha=2, use_tucker=True)),
    ("loha_tucker", LohaModule, dict(lora_dim=4, alpha=2, use_tucker=True)),
    (
        "lokr_tucker",
        LokrModule,
        dict(lora_dim=2, alpha=1, factor=4, use_tucker=True, decompose_both=False),
    ),
    (
        "dora_columns",
        LoConModule,
        dict(lora_dim=4, alpha=2, weight_decompose=True, wd_on_out=False),
    ),
    ("full", FullModule, dict()),
    ("loha_dora", LohaModule, dict(lora_dim=4, alpha=2, weight_decompose=True)),
    (
        "lokr_dora",
        LokrModule,
        dict(lora_dim=2, alpha=1, factor=4, weight_decompose=True),
    ),
    (
        "loha_dora_in",
        LohaModule,
        dict(lora_dim=4, alpha=2, weight_decompose=True, wd_on_out=False),
    ),
    (
        "lokr_dora_in",
        LokrModule,
        dict(lora_dim=2, alpha=1, factor=4, weight_decompose=True, wd_on_out=False),
    ),
]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/adapters/lycoris"
    os.makedirs(out, exist_ok=True)
    layers = base_layers()
    base = {}
    for name, m in layers.items():
        base[f"{name}.weight"] = m.weight.detach().clone().contiguous()
        base[f"{name}.bias"] = m.bias.detach().clone().contiguous()
    save_file(base, os.path.join(out, "base.safetensors"))
    for index, (case, cls, kw) in enumerate(CASES):
        rng = np.random.default_rng(SEED + 1 + index)
        tensors, deltas = {}, {}
        for name, org in layers.items():
            if case == "dora_columns" and name != "lin":
                continue
            mod = cls(f"lora_unet_{name}", org, multiplier=1.0, **kw)
            mod.to(torch.float64)
            state = mod.state_dict()
            with torch.no_grad():
                for k, v in state.items():
                    if k == "alpha" or not v.is_floating_point():
                        continue
                    v.copy_(rand(rng, tuple(v.shape), 0.3))
                if case == "full":
                    # Full's state holds the trained weight and bias; the file their changes.
                    diff, diff_b = mod.get_diff_weight(multiplier=1)
                    deltas[f"{name}.weight"] = diff.clone().contiguous()
                    deltas[f"{name}.bias"] = diff_b.clone().contiguous()
                elif case == "dora_columns":
                    merged = mod.get_merged_weight(multiplier=1)[0]
                    deltas[f"{name}.weight"] = (merged - org.weight).detach().contiguous()
                elif case in ("loha_dora", "lokr_dora", "loha_dora_in", "lokr_dora_in"):
                    # What the module's forward makes the weight: its change (get_weight x
                    # scalar, as below) decomposed with the magnitudes a row.
                    change = mod.get_weight(mod.shape) * mod.scalar
                    merged = mod.apply_weight_decompose(org.weight + change, 1)
                    deltas[f"{name}.weight"] = (merged - org.weight).detach().contiguous()
                elif case in ("loha_tucker", "lokr_tucker"):
                    # What the module's forward adds (get_weight x scalar): 4.1.3's
                    # get_diff_weight multiplies LoHa's and LoKr's by the scale once more.
                    change = mod.get_weight(mod.shape) * mod.scalar
                    deltas[f"{name}.weight"] = change.detach().contiguous()
                else:
                    deltas[f"{name}.weight"] = mod.get_diff_weight(multiplier=1)[0].detach().contiguous()
            # What LyCORIS writes to a file (its `custom_state_dict`: lora_up with any scalar).
            state = mod.custom_state_dict() if hasattr(mod, "custom_state_dict") else mod.state_dict()
            saved = {k: v.detach().clone().contiguous() for k, v in state.items()}
            if case == "full":
                saved = {"diff": deltas[f"{name}.weight"], "diff_b": deltas[f"{name}.bias"]}
            for k, v in saved.items():
                tensors[f"lora_unet_{name}.{k}"] = v
        keys = sorted(tensors)
        print(case, [k for k in keys if "conv." in k or "lin." in k])
        save_file(tensors, os.path.join(out, f"{case}.safetensors"))
        save_file(deltas, os.path.join(out, f"{case}_delta.safetensors"))


if __name__ == "__main__":
    main()
