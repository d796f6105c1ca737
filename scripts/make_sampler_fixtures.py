#!/usr/bin/env python3
"""Sampler fixtures: diffusers' schedulers and pipelines' denoising loops (tests/sampler.rs).

Usage:  python scripts/make_sampler_fixtures.py [OUT_DIR]        (default OUT_DIR: tests/fixtures/sampler)

Needs torch, diffusers (0.42.1), transformers (only so that the pipeline modules import; no text
encoder is built or run), safetensors, numpy; no network. Runs on the CPU in float32, the dtype
the pipelines sample in. The tiny random models are the ones of scripts/make_model_fixtures.py,
read from tests/fixtures/models/<name>/{transformer,unet} (float32 weights).

Random values: numpy's PCG64 (`numpy.random.default_rng(SEED + k)`, standard normals rounded to
float32), k fixed per use below; torch's generator is never used. Deterministic: two runs write
the same bytes (one thread, metadata {"format": "pt"} only).

Files written:

  schedulers.safetensors   float32 tensors, keyed `<case>.<what>`:
    flow.<cfg>.<steps>.<seq>.{timesteps,sigmas}
        FlowMatchEulerDiscreteScheduler.set_timesteps as the pipelines call it. cfg `flux_dev`
        (FLUX.1-dev's scheduler_config: shift 3, use_dynamic_shifting, base/max shift 0.5 / 1.15,
        base/max seq len 256 / 4096; sigmas = linspace(1, 1/n, n) and mu = calculate_shift(seq),
        as FluxPipeline), `flux_schnell` (shift 1, no dynamic shifting; same sigmas) and `sd3`
        (SD3.5's: shift 3; no sigmas passed, as StableDiffusion3Pipeline; seq unused, 0).
    flow.step.{sample,model_output,prev.<i>}
        step i of the flux_dev 4-step, seq 256 schedule on (2, 4, 3, 3) sample / model output
        (k = 1, 2), each from the same sample.
    euler.<pred>.<steps>.{timesteps,sigmas,init_noise_sigma}
        EulerDiscreteScheduler with SDXL's scheduler_config (scaled_linear 0.00085..0.012, 1000
        train steps, leading spacing, steps_offset 1, linear interpolation), pred `epsilon` or
        `v_prediction`.
    euler.<pred>.step.{sample,model_output,scaled.<i>,prev.<i>}
        the 5-step schedule: scale_model_input and step at step i (k = 3, 4).
    ddim.<pred>.<steps>.{timesteps,prev_timesteps,alphas_cumprod_t,alphas_cumprod_prev}
        DDIMScheduler with SDXL's config (eta 0, set_alpha_to_one False, steps_offset 1,
        clip_sample False, leading spacing); the alphas the step at each timestep reads.
    ddim.<pred>.step.{sample,model_output,prev.<i>}    the 5-step schedule's steps (k = 5, 6).
    betas.{alphas_cumprod}   the scheduler's float32 alphas_cumprod (1000,).

  <case>.safetensors, one per pipeline run, float32:
    noise (B, C, H, W)       the initial latents handed to the pipeline (k = 10), unpacked for Flux
    context, pooled          prompt_embeds, pooled_prompt_embeds (k = 11)
    neg_context, neg_pooled  negative_* (k = 12), when the case uses classifier-free guidance
    time_ids (B, 6)          SDXL: the add_time_ids the pipeline made (original, crop, target)
    guidance (1,)            guidance_scale given to the pipeline
    timesteps, sigmas        the scheduler's after set_timesteps (DDIM: sigmas absent)
    latents.<i> (B, C, H, W) the latents after step i (callback_on_step_end), unpacked for Flux
  cases:
    flux_dev      FluxPipeline, tiny `flux` model, (2, 4, 8, 6) latents, 6 steps, guidance 3.5
    flux_schnell  FluxPipeline, tiny `flux_schnell`, 4 steps (no guidance input)
    sd35          StableDiffusion3Pipeline, tiny `sd35_large`, (2, 4, 8, 6), 5 steps, CFG 4.5
    sdxl_euler    StableDiffusionXLPipeline, tiny `sdxl`, (2, 4, 16, 12), 5 steps, CFG 5.0, Euler
    sdxl_ddim     the same with DDIMScheduler, 5 steps

Each pipeline is built with its transformer / unet and scheduler only (text encoders, tokenizers
and VAE None) and called with prompt embeddings and latents given, output_type="latent".
"""

