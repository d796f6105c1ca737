#!/usr/bin/env python3
"""FP8 FLUX.2 single files for tests/flux2_fp8.rs, made from the tiny FLUX.2 transformer of
tests/fixtures/flux2/flux2/single_file.safetensors (BFL keys, float32).

Every Linear weight of the double and single blocks becomes float8_e4m3fn codes with a scale,
code = (w / scale).to(torch.float8_e4m3fn), scale = absmax / 448 (torch.finfo's max of
float8_e4m3fn), over the whole tensor or over each output row; every other tensor is stored
in bfloat16, as released FP8 files keep them. The files, under tests/fixtures/flux2_fp8/:

  bfl_tensor.safetensors     BFL's bare keys; beside each FP8 weight `<layer>.weight_scale`
                             (one float32, shape ()) and `<layer>.input_scale` (one float32):
                             the convention of BFL's FP8 FLUX.2 [klein] files, as
                             FLAME's FLUX.2 loader used to refuse them by these names, and of
                             ComfyUI's current quantized files (Comfy-Org/ComfyUI
                             comfy/utils.py `convert_old_quants` writes `weight_scale` and
                             `input_scale`; comfy/ops.py multiplies the weight by
                             `weight_scale`)
  bfl_channel.safetensors    the same keys with one scale a row: `weight_scale` of shape
                             (out,) in the double blocks and (out, 1) in the single blocks,
                             and the metadata `_quantization_metadata` =
                             {"layers": {<layer>: {"format": "float8_e4m3fn"}}} (bare layer
                             names) that `convert_old_quants` reads
  comfy_scaled.safetensors   ComfyUI's older "scaled fp8" files: every key under
                             `model.diffusion_model.`, the marker tensor
                             `model.diffusion_model.scaled_fp8` (empty, float8_e4m3fn: the
                             dtype comfy/model_detection.py takes from it), and
                             `<layer>.scale_weight`, `<layer>.scale_input` (1.0) beside each
                             FP8 weight, the per-tensor scales of bfl_tensor
  comfy_quant.safetensors    ComfyUI's current files: `model.diffusion_model.` keys,
                             `<layer>.weight_scale`, `<layer>.input_scale` and
                             `<layer>.comfy_quant` (uint8 bytes of the JSON
                             {"format": "float8_e4m3fn"}), the per-tensor scales again
  dequantized_tensor.safetensors, dequantized_row.safetensors
                             the model those files stand for, in float32 with BFL's bare
                             keys: code.float() * scale (per tensor, per row), every other
                             tensor the bfloat16 value
  diffusers_tensor.safetensors
                             the tiny model's diffusers transformer
                             (tests/fixtures/flux2/flux2/transformer) as one file with
                             diffusers' bare names, its blocks' Linear weights FP8 with a
                             `weight_scale` and `input_scale` each, split q/k/v: the layout of
                             BFL's FP8 FLUX.2 [klein] files (black-forest-labs/FLUX.2-klein-4b-fp8
                             names `transformer_blocks.N.attn.to_q` ..., as reported in
                             sgl-project/sglang#38514)
  diffusers_dequantized/     its model as a diffusers folder in float32 (config.json beside
                             diffusion_pytorch_model.safetensors): code.float() * scale
  bad.safetensors            refusals, one layer each: `blockwise.weight` FP8 with a scale of
                             shape (rows, cols / 8); `int8.weight` FP8 whose comfy_quant says
                             {"format": "int8_tensorwise"}; `twice.weight` FP8 with both
                             `weight_scale` and `scale_weight`; `nan.weight` FP8 holding the
                             NaN code 0x7F; `plain.weight` FP8 without a scale (its codes'
                             values)

How to run (CPU, torch with float8_e4m3fn; deterministic):

  python3 scripts/make_flux2_fp8_fixtures.py
"""

import json
import os

