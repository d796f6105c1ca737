#!/usr/bin/env python3
"""Parity fixtures for tiny random-weight diffusers models (Flux, SD3.5 large/medium, SDXL UNet).

Usage:  python scripts/make_model_fixtures.py [OUT_DIR]        (default OUT_DIR: tests/fixtures/models)

Needs only torch, diffusers (0.42.1), safetensors, numpy; no network (nothing is downloaded, the
single-file check loads with local_files_only=True). Runs on CPU whatever hardware is present.

Determinism: per model `torch.manual_seed(SEED)` before construction; then EVERY parameter is
overwritten with values from `numpy.random.default_rng(SEED)` (numpy's PCG64 stream, stable across
torch versions), in `model.named_parameters()` order, and rounded to float32. Buffers (SD3's
`pos_embed.pos_embed`) stay as diffusers computes them. Inputs come from a second numpy stream
(`default_rng(SEED + 1000)`) and are float32 values too. The forward/backward then runs on CPU in
float64 (`model.double()`, TF32 off) from exactly those float32 values, and every result is stored
as float32. diffusers' sinusoidal timestep embedding is patched to run in float64 too (it casts to
float32 whatever the model dtype); RoPE and SD3's RMSNorm variance stay float32 inside diffusers,
which is ~1e-7 relative.

Parameter initialisation (so that no layer is zero, diffusers zero-inits some):
  * ndim >= 2 weights: N(0, (0.7 / sqrt(fan_in))^2), fan_in = numel / shape[0]
  * 1-D norm weights (name ends in `.weight` and contains `norm`, or owner is a
    LayerNorm/GroupNorm/RMSNorm): 1 + 0.1 * N(0, 1)
  * other 1-D parameters (biases): 0.1 * N(0, 1)

Files written, per model NAME in {flux, flux_schnell, sd35_large, sd35_medium, sdxl, sdxl_widths}:

  NAME/SUB/            diffusers layout from `model.save_pretrained(..., safe_serialization=True)`,
                       float32; SUB = `transformer` (flux, sd35_*) or `unet` (sdxl). config.json +
                       diffusion_pytorch_model.safetensors; for sdxl the weights are SHARDED
                       (max_shard_size "200KB"): diffusion_pytorch_model-0000K-of-0000N.safetensors
                       + diffusion_pytorch_model.safetensors.index.json.
  NAME/single_file.safetensors
                       the same float32 weights in the original single-file checkpoint layout:
                       flux: BFL flux1-dev keys, no prefix; sd35_*: Stability SD3.5 keys and
                       sdxl: LDM sd_xl_base_1.0 keys, both with prefix `model.diffusion_model.`.
                       Includes SD3's `pos_embed` buffer (as in the real files). Checked by loading
                       it back with diffusers' own `from_single_file` (see verify_single_file).
  NAME/io.safetensors  float32 tensors:
                       inputs (names/shapes below), `output`, `loss_weight` (N(0,1), shape of
                       output), `loss` (shape (1,)) with loss = sum(output * loss_weight), and
                       `grad.<input>` = d loss / d input for the differentiable inputs.
  NAME/grads.safetensors
                       d loss / d parameter for EVERY parameter (no buffers), keyed by the
                       single-file key WITHOUT the `model.diffusion_model.` prefix; gradients of
                       fused single-file tensors are the same concatenation / half swap of the
                       diffusers gradients as the weights.
  manifest.json        per model: class, config, input names + shapes, grad inputs, output shape,
                       single-file prefix, file list, seed.

Inputs (B = 2):
  flux        latents (2,4,8,6) randn; img = FluxPipeline._pack_latents(latents) (2,12,16)
              [(B,C,H,W)->(B,C,H/2,2,W/2,2)->permute(0,2,4,1,3,5)->(B,(H/2)(W/2),4C)];
              img_ids (12,3) as FluxPipeline._prepare_latent_image_ids(4,3): [0, row, col];
              txt (2,5,24) randn; txt_ids (5,3) zeros; y (2,20) randn; timesteps (2,) = [0.3,0.85]
              (sigma-like: the model multiplies by 1000); guidance (2,) = [3.5,1.0] (also x1000).
              output = model(hidden_states=img, encoder_hidden_states=txt, pooled_projections=y,
              timestep=timesteps, img_ids=img_ids, txt_ids=txt_ids, guidance=guidance).sample
              -> (2,12,16).  grads: img, txt, y.
  sd35_large  x (2,4,8,6), context (2,5,24), y (2,20), timesteps (2,) = [250,780].
  sd35_medium output = model(hidden_states=x, encoder_hidden_states=context,
              pooled_projections=y, timestep=timesteps).sample -> (2,4,8,6).  grads: x, context, y.
  sdxl        x (2,4,13,10), timesteps (2,) = [10,901], context (2,5,24), text_embeds (2,20),
              time_ids (2,6) = [[12,8,0,0,12,8],[16,16,2,3,16,16]].
              output = model(x, timesteps, encoder_hidden_states=context, added_cond_kwargs=
              {"text_embeds": text_embeds, "time_ids": time_ids}).sample -> (2,4,12,8).
              grads: x, context, text_embeds.

Model configs: see MODELS below.
"""

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import types

