#!/usr/bin/env python3
"""LoRA files as ai-toolkit and musubi-tuner write them for FLUX.2 [klein] and Z-Image, on the
tiny models of tests/fixtures/flux2/flux2/single_file.safetensors (BFL keys) and
tests/fixtures/zimage/ (original keys; diffusers config.json), for tests/tool_layouts.rs.

The key names follow the tools' code (read, not run: neither tool is installed here):

  ai-toolkit (ostris/ai-toolkit at commit 27a03a91f23eb1b757d5ec2e80ee3e129cfcc350)
    toolkit/lora_special.py `LoRASpecialNetwork.create_modules`: with `is_transformer` the
      network is in PEFT format (alpha = rank), named "transformer.<module path>", and with
      `transformer_only` (its default) only modules whose path holds one of the model's
      `get_transformer_block_names()`; every Linear of the model class in
      `target_lora_modules` gets a LoRA.
    toolkit/network_mixins.py `get_state_dict`: PEFT format saves `lora_down` as `lora_A`,
      `lora_up` as `lora_B`, and drops `alpha` (for LoRA); tensors in the save dtype (its
      default float16).
    extensions_built_in/diffusion_models/flux2/flux2_model.py: target "Flux2" (its port of
      BFL's model, flux2/src/model.py: BFL's module names), block names "double_blocks",
      "single_blocks"; `convert_lora_weights_before_save` replaces "transformer." by
      "diffusion_model.".
    extensions_built_in/diffusion_models/z_image/z_image.py: target
      "ZImageTransformer2DModel" (diffusers' class, toolkit/models/v2/z_image.py), block name
      "layers"; the same "diffusion_model." rename.
  musubi-tuner (kohya-ss/musubi-tuner at commit 30c658c4f4b0bf05038b3346eff9670259b10fc7)
    src/musubi_tuner/networks/lora.py `LoRANetwork.create_modules`: each Linear inside a
      module of a target class, named "lora_unet_" + "<block path>.<child path>" with dots as
      underscores, unless an exclude pattern fullmatches the dotted path; `LoRAModule` holds
      `lora_down`, `lora_up` and the buffer `alpha`; `save_weights` writes the network's
      state dict in the save dtype (here bfloat16, alpha included).
    src/musubi_tuner/networks/lora_flux_2.py: targets "DoubleStreamBlock",
      "SingleStreamBlock" of flux_2/flux2_models.py (BFL's names); excludes
      r".*(img_mod\\.lin|txt_mod\\.lin|modulation\\.lin).*" and r".*(norm).*".
    src/musubi_tuner/networks/lora_zimage.py: target "ZImageTransformerBlock" of
      zimage/zimage_model.py, whose attention is `to_q`, `to_k`, `to_v`, `to_out` (a
      ModuleList: `to_out.0`) as diffusers names it, and `feed_forward.w1/w2/w3`; excludes
      r".*(_modulation|_refiner).*" (the refiner blocks and adaLN_modulation).

Z-Image's module names are taken from diffusers' ZImageTransformer2DModel built from the
tiny config (diffusers 0.42.1), whose names ai-toolkit uses and musubi-tuner's model shares.

Files, under tests/fixtures/tool_loras/ (every LoRA tensor seeded random, rank 4):

  flux2_ai_toolkit.safetensors   diffusion_model.<BFL module>.lora_A.weight / .lora_B.weight,
                                 float16
  flux2_musubi.safetensors       lora_unet_<BFL module>.lora_down.weight / .lora_up.weight /
                                 .alpha (2.0), bfloat16
  zimage_ai_toolkit.safetensors  diffusion_model.<diffusers module>.lora_A.weight / .lora_B,
                                 float16 (layers.* only: attention.to_q/to_k/to_v/to_out.0,
                                 feed_forward.w1/w2/w3, adaLN_modulation.0)
  zimage_musubi.safetensors      lora_unet_<diffusers module>.lora_down.weight / .lora_up /
                                 .alpha (3.0), bfloat16 (layers.*: attention and feed_forward)
  merged.safetensors             for each file <name>, "<name>.<original key>": the tiny
                                 model's weight with the file's change merged at strength 1,
                                 W + (alpha / rank) B A (scale 1 without alpha), in float64
                                 from the stored values, saved as float32. Z-Image's
                                 to_q / to_k / to_v are rows 0, d and 2d of the original
                                 attention.qkv (diffusers' converter chunks it in that order)
                                 and to_out.0 is attention.out.

Each file's metadata is one key (safetensors orders several at random, which would make the
bytes differ from run to run).

How to run (CPU; torch, safetensors, diffusers 0.42.1; deterministic):

  python3 scripts/make_tool_lora_fixtures.py
"""

import json
import os
import re

import torch
from safetensors.torch import load_file, save_file

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
OUT = os.path.join(ROOT, "tool_loras")
RANK = 4


def flux2_modules(sd):
    """BFL's Linear modules of the double and single blocks (2-D `.weight` keys)."""
    return [k[: -len(".weight")] for k in sorted(sd)
            if k.startswith(("double_blocks.", "single_blocks.")) and k.endswith(".weight")
            and sd[k].ndim == 2]


def zimage_modules():
    """(module path, (out, in)) of every Linear of diffusers' ZImageTransformer2DModel."""
    from diffusers import ZImageTransformer2DModel

    with open(os.path.join(ROOT, "zimage", "transformer", "config.json")) as f:
        cfg = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    model = ZImageTransformer2DModel(**cfg)
    return [(n, (m.out_features, m.in_features)) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)]


