#!/usr/bin/env python3
"""Loads FLAME's kohya-layout adapter files into LyCORIS and checks that LyCORIS computes the
change FLAME's adapters make.

Usage:  PYTHONPATH=/tmp/pysite2:/tmp/pysite python3 scripts/check_lycoris_load.py DIR BASE
        (run by tests/adapters.rs `flame_kohya_files_load_into_lycoris`, which writes DIR)

DIR holds, for each case, `<case>.safetensors` (FLAME's kohya file: `lora_unet_<layer>.<tensor>`)
and `<case>_delta.safetensors` (`<layer>.weight`: the change FLAME's adapter makes to that
layer's weight, and `<layer>.bias` to its bias where the kind trains it; float64). BASE is tests/fixtures/adapters/base.safetensors, the layers
  lin   nn.Linear(12, 10)
  conv  nn.Conv2d(4, 6, kernel_size=3, padding=1)
  pw    nn.Conv2d(4, 6, kernel_size=1)
Each file is read by `lycoris.create_lycoris_from_weights` with its keys renamed from
`lora_unet_` to LyCORIS's own prefix `lycoris_` (the kohya prefix is the kohya wrapper's name
for a UNet; the tensors are LyCORIS's). The wrapped layers run on random inputs; their output
less the base layer's must be the input through FLAME's change, and every layer must be
wrapped (no tensor left out). Checked with lycoris-lora 4.1.3 and torch 2.15.0 on the CPU,
float64:
    pip install --target /tmp/pysite2 torch numpy
    pip install --target /tmp/pysite --no-deps lycoris-lora==4.1.3
A case may come with `<case>.json`, LyCORIS's module settings for it (`algo`, `dim`, `alpha`,
`factor`, `decompose_both`, `use_tucker`, `weight_decompose`, `wd_on_out`). Only for the forms
LyCORIS's own loader cannot read, even from files LyCORIS itself wrote (LoKr's Tucker form: 4.1.3's
`LokrModule.make_module_from_state_dict` takes the rank from `lokr_w2_a.size(1)`, which in
that form is the output side; LoKr's and LoHa's magnitudes per input channel, `wd_on_out=False`:
its `make_module_from_state_dict` builds the module with `wd_on_out=True` and copies the file's
`dora_scale` (1, in[, 1, 1]) into one of (out, 1[, 1, 1])), LyCORIS's module of that algorithm
is then built on each
layer with those settings and FLAME's tensors loaded into it strictly (every key, every
shape).
Exits 1 when a case is off by more than 1e-6 (relative to the change; FLAME's adapter tensors
are float32) or fails to load.
"""

import copy
import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from lycoris import create_lycoris_from_weights
from lycoris.modules.locon import LoConModule
from lycoris.modules.loha import LohaModule
from lycoris.modules.lokr import LokrModule

MODULES = {"locon": LoConModule, "loha": LohaModule, "lokr": LokrModule}


class Built:
    """LyCORIS's modules built by hand, one a layer (what `net.loras` lists)."""

    def __init__(self, model, sd, settings):
        kw = dict(settings)
        cls, dim, alpha = MODULES[kw.pop("algo")], kw.pop("dim"), kw.pop("alpha")
        self.loras = []
        for name in ("lin", "conv", "pw"):
            lora = cls(f"lycoris_{name}", getattr(model, name), 1.0, dim, alpha, **kw)
            own = {k.split(".", 1)[1]: v for k, v in sd.items()
                   if k.startswith(f"lycoris_{name}.")}
            lora.load_state_dict(own, strict=True)
            self.loras.append(lora)

    def apply_to(self):
        for lora in self.loras:
            lora.apply_to()

torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
# FLAME's adapter tensors are float32: its changes carry float32's rounding.
TOLERANCE = 1e-6


class Layers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(12, 10)
        self.conv = torch.nn.Conv2d(4, 6, kernel_size=3, padding=1)
        self.pw = torch.nn.Conv2d(4, 6, kernel_size=1)


def main():
    folder, base_path = sys.argv[1], sys.argv[2]
    base = {k: v.to(torch.float64) for k, v in load_file(base_path).items()}
    layers = Layers()
    layers.load_state_dict(base)
    inputs = {
        "lin": torch.randn(3, 12),
        "conv": torch.randn(2, 4, 5, 5),
        "pw": torch.randn(2, 4, 5, 5),
    }
    cases = sorted(
        f[: -len(".safetensors")]
        for f in os.listdir(folder)
        if f.endswith(".safetensors") and not f.endswith("_delta.safetensors")
    )
    failed = 0
    for case in cases:
        sd = load_file(os.path.join(folder, f"{case}.safetensors"))
        sd = {k.replace("lora_unet_", "lycoris_", 1): v.to(torch.float64) for k, v in sd.items()}
        delta = load_file(os.path.join(folder, f"{case}_delta.safetensors"))
        model = copy.deepcopy(layers)
        plain = {m: getattr(model, m)(x).detach() for m, x in inputs.items()}
        settings = os.path.join(folder, f"{case}.json")
        try:
            if os.path.exists(settings):
                with open(settings) as f:
                    net = Built(model, sd, json.load(f))
                print(f"{case}: LyCORIS's modules built with {settings}, FLAME's tensors in")
            else:
                net, _ = create_lycoris_from_weights(1.0, None, model, weights_sd=sd)
            net.apply_to()
        except Exception as e:  # noqa: BLE001 - any failure to load is the finding
            print(f"{case}: LyCORIS could not load it: {e!r}")
            failed += 1
            continue
        wrapped = sorted(m.lora_name for m in net.loras)
        want_wrapped = sorted(f"lycoris_{m}" for m in inputs)
        if wrapped != want_wrapped:
            print(f"{case}: LyCORIS wrapped {wrapped}, not {want_wrapped}")
            failed += 1
            continue
        with torch.no_grad():
            for m, x in inputs.items():
                d = delta[f"{m}.weight"].to(torch.float64)
                b = delta.get(f"{m}.bias")
                b = None if b is None else b.to(torch.float64)
                if m == "lin":
                    want = F.linear(x, d, b)
                else:
                    want = F.conv2d(x, d, b, padding=getattr(model, m).padding)
                got = getattr(model, m)(x) - plain[m]
                err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
                status = "ok" if err <= TOLERANCE else "OFF"
                algo = next(x for x in net.loras if x.lora_name == f"lycoris_{m}")
                print(f"{case} {m} ({algo.__class__.__name__}): off by {err:.2e} {status}")
                if err > TOLERANCE:
                    failed += 1
    print(f"{len(cases)} cases, {failed} failures")
    sys.exit(1 if failed or not cases else 0)


if __name__ == "__main__":
    main()