import numpy as np
import torch

# diffusers 0.42 probes `torch.accelerator` (torch >= 2.6) at import time. On an older CPU torch
# give it a stand-in saying "no accelerator" so the import works; a newer torch is left alone.
if not hasattr(torch, "accelerator"):
    torch.accelerator = types.SimpleNamespace(
        is_available=lambda: False, current_accelerator=lambda *a, **k: None, device_count=lambda: 0
    )

import diffusers  # noqa: E402
import diffusers.loaders.single_file_utils as sfu  # noqa: E402
import diffusers.models.embeddings as _emb  # noqa: E402

_f32_timestep_embedding = _emb.get_timestep_embedding


def _timestep_embedding(timesteps, embedding_dim, flip_sin_to_cos=False, downscale_freq_shift=1,
                        scale=1, max_period=10000):
    """diffusers' get_timestep_embedding, in float64 for float64 timesteps. diffusers computes
    it in float32 whatever the model dtype; with Flux's t x 1000 that alone moves the f64
    reference's parameter gradients by ~1e-4 relative. The formula is unchanged."""
    if timesteps.dtype != torch.float64:
        return _f32_timestep_embedding(timesteps, embedding_dim, flip_sin_to_cos,
                                       downscale_freq_shift, scale, max_period)
    half = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float64,
                                                    device=timesteps.device)
    emb = timesteps[:, None] * torch.exp(exponent / (half - downscale_freq_shift))[None, :]
    emb = scale * emb
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half:], emb[:, :half]], dim=-1)
    if embedding_dim % 2 == 1:
        emb = torch.nn.functional.pad(emb, (0, 1, 0, 0))
    return emb


_emb.get_timestep_embedding = _timestep_embedding
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

SEED = 1234
LDM_PREFIX = "model.diffusion_model."

MODELS = {
    "flux": dict(
        cls=FluxTransformer2DModel,
        sub="transformer",
        prefix="",
        config=dict(
            patch_size=1,
            in_channels=16,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=24,
            pooled_projection_dim=20,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        ),
    ),
    "sd35_large": dict(
        cls=SD3Transformer2DModel,
        sub="transformer",
        prefix=LDM_PREFIX,
        config=dict(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=24,
            caption_projection_dim=16,
            pooled_projection_dim=20,
            out_channels=4,
            pos_embed_max_size=8,
            qk_norm="rms_norm",
            dual_attention_layers=(),
        ),
    ),
    "sd35_medium": dict(
        cls=SD3Transformer2DModel,
        sub="transformer",
        prefix=LDM_PREFIX,
        config=dict(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=3,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=24,
            caption_projection_dim=16,
            pooled_projection_dim=20,
            out_channels=4,
            pos_embed_max_size=8,
            qk_norm="rms_norm",
            dual_attention_layers=(0, 1),
        ),
    ),
    "sdxl": dict(
        cls=UNet2DConditionModel,
        sub="unet",
        prefix=LDM_PREFIX,
        config=dict(
            sample_size=16,
            in_channels=4,
            out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(4, 8, 16),
            layers_per_block=2,
            transformer_layers_per_block=(1, 1, 2),
            attention_head_dim=(1, 2, 4),  # SDXL naming: this is the number of heads
            norm_num_groups=2,  # 2+ channels a group: a 1-channel group cancels the time embedding
            cross_attention_dim=24,
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=20 + 6 * 8,
        ),
    ),
}


