#!/usr/bin/env python3
"""Parity fixtures for a tiny random-weight Z-Image transformer (diffusers ZImageTransformer2DModel).

Usage:  python scripts/make_zimage_fixtures.py [OUT_DIR]        (default OUT_DIR: tests/fixtures/zimage)

Needs torch, diffusers 0.42.1, safetensors and numpy; no network. Runs on the CPU on one thread
(`torch.set_num_threads(1)`), whatever hardware is present. Made with torch 2.15.0, diffusers 0.42.1,
safetensors 0.8.0, numpy 2.4.6.

Determinism: `torch.manual_seed(SEED)` before construction; then EVERY parameter is overwritten with
values from `numpy.random.default_rng(SEED)` in `model.named_parameters()` order, as float32 values
(the rules of scripts/make_model_fixtures.py: ndim >= 2 weights N(0, (0.7/sqrt(fan_in))^2), norm
weights 1 + 0.1 N(0,1), the rest, biases and the two pad tokens, 0.1 N(0,1)). Inputs come from
`default_rng(SEED + 1000)`, the loss weight from `default_rng(SEED + 2000)`. The forward and
backward run in float64 (`model.double()`) from exactly those float32 values and every result is
stored as float32. The sinusoidal timestep embedding (`TimestepEmbedder.timestep_embedding`, float32
in diffusers) is patched to run in float64 with the same formula; diffusers' RMSNorm variance and
the RoPE product stay float32 inside diffusers (about 1e-7 relative).

Files written under OUT_DIR:
  transformer/         `model.save_pretrained(...)`: config.json + diffusion_pytorch_model.safetensors
                       (diffusers layout, float32).
  single_file.safetensors
                       the same weights in the original layout that diffusers'
                       `convert_z_image_transformer_checkpoint_to_diffusers` reads (no key prefix;
                       ComfyUI's files add `model.diffusion_model.`, which the tests add themselves):
                       `x_embedder.*` (diffusers `all_x_embedder.2-1.*`), `final_layer.*`
                       (`all_final_layer.2-1.*`), `*.attention.qkv.weight` = cat(to_q, to_k, to_v),
                       `*.attention.out.weight` (`to_out.0`), `*.attention.q_norm/k_norm.weight`
                       (`norm_q/norm_k`); every other key as in diffusers. Written by
                       `to_original` below and checked by converting it back with diffusers' own
                       function (exact keys and values) and by `from_single_file`.
  io.safetensors       inputs as ZImagePipeline hands them to the transformer, batched FLAME's way:
                         latents (2,4,8,6)      the pipeline's (B, C, H, W); the model gets
                                                `list(latents.unsqueeze(2).unbind(0))`
                         cap_feats (2,37,24)    two captions of 5 and 37 tokens, right-padded
                                                with zeros to 37; the model gets
                                                `[cap_feats[i][:len_i]]`, the pipeline's
                                                `prompt_embeds[i][prompt_masks[i]]`
                         cap_mask (2,37)        1 for a caption's tokens, 0 for padding
                         timesteps (2,)         the model's t = [0.3, 0.85] (the pipeline passes
                                                (1000 - scheduler t) / 1000 = 1 - sigma)
                       `output` (2,4,8,6): `torch.stack(model(...)[0]).squeeze(2)`, the model's
                       raw output (the pipeline negates it for the scheduler);
                       `loss_weight` (N(0,1), output's shape); `loss` (1,) = sum(output *
                       loss_weight); `grad.latents`, `grad.cap_feats` (zero at padding).
  grads.safetensors    d loss / d parameter for every parameter, by original key (qkv gradients
                       concatenated as the weights are).
  keylist_6b.json      [[key, shape], ...] of the released 6B transformer in both layouts
                       ({"original": ..., "diffusers": ...}), from `ZImageTransformer2DModel()`
                       at diffusers' default config (the released one) on the meta device, the
                       original keys through `to_original`; and that config ("config").
  manifest.json        config, shapes, versions, sizes.

Model config (CONFIG below): dim 32, 2 heads (head dim 16 = sum of axes_dims [4, 6, 6]), 2 main
layers, 1 noise-refiner and 1 context-refiner layer, in_channels 4, cap_feat_dim 24, patch 2x2x1,
rope_theta 256, axes_lens [128, 16, 16]. The timestep MLP's 256 -> 1024 -> min(dim, 256) widths are
fixed in diffusers (`TimestepEmbedder(..., mid_size=1024)`), which is most of the fixture's size.
"""

