#!/usr/bin/env python3
"""Parity fixtures for the FLUX.2 transformer (diffusers' Flux2Transformer2DModel, as FLUX.2 [klein] uses it).

Usage:  python scripts/make_flux2_fixtures.py [OUT_DIR]        (default OUT_DIR: tests/fixtures/flux2)

Made with torch 2.15.0, diffusers 0.42.1, transformers 5.24.0 (for the pipeline's static methods), peft 0.21.2,
safetensors, numpy; no network. Runs on the CPU in one thread (torch.set_num_threads(1)) whatever hardware is present.

Determinism and values follow scripts/make_model_fixtures.py, whose functions this script imports (its parameter
initialisation `init_params`, its float64 timestep-embedding patch, its safetensors writer): `torch.manual_seed(SEED)`
before construction, then every parameter overwritten from `numpy.random.default_rng(SEED)` in `named_parameters()`
order and rounded to float32; inputs from `default_rng(SEED + 1000)`; the forward and backward run in float64
(`model.double()`) from those float32 values, and every result is stored as float32. diffusers keeps RoPE in float32
(`get_1d_rotary_pos_embed(...).float()`, `apply_rotary_emb` computes in `x.float()`), about 1e-7 relative.

Models (MODELS below): `flux2`: 2 double + 2 single blocks, 2 heads of 16 (hidden 32), RoPE axes (4, 4, 4, 4) with
theta 2000, MLP ratio 3 (Klein's), text width 24, 32 timestep channels, no guidance embedding (as klein 4B / 9B);
`flux2_guided`: 1 + 1 blocks of one head of 16 (hidden 16) with the guidance embedding (FLUX.2 [dev]'s
`guidance_embeds`).

Files written, per model NAME:

  NAME/transformer/    diffusers layout (`save_pretrained`, float32): config.json + diffusion_pytorch_model.safetensors.
  NAME/single_file.safetensors
                       the same weights in BFL's single-file layout (keys of BFL's `flux2` `Flux2` module, no prefix),
                       made by `flux2_to_original` below, the inverse of diffusers'
                       `convert_flux2_transformer_checkpoint_to_diffusers`; checked by running that converter on it
                       (exact keys and values) and by `Flux2Transformer2DModel.from_single_file` offline.
  NAME/io.safetensors  raw_latents (2, C/4, 8, 6) (what the autoencoder would give, before patching), latents
                       (2, C, 4, 3) = Flux2KleinPipeline._patchify_latents(raw_latents), img (2, 12, C) =
                       _pack_latents(latents), img_ids (2, 12, 4) = _prepare_latent_ids(latents) (t, h, w, l) = (0, row,
                       col, 0), txt (2, 5, 24) randn (the text encoder's stacked hidden states), txt_ids (2, 5, 4) =
                       _prepare_text_ids(txt) = (0, 0, 0, token), timesteps (2,) = [0.3, 0.85] (sigmas: the pipeline
                       passes timestep / 1000 and the model multiplies by 1000), guidance (2,) = [3.5, 1.0]
                       (flux2_guided only); output = model(hidden_states=img, encoder_hidden_states=txt,
                       timestep=timesteps, img_ids=img_ids, txt_ids=txt_ids, guidance=...).sample (2, 12, C);
                       loss_weight (N(0, 1), output's shape), loss = sum(output * loss_weight), grad.img, grad.txt.
  NAME/grads.safetensors
                       d loss / d parameter for every parameter, by BFL key (fused qkv gradients concatenated, the final
                       adaLN's halves swapped, as the weights).
  flux2/lora.safetensors
                       a rank-2 LoRA (alpha 2) on every Linear of the blocks, in the diffusers / PEFT layout
                       (`transformer.<module>.lora_A.weight`, `lora_B.weight`, from peft's `get_peft_model_state_dict`),
                       random A and B (B not zero); the q, k and v parts of each double block's stream share one A
                       (one LoRA on BFL's fused qkv).
  flux2/lora_io.safetensors
                       with that LoRA injected by peft (`inject_adapter_in_model`): `output`, grad.img, grad.txt of the
                       same loss, and the adapters' gradients by BFL layer path: `<layer>.lora_down.weight` (A; the sum
                       of the q, k and v parts' gradients on a fused qkv) and `<layer>.lora_up.weight` (B; the parts'
                       gradients concatenated).
  schedule.safetensors the sampler of Flux2KleinPipeline: `mu.<tokens>.<steps>` = compute_empirical_mu(tokens, steps) and
                       `sigmas.<tokens>.<steps>` = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)'s sigmas
                       after set_timesteps(steps, sigmas=linspace(1, 1/steps, steps), mu=mu), for a few sizes.
  manifest.json        configs, shapes, versions, files.
"""