# FLUX.1-schnell: Flux without the guidance embedding (one block of each kind keeps it small).
MODELS["flux_schnell"] = dict(
    MODELS["flux"],
    config=dict(MODELS["flux"]["config"], guidance_embeds=False, num_layers=1, num_single_layers=1),
)

# SDXL with level widths that are not multiples of the first (diffusers builds any widths the
# norm groups and heads divide).
MODELS["sdxl_widths"] = dict(
    MODELS["sdxl"],
    config=dict(MODELS["sdxl"]["config"], block_out_channels=(4, 6, 10), attention_head_dim=(1, 2, 5)),
)

# ----------------------------------------------------------------------------------------------
# random values


def _normal(rng, shape):
    return torch.from_numpy(rng.standard_normal(size=tuple(shape)).astype(np.float32))


_NORM_TYPES = (torch.nn.LayerNorm, torch.nn.GroupNorm, diffusers.models.normalization.RMSNorm)
if hasattr(torch.nn, "RMSNorm"):
    _NORM_TYPES = _NORM_TYPES + (torch.nn.RMSNorm,)


def init_params(model, rng):
    owners = {}
    for mname, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            owners[f"{mname}.{pname}" if mname else pname] = mod
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                fan_in = p.numel() // p.shape[0]
                v = _normal(rng, p.shape) * np.float32(0.7 / np.sqrt(fan_in))
            elif name.endswith(".weight") and ("norm" in name.lower() or isinstance(owners[name], _NORM_TYPES)):
                v = 1.0 + 0.1 * _normal(rng, p.shape)
            else:
                v = 0.1 * _normal(rng, p.shape)
            p.copy_(v.to(torch.float32))


# ----------------------------------------------------------------------------------------------
# diffusers -> original single-file key mappings (exact inverses of diffusers' converters in
# diffusers/loaders/single_file_utils.py). Each takes a {diffusers_key: tensor} dict (parameters,
# optionally buffers; or gradients) and returns {original_key_without_prefix: tensor}; every input
# key must be consumed exactly once.


def _swap_halves(t):
    # diffusers AdaLayerNormContinuous stores (scale, shift); BFL / Stability store (shift, scale).
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


class _Mapper:
    def __init__(self, sd):
        self.src = dict(sd)
        self.out = {}

    def has(self, key):
        return key in self.src

    def mv(self, dst, src, fn=None):
        for wb in ("weight", "bias"):
            k = f"{src}.{wb}"
            if k in self.src:
                t = self.src.pop(k)
                self.out[f"{dst}.{wb}"] = fn(t) if fn else t

    def mv_key(self, dst, src):
        if src in self.src:
            self.out[dst] = self.src.pop(src)

    def cat(self, dst, srcs):
        for wb in ("weight", "bias"):
            ks = [f"{s}.{wb}" for s in srcs]
            present = [k in self.src for k in ks]
            if any(present):
                assert all(present), ks
                self.out[f"{dst}.{wb}"] = torch.cat([self.src.pop(k) for k in ks], dim=0)

    def done(self):
        if self.src:
            raise KeyError(f"unmapped diffusers keys: {sorted(self.src)}")
        return self.out


