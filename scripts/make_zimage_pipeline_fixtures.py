#!/usr/bin/env python3
"""Fixtures for tests/zimage_pipeline.rs: a tiny random diffusers `ZImagePipeline` folder and
what diffusers computes with it.

  tests/fixtures/zimage_pipeline/
    pipeline/            `ZImagePipeline.save_pretrained`: model_index.json;
                         transformer/ (ZImageTransformer2DModel: dim 32, 2 heads, 16 latent
                         channels, cap_feat_dim 32 = the text encoder's hidden size);
                         text_encoder/ (the tiny Qwen3ForCausalLM of tests/fixtures/qwen3:
                         4 layers, hidden 32); tokenizer/ (its tiny byte-level BPE);
                         vae/ (AutoencoderKL: 4 levels, so 8x down, 16 latent channels, no
                         quant convs, scaling_factor 0.3611 and shift_factor 0.1159 as
                         FLUX.1's ae); scheduler/ (FlowMatchEulerDiscreteScheduler, shift 3.0,
                         use_dynamic_shifting false: Z-Image-Turbo's scheduler_config.json).
    outputs.safetensors  `encode_prompt.<i>`: `ZImagePipeline.encode_prompt(CAPTIONS[i],
                         do_classifier_free_guidance=False)[0][0]`, (L_i, 32);
                         for each case of CASES: `<case>.latents` (1, 16, H/8, W/8) the
                         starting latents, `<case>.step.<k>` the latents after step k
                         (`callback_on_step_end`), `<case>.final` (`output_type="latent"`),
                         `<case>.image` (1, 3, H, W) in [0, 1] (`output_type="pt"`).
    cases.json           the captions, and per case its prompt, negative prompt, guidance
                         scale (diffusers' form: pos + g (pos - neg), CFG when g > 0),
                         steps, height, width, the scheduler's sigmas, and
                         `ZImagePipeline.__call__`'s cfg_normalization (as a number: its
                         True is 1.0, as the pipeline's float() reads it) and
                         cfg_truncation (its defaults, False and 1.0, where a case leaves
                         them out).

The cases "cfg_norm", "cfg_trunc" and "cfg_both" are "cfg" (the same prompts, scale,
steps, size and starting latents) with the pipeline's cfg_normalization and / or
cfg_truncation on (pipelines/z_image/pipeline_z_image.py at diffusers 0.42.1): the script
prints how far each ends from "cfg", so a case that changes nothing shows.

Everything in float32 on the CPU with torch's deterministic defaults: the pipeline as
released runs so (the scheduler steps in float32 whatever the model's dtype).
Versions: torch 2.15, transformers 5.24.0, diffusers 0.42.1.
"""

import json
import os
import shutil

import numpy as np
import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from safetensors.torch import save_file
from transformers import AutoTokenizer, Qwen3ForCausalLM

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
OUT = os.path.join(ROOT, "zimage_pipeline")
QWEN3 = os.path.join(ROOT, "qwen3")

# Widths: Qwen3's hidden size (32, tests/fixtures/qwen3/text_encoder/config.json) is the
# transformer's cap_feat_dim. axes_lens[0] covers 512 caption slots plus the image frame.
TRANSFORMER = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=16,
    dim=32,
    n_layers=2,
    n_refiner_layers=1,
    n_heads=2,
    n_kv_heads=2,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=32,
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=[4, 6, 6],
    axes_lens=[1024, 32, 32],
)
VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[8, 8, 8, 8],
    layers_per_block=1,
    latent_channels=16,
    norm_num_groups=4,
    sample_size=64,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
# Z-Image-Turbo's scheduler/scheduler_config.json.
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)

CAPTIONS = [
    "a photo of a cat",
    "",
    "a red fox in the snow at dawn, soft light, film grain, shallow depth of field, 35mm",
]
CASES = {
    # Z-Image-Turbo's way: no classifier-free guidance.
    "turbo": dict(prompt=CAPTIONS[0], negative="", guidance=0.0, steps=3, height=64, width=48),
    # The base model's way: CFG with a negative prompt.
    "cfg": dict(prompt=CAPTIONS[2], negative="blurry", guidance=2.5, steps=4, height=48, width=64),
}
# Z-Image's two guidance options on the "cfg" case. Its 4 steps have normalized times
# (1000 - t) / 1000 of 0, 0.1, 0.25 and 0.5 (sigmas 1, 0.9, 0.75, 0.5 after shift 3), so a
# truncation of 0.2 leaves the last two steps unguided and 0.3 the last one.
CASES["cfg_norm"] = dict(CASES["cfg"], cfg_normalization=True)
CASES["cfg_trunc"] = dict(CASES["cfg"], cfg_truncation=0.2)
CASES["cfg_both"] = dict(CASES["cfg"], cfg_normalization=1.2, cfg_truncation=0.3)