import argparse
import json
import os
import shutil
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_model_fixtures as mmf  # noqa: E402  (the float64 timestep-embedding patch applies on import)

import diffusers  # noqa: E402
import diffusers.loaders.single_file_utils as sfu  # noqa: E402
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel  # noqa: E402
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline, compute_empirical_mu  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

SEED = mmf.SEED

BASE = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=24,
    timestep_guidance_channels=32,
    mlp_ratio=3.0,
    axes_dims_rope=(4, 4, 4, 4),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=False,
)
MODELS = {
    "flux2": BASE,
    "flux2_guided": dict(BASE, num_layers=1, num_single_layers=1, num_attention_heads=1, guidance_embeds=True),
}

# ----------------------------------------------------------------------------------------------
# diffusers -> BFL keys: the inverse of sfu.convert_flux2_transformer_checkpoint_to_diffusers.


def flux2_to_original(sd, cfg):
    m = mmf._Mapper(sd)
    m.mv("img_in", "x_embedder")
    m.mv("txt_in", "context_embedder")
    for dst, src in (("time_in", "timestep_embedder"), ("guidance_in", "guidance_embedder")):
        m.mv(f"{dst}.in_layer", f"time_guidance_embed.{src}.linear_1")
        m.mv(f"{dst}.out_layer", f"time_guidance_embed.{src}.linear_2")
    for name in ("double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation"):
        m.mv(f"{name}.lin", f"{name}.linear")
    for i in range(cfg["num_layers"]):
        d, s = f"double_blocks.{i}", f"transformer_blocks.{i}"
        m.cat(f"{d}.img_attn.qkv", [f"{s}.attn.to_q", f"{s}.attn.to_k", f"{s}.attn.to_v"])
        m.cat(f"{d}.txt_attn.qkv", [f"{s}.attn.add_q_proj", f"{s}.attn.add_k_proj", f"{s}.attn.add_v_proj"])
        m.mv_key(f"{d}.img_attn.norm.query_norm.scale", f"{s}.attn.norm_q.weight")
        m.mv_key(f"{d}.img_attn.norm.key_norm.scale", f"{s}.attn.norm_k.weight")
        m.mv_key(f"{d}.txt_attn.norm.query_norm.scale", f"{s}.attn.norm_added_q.weight")
        m.mv_key(f"{d}.txt_attn.norm.key_norm.scale", f"{s}.attn.norm_added_k.weight")
        m.mv(f"{d}.img_attn.proj", f"{s}.attn.to_out.0")
        m.mv(f"{d}.txt_attn.proj", f"{s}.attn.to_add_out")
        m.mv(f"{d}.img_mlp.0", f"{s}.ff.linear_in")
        m.mv(f"{d}.img_mlp.2", f"{s}.ff.linear_out")
        m.mv(f"{d}.txt_mlp.0", f"{s}.ff_context.linear_in")
        m.mv(f"{d}.txt_mlp.2", f"{s}.ff_context.linear_out")
    for i in range(cfg["num_single_layers"]):
        d, s = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        m.mv(f"{d}.linear1", f"{s}.attn.to_qkv_mlp_proj")
        m.mv(f"{d}.linear2", f"{s}.attn.to_out")
        m.mv_key(f"{d}.norm.query_norm.scale", f"{s}.attn.norm_q.weight")
        m.mv_key(f"{d}.norm.key_norm.scale", f"{s}.attn.norm_k.weight")
    m.mv("final_layer.linear", "proj_out")
    m.mv("final_layer.adaLN_modulation.1", "norm_out.linear", fn=mmf._swap_halves)
    return m.done()


# The BFL layer of each diffusers Linear in the blocks, and the row offset of its part in a fused one.
def bfl_layer(module):
    p = module.split(".")
    if p[0] == "transformer_blocks":
        i, rest = p[1], ".".join(p[2:])
        parts = {
            "attn.to_q": ("img_attn.qkv", 0),
            "attn.to_k": ("img_attn.qkv", 1),
            "attn.to_v": ("img_attn.qkv", 2),
            "attn.add_q_proj": ("txt_attn.qkv", 0),
            "attn.add_k_proj": ("txt_attn.qkv", 1),
            "attn.add_v_proj": ("txt_attn.qkv", 2),
            "attn.to_out.0": ("img_attn.proj", None),
            "attn.to_add_out": ("txt_attn.proj", None),
            "ff.linear_in": ("img_mlp.0", None),
            "ff.linear_out": ("img_mlp.2", None),
            "ff_context.linear_in": ("txt_mlp.0", None),
            "ff_context.linear_out": ("txt_mlp.2", None),
        }
        layer, part = parts[rest]
        return f"double_blocks.{i}.{layer}", part
    assert p[0] == "single_transformer_blocks", module
    i, rest = p[1], ".".join(p[2:])
    layer = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}[rest]
    return f"single_blocks.{i}.{layer}", None