def flux_to_original(sd, cfg):
    m = _Mapper(sd)
    m.mv("img_in", "x_embedder")
    m.mv("txt_in", "context_embedder")
    for dst, src in (("time_in", "timestep_embedder"), ("vector_in", "text_embedder"), ("guidance_in", "guidance_embedder")):
        m.mv(f"{dst}.in_layer", f"time_text_embed.{src}.linear_1")
        m.mv(f"{dst}.out_layer", f"time_text_embed.{src}.linear_2")
    for i in range(cfg["num_layers"]):
        d, s = f"double_blocks.{i}", f"transformer_blocks.{i}"
        m.mv(f"{d}.img_mod.lin", f"{s}.norm1.linear")
        m.mv(f"{d}.txt_mod.lin", f"{s}.norm1_context.linear")
        m.cat(f"{d}.img_attn.qkv", [f"{s}.attn.to_q", f"{s}.attn.to_k", f"{s}.attn.to_v"])
        m.cat(f"{d}.txt_attn.qkv", [f"{s}.attn.add_q_proj", f"{s}.attn.add_k_proj", f"{s}.attn.add_v_proj"])
        m.mv_key(f"{d}.img_attn.norm.query_norm.scale", f"{s}.attn.norm_q.weight")
        m.mv_key(f"{d}.img_attn.norm.key_norm.scale", f"{s}.attn.norm_k.weight")
        m.mv_key(f"{d}.txt_attn.norm.query_norm.scale", f"{s}.attn.norm_added_q.weight")
        m.mv_key(f"{d}.txt_attn.norm.key_norm.scale", f"{s}.attn.norm_added_k.weight")
        m.mv(f"{d}.img_attn.proj", f"{s}.attn.to_out.0")
        m.mv(f"{d}.txt_attn.proj", f"{s}.attn.to_add_out")
        m.mv(f"{d}.img_mlp.0", f"{s}.ff.net.0.proj")
        m.mv(f"{d}.img_mlp.2", f"{s}.ff.net.2")
        m.mv(f"{d}.txt_mlp.0", f"{s}.ff_context.net.0.proj")
        m.mv(f"{d}.txt_mlp.2", f"{s}.ff_context.net.2")
    for i in range(cfg["num_single_layers"]):
        d, s = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        m.mv(f"{d}.modulation.lin", f"{s}.norm.linear")
        m.cat(f"{d}.linear1", [f"{s}.attn.to_q", f"{s}.attn.to_k", f"{s}.attn.to_v", f"{s}.proj_mlp"])
        m.mv_key(f"{d}.norm.query_norm.scale", f"{s}.attn.norm_q.weight")
        m.mv_key(f"{d}.norm.key_norm.scale", f"{s}.attn.norm_k.weight")
        m.mv(f"{d}.linear2", f"{s}.proj_out")
    m.mv("final_layer.linear", "proj_out")
    m.mv("final_layer.adaLN_modulation.1", "norm_out.linear", fn=_swap_halves)
    return m.done()


def sd3_to_original(sd, cfg):
    m = _Mapper(sd)
    n = cfg["num_layers"]
    dual = set(cfg["dual_attention_layers"])
    m.mv_key("pos_embed", "pos_embed.pos_embed")  # buffer, present in the real files
    m.mv("x_embedder.proj", "pos_embed.proj")
    m.mv("t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1")
    m.mv("t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2")
    m.mv("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1")
    m.mv("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2")
    m.mv("context_embedder", "context_embedder")
    for i in range(n):
        last = i == n - 1
        x, c, s = f"joint_blocks.{i}.x_block", f"joint_blocks.{i}.context_block", f"transformer_blocks.{i}"
        m.mv(f"{x}.adaLN_modulation.1", f"{s}.norm1.linear")
        # the last block's context stream is "pre only": AdaLayerNormContinuous (scale, shift) in
        # diffusers, (shift, scale) in the original.
        m.mv(f"{c}.adaLN_modulation.1", f"{s}.norm1_context.linear", fn=_swap_halves if last else None)
        m.cat(f"{x}.attn.qkv", [f"{s}.attn.to_q", f"{s}.attn.to_k", f"{s}.attn.to_v"])
        m.cat(f"{c}.attn.qkv", [f"{s}.attn.add_q_proj", f"{s}.attn.add_k_proj", f"{s}.attn.add_v_proj"])
        m.mv_key(f"{x}.attn.ln_q.weight", f"{s}.attn.norm_q.weight")
        m.mv_key(f"{x}.attn.ln_k.weight", f"{s}.attn.norm_k.weight")
        m.mv_key(f"{c}.attn.ln_q.weight", f"{s}.attn.norm_added_q.weight")
        m.mv_key(f"{c}.attn.ln_k.weight", f"{s}.attn.norm_added_k.weight")
        m.mv(f"{x}.attn.proj", f"{s}.attn.to_out.0")
        if not last:
            m.mv(f"{c}.attn.proj", f"{s}.attn.to_add_out")
        if i in dual:
            m.cat(f"{x}.attn2.qkv", [f"{s}.attn2.to_q", f"{s}.attn2.to_k", f"{s}.attn2.to_v"])
            m.mv_key(f"{x}.attn2.ln_q.weight", f"{s}.attn2.norm_q.weight")
            m.mv_key(f"{x}.attn2.ln_k.weight", f"{s}.attn2.norm_k.weight")
            m.mv(f"{x}.attn2.proj", f"{s}.attn2.to_out.0")
        m.mv(f"{x}.mlp.fc1", f"{s}.ff.net.0.proj")
        m.mv(f"{x}.mlp.fc2", f"{s}.ff.net.2")
        if not last:
            m.mv(f"{c}.mlp.fc1", f"{s}.ff_context.net.0.proj")
            m.mv(f"{c}.mlp.fc2", f"{s}.ff_context.net.2")
    m.mv("final_layer.linear", "proj_out")
    m.mv("final_layer.adaLN_modulation.1", "norm_out.linear", fn=_swap_halves)
    return m.done()