def randomize(module, seed, scale=0.7):
    """Every parameter drawn from a seeded normal: weights at scale / sqrt(fan_in), norm
    weights near 1, everything else (biases, pad tokens) small: nothing left at zero, so the
    zero-initialized output layers of a fresh model do not hide the network."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            z = torch.from_numpy(rng.standard_normal(size=tuple(p.shape)).astype(np.float32))
            if "norm" in name.lower() and name.endswith("weight"):
                v = 1.0 + 0.1 * z
            elif p.ndim >= 2 and not name.endswith("pad_token"):
                v = z * np.float32(scale / np.sqrt(p.numel() // p.shape[0]))
            else:
                v = 0.1 * z
            p.copy_(v)
    return module


def main():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    if os.path.exists(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)

    transformer = randomize(ZImageTransformer2DModel(**TRANSFORMER), 1).eval()
    vae = randomize(AutoencoderKL(**VAE), 2, scale=1.0).eval()
    text_encoder = Qwen3ForCausalLM.from_pretrained(
        os.path.join(QWEN3, "text_encoder"), torch_dtype=torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(QWEN3, "tokenizer"))
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    pipe = ZImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        transformer=transformer,
    )
    folder = os.path.join(OUT, "pipeline")
    pipe.save_pretrained(folder, safe_serialization=True)
    # Loaded back, so the references come from the files FLAME reads.
    pipe = ZImagePipeline.from_pretrained(folder, torch_dtype=torch.float32)

    out = {}
    lens = []
    with torch.no_grad():
        for i, c in enumerate(CAPTIONS):
            emb, _ = pipe.encode_prompt(c, device="cpu", do_classifier_free_guidance=False)
            out[f"encode_prompt.{i}"] = emb[0]
            lens.append(int(emb[0].shape[0]))

    cases = {}
    for name, c in CASES.items():
        shape = (1, 16, c["height"] // 8, c["width"] // 8)
        g = torch.Generator().manual_seed(7)
        latents = torch.randn(shape, generator=g, dtype=torch.float32)
        out[f"{name}.latents"] = latents
        steps = {}

        def on_step(p, i, t, kw):
            steps[i] = kw["latents"].clone()
            return {}

        common = dict(
            prompt=c["prompt"], negative_prompt=c["negative"], guidance_scale=c["guidance"],
            num_inference_steps=c["steps"], height=c["height"], width=c["width"],
            cfg_normalization=c.get("cfg_normalization", False),
            cfg_truncation=c.get("cfg_truncation", 1.0),
        )
        with torch.no_grad():
            final = pipe(**common, latents=latents.clone(), output_type="latent",
                         callback_on_step_end=on_step).images
            image = pipe(**common, latents=latents.clone(), output_type="pt").images
        for i, s in steps.items():
            out[f"{name}.step.{i}"] = s
        out[f"{name}.final"] = final
        out[f"{name}.image"] = image
        sigmas = pipe.scheduler.sigmas.tolist()
        cases[name] = dict(c, sigmas=sigmas,
                           cfg_normalization=float(c.get("cfg_normalization", False)),
                           cfg_truncation=float(c.get("cfg_truncation", 1.0)))
        if name != "cfg" and name.startswith("cfg"):
            apart = (final - out["cfg.final"]).abs().max().item()
            print(f"{name}: final latents {apart:.3e} from cfg's")

    save_file({k: v.detach().to(torch.float32).contiguous() for k, v in out.items()},
              os.path.join(OUT, "outputs.safetensors"))
    with open(os.path.join(OUT, "cases.json"), "w") as f:
        json.dump(dict(captions=CAPTIONS, tokens=lens, cases=cases,
                       versions=dict(torch=torch.__version__,
                                     diffusers=__import__("diffusers").__version__,
                                     transformers=__import__("transformers").__version__)),
                  f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(OUT) for n in ns)
    print(f"{OUT}: {total / 1e6:.2f} MB; caption tokens {lens}")


if __name__ == "__main__":
    main()
