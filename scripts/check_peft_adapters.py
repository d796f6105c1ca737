#!/usr/bin/env python3
"""Loads FLAME's PEFT-layout adapter files (LoRA, DoRA, LoKr, LoHa, PEFT's Tucker forms and
LoKr / LoHa per diffusers projection) into peft and checks that peft computes FLAME's outputs.

Usage:
  check_peft_adapters.py tiny DIR FIXTURES   (tests/adapters.rs `flame_peft_files_load_into_peft`)
  check_peft_adapters.py flux DIR FIXTURE    (tests/adapters_fused.rs, the tiny Flux fixture)

DIR holds one folder per case, as FLAME writes them: `adapter_model.safetensors` (FLAME's
`Adapters::save_peft` with the prefix `base_model.model`, peft's own), `adapter_config.json`
(`Adapters::save_peft_config`) and `flame.safetensors` (FLAME's outputs: `y.<module>` for the
tiny model's three layers on FIXTURES/inputs.safetensors' `x.<module>`, or `output` for the
Flux transformer on FIXTURE/io.safetensors).

Each case is loaded twice: `get_peft_model` with the file's config and
`set_peft_model_state_dict`, which must report no unexpected key and no missing adapter key
(strict), and `PeftModel.from_pretrained`; both must compute FLAME's outputs within 1e-5
relative (float64 on the CPU; FLAME's tensors are float32), and the adapter must move the
output. Checked with peft 0.21.2, torch 2.15, diffusers 0.42.1. Exits 1 on any failure.
"""

import copy
import os
import sys
import types

import torch

if not hasattr(torch, "accelerator"):  # diffusers 0.42 probes it; torch < 2.6 lacks it
    torch.accelerator = types.SimpleNamespace(
        is_available=lambda: False, current_accelerator=lambda *a, **k: None, device_count=lambda: 0)

from peft import PeftConfig, PeftModel, get_peft_model, set_peft_model_state_dict  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

TOLERANCE = 1e-5
ADAPTER_NAMES = ("lora_", "lokr_", "hada_")
torch.set_default_dtype(torch.float64)


class Tiny(torch.nn.Module):
    """tests/fixtures/adapters' model (scripts/make_adapter_fixtures.py)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(12, 10)
        self.conv = torch.nn.Conv2d(4, 6, kernel_size=3, padding=1)
        self.pw = torch.nn.Conv2d(4, 6, kernel_size=1)


def tiny_model(fixtures):
    m = Tiny()
    m.load_state_dict({k: v.double() for k, v in
                       load_file(os.path.join(fixtures, "base.safetensors")).items()})
    inputs = load_file(os.path.join(fixtures, "inputs.safetensors"))
    xs = {k[2:]: v.double() for k, v in inputs.items() if k.startswith("x.")}

    def run(model):
        inner = model.base_model.model if hasattr(model, "base_model") else model
        return {f"y.{name}": getattr(inner, name)(x) for name, x in xs.items()}
    return m.eval(), run


def flux_model(fixture):
    from diffusers import FluxTransformer2DModel
    m = FluxTransformer2DModel.from_pretrained(os.path.join(fixture, "transformer")).double()
    io = {k: v.double() for k, v in load_file(os.path.join(fixture, "io.safetensors")).items()}

    def run(model):
        out = model(hidden_states=io["img"], encoder_hidden_states=io["txt"],
                    pooled_projections=io["y"], timestep=io["timesteps"], img_ids=io["img_ids"],
                    txt_ids=io["txt_ids"], guidance=io["guidance"])
        return {"output": out.sample if hasattr(out, "sample") else out[0]}
    return m.eval(), run


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def check(case_dir, base, run):
    want = {k: v.double() for k, v in
            load_file(os.path.join(case_dir, "flame.safetensors")).items()}
    config = PeftConfig.from_pretrained(case_dir)
    sd = load_file(os.path.join(case_dir, "adapter_model.safetensors"))
    sd = {k: v.double() for k, v in sd.items()}
    model = get_peft_model(copy.deepcopy(base), config)
    res = set_peft_model_state_dict(model, sd)
    missing = [k for k in res.missing_keys if any(n in k for n in ADAPTER_NAMES)]
    problems = []
    if res.unexpected_keys:
        problems.append(f"unexpected keys {res.unexpected_keys[:4]}")
    if missing:
        problems.append(f"missing adapter keys {missing[:4]}")
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), case_dir).double()
    with torch.no_grad():
        plain = run(base)
        for name, m in (("set_peft_model_state_dict", model.eval()),
                        ("PeftModel.from_pretrained", loaded.eval())):
            got = run(m)
            for k, w in want.items():
                err, moved = rel(got[k], w), rel(plain[k], w)
                print(f"  {name} {k}: off by {err:.2e} (the adapter moves it by {moved:.2e})")
                if err > TOLERANCE or moved < 1e-4:
                    problems.append(f"{name} {k}: off by {err:.2e}, moved {moved:.2e}")
    return problems


def main():
    mode, folder, fixture = sys.argv[1:4]
    base, run = tiny_model(fixture) if mode == "tiny" else flux_model(fixture)
    cases = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
    failed = 0
    for case in cases:
        print(case)
        problems = check(os.path.join(folder, case), base, run)
        for p in problems:
            print(f"  FAIL {p}")
        failed += bool(problems)
    print(f"{len(cases)} cases, {failed} failures")
    sys.exit(1 if failed or not cases else 0)


if __name__ == "__main__":
    main()
