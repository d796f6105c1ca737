#!/usr/bin/env python3
"""Loads a FLAME-written PEFT LoRA or DoRA into diffusers' tiny Flux (the parity fixture) with
`load_lora_adapter` and compares diffusers' output with FLAME's.

Usage: check_peft_lora.py FIXTURE_DIR LORA.safetensors FLAME_OUTPUT.safetensors
Runs in float64 on the CPU; exits 1 when max |diff| / max |flame| exceeds 1e-4. Called by the
ignored test peft_file_matches_diffusers_with_the_adapter in tests/lora.rs."""
import sys
import types

import torch

if not hasattr(torch, "accelerator"):  # diffusers 0.42 probes it; torch < 2.6 lacks it
    torch.accelerator = types.SimpleNamespace(
        is_available=lambda: False, current_accelerator=lambda *a, **k: None, device_count=lambda: 0)

from diffusers import FluxTransformer2DModel  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def main():
    fixture, lora, flame_out = sys.argv[1:4]
    model = FluxTransformer2DModel.from_pretrained(f"{fixture}/transformer").double().eval()
    model.load_lora_adapter(load_file(lora), prefix="transformer")
    io = {k: v.double() for k, v in load_file(f"{fixture}/io.safetensors").items()}
    with torch.no_grad():
        out = model(hidden_states=io["img"], encoder_hidden_states=io["txt"],
                    pooled_projections=io["y"], timestep=io["timesteps"], img_ids=io["img_ids"],
                    txt_ids=io["txt_ids"], guidance=io["guidance"]).sample
        base = model
        model.disable_lora()
        plain = base(hidden_states=io["img"], encoder_hidden_states=io["txt"],
                     pooled_projections=io["y"], timestep=io["timesteps"], img_ids=io["img_ids"],
                     txt_ids=io["txt_ids"], guidance=io["guidance"]).sample
    want = load_file(flame_out)["output"].double()
    err = ((out - want).abs().max() / want.abs().max()).item()
    moved = ((plain - want).abs().max() / want.abs().max()).item()
    kind = "DoRA" if any("lora_magnitude_vector" in k for k in load_file(lora)) else "LoRA"
    print(f"diffusers + PEFT {kind} vs FLAME: {err:.2e} relative (the adapter moves the output "
          f"by {moved:.2e})")
    sys.exit(0 if err <= 1e-4 and moved > 1e-3 else 1)


if __name__ == "__main__":
    main()