# ----------------------------------------------------------------------------------------------


def verify_single_file(name, model_dir, single_path, ref):
    checks = []
    conv = sfu.convert_flux2_transformer_checkpoint_to_diffusers(dict(load_file(single_path)))
    missing, extra = set(ref) - set(conv), set(conv) - set(ref)
    if missing or extra:
        raise AssertionError(f"{name}: converter key mismatch; missing {sorted(missing)} extra {sorted(extra)}")
    for k, v in ref.items():
        if not torch.equal(conv[k].to(v.dtype), v):
            raise AssertionError(f"{name}: converter value mismatch at {k}")
    checks.append("sfu.convert_flux2_transformer_checkpoint_to_diffusers")
    loaded = Flux2Transformer2DModel.from_single_file(
        single_path, config=model_dir, subfolder="transformer", local_files_only=True, low_cpu_mem_usage=False
    )
    lsd = loaded.state_dict()
    if set(lsd) != set(ref) or any(not torch.equal(lsd[k], v) for k, v in ref.items()):
        raise AssertionError(f"{name}: from_single_file differs")
    checks.append("Flux2Transformer2DModel.from_single_file(local_files_only=True)")
    return checks


def make_inputs(cfg, rng):
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    raw = mmf._normal(rng, (2, cfg["in_channels"] // 4, 8, 6))
    latents = Flux2KleinPipeline._patchify_latents(raw)
    img = Flux2KleinPipeline._pack_latents(latents).contiguous()
    img_ids = Flux2KleinPipeline._prepare_latent_ids(latents).to(torch.float32).contiguous()
    txt = mmf._normal(rng, (2, 5, cfg["joint_attention_dim"]))
    txt_ids = Flux2KleinPipeline._prepare_text_ids(txt).to(torch.float32).contiguous()
    inputs = dict(
        raw_latents=raw,
        latents=latents.contiguous(),
        img=img,
        img_ids=img_ids,
        txt=txt,
        txt_ids=txt_ids,
        timesteps=f32([0.3, 0.85]),
    )
    if cfg["guidance_embeds"]:
        inputs["guidance"] = f32([3.5, 1.0])
    return inputs, ["img", "txt"]


def call(model, t):
    return model(
        hidden_states=t["img"],
        encoder_hidden_states=t["txt"],
        timestep=t["timesteps"],
        img_ids=t["img_ids"],
        txt_ids=t["txt_ids"],
        guidance=t.get("guidance"),
    ).sample


def forward_backward(model, inputs, grad_names, lw=None):
    t = {k: v.double().detach().requires_grad_(k in grad_names) for k, v in inputs.items()}
    out = call(model, t)
    if lw is None:
        lw = mmf._normal(np.random.default_rng(SEED + 2000), out.shape)
    loss = (out * lw.double()).sum()
    loss.backward()
    return out, lw, loss, {k: t[k].grad for k in grad_names}


def lora_fixture(model, cfg, inputs, grad_names, lw, d):
    """A peft LoRA on every Linear of the blocks; see the module docs (flux2/lora*.safetensors)."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    targets = [
        n
        for n, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear) and n.split(".")[0] in ("transformer_blocks", "single_transformer_blocks")
    ]
    model = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, lora_dropout=0.0, target_modules=targets), model)
    model = model.double()
    rng = np.random.default_rng(SEED + 3000)
    shared = {}
    with torch.no_grad():
        for n in targets:
            mod = model.get_submodule(n)
            a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
            layer, part = bfl_layer(n)
            if part is None or part == 0:
                va = mmf._normal(rng, a.shape) * np.float32(1.0 / np.sqrt(a.shape[1]))
                shared[layer] = va
            a.copy_(shared[layer].to(a.dtype))
            b.copy_((mmf._normal(rng, b.shape) * np.float32(0.5)).to(b.dtype))
    for p in model.parameters():
        p.grad = None
    out, _, loss, igrads = forward_backward(model, inputs, grad_names, lw)
    peft_sd = get_peft_model_state_dict(model)
    mmf._save({f"transformer.{k}": v for k, v in peft_sd.items()}, os.path.join(d, "lora.safetensors"))
    io = {"output": out.detach(), "loss": loss.detach().reshape(1)}
    for k, g in igrads.items():
        io[f"grad.{k}"] = g
    down, up = {}, {}
    for n in targets:
        mod = model.get_submodule(n)
        ga, gb = mod.lora_A["default"].weight.grad, mod.lora_B["default"].weight.grad
        layer, part = bfl_layer(n)
        down[layer] = ga if layer not in down else down[layer] + ga
        up.setdefault(layer, []).append((part or 0, gb))
    for layer in down:
        io[f"{layer}.lora_down.weight"] = down[layer]
        io[f"{layer}.lora_up.weight"] = torch.cat([g for _, g in sorted(up[layer], key=lambda x: x[0])], dim=0)
    mmf._save(io, os.path.join(d, "lora_io.safetensors"))
    print(f"  flux2 lora: {len(targets)} peft modules on {len(down)} BFL layers, loss {loss.item():.6f}")
    return {"targets": len(targets), "layers": len(down), "rank": 2, "alpha": 2}


def build(name, cfg, out_dir):
    d = os.path.join(out_dir, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    torch.manual_seed(SEED)
    model = Flux2Transformer2DModel(**cfg)
    mmf.init_params(model, np.random.default_rng(SEED))
    model.eval()
    model.save_pretrained(os.path.join(d, "transformer"), safe_serialization=True)
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    single = os.path.join(d, "single_file.safetensors")
    mmf._save(flux2_to_original(ref, cfg), single)
    checks = verify_single_file(name, d, single, ref)
    print(f"  {name}: single file verified via " + "; ".join(checks))

    inputs, grad_names = make_inputs(cfg, np.random.default_rng(SEED + 1000))
    model = model.double()
    model.zero_grad(set_to_none=True)
    out, lw, loss, igrads = forward_backward(model, inputs, grad_names)
    io = dict(inputs)
    io.update(output=out.detach(), loss_weight=lw, loss=loss.detach().reshape(1))
    for k, g in igrads.items():
        io[f"grad.{k}"] = g
    mmf._save(io, os.path.join(d, "io.safetensors"))
    pgrads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in model.named_parameters()}
    zero = [k for k, g in pgrads.items() if not bool(g.abs().max() > 0)]
    if zero:
        raise AssertionError(f"{name}: parameters without a gradient: {zero}")
    mmf._save(flux2_to_original(pgrads, cfg), os.path.join(d, "grads.safetensors"))
    entry = {
        "class": "Flux2Transformer2DModel",
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
        "single_file_verified_with": checks,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "inputs": {k: list(v.shape) for k, v in inputs.items()},
        "grad_inputs": grad_names,
        "output_shape": list(out.shape),
        "loss": "sum(output * loss_weight)",
    }
    if name == "flux2":
        model.zero_grad(set_to_none=True)
        entry["lora"] = lora_fixture(model, cfg, inputs, grad_names, lw, d)
    print(f"  {name}: {entry['num_parameters']} parameters, output {tuple(out.shape)}, loss {loss.item():.6f}")
    return entry


SCHEDULE_CASES = [(12, 4), (12, 50), (1024, 4), (4096, 50), (5000, 28)]


def schedule(out_dir):
    out = {}
    for tokens, steps in SCHEDULE_CASES:
        mu = compute_empirical_mu(image_seq_len=tokens, num_steps=steps)
        s = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
        s.set_timesteps(steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        out[f"mu.{tokens}.{steps}"] = torch.tensor([mu], dtype=torch.float64)
        out[f"sigmas.{tokens}.{steps}"] = s.sigmas.to(torch.float32)
    mmf._save(out, os.path.join(out_dir, "schedule.safetensors"))
    return [list(c) for c in SCHEDULE_CASES]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", nargs="?", default="tests/fixtures/flux2")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"torch {torch.__version__}, diffusers {diffusers.__version__}, numpy {np.__version__}")
    manifest = {name: build(name, cfg, args.out_dir) for name, cfg in MODELS.items()}
    cases = schedule(args.out_dir)
    import peft
    import transformers

    doc = {
        "generator": "scripts/make_flux2_fixtures.py",
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "seed": SEED,
        "dtype_compute": "float64 (CPU)",
        "dtype_stored": "float32",
        "models": manifest,
        "schedule_cases": cases,
    }
    files = []
    total = 0
    for root, _, fs in os.walk(args.out_dir):
        for f in sorted(fs):
            p = os.path.join(root, f)
            if os.path.relpath(p, args.out_dir) != "manifest.json":
                files.append(os.path.relpath(p, args.out_dir))
                total += os.path.getsize(p)
    doc["files"] = sorted(files)
    with open(os.path.join(args.out_dir, "manifest.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"total fixture size {total} B ({total / 2**20:.2f} MiB) in {args.out_dir}")


if __name__ == "__main__":
    sys.exit(main())
