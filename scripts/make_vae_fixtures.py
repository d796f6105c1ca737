#!/usr/bin/env python3
"""Fixtures for tests/vae.rs: tiny random diffusers `AutoencoderKL`s in both key layouts, with
what diffusers returns for them.

Writes tests/fixtures/vae/:
  sdxl_like/            config.json + diffusion_pytorch_model.safetensors (diffusers layout):
                        block_out_channels (8, 16), layers_per_block 1, 4 norm groups, 4 latent
                        channels, quant_conv and post_quant_conv, scaling_factor 0.13025
  sdxl_like_ldm.safetensors
                        the same weights in the original LDM layout under first_stage_model.
                        (as SDXL's single file), attention projections as 1x1 convs (C, C, 1, 1)
  flux_like/            block_out_channels (8, 8), 16 latent channels, no quant convs,
                        scaling_factor 0.3611, shift_factor 0.1159 (diffusers layout); one logvar
                        channel's conv_out bias is raised by 50 so the [-30, 20] clamp bites
  flux_like_ae.safetensors
                        the same in the LDM layout without a prefix (as BFL's ae.safetensors)
  flux2_like/           a diffusers `AutoencoderKLFlux2` (FLUX.2's): block_out_channels (8, 8),
                        8 latent channels, quant convs, 2x2 patches, random batch-norm
                        running statistics (the latents' normalization)
  flux2_like_ae.safetensors
                        the same in the LDM layout without a prefix, `bn.*` kept (as FLUX.2's
                        ae.safetensors)
  outputs.safetensors   inputs and diffusers' outputs (computed in f64, stored in f32):
                        <model>.x<H>x<W> images, .mean / .logvar (the encoder's posterior,
                        logvar clamped), .decoded (the decoder on the reference mean), and for
                        sdxl_like on 48x40 the tiled encode / decode with 16-pixel tiles;
                        for flux2_like also .latents (the posterior's mode patched and
                        normalized as `Flux2KleinPipeline._encode_vae_image` does) and
                        .from_latents (the pipeline's decode of those: denormalized,
                        unpatched, decoded)

The LDM renaming is the inverse of diffusers' own conversion
(`diffusers.loaders.single_file_utils.convert_ldm_vae_checkpoint`): resnets `block.M` with
`nin_shortcut`, `downsample.conv`, `mid.block_1 / attn_1 / block_2` with `norm, q, k, v,
proj_out`, `norm_out`, and the decoder's `up` list in reverse order of `up_blocks`. The script
checks the inverse by converting the LDM dict back with that function.

Deterministic (fixed seeds, one thread). Run: python3 scripts/make_vae_fixtures.py
Made with torch 2.15.0, diffusers 0.42.1.
"""

import os
import shutil

import diffusers
import numpy as np
import torch
from diffusers import AutoencoderKL, AutoencoderKLFlux2
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
from safetensors.numpy import save_file

torch.set_num_threads(1)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "vae")