_RESNET_TO_LDM = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "time_emb_proj": "emb_layers.1",
    "conv_shortcut": "skip_connection",
}


def _resnet_rest(rest):
    head, tail = rest.split(".", 1)
    return f"{_RESNET_TO_LDM[head]}.{tail}"


def sdxl_to_original(sd, cfg):
    """Inverse of diffusers' convert_ldm_unet_checkpoint. With L = layers_per_block:
    down_blocks.i.resnets.j      -> input_blocks.(1 + i*(L+1) + j).0   (resnet renames)
    down_blocks.i.attentions.j   -> input_blocks.(1 + i*(L+1) + j).1   (same inner names)
    down_blocks.i.downsamplers.0.conv -> input_blocks.(1 + i*(L+1) + L).0.op
    mid_block.resnets.0 / attentions.0 / resnets.1 -> middle_block.0 / .1 / .2
    up_blocks.i.resnets.j (j <= L)  -> output_blocks.(i*(L+1) + j).0
    up_blocks.i.attentions.j        -> output_blocks.(i*(L+1) + j).1
    up_blocks.i.upsamplers.0.conv   -> output_blocks.(i*(L+1) + L).{2 if the block has attentions else 1}.conv
    """
    L = cfg["layers_per_block"]
    fixed = {
        "time_embedding.linear_1": "time_embed.0",
        "time_embedding.linear_2": "time_embed.2",
        "add_embedding.linear_1": "label_emb.0.0",
        "add_embedding.linear_2": "label_emb.0.2",
        "conv_in": "input_blocks.0.0",
        "conv_norm_out": "out.0",
        "conv_out": "out.2",
    }
    up_has_attn = {i: t.startswith("CrossAttn") for i, t in enumerate(cfg["up_block_types"])}
    out = {}
    for key, t in sd.items():
        base, wb = key.rsplit(".", 1)
        parts = key.split(".")
        if base in fixed:
            new = f"{fixed[base]}.{wb}"
        elif parts[0] == "down_blocks":
            i, kind = int(parts[1]), parts[2]
            if kind == "downsamplers":
                assert parts[3:5] == ["0", "conv"], key
                new = f"input_blocks.{1 + i * (L + 1) + L}.0.op.{wb}"
            else:
                j, rest = int(parts[3]), ".".join(parts[4:])
                idx = 1 + i * (L + 1) + j
                new = f"input_blocks.{idx}.0.{_resnet_rest(rest)}" if kind == "resnets" else f"input_blocks.{idx}.1.{rest}"
                assert kind in ("resnets", "attentions"), key
        elif parts[0] == "mid_block":
            kind, j, rest = parts[1], int(parts[2]), ".".join(parts[3:])
            if kind == "resnets":
                new = f"middle_block.{2 * j}.{_resnet_rest(rest)}"
            else:
                assert kind == "attentions" and j == 0, key
                new = f"middle_block.1.{rest}"
        elif parts[0] == "up_blocks":
            i, kind = int(parts[1]), parts[2]
            if kind == "upsamplers":
                assert parts[3:5] == ["0", "conv"], key
                new = f"output_blocks.{i * (L + 1) + L}.{2 if up_has_attn[i] else 1}.conv.{wb}"
            else:
                j, rest = int(parts[3]), ".".join(parts[4:])
                idx = i * (L + 1) + j
                new = f"output_blocks.{idx}.0.{_resnet_rest(rest)}" if kind == "resnets" else f"output_blocks.{idx}.1.{rest}"
                assert kind in ("resnets", "attentions"), key
        else:
            raise KeyError(f"unmapped diffusers key: {key}")
        assert new not in out, (key, new)
        out[new] = t
    return out


