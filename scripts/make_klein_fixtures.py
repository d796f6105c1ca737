#!/usr/bin/env python3
"""A tiny random FLUX.2 [klein] pipeline and what diffusers' Flux2KleinPipeline computes with it, for tests/klein.rs.

Usage:  python scripts/make_klein_fixtures.py [OUT_DIR]        (default OUT_DIR: tests/fixtures/klein)

Made with torch 2.15.0, diffusers 0.42.1, transformers 5.24.0, safetensors, numpy; no network. Runs on the CPU in one
thread (torch.set_num_threads(1)); every random value comes from fixed seeds, so two runs write the same tensors.

Files written:

  pipeline/            a diffusers `Flux2KleinPipeline` folder (`save_pretrained`, float32, is_distilled false: the
                       base model, which takes classifier-free guidance):
    transformer/       Flux2Transformer2DModel: 2 double + 2 single blocks, 2 heads of 16 (hidden 32), RoPE axes
                       (4, 4, 4, 4), theta 2000, MLP ratio 3, no guidance embedding (as klein), in_channels 32 =
                       4 x the autoencoder's 8 latent channels, joint_attention_dim 48 = 3 x Qwen3's width 16;
                       parameters from make_model_fixtures.init_params.
    text_encoder/      Qwen3ForCausalLM: 28 layers (the pipeline reads hidden_states 9, 18 and 27, its
                       `text_encoder_out_layers` default), width 16, 2 heads of 8, 1 key-value head, MLP 32,
                       the vocabulary of tests/fixtures/qwen3/tokenizer.
    tokenizer/         tests/fixtures/qwen3/tokenizer (a tiny byte-level BPE with Qwen3's special tokens), as
                       transformers saves it.
    vae/               AutoencoderKLFlux2: block_out_channels (8, 8) (downscale 2), 8 latent channels, 4 groups,
                       random BatchNorm running statistics (mean 0.3 N(0, 1), var 0.5 + U(0, 1)).
    scheduler/         FlowMatchEulerDiscreteScheduler with dynamic shifting and the exponential time shift (the
                       configuration FLUX.2's pipelines ship; the pipeline passes its own mu, compute_empirical_mu).
    model_index.json
  outputs.safetensors  (all float32)
    captions.<i>       (none: captions are in cases.json)
    encode.context     Flux2KleinPipeline.encode_prompt(CAPTIONS) in float64 (the pipeline's modules in float64),
                       (4, 512, 48); encode.text_ids (4, 512, 4).
    <case>.noise       (2, 32, 8, 6): the `latents=` given to __call__ (patched, normalized: the model's own latents)
                       for a 32 x 24 (height x width) picture.
    <case>.context     the prompt_embeds given (encode.context of captions 0 and 1, rounded to float32);
    <case>.neg_context the negative_prompt_embeds given (encode_prompt("") twice), cfg only.
    <case>.timesteps, <case>.sigmas   the scheduler's after the run.
    <case>.latents.<i> the latents after step i (from callback_on_step_end, unpacked to (2, 32, 8, 6)).
    <case>.latent      __call__(output_type="latent"): the final latents un-normalized by the BatchNorm statistics
                       and unpatched, (2, 8, 16, 12).
    <case>.image       __call__(output_type="pt"): the decoded picture in [0, 1], (2, 3, 32, 24).
    <case>.decoded     vae.decode(<case>.latent) before the image processor, in [-1, 1] (not clamped).
  cases.json           the captions, and per case: steps, guidance_scale, whether it runs classifier-free guidance.

Cases: `cfg` (guidance_scale 4.0, 4 steps: the base model's classifier-free guidance against the empty prompt) and
`plain` (guidance_scale 1.0, 3 steps: no guidance). The trajectories run in float32 (FlowMatchEulerDiscreteScheduler
steps in float32 whatever the model's dtype).
"""

import json
import os
import shutil
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_model_fixtures as mmf  # noqa: E402  (init_params; its float64 timestep-embedding patch)

import diffusers  # noqa: E402
import transformers  # noqa: E402
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline  # noqa: E402
from diffusers import Flux2Transformer2DModel  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

torch.set_num_threads(1)
diffusers.utils.logging.set_verbosity_error()
transformers.utils.logging.set_verbosity_error()
ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "fixtures", "klein")
TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "qwen3", "tokenizer")
SEED = 4321

CAPTIONS = [
    "a large red circle on a white background",
    "a small blue square on a black background",
    "",
    "Ünïcödé, punctuation!? and    spaces",
]

QWEN_WIDTH = 16
LATENT_CHANNELS = 8
TRANSFORMER = dict(
    patch_size=1,
    in_channels=4 * LATENT_CHANNELS,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=3 * QWEN_WIDTH,
    timestep_guidance_channels=32,
    mlp_ratio=3.0,
    axes_dims_rope=(4, 4, 4, 4),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=False,
)
VAE = dict(
    in_channels=3,
    out_channels=3,
    block_out_channels=(8, 8),
    layers_per_block=1,
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    norm_num_groups=4,
    latent_channels=LATENT_CHANNELS,
    sample_size=32,
)
# FlowMatchEulerDiscreteScheduler as FLUX.2's pipelines configure it: dynamic shifting (mu given by the pipeline) with
# the exponential time shift; the remaining fields are the class's defaults.
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")
HEIGHT, WIDTH = 32, 24
CASES = {"cfg": dict(guidance_scale=4.0, steps=4), "plain": dict(guidance_scale=1.0, steps=3)}


def f32(t):
    return t.detach().to(torch.float32).contiguous().clone()