import argparse
import math
import os
import sys

import numpy as np
import torch

os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import diffusers  # noqa: E402
from diffusers import (  # noqa: E402
    DDIMScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from diffusers.pipelines.flux.pipeline_flux import calculate_shift  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

SEED = 777
MODELS = "tests/fixtures/models"

FLUX_DEV = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
)
FLUX_SCHNELL = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=False,
)
SD3 = dict(num_train_timesteps=1000, shift=3.0)
SDXL = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    num_train_timesteps=1000,
    steps_offset=1,
    timestep_spacing="leading",
    clip_sample=False,
    set_alpha_to_one=False,
)
SDXL_EULER = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    num_train_timesteps=1000,
    steps_offset=1,
    timestep_spacing="leading",
    interpolation_type="linear",
    use_karras_sigmas=False,
)


def normal(k, shape):
    rng = np.random.default_rng(SEED + k)
    return torch.from_numpy(rng.standard_normal(size=tuple(shape)).astype(np.float32))


def f32(t):
    return torch.as_tensor(t).detach().to(torch.float32).contiguous().clone()


def schedulers():
    out = {}
    # Flow matching tables.
    for n, seq in [(1, 256), (4, 256), (6, 12), (20, 1024), (28, 4096), (50, 6000)]:
        s = FlowMatchEulerDiscreteScheduler(**FLUX_DEV)
        sig = np.linspace(1.0, 1 / n, n)
        s.set_timesteps(sigmas=sig, mu=calculate_shift(seq, 256, 4096, 0.5, 1.15))
        out[f"flow.flux_dev.{n}.{seq}.timesteps"] = f32(s.timesteps)
        out[f"flow.flux_dev.{n}.{seq}.sigmas"] = f32(s.sigmas)
    for n in [1, 4, 8]:
        s = FlowMatchEulerDiscreteScheduler(**FLUX_SCHNELL)
        s.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=calculate_shift(256))
        out[f"flow.flux_schnell.{n}.256.timesteps"] = f32(s.timesteps)
        out[f"flow.flux_schnell.{n}.256.sigmas"] = f32(s.sigmas)
    for n in [1, 2, 5, 28, 40]:
        s = FlowMatchEulerDiscreteScheduler(**SD3)
        s.set_timesteps(num_inference_steps=n)
        out[f"flow.sd3.{n}.0.timesteps"] = f32(s.timesteps)
        out[f"flow.sd3.{n}.0.sigmas"] = f32(s.sigmas)
    s = FlowMatchEulerDiscreteScheduler(**FLUX_DEV)
    s.set_timesteps(sigmas=np.linspace(1.0, 1 / 4, 4), mu=calculate_shift(256))
    sample, mo = normal(1, (2, 4, 3, 3)), normal(2, (2, 4, 3, 3))
    out["flow.step.sample"], out["flow.step.model_output"] = sample, mo
    for i, t in enumerate(s.timesteps):
        s._step_index = i
        out[f"flow.step.prev.{i}"] = f32(s.step(mo, t, sample).prev_sample)

    # Euler (SDXL).
    for pred, k in [("epsilon", 3), ("v_prediction", 4)]:
        for n in [1, 5, 30, 50]:
            s = EulerDiscreteScheduler(prediction_type=pred, **SDXL_EULER)
            s.set_timesteps(n)
            out[f"euler.{pred}.{n}.timesteps"] = f32(s.timesteps)
            out[f"euler.{pred}.{n}.sigmas"] = f32(s.sigmas)
            out[f"euler.{pred}.{n}.init_noise_sigma"] = f32(s.init_noise_sigma).reshape(1)
        s = EulerDiscreteScheduler(prediction_type=pred, **SDXL_EULER)
        s.set_timesteps(5)
        sample, mo = normal(k, (2, 4, 3, 3)), normal(k + 100, (2, 4, 3, 3))
        out[f"euler.{pred}.step.sample"], out[f"euler.{pred}.step.model_output"] = sample, mo
        for i, t in enumerate(s.timesteps):
            s._step_index = i
            out[f"euler.{pred}.step.scaled.{i}"] = f32(s.scale_model_input(sample, t))
            s._step_index = i
            out[f"euler.{pred}.step.prev.{i}"] = f32(s.step(mo, t, sample).prev_sample)

    # DDIM (SDXL).
    for pred, k in [("epsilon", 5), ("v_prediction", 6)]:
        for n in [1, 5, 30, 50, 999]:
            s = DDIMScheduler(prediction_type=pred, **SDXL)
            s.set_timesteps(n)
            ts = s.timesteps
            prev = ts - 1000 // n
            ac = s.alphas_cumprod
            out[f"ddim.{pred}.{n}.timesteps"] = f32(ts)
            out[f"ddim.{pred}.{n}.prev_timesteps"] = f32(prev)
            out[f"ddim.{pred}.{n}.alphas_cumprod_t"] = f32(ac[ts])
            out[f"ddim.{pred}.{n}.alphas_cumprod_prev"] = f32(
                [ac[p].item() if p >= 0 else s.final_alpha_cumprod.item() for p in prev.tolist()]
            )
        s = DDIMScheduler(prediction_type=pred, **SDXL)
        s.set_timesteps(5)
        sample, mo = normal(k, (2, 4, 3, 3)), normal(k + 100, (2, 4, 3, 3))
        out[f"ddim.{pred}.step.sample"], out[f"ddim.{pred}.step.model_output"] = sample, mo
        for i, t in enumerate(s.timesteps):
            out[f"ddim.{pred}.step.prev.{i}"] = f32(s.step(mo, t, sample, eta=0.0).prev_sample)
    out["betas.alphas_cumprod"] = f32(DDIMScheduler(**SDXL).alphas_cumprod)
    return out