def lora(gen, out_dim, in_dim):
    down = torch.randn(RANK, in_dim, generator=gen) * 0.3
    up = torch.randn(out_dim, RANK, generator=gen) * 0.3
    return down, up


def zimage_original(module, d):
    """The original key and first row of a diffusers Z-Image module's weight."""
    m = re.fullmatch(r"(.*)\.attention\.to_([qkv])", module)
    if m:
        return f"{m.group(1)}.attention.qkv.weight", "qkv".index(m.group(2)) * d
    m = re.fullmatch(r"(.*)\.attention\.to_out\.0", module)
    if m:
        return f"{m.group(1)}.attention.out.weight", 0
    return f"{module}.weight", 0


def main():
    os.makedirs(OUT, exist_ok=True)
    gen = torch.Generator().manual_seed(11)
    merged = {}

    def merge(name, base, target, row, down, up, scale):
        key = f"{name}.{target}"
        w = merged.get(key, base[target].double()).clone()
        delta = scale * (up.double() @ down.double())
        w[row: row + delta.shape[0]] += delta
        merged[key] = w

    # FLUX.2 [klein]: BFL's names in both tools.
    flux2 = load_file(os.path.join(ROOT, "flux2", "flux2", "single_file.safetensors"))
    ai, mu = {}, {}
    for m in flux2_modules(flux2):
        out_dim, in_dim = flux2[f"{m}.weight"].shape
        down, up = lora(gen, out_dim, in_dim)
        down, up = down.half(), up.half()
        ai[f"diffusion_model.{m}.lora_A.weight"] = down
        ai[f"diffusion_model.{m}.lora_B.weight"] = up
        merge("flux2_ai_toolkit", flux2, f"{m}.weight", 0, down, up, 1.0)
        if re.fullmatch(r".*(img_mod\.lin|txt_mod\.lin|modulation\.lin).*", m) or "norm" in m:
            continue
        down, up = lora(gen, out_dim, in_dim)
        down, up, alpha = down.bfloat16(), up.bfloat16(), torch.tensor(2.0).bfloat16()
        name = "lora_unet_" + m.replace(".", "_")
        mu.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                   f"{name}.alpha": alpha})
        merge("flux2_musubi", flux2, f"{m}.weight", 0, down, up, alpha.double().item() / RANK)
    save_file(ai, os.path.join(OUT, "flux2_ai_toolkit.safetensors"),
              metadata={"software": "ai-toolkit layout (scripts/make_tool_lora_fixtures.py)"})
    save_file(mu, os.path.join(OUT, "flux2_musubi.safetensors"),
              metadata={"ss_network_module": "networks.lora_flux_2"})

    # Z-Image: diffusers' module names in both tools.
    zimage = load_file(os.path.join(ROOT, "zimage", "single_file.safetensors"))
    d = zimage["layers.0.attention.qkv.weight"].shape[1]
    ai, mu = {}, {}
    for m, (out_dim, in_dim) in zimage_modules():
        # ai-toolkit: the "layers" blocks (transformer_only), every Linear in them.
        if "layers" in f"transformer.{m}":
            target, row = zimage_original(m, d)
            down, up = lora(gen, out_dim, in_dim)
            down, up = down.half(), up.half()
            ai[f"diffusion_model.{m}.lora_A.weight"] = down
            ai[f"diffusion_model.{m}.lora_B.weight"] = up
            merge("zimage_ai_toolkit", zimage, target, row, down, up, 1.0)
        # musubi-tuner: Linears inside ZImageTransformerBlock (layers, noise_refiner,
        # context_refiner), less the excluded refiners and modulations.
        block = re.match(r"(layers|noise_refiner|context_refiner)\.\d+\.", m)
        if block and not re.fullmatch(r".*(_modulation|_refiner).*", m):
            target, row = zimage_original(m, d)
            down, up = lora(gen, out_dim, in_dim)
            down, up, alpha = down.bfloat16(), up.bfloat16(), torch.tensor(3.0).bfloat16()
            name = "lora_unet_" + m.replace(".", "_")
            mu.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                       f"{name}.alpha": alpha})
            merge("zimage_musubi", zimage, target, row, down, up,
                  alpha.double().item() / RANK)
    save_file(ai, os.path.join(OUT, "zimage_ai_toolkit.safetensors"),
              metadata={"software": "ai-toolkit layout (scripts/make_tool_lora_fixtures.py)"})
    save_file(mu, os.path.join(OUT, "zimage_musubi.safetensors"),
              metadata={"ss_network_module": "networks.lora_zimage"})

    save_file({k: v.float().contiguous() for k, v in sorted(merged.items())},
              os.path.join(OUT, "merged.safetensors"))
    total = sum(os.path.getsize(os.path.join(OUT, n)) for n in os.listdir(OUT))
    counts = {n: len(load_file(os.path.join(OUT, f"{n}.safetensors")))
              for n in ["flux2_ai_toolkit", "flux2_musubi", "zimage_ai_toolkit",
                        "zimage_musubi"]}
    print(f"{OUT}: {total / 1e6:.2f} MB; tensors {counts}; {len(merged)} merged weights")


if __name__ == "__main__":
    main()