def make_transformer():
    torch.manual_seed(SEED)
    tr = Flux2Transformer2DModel(**TRANSFORMER)
    mmf.init_params(tr, np.random.default_rng(SEED))
    return tr.eval()


def make_text_encoder(tok):
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=QWEN_WIDTH, intermediate_size=32, num_hidden_layers=28,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6,
                      max_position_embeddings=40960,
                      rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                      tie_word_embeddings=True, attention_bias=False, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, attn_implementation="eager")
    torch.manual_seed(SEED + 1)
    model = Qwen3ForCausalLM(cfg)
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if "norm" in name:
                v = 1.0 + 0.2 * r
            elif "embed" in name:
                v = r
            else:
                v = r / p.shape[-1] ** 0.5
            p.copy_(v.float())
    return model.float().eval()


def make_vae():
    torch.manual_seed(SEED + 2)
    vae = AutoencoderKLFlux2(**VAE)
    g = torch.Generator().manual_seed(SEED + 2)
    with torch.no_grad():
        for name, p in sorted(vae.named_parameters()):
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if p.ndim == 1 and "norm" in name and name.endswith("weight"):
                v = 1.0 + 0.1 * r
            elif p.ndim == 1:
                v = 0.2 * r
            else:
                v = r / (p.numel() // p.shape[0]) ** 0.5
            p.copy_(v.float())
        n = vae.bn.running_mean.numel()
        vae.bn.running_mean.copy_((0.3 * torch.randn(n, generator=g, dtype=torch.float64)).float())
        vae.bn.running_var.copy_((0.5 + torch.rand(n, generator=g, dtype=torch.float64)).float())
    return vae.eval()


def unpack(x, h, w):
    # Flux2KleinPipeline._pack_latents' inverse: (B, h w, C) -> (B, C, h, w).
    b, _, c = x.shape
    return x.permute(0, 2, 1).reshape(b, c, h, w)


def main():
    print("diffusers", diffusers.__version__, "transformers", transformers.__version__, "torch", torch.__version__)
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=make_vae(),
        text_encoder=make_text_encoder(tok),
        tokenizer=tok,
        transformer=make_transformer(),
        is_distilled=False,
    )
    folder = os.path.join(OUT, "pipeline")
    pipe.save_pretrained(folder, safe_serialization=True)
    # The reference runs the saved files as diffusers loads them.
    pipe = Flux2KleinPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.vae_scale_factor == 2

    out = {}
    # encode_prompt in float64.
    te64 = Qwen3ForCausalLM.from_pretrained(os.path.join(folder, "text_encoder"), dtype=torch.float64,
                                            attn_implementation="eager").eval()
    with torch.no_grad():
        ctx, ids = Flux2KleinPipeline(scheduler=None, vae=None, text_encoder=te64, tokenizer=pipe.tokenizer,
                                      transformer=None).encode_prompt(prompt=CAPTIONS, device="cpu")
    assert ctx.shape == (len(CAPTIONS), 512, 3 * QWEN_WIDTH), ctx.shape
    out["encode.context"], out["encode.text_ids"] = ctx, ids.float()

    b, c = 2, TRANSFORMER["in_channels"]
    h, w = HEIGHT // 4, WIDTH // 4
    g = torch.Generator().manual_seed(SEED + 3)
    noise = torch.randn((b, c, h, w), generator=g, dtype=torch.float32)
    cond = f32(ctx[:2])
    neg = f32(ctx[2:3]).repeat(2, 1, 1)
    for name, case in CASES.items():
        cfg = case["guidance_scale"] > 1
        steps = []

        def cb(_pipe, i, t, kwargs):
            steps.append(unpack(kwargs["latents"], h, w).clone())
            return kwargs

        kw = dict(prompt_embeds=cond, negative_prompt_embeds=neg if cfg else None,
                  guidance_scale=case["guidance_scale"], num_inference_steps=case["steps"], height=HEIGHT,
                  width=WIDTH, latents=noise.clone())
        with torch.no_grad():
            lat = pipe(output_type="latent", callback_on_step_end=cb, callback_on_step_end_tensor_inputs=["latents"],
                       **kw).images
            timesteps, sigmas = pipe.scheduler.timesteps.clone(), pipe.scheduler.sigmas.clone()
            img = pipe(output_type="pt", **kw).images
            decoded = pipe.vae.decode(lat, return_dict=False)[0]
        assert len(steps) == case["steps"] and lat.shape == (b, LATENT_CHANNELS, 2 * h, 2 * w), lat.shape
        assert img.shape == (b, 3, HEIGHT, WIDTH), img.shape
        out[f"{name}.noise"], out[f"{name}.context"] = noise, cond
        if cfg:
            out[f"{name}.neg_context"] = neg
        out[f"{name}.timesteps"], out[f"{name}.sigmas"] = timesteps, sigmas
        for i, s in enumerate(steps):
            out[f"{name}.latents.{i}"] = s
        out[f"{name}.latent"], out[f"{name}.image"], out[f"{name}.decoded"] = lat, img, decoded
    save_file({k: f32(v) for k, v in out.items()}, os.path.join(OUT, "outputs.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(OUT, "cases.json"), "w") as f:
        json.dump({"captions": CAPTIONS, "height": HEIGHT, "width": WIDTH,
                   "cases": {n: dict(c, cfg=c["guidance_scale"] > 1) for n, c in CASES.items()},
                   "versions": {"diffusers": diffusers.__version__, "transformers": transformers.__version__,
                                "torch": torch.__version__}}, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