def pack(latents):
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(x, h, w):
    b, _, c4 = x.shape
    x = x.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, h, w)


def run(pipe, latents, record, **kw):
    steps = []

    def cb(_pipe, i, t, kwargs):
        steps.append(record(kwargs["latents"]))
        return kwargs

    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        pipe(
            latents=latents,
            output_type="latent",
            callback_on_step_end=cb,
            callback_on_step_end_tensor_inputs=["latents"],
            **kw,
        )
    return steps


def flux_case(name, model, guidance, steps, sched):
    tr = FluxTransformer2DModel.from_pretrained(os.path.join(MODELS, model, "transformer"))
    tr.eval()
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**sched),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=tr,
    )
    b, c, h, w = 2, 4, 8, 6
    noise = normal(10, (b, c, h, w))
    packed = pack(noise)
    assert torch.equal(unpack(packed, h, w), noise)
    ctx, pooled = normal(11, (b, 5, 24)), normal(111, (b, 20))
    lat = run(
        pipe,
        packed,
        lambda x: unpack(x, h, w),
        prompt_embeds=ctx,
        pooled_prompt_embeds=pooled,
        guidance_scale=guidance,
        num_inference_steps=steps,
        height=8 * h,
        width=8 * w,
    )
    out = dict(noise=noise, context=ctx, pooled=pooled, guidance=torch.tensor([guidance]))
    out["timesteps"], out["sigmas"] = pipe.scheduler.timesteps, pipe.scheduler.sigmas
    return name, out, lat