import torch
from safetensors.torch import load_file, save_file

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
SRC = os.path.join(ROOT, "flux2", "flux2", "single_file.safetensors")
DIFFUSERS = os.path.join(ROOT, "flux2", "flux2", "transformer")
OUT = os.path.join(ROOT, "flux2_fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
PREFIX = "model.diffusion_model."


def quantized(key, t):
    """Whether `key` is a Linear weight of a block (the layers FP8 files quantize)."""
    return key.startswith(("double_blocks.", "single_blocks.")) and key.endswith(".weight") \
        and t.ndim == 2


def quantize(w, per_row):
    """(codes, scale): scale (rows,) per row or () per tensor, float32."""
    if per_row:
        scale = (w.abs().amax(dim=1) / FP8_MAX).to(torch.float32)
        codes = (w / scale[:, None]).to(FP8)
    else:
        scale = (w.abs().max() / FP8_MAX).to(torch.float32)
        codes = (w / scale).to(FP8)
    return codes, scale


def dequantize(codes, scale):
    s = scale if scale.ndim == 0 else scale.reshape(-1, 1)
    return codes.float() * s


def main():
    os.makedirs(OUT, exist_ok=True)
    src = load_file(SRC)
    variants = {"bfl_tensor": {}, "bfl_channel": {}, "comfy_scaled": {}, "comfy_quant": {}}
    refs = {"tensor": {}, "row": {}}
    layers = {}
    for key in sorted(src):
        w = src[key]
        if not quantized(key, w):
            b = w.to(torch.bfloat16)
            for v in variants.values():
                v[key] = b
            for r in refs.values():
                r[key] = b.float()
            continue
        layer = key[: -len(".weight")]
        layers[layer] = {"format": "float8_e4m3fn"}
        codes, scale = quantize(w, per_row=False)
        rcodes, rscale = quantize(w, per_row=True)
        refs["tensor"][key] = dequantize(codes, scale)
        refs["row"][key] = dequantize(rcodes, rscale)
        input_scale = torch.tensor(0.01, dtype=torch.float32)
        variants["bfl_tensor"].update({
            key: codes, f"{layer}.weight_scale": scale, f"{layer}.input_scale": input_scale})
        shaped = rscale if key.startswith("double_blocks.") else rscale.reshape(-1, 1)
        variants["bfl_channel"].update({
            key: rcodes, f"{layer}.weight_scale": shaped.contiguous(),
            f"{layer}.input_scale": input_scale})
        variants["comfy_scaled"].update({
            key: codes, f"{layer}.scale_weight": scale,
            f"{layer}.scale_input": torch.tensor(1.0, dtype=torch.float32)})
        record = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode("utf-8")),
                              dtype=torch.uint8)
        variants["comfy_quant"].update({
            key: codes, f"{layer}.weight_scale": scale, f"{layer}.input_scale": input_scale,
            f"{layer}.comfy_quant": record})
    variants["comfy_scaled"]["scaled_fp8"] = torch.empty(0, dtype=FP8)
    for name, tensors in variants.items():
        if name.startswith("comfy"):
            tensors = {PREFIX + k: v for k, v in tensors.items()}
        # One metadata key a file: safetensors orders several at random.
        meta = {"format": "pt"}
        if name == "bfl_channel":
            meta = {"_quantization_metadata": json.dumps({"layers": layers}, sort_keys=True)}
        save_file({k: v.clone().contiguous() for k, v in tensors.items()},
                  os.path.join(OUT, f"{name}.safetensors"), metadata=meta)
    for name, tensors in refs.items():
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  os.path.join(OUT, f"dequantized_{name}.safetensors"), metadata={"format": "pt"})

    # BFL's FP8 FLUX.2 [klein] layout: diffusers' names, split q/k/v, per-tensor scales.
    dsrc = load_file(os.path.join(DIFFUSERS, "diffusion_pytorch_model.safetensors"))
    dfile, dref = {}, {}
    for key in sorted(dsrc):
        w = dsrc[key]
        if key.startswith(("transformer_blocks.", "single_transformer_blocks.")) \
                and key.endswith(".weight") and w.ndim == 2:
            layer = key[: -len(".weight")]
            codes, scale = quantize(w, per_row=False)
            dfile.update({key: codes, f"{layer}.weight_scale": scale,
                          f"{layer}.input_scale": torch.tensor(0.01, dtype=torch.float32)})
            dref[key] = dequantize(codes, scale)
        else:
            dfile[key] = w.to(torch.bfloat16)
            dref[key] = w.to(torch.bfloat16).float()
    save_file({k: v.clone().contiguous() for k, v in dfile.items()},
              os.path.join(OUT, "diffusers_tensor.safetensors"), metadata={"format": "pt"})
    dout = os.path.join(OUT, "diffusers_dequantized")
    os.makedirs(dout, exist_ok=True)
    save_file({k: v.contiguous() for k, v in dref.items()},
              os.path.join(dout, "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(DIFFUSERS, "config.json")) as f:
        config = f.read()
    with open(os.path.join(dout, "config.json"), "w") as f:
        f.write(config)

    # Refusals, and a weight without a scale.
    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, 16, generator=g)
    codes, scale = quantize(w, per_row=False)
    nan = codes.clone()
    nan.view(torch.uint8)[2, 5] = 0x7F
    int8 = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode("utf-8")),
                        dtype=torch.uint8)
    bad = {
        "blockwise.weight": codes, "blockwise.weight_scale": torch.full((8, 2), 0.01),
        "int8.weight": codes, "int8.weight_scale": scale, "int8.comfy_quant": int8,
        "twice.weight": codes, "twice.weight_scale": scale, "twice.scale_weight": scale,
        "nan.weight": nan, "nan.weight_scale": scale,
        "plain.weight": codes,
    }
    save_file({k: v.clone().contiguous() for k, v in bad.items()},
              os.path.join(OUT, "bad.safetensors"), metadata={"format": "pt"})
    total = sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(OUT) for n in ns)
    fp8_layers = len(layers)
    err = max((refs["tensor"][k] - src[k]).abs().max().item() / src[k].abs().max().item()
              for k in refs["tensor"] if k in src and quantized(k, src[k]))
    print(f"{OUT}: {total / 1e6:.2f} MB; {fp8_layers} FP8 layers; worst per-tensor "
          f"rounding {err:.3e} of a weight's largest value")


if __name__ == "__main__":
    main()