TO_ORIGINAL = {"flux": flux_to_original, "flux_schnell": flux_to_original, "sd35_large": sd3_to_original, "sd35_medium": sd3_to_original, "sdxl": sdxl_to_original, "sdxl_widths": sdxl_to_original}


# ----------------------------------------------------------------------------------------------
# single-file check with diffusers' own loader


class _TorchWithFluxSplit:
    """diffusers' convert_flux_transformer_checkpoint_to_diffusers hard-codes inner_dim = 3072 and
    mlp_ratio = 4 when it splits single_blocks.N.linear1 into q/k/v/mlp. For a tiny model the
    split sizes (3072, 3072, 3072, 12288) are rescaled to the tensor's real row count (same 1:1:1:4
    ratio); everything else is plain torch."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def split(tensor, split_size_or_sections, dim=0):
        if (
            isinstance(split_size_or_sections, (tuple, list))
            and tuple(split_size_or_sections) == (3072, 3072, 3072, 12288)
            and tensor.shape[dim] != sum(split_size_or_sections)
        ):
            assert tensor.shape[dim] % 7 == 0
            d = tensor.shape[dim] // 7
            split_size_or_sections = (d, d, d, 4 * d)
        return torch.split(tensor, split_size_or_sections, dim=dim)


@contextlib.contextmanager
def _flux_split_patch(enabled):
    if not enabled:
        yield
        return
    saved = sfu.torch
    sfu.torch = _TorchWithFluxSplit()
    try:
        yield
    finally:
        sfu.torch = saved


def verify_single_file(name, spec, model_dir, single_path, ref):
    """ref: the float32 diffusers state dict (parameters + persistent buffers)."""
    cls = spec["cls"]
    patch = name.startswith("flux") and spec["config"]["num_attention_heads"] * spec["config"]["attention_head_dim"] != 3072
    checks = []
    # 1. diffusers' converter directly on the single-file dict: exact key set and values.
    conv_fn = {
        "flux": sfu.convert_flux_transformer_checkpoint_to_diffusers,
        "flux_schnell": sfu.convert_flux_transformer_checkpoint_to_diffusers,
        "sd35_large": sfu.convert_sd3_transformer_checkpoint_to_diffusers,
        "sd35_medium": sfu.convert_sd3_transformer_checkpoint_to_diffusers,
        "sdxl": sfu.convert_ldm_unet_checkpoint,
        "sdxl_widths": sfu.convert_ldm_unet_checkpoint,
    }[name]
    ckpt = load_file(single_path)
    cfg = json.load(open(os.path.join(model_dir, spec["sub"], "config.json")))
    with _flux_split_patch(patch):
        conv = conv_fn(checkpoint=dict(ckpt), config=cfg)
    missing, extra = set(ref) - set(conv), set(conv) - set(ref)
    if missing or extra:
        raise AssertionError(f"{name}: converter key mismatch; missing {sorted(missing)} extra {sorted(extra)}")
    for k, v in ref.items():
        if not torch.equal(conv[k].to(v.dtype), v):
            raise AssertionError(f"{name}: converter value mismatch at {k}")
    checks.append(f"sfu.{conv_fn.__name__}")
    # 2. the public loader, offline, from the file on disk, with the saved diffusers config.
    with _flux_split_patch(patch):
        loaded = cls.from_single_file(
            single_path,
            config=model_dir,
            subfolder=spec["sub"],
            local_files_only=True,
            low_cpu_mem_usage=False,
        )
    lsd = loaded.state_dict()
    if set(lsd) != set(ref):
        raise AssertionError(f"{name}: from_single_file key mismatch")
    for k, v in ref.items():
        if not torch.equal(lsd[k], v):
            raise AssertionError(f"{name}: from_single_file value mismatch at {k}")
    checks.append(f"{cls.__name__}.from_single_file(local_files_only=True)" + (" [flux linear1 split-size patch]" if patch else ""))
    return checks


# ----------------------------------------------------------------------------------------------
# inputs and forward


def _pack_latents(latents):
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def _latent_image_ids(h, w):
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(h)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


def make_inputs(name, rng):
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    if name.startswith("flux"):
        latents = _normal(rng, (2, 4, 8, 6))
        img = _pack_latents(latents).contiguous()
        img_ids = _latent_image_ids(8 // 2, 6 // 2)
        try:  # cross-check against the pipeline's own helpers when importable (needs transformers)
            from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
        except Exception as e:  # noqa: BLE001
            FluxPipeline = None
            print(f"  flux: FluxPipeline not importable ({e.__class__.__name__}); skipped helper cross-check")
        if FluxPipeline is not None:
            assert torch.equal(FluxPipeline._pack_latents(latents, 2, 4, 8, 6), img)
            assert torch.equal(FluxPipeline._prepare_latent_image_ids(2, 4, 3, "cpu", torch.float32), img_ids)
            print("  flux: packing / img_ids match FluxPipeline helpers")
        inputs = dict(
            latents=latents,
            img=img,
            img_ids=img_ids,
            txt=_normal(rng, (2, 5, 24)),
            txt_ids=torch.zeros(5, 3),
            y=_normal(rng, (2, 20)),
            timesteps=f32([0.3, 0.85]),
            guidance=f32([3.5, 1.0]),
        )
        if name == "flux_schnell":
            del inputs["guidance"]
        grads = ["img", "txt", "y"]
    elif name.startswith("sd35"):
        inputs = dict(
            x=_normal(rng, (2, 4, 8, 6)),
            context=_normal(rng, (2, 5, 24)),
            y=_normal(rng, (2, 20)),
            timesteps=f32([250.0, 780.0]),
        )
        grads = ["x", "context", "y"]
    else:
        inputs = dict(
            x=_normal(rng, (2, 4, 13, 10)),  # odd: the up path resizes to the skips
            timesteps=f32([10.0, 901.0]),
            context=_normal(rng, (2, 5, 24)),
            text_embeds=_normal(rng, (2, 20)),
            time_ids=f32([[12, 8, 0, 0, 12, 8], [16, 16, 2, 3, 16, 16]]),
        )
        grads = ["x", "context", "text_embeds"]
    return inputs, grads


def call(name, model, t):
    if name.startswith("flux"):
        return model(
            hidden_states=t["img"],
            encoder_hidden_states=t["txt"],
            pooled_projections=t["y"],
            timestep=t["timesteps"],
            img_ids=t["img_ids"],
            txt_ids=t["txt_ids"],
            guidance=t.get("guidance"),  # absent for schnell (no guidance embedding)
        ).sample
    if name.startswith("sd35"):
        return model(
            hidden_states=t["x"], encoder_hidden_states=t["context"], pooled_projections=t["y"], timestep=t["timesteps"]
        ).sample
    return model(
        t["x"],
        t["timesteps"],
        encoder_hidden_states=t["context"],
        added_cond_kwargs={"text_embeds": t["text_embeds"], "time_ids": t["time_ids"]},
    ).sample


# ----------------------------------------------------------------------------------------------


def _save(tensors, path):
    save_file({k: v.detach().to(torch.float32).contiguous().clone() for k, v in tensors.items()}, path, metadata={"format": "pt"})


def _jsonable(v):
    if isinstance(v, tuple):
        return list(v)
    return v


def build(name, spec, out_dir):
    d = os.path.join(out_dir, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)

    torch.manual_seed(SEED)
    model = spec["cls"](**spec["config"])  # float32 (torch default dtype)
    init_params(model, np.random.default_rng(SEED))
    model.eval()
    cfg = dict(model.config)

    # 1. diffusers layout (float32)
    kw = dict(safe_serialization=True)
    if name.startswith("sdxl"):
        kw["max_shard_size"] = "200KB"
    model.save_pretrained(os.path.join(d, spec["sub"]), **kw)

    # 2. single file
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    orig = TO_ORIGINAL[name](ref, cfg)
    single_path = os.path.join(d, "single_file.safetensors")
    _save({spec["prefix"] + k: v for k, v in orig.items()}, single_path)
    checks = verify_single_file(name, spec, d, single_path, ref)
    print(f"  {name}: single file verified via " + "; ".join(checks))

    # 3. forward / backward in float64 on CPU
    inputs, grad_names = make_inputs(name, np.random.default_rng(SEED + 1000))
    model = model.double()
    model.zero_grad(set_to_none=True)
    t = {}
    for k, v in inputs.items():
        t[k] = v.double().detach().requires_grad_(k in grad_names)
    if name.startswith("flux"):
        # `img` is the leaf that is fed to the model; latents only document where it came from
        t["latents"] = t["latents"].detach()
    out = call(name, model, t)
    lw = _normal(np.random.default_rng(SEED + 2000), out.shape)
    loss = (out * lw.double()).sum()
    loss.backward()

    io = dict(inputs)
    io["output"] = out.detach()
    io["loss_weight"] = lw
    io["loss"] = loss.detach().reshape(1)
    for k in grad_names:
        io[f"grad.{k}"] = t[k].grad
    _save(io, os.path.join(d, "io.safetensors"))

    # 4. parameter gradients in single-file names
    pgrads = {}
    none_grads = []
    for k, p in model.named_parameters():
        if p.grad is None:
            none_grads.append(k)
            pgrads[k] = torch.zeros_like(p)
        else:
            pgrads[k] = p.grad
    if none_grads:
        print(f"  WARNING {name}: parameters without gradient (stored as zeros): {none_grads}")
    _save(TO_ORIGINAL[name](pgrads, cfg), os.path.join(d, "grads.safetensors"))
    zero = [k for k, g in pgrads.items() if not bool(g.abs().max() > 0)]
    if zero:
        print(f"  WARNING {name}: all-zero parameter gradients: {zero}")

    n_params = sum(p.numel() for p in model.parameters())
    print(f"  {name}: {n_params} parameters, output {tuple(out.shape)}, loss {loss.item():.6f}")
    files = []
    for root, _, fs in os.walk(d):
        for f in sorted(fs):
            p = os.path.join(root, f)
            files.append(os.path.relpath(p, out_dir))
            print(f"    {os.path.relpath(p, out_dir):70s} {os.path.getsize(p):>9d} B")
    return {
        "class": spec["cls"].__name__,
        "diffusers_subfolder": spec["sub"],
        "config": {k: _jsonable(v) for k, v in spec["config"].items()},
        "single_file_prefix": spec["prefix"],
        "single_file_verified_with": checks,
        "seed": SEED,
        "num_parameters": n_params,
        "inputs": {k: list(v.shape) for k, v in inputs.items()},
        "grad_inputs": grad_names,
        "output_shape": list(out.shape),
        "loss": "sum(output * loss_weight)",
        "files": sorted(files),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", nargs="?", default="tests/fixtures/models")
    ap.add_argument("--only", nargs="*", choices=list(MODELS), help="build only these models")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"torch {torch.__version__}, diffusers {diffusers.__version__}, numpy {np.__version__}")

    manifest_path = os.path.join(args.out_dir, "manifest.json")
    manifest = {}
    if args.only and os.path.exists(manifest_path):
        manifest = json.load(open(manifest_path)).get("models", {})
    for name in args.only or list(MODELS):
        print(f"[{name}]")
        manifest[name] = build(name, MODELS[name], args.out_dir)

    total = 0
    for root, _, fs in os.walk(args.out_dir):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in fs)
    doc = {
        "generator": "scripts/make_model_fixtures.py",
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "dtype_compute": "float64 (CPU)",
        "dtype_stored": "float32",
        "models": {k: manifest[k] for k in MODELS if k in manifest},
    }
    with open(manifest_path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"total fixture size {total} B ({total / 2**20:.2f} MiB) in {args.out_dir}")


if __name__ == "__main__":
    sys.exit(main())