import argparse
import json
import math
import os
import shutil
import sys
import types

import numpy as np
import torch

if not hasattr(torch, "accelerator"):
    torch.accelerator = types.SimpleNamespace(
        is_available=lambda: False, current_accelerator=lambda *a, **k: None, device_count=lambda: 0
    )

import diffusers  # noqa: E402
import diffusers.loaders.single_file_utils as sfu  # noqa: E402
import diffusers.models.transformers.transformer_z_image as zi  # noqa: E402
from diffusers import ZImageTransformer2DModel  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

SEED = 1234
CONFIG = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=4,
    dim=32,
    n_layers=2,
    n_refiner_layers=1,
    n_heads=2,
    n_kv_heads=2,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=24,
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=[4, 6, 6],
    axes_lens=[128, 16, 16],
)
CAPTION_LENS = [5, 37]
TIMESTEPS = [0.3, 0.85]
LATENT = (4, 8, 6)


def _timestep_embedding(t, dim, max_period=10000):
    """ZImage's TimestepEmbedder.timestep_embedding with the same formula, in float64 for
    float64 timesteps (diffusers computes it in float32 whatever the model's dtype; t x 1000
    alone would move the float64 reference by ~1e-5 relative)."""
    if t.dtype != torch.float64:
        return _f32_embedding(t, dim, max_period)
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=torch.float64) / half)
    args = t[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


_f32_embedding = zi.TimestepEmbedder.timestep_embedding
zi.TimestepEmbedder.timestep_embedding = staticmethod(_timestep_embedding)


def _normal(rng, shape):
    return torch.from_numpy(rng.standard_normal(size=tuple(shape)).astype(np.float32))


def init_params(model, rng):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and not name.endswith("pad_token"):
                fan_in = p.numel() // p.shape[0]
                v = _normal(rng, p.shape) * np.float32(0.7 / np.sqrt(fan_in))
            elif name.endswith(".weight") and "norm" in name.lower() or name == "cap_embedder.0.weight":
                v = 1.0 + 0.1 * _normal(rng, p.shape)
            else:
                v = 0.1 * _normal(rng, p.shape)
            p.copy_(v.to(torch.float32))


def to_original(sd, cfg):
    """diffusers keys -> original keys: the inverse of
    `convert_z_image_transformer_checkpoint_to_diffusers` (diffusers/loaders/single_file_utils.py)."""
    tag = f"{cfg['all_patch_size'][0]}-{cfg['all_f_patch_size'][0]}"
    src = dict(sd)
    out = {}
    for k in list(src):
        if ".attention.to_q." in k:
            base = k.split(".attention.to_q.")[0]
            leaf = k.split(".attention.to_q.")[1]
            parts = [src.pop(f"{base}.attention.to_{x}.{leaf}") for x in "qkv"]
            out[f"{base}.attention.qkv.{leaf}"] = torch.cat(parts, dim=0)
    for k, v in src.items():
        if ".attention.to_k." in k or ".attention.to_v." in k:
            continue
        n = k.replace(f"all_x_embedder.{tag}.", "x_embedder.").replace(f"all_final_layer.{tag}.", "final_layer.")
        n = n.replace(".attention.to_out.0.", ".attention.out.")
        n = n.replace(".attention.norm_q.", ".attention.q_norm.").replace(".attention.norm_k.", ".attention.k_norm.")
        out[n] = v
    return out


def _save(tensors, path):
    save_file({k: v.detach().to(torch.float32).contiguous().clone() for k, v in tensors.items()}, path,
              metadata={"format": "pt"})


def verify_single_file(out_dir, single_path, ref):
    conv = sfu.convert_z_image_transformer_checkpoint_to_diffusers(dict(load_file(single_path)))
    if set(conv) != set(ref):
        raise AssertionError(f"converter keys: missing {set(ref) - set(conv)}, extra {set(conv) - set(ref)}")
    for k, v in ref.items():
        if not torch.equal(conv[k], v):
            raise AssertionError(f"converter value mismatch at {k}")
    loaded = ZImageTransformer2DModel.from_single_file(
        single_path, config=out_dir, subfolder="transformer", local_files_only=True, low_cpu_mem_usage=False
    )
    lsd = loaded.state_dict()
    for k, v in ref.items():
        if not torch.equal(lsd[k], v):
            raise AssertionError(f"from_single_file value mismatch at {k}")
    return ["sfu.convert_z_image_transformer_checkpoint_to_diffusers", "from_single_file(local_files_only=True)"]


def write_keylist(path):
    with torch.device("meta"):
        big = ZImageTransformer2DModel()
    sd = big.state_dict()
    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in dict(big.config).items() if not k.startswith("_")}
    orig = to_original(sd, dict(big.config))
    doc = {
        "config": cfg,
        "diffusers": [[k, list(v.shape)] for k, v in sorted(sd.items())],
        "original": [[k, list(v.shape)] for k, v in sorted(orig.items())],
    }
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    conv = sfu.convert_z_image_transformer_checkpoint_to_diffusers(dict(orig))
    if {k: tuple(v.shape) for k, v in conv.items()} != {k: tuple(v.shape) for k, v in sd.items()}:
        raise AssertionError("6B key list: the converter does not give back the diffusers keys")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", nargs="?", default="tests/fixtures/zimage")
    args = ap.parse_args()
    torch.set_num_threads(1)
    d = args.out_dir
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    print(f"torch {torch.__version__}, diffusers {diffusers.__version__}, numpy {np.__version__}")

    torch.manual_seed(SEED)
    model = ZImageTransformer2DModel(**CONFIG)
    init_params(model, np.random.default_rng(SEED))
    model.eval()
    cfg = dict(model.config)
    model.save_pretrained(os.path.join(d, "transformer"), safe_serialization=True)

    write_keylist(os.path.join(d, "keylist_6b.json"))
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    single_path = os.path.join(d, "single_file.safetensors")
    _save(to_original(ref, cfg), single_path)
    checks = verify_single_file(d, single_path, ref)
    print("  single file verified via " + "; ".join(checks))

    rng = np.random.default_rng(SEED + 1000)
    b, tmax = len(CAPTION_LENS), max(CAPTION_LENS)
    latents = _normal(rng, (b,) + LATENT)
    cap = torch.zeros(b, tmax, CONFIG["cap_feat_dim"])
    mask = torch.zeros(b, tmax)
    for i, n in enumerate(CAPTION_LENS):
        cap[i, :n] = _normal(rng, (n, CONFIG["cap_feat_dim"]))
        mask[i, :n] = 1.0
    timesteps = torch.tensor(TIMESTEPS, dtype=torch.float32)

    model = model.double()
    model.zero_grad(set_to_none=True)
    lat = latents.double().requires_grad_(True)
    capd = cap.double().requires_grad_(True)
    x_list = list(lat.unsqueeze(2).unbind(0))
    cap_list = [capd[i][mask[i].bool()] for i in range(b)]
    out_list = model(x_list, timesteps.double(), cap_list, return_dict=False)[0]
    out = torch.stack(out_list, dim=0).squeeze(2)
    lw = _normal(np.random.default_rng(SEED + 2000), out.shape)
    loss = (out * lw.double()).sum()
    loss.backward()

    io = {
        "latents": latents,
        "cap_feats": cap,
        "cap_mask": mask,
        "timesteps": timesteps,
        "output": out.detach(),
        "loss_weight": lw,
        "loss": loss.detach().reshape(1),
        "grad.latents": lat.grad,
        "grad.cap_feats": capd.grad,
    }
    _save(io, os.path.join(d, "io.safetensors"))

    pgrads, missing = {}, []
    for k, p in model.named_parameters():
        if p.grad is None:
            missing.append(k)
            pgrads[k] = torch.zeros_like(p)
        else:
            pgrads[k] = p.grad
    if missing:
        print(f"  WARNING: parameters without gradient (stored as zeros): {missing}")
    _save(to_original(pgrads, cfg), os.path.join(d, "grads.safetensors"))

    files, total = [], 0
    for root, _, fs in os.walk(d):
        for f in sorted(fs):
            p = os.path.join(root, f)
            files.append(os.path.relpath(p, d))
            total += os.path.getsize(p)
            print(f"    {os.path.relpath(p, d):50s} {os.path.getsize(p):>9d} B")
    manifest = {
        "generator": "scripts/make_zimage_fixtures.py",
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "dtype_compute": "float64 (CPU)",
        "dtype_stored": "float32",
        "class": "ZImageTransformer2DModel",
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in CONFIG.items()},
        "caption_lens": CAPTION_LENS,
        "timesteps": TIMESTEPS,
        "seed": SEED,
        "single_file_verified_with": checks,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "loss": "sum(output * loss_weight)",
        "files": sorted(files),
    }
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    print(f"  loss {loss.item():.6f}; total {total} B ({total / 2**20:.2f} MiB)")


if __name__ == "__main__":
    sys.exit(main())