def sd3_case():
    tr = SD3Transformer2DModel.from_pretrained(os.path.join(MODELS, "sd35_large", "transformer"))
    tr.eval()
    pipe = StableDiffusion3Pipeline(
        transformer=tr,
        scheduler=FlowMatchEulerDiscreteScheduler(**SD3),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    b, c, h, w = 2, 4, 8, 6
    noise = normal(10, (b, c, h, w))
    ctx, pooled = normal(11, (b, 5, 24)), normal(111, (b, 20))
    nctx, npooled = normal(12, (b, 5, 24)), normal(112, (b, 20))
    lat = run(
        pipe,
        noise,
        lambda x: x.clone(),
        prompt_embeds=ctx,
        pooled_prompt_embeds=pooled,
        negative_prompt_embeds=nctx,
        negative_pooled_prompt_embeds=npooled,
        guidance_scale=4.5,
        num_inference_steps=5,
        height=8 * h,
        width=8 * w,
    )
    out = dict(noise=noise, context=ctx, pooled=pooled, neg_context=nctx, neg_pooled=npooled)
    out["guidance"] = torch.tensor([4.5])
    out["timesteps"], out["sigmas"] = pipe.scheduler.timesteps, pipe.scheduler.sigmas
    return "sd35", out, lat


def sdxl_case(name, scheduler):
    unet = UNet2DConditionModel.from_pretrained(os.path.join(MODELS, "sdxl", "unet"))
    unet.eval()
    pipe = StableDiffusionXLPipeline(
        vae=None,
        text_encoder=None,
        text_encoder_2=None,
        tokenizer=None,
        tokenizer_2=None,
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )
    b, c, h, w = 2, 4, 16, 12
    noise = normal(10, (b, c, h, w))
    ctx, pooled = normal(11, (b, 5, 24)), normal(111, (b, 20))
    nctx, npooled = normal(12, (b, 5, 24)), normal(112, (b, 20))
    lat = run(
        pipe,
        noise,
        lambda x: x.clone(),
        prompt_embeds=ctx,
        pooled_prompt_embeds=pooled,
        negative_prompt_embeds=nctx,
        negative_pooled_prompt_embeds=npooled,
        guidance_scale=5.0,
        num_inference_steps=5,
        height=8 * h,
        width=8 * w,
    )
    # The pipeline's add_time_ids: original size, crop (0, 0), target size, in pixels.
    ids = torch.tensor([[8 * h, 8 * w, 0, 0, 8 * h, 8 * w]] * b, dtype=torch.float32)
    out = dict(noise=noise, context=ctx, pooled=pooled, neg_context=nctx, neg_pooled=npooled, time_ids=ids)
    out["guidance"] = torch.tensor([5.0])
    out["timesteps"] = pipe.scheduler.timesteps
    if hasattr(pipe.scheduler, "sigmas"):
        out["sigmas"] = pipe.scheduler.sigmas
    return name, out, lat


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", nargs="?", default="tests/fixtures/sampler")
    args = ap.parse_args()
    torch.set_num_threads(1)  # deterministic reductions
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"torch {torch.__version__}, diffusers {diffusers.__version__}, numpy {np.__version__}")
    meta = {"format": "pt"}  # one key: safetensors writes metadata in hash-map order

    def save(tensors, name):
        path = os.path.join(args.out_dir, name)
        save_file({k: f32(v) for k, v in tensors.items()}, path, metadata=meta)
        os.chmod(path, 0o644)

    save(schedulers(), "schedulers.safetensors")

    cases = [
        flux_case("flux_dev", "flux", 3.5, 6, FLUX_DEV),
        flux_case("flux_schnell", "flux_schnell", 0.0, 4, FLUX_SCHNELL),
        sd3_case(),
        sdxl_case("sdxl_euler", EulerDiscreteScheduler(**SDXL_EULER)),
        sdxl_case("sdxl_ddim", DDIMScheduler(**SDXL)),
    ]
    for name, out, lat in cases:
        for i, x in enumerate(lat):
            out[f"latents.{i}"] = x
        save(out, f"{name}.safetensors")
        print(f"  {name}: {len(lat)} steps, final |latents| max {lat[-1].abs().max().item():.4f}")

    total = sum(os.path.getsize(os.path.join(args.out_dir, f)) for f in os.listdir(args.out_dir))
    print(f"total fixture size {total} B ({total / 2**20:.2f} MiB) in {args.out_dir}")


if __name__ == "__main__":
    sys.exit(main())