def randomize(model, seed):
    """Every parameter redrawn (norm scales near 1, biases 0.2 N(0,1), weights N(0, 1/fan_in)),
    rounded to f32 (what the fixture stores), in f64."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if "norm" in name and name.endswith("weight"):
                v = 1.0 + 0.2 * r
            elif name.endswith("bias"):
                v = 0.2 * r
            else:
                v = r / float(np.prod(p.shape[1:])) ** 0.5
            p.copy_(v.float().double())
    return model.double().eval()


def f32(sd):
    return {k: v.detach().float().contiguous().numpy() for k, v in sd.items()}


def ldm_keys(sd, n_blocks):
    """diffusers AutoencoderKL keys -> the original LDM / BFL names."""
    out = {}
    attn = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
    for k, v in sd.items():
        parts = k.split(".")
        side = parts[0]  # encoder / decoder / quant_conv / post_quant_conv
        rest = ".".join(parts[1:])
        if side in ("quant_conv", "post_quant_conv"):
            out[k] = v
            continue
        if rest.startswith("conv_norm_out."):
            rest = "norm_out." + rest[len("conv_norm_out."):]
        elif rest.startswith("down_blocks."):
            _, i, kind, m, *leaf = rest.split(".")
            if kind == "resnets":
                rest = f"down.{i}.block.{m}." + ".".join(leaf)
            else:  # downsamplers.0.conv
                rest = f"down.{i}.downsample." + ".".join(leaf)
        elif rest.startswith("up_blocks."):
            _, i, kind, m, *leaf = rest.split(".")
            j = n_blocks - 1 - int(i)
            if kind == "resnets":
                rest = f"up.{j}.block.{m}." + ".".join(leaf)
            else:  # upsamplers.0.conv
                rest = f"up.{j}.upsample." + ".".join(leaf)
        elif rest.startswith("mid_block.resnets."):
            _, _, m, *leaf = rest.split(".")
            rest = f"mid.block_{int(m) + 1}." + ".".join(leaf)
        elif rest.startswith("mid_block.attentions.0."):
            tail = rest[len("mid_block.attentions.0."):]
            mod, leaf = tail.rsplit(".", 1)
            rest = f"mid.attn_1.{attn[mod]}.{leaf}"
            if mod != "group_norm" and leaf == "weight":
                v = v[:, :, None, None]  # a 1x1 conv in LDM
        rest = rest.replace("conv_shortcut", "nin_shortcut")
        out[f"{side}.{rest}"] = v
    return out


def make(name, seed, channels, latent, quant, scale, shift, images, tiled=None):
    cfg = dict(in_channels=3, out_channels=3, block_out_channels=channels, layers_per_block=1,
               down_block_types=("DownEncoderBlock2D",) * 2,
               up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4,
               latent_channels=latent, sample_size=32, scaling_factor=scale,
               shift_factor=shift, use_quant_conv=quant, use_post_quant_conv=quant)
    vae = randomize(AutoencoderKL(**cfg), seed)
    if not quant:
        with torch.no_grad():
            vae.encoder.conv_out.bias[latent] += 50.0  # logvar channel 0 clamps at 20
    folder = os.path.join(OUT, name)
    os.makedirs(folder)
    vae.save_config(folder)
    sd = vae.state_dict()
    save_file(f32(sd), os.path.join(folder, "diffusion_pytorch_model.safetensors"),
              metadata={"format": "pt"})
    ldm = ldm_keys(sd, 2)
    back = convert_ldm_vae_checkpoint({f"first_stage_model.{k}": v for k, v in ldm.items()},
                                      vae.config)
    assert sorted(back) == sorted(sd), set(back) ^ set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    out = {}
    g = torch.Generator().manual_seed(seed + 100)
    for shape in images:
        x = (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).float().double()
        tag = f"{name}.x{shape[2]}x{shape[3]}"
        with torch.no_grad():
            post = vae.encode(x).latent_dist
            out[f"{tag}"] = x
            out[f"{tag}.mean"] = post.mean
            out[f"{tag}.logvar"] = post.logvar
            out[f"{tag}.decoded"] = vae.decode(post.mean.float().double()).sample
            if tiled and shape[2:] == tiled[0]:
                vae.tile_sample_min_size = tiled[1]
                vae.tile_latent_min_size = tiled[1] // 2
                tp = vae.tiled_encode(x).latent_dist
                out[f"{tag}.tiled_mean"] = tp.mean
                out[f"{tag}.tiled_logvar"] = tp.logvar
                out[f"{tag}.tiled_decoded"] = vae.tiled_decode(post.mean.float().double()).sample
    return ldm, out


def make_flux2(name, seed, images):
    cfg = dict(in_channels=3, out_channels=3, block_out_channels=(8, 8), layers_per_block=1,
               down_block_types=("DownEncoderBlock2D",) * 2,
               up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4,
               latent_channels=8, sample_size=32)
    vae = randomize(AutoencoderKLFlux2(**cfg), seed)
    g = torch.Generator().manual_seed(seed + 50)
    with torch.no_grad():
        n = vae.bn.running_mean.numel()
        vae.bn.running_mean.copy_((0.3 * torch.randn(n, generator=g, dtype=torch.float64))
                                  .float().double())
        vae.bn.running_var.copy_((0.5 + torch.rand(n, generator=g, dtype=torch.float64))
                                 .float().double())
    folder = os.path.join(OUT, name)
    os.makedirs(folder)
    vae.save_config(folder)
    sd = vae.state_dict()
    save_file(f32(sd), os.path.join(folder, "diffusion_pytorch_model.safetensors"),
              metadata={"format": "pt"})
    ldm = ldm_keys(sd, 2)
    back = convert_ldm_vae_checkpoint({f"first_stage_model.{k}": v for k, v in ldm.items()},
                                      vae.config)
    kept = [k for k in sd if not k.startswith("bn.")]
    assert sorted(back) == sorted(kept), set(back) ^ set(kept)
    for k in kept:
        assert torch.equal(back[k], sd[k]), k
    eps = vae.config.batch_norm_eps
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + eps)
    out = {}
    g = torch.Generator().manual_seed(seed + 100)
    for shape in images:
        x = (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).float().double()
        tag = f"{name}.x{shape[2]}x{shape[3]}"
        with torch.no_grad():
            post = vae.encode(x).latent_dist
            out[tag] = x
            out[f"{tag}.mean"] = post.mean
            out[f"{tag}.logvar"] = post.logvar
            out[f"{tag}.decoded"] = vae.decode(post.mean.float().double()).sample
            # Flux2KleinPipeline._encode_vae_image (argmax: the posterior's mode).
            lat = (Flux2KleinPipeline._patchify_latents(post.mode()) - mean) / std
            out[f"{tag}.latents"] = lat
            # Flux2KleinPipeline.__call__'s decode of the final latents.
            z = Flux2KleinPipeline._unpatchify_latents(lat.float().double() * std + mean)
            out[f"{tag}.from_latents"] = vae.decode(z).sample
    return ldm, out


if __name__ == "__main__":
    print("diffusers", diffusers.__version__, "torch", torch.__version__)
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    arrays = {}
    # SDXL's vae/config.json: scaling_factor 0.13025, no shift_factor.
    ldm, io = make("sdxl_like", 1, (8, 16), 4, True, 0.13025, None,
                   [(2, 3, 24, 24), (1, 3, 48, 40)], tiled=((48, 40), 16))
    save_file(f32({f"first_stage_model.{k}": v for k, v in ldm.items()}),
              os.path.join(OUT, "sdxl_like_ldm.safetensors"))
    arrays.update(io)
    # FLUX.1-dev's vae/config.json: scaling_factor 0.3611, shift_factor 0.1159.
    ldm, io = make("flux_like", 2, (8, 8), 16, False, 0.3611, 0.1159, [(1, 3, 48, 40)])
    save_file(f32(ldm), os.path.join(OUT, "flux_like_ae.safetensors"))
    arrays.update(io)
    # FLUX.2's AutoencoderKLFlux2: batch-norm statistics over 2x2-patched latents.
    ldm, io = make_flux2("flux2_like", 3, [(2, 3, 32, 24)])
    save_file(f32(ldm), os.path.join(OUT, "flux2_like_ae.safetensors"))
    arrays.update(io)
    save_file(f32(arrays), os.path.join(OUT, "outputs.safetensors"))
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(OUT) for f in fs)
    print(f"wrote {OUT}: {total / 1024:.0f} KiB")
