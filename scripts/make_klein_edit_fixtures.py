#!/usr/bin/env python3
"""FLUX.2 [klein] conditioned on reference images, as diffusers' Flux2KleinPipeline computes it, for tests/klein_edit.rs.

Usage:  python scripts/make_klein_edit_fixtures.py [OUT_DIR]        (default OUT_DIR: tests/fixtures/klein_edit)

Made with torch 2.15.0, diffusers 0.42.1, transformers 5.24.0, safetensors, numpy, Pillow; no network. Runs on the CPU
in one thread; every random value comes from fixed seeds, so two runs write the same bytes.

The model is the tiny random pipeline of scripts/make_klein_fixtures.py (tests/fixtures/klein/pipeline: 2 double + 2
single blocks of hidden 32, latents of 4 x 8 channels, Qwen3 of width 16, AutoencoderKLFlux2 with a downscale of 2, so
the pipeline's `vae_scale_factor * 2` is 4). This script rebuilds that pipeline's transformer from the same seeds and
refuses to run when the saved folder differs from it, then reads the folder as diffusers loads it.

Files written:

  refs/a.png, refs/b.png, refs/big.png
                       reference pictures (RGB, smooth random patterns from numpy's default_rng): a 66 x 81 and b
                       75 x 70 (width x height; sides that are not multiples of 4, so the pipeline's floor and centre
                       crop act), big 1200 x 1000 (more than 1024 x 1024 pixels: the pipeline's resize to that area; blocks of 10 x 10 pixels of a
                       120 x 100 picture, a small file).
  forward.safetensors  Flux2Transformer2DModel in float64 on reference tokens appended after the image tokens, as
                       Flux2KleinPipeline.__call__ builds its input (`torch.cat([latents, image_latents], dim=1)`,
                       `torch.cat([latent_ids, image_latent_ids], dim=1)`, `noise_pred[:, :latents.size(1)]`), the
                       reference ids from `_prepare_image_ids` (t = 10 + 10 i), per case:
      <case>.x         (B, 32, h, w) the target's patched latents; <case>.ref.<i> (B, 32, h_i, w_i) reference latents;
      <case>.context   (B, 7, 48); <case>.t (B,) sigmas in [0, 1];
      <case>.output    the prediction for the target tokens, unpacked to (B, 32, h, w);
      <case>.loss_weight, and with loss = sum(output * loss_weight): <case>.grad.x, <case>.grad.ref.<i> (unpacked),
      <case>.grad.context, and <case>.param.<BFL key> for every parameter (make_flux2_fixtures.flux2_to_original).
                       Cases: `one` (B 1, x 4 x 5, one reference 6 x 4) and `two` (B 2, x 4 x 3, references 5 x 4
                       and 3 x 6). Inputs are float32 values; the forward and backward run in float64.
  outputs.safetensors  Flux2KleinPipeline.__call__(image=[...]) from given latents, float32, per case:
      <case>.noise     the `latents=` given (patched, normalized; the model's own latents);
      <case>.context, <case>.neg_context (cfg only): the prompt_embeds / negative_prompt_embeds given;
      <case>.cond.<i>  the pipeline's preprocessed reference picture i (1, 3, H, W) in [-1, 1]
                       (Flux2ImageProcessor.preprocess after the size rules of __call__);
      <case>.image_latents (1, N, 32), <case>.image_ids (1, N, 4): prepare_image_latents' packed reference tokens and
                       their ids for a batch of one;
      <case>.timesteps, <case>.sigmas; <case>.latents.<s> the latents after step s, unpacked (B, 32, h, w);
      <case>.latent    output_type="latent" (un-normalized, unpatched), <case>.decoded  vae.decode of it.
                       Cases: `cfg` (references a and b, two prompts, guidance_scale 4.0 against the empty prompt,
                       3 steps, 32 x 24 output) and `plain` (reference a, one prompt, guidance_scale 1.0, 3 steps, the
                       output's size left to the pipeline: the first reference's, 80 x 64).
      big.cond         the pipeline's preprocessed big.png, rows 100..132 and columns 200..232 only (3, 32, 32):
                       PIL's LANCZOS resize to 1024 x 1024 pixels of area rounds to 8 bits, FLAME's does not.
  cases.json           the captions, the cases, the reference sizes the pipeline's rules give (`sizes`: original ->
                       after `_resize_to_target_area` -> after the floor to multiples of 16 and of 4), versions.
"""

import json
import os
import shutil
import sys

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_flux2_fixtures as mff  # noqa: E402  (flux2_to_original)
import make_klein_fixtures as mkf  # noqa: E402  (the tiny pipeline's builders)
import make_model_fixtures as mmf  # noqa: E402  (the float64 timestep-embedding patch, _normal, _save)

import diffusers  # noqa: E402
import transformers  # noqa: E402
from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel  # noqa: E402
from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

torch.set_num_threads(1)
diffusers.utils.logging.set_verbosity_error()
transformers.utils.logging.set_verbosity_error()
ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "fixtures", "klein_edit")
PIPELINE = os.path.join(ROOT, "tests", "fixtures", "klein", "pipeline")
SEED = 9876
CAPTIONS = ["make the circle blue", "turn the background black", ""]
REFS = {"a": (66, 81), "b": (75, 70), "big": (1200, 1000)}
# (width, height) of pictures whose size rules are recorded (no pixels): over and under the pipeline's 1024 x 1024.
SIZE_CASES = [(1200, 1000), (1025, 1024), (3000, 700), (1024, 1024), (700, 3000), (66, 81)]
FORWARD = {
    "one": dict(b=1, x=(4, 5), refs=[(6, 4)], t=[0.63]),
    "two": dict(b=2, x=(4, 3), refs=[(5, 4), (3, 6)], t=[0.3, 0.85]),
}
CASES = {
    "cfg": dict(refs=["a", "b"], prompts=[0, 1], guidance_scale=4.0, steps=3, height=32, width=24),
    "plain": dict(refs=["a"], prompts=[0], guidance_scale=1.0, steps=3, height=None, width=None),
}


def f32(t):
    return t.detach().to(torch.float32).contiguous().clone()


def picture(w, h, seed):
    """A smooth RGB picture: a few random sinusoids per channel, as 8-bit PNG values."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.zeros((h, w, 3))
    for c in range(3):
        for _ in range(3):
            fx, fy, ph = rng.uniform(0.5, 4.0), rng.uniform(0.5, 4.0), rng.uniform(0, 2 * np.pi)
            img[..., c] += np.sin(2 * np.pi * (fx * x / w + fy * y / h) + ph)
    img = (img - img.min()) / (img.max() - img.min())
    return Image.fromarray(np.round(img * 255).astype(np.uint8), "RGB")


def check_transformer():
    """The saved pipeline's transformer is the one make_klein_fixtures.py builds from its seeds."""
    want = {k: v.float() for k, v in mkf.make_transformer().state_dict().items()}
    got = load_file(os.path.join(PIPELINE, "transformer", "diffusion_pytorch_model.safetensors"))
    if set(want) != set(got) or any(not torch.equal(want[k], got[k]) for k in want):
        raise SystemExit(f"{PIPELINE} is not make_klein_fixtures.py's pipeline: run that script first")


def unpack(x, h, w):
    # Flux2KleinPipeline._pack_latents' inverse: (B, h w, C) -> (B, C, h, w).
    b, _, c = x.shape
    return x.permute(0, 2, 1).reshape(b, c, h, w)


def forward_cases(transformer, out):
    model = transformer.double()
    rng = np.random.default_rng(SEED)
    cin = model.config.in_channels
    for name, case in FORWARD.items():
        b = case["b"]
        x = mmf._normal(rng, (b, cin, *case["x"]))
        refs = [mmf._normal(rng, (b, cin, *hw)) for hw in case["refs"]]
        ctx = mmf._normal(rng, (b, 7, model.config.joint_attention_dim))
        t = torch.tensor(case["t"], dtype=torch.float32)
        xs = x.double().requires_grad_()
        rs = [r.double().requires_grad_() for r in refs]
        cs = ctx.double().requires_grad_()
        hidden = torch.cat([Flux2KleinPipeline._pack_latents(xs)] + [Flux2KleinPipeline._pack_latents(r) for r in rs],
                           dim=1)
        ids = torch.cat([Flux2KleinPipeline._prepare_latent_ids(xs),
                         Flux2KleinPipeline._prepare_image_ids([r[:1] for r in rs]).repeat(b, 1, 1)], dim=1)
        txt_ids = Flux2KleinPipeline._prepare_text_ids(cs)
        pred = model(hidden_states=hidden, encoder_hidden_states=cs, timestep=t.double(), img_ids=ids,
                     txt_ids=txt_ids, guidance=None, return_dict=False)[0]
        h, w = case["x"]
        pred = unpack(pred[:, : h * w], h, w)
        lw = mmf._normal(rng, pred.shape)
        model.zero_grad(set_to_none=True)
        (pred * lw.double()).sum().backward()
        out[f"{name}.x"], out[f"{name}.context"], out[f"{name}.t"] = x, ctx, t
        out[f"{name}.output"], out[f"{name}.loss_weight"] = pred, lw
        out[f"{name}.grad.x"], out[f"{name}.grad.context"] = xs.grad, cs.grad
        for i, (r, g) in enumerate(zip(refs, rs)):
            out[f"{name}.ref.{i}"], out[f"{name}.grad.ref.{i}"] = r, g.grad
        grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in model.named_parameters()}
        zero = [k for k, g in grads.items() if not bool(g.abs().max() > 0)]
        if zero:
            raise AssertionError(f"{name}: parameters without a gradient: {zero}")
        for k, g in mff.flux2_to_original(grads, dict(model.config)).items():
            out[f"{name}.param.{k}"] = g
        print(f"  forward {name}: output {tuple(pred.shape)}, {len(rs)} reference(s)")
    transformer.float()


def size_rules(w, h, multiple):
    """The sizes Flux2KleinPipeline.__call__ gives a reference of w x h (step 4 of __call__)."""
    img = Image.new("RGB", (w, h))
    if w * h > 1024 * 1024:
        img = Flux2ImageProcessor._resize_to_target_area(img, 1024 * 1024)
    rw, rh = img.size
    return [rw, rh, (rw // multiple) * multiple, (rh // multiple) * multiple]


def main():
    print("diffusers", diffusers.__version__, "transformers", transformers.__version__, "torch", torch.__version__)
    check_transformer()
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(os.path.join(OUT, "refs"))
    pics = {}
    for i, (name, (w, h)) in enumerate(REFS.items()):
        if name == "big":
            # Blocks of 10 x 10 pixels of a 120 x 100 picture: a small file.
            pics[name] = picture(w // 10, h // 10, SEED + 10 + i).resize((w, h), Image.Resampling.NEAREST)
        else:
            pics[name] = picture(w, h, SEED + 10 + i)
        pics[name].save(os.path.join(OUT, "refs", f"{name}.png"))
    pics = {n: Image.open(os.path.join(OUT, "refs", f"{n}.png")).convert("RGB") for n in REFS}

    pipe = Flux2KleinPipeline.from_pretrained(PIPELINE, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    multiple = pipe.vae_scale_factor * 2
    assert multiple == 4, multiple

    fwd = {}
    forward_cases(pipe.transformer, fwd)
    mmf._save(fwd, os.path.join(OUT, "forward.safetensors"))

    with torch.no_grad():
        ctx, _ = pipe.encode_prompt(prompt=CAPTIONS, device="cpu")
    out = {}
    # prepare_image_latents as __call__ calls it: its inputs (the preprocessed pictures) and outputs, recorded.
    seen = {}
    prepare = pipe.prepare_image_latents

    def recording(images, batch_size, generator, device, dtype):
        seen["cond"] = [im.clone() for im in images]
        lat, ids = prepare(images=images, batch_size=1, generator=generator, device=device, dtype=dtype)
        seen["image_latents"], seen["image_ids"] = lat.clone(), ids.clone()
        return prepare(images=images, batch_size=batch_size, generator=generator, device=device, dtype=dtype)

    pipe.prepare_image_latents = recording
    g = torch.Generator().manual_seed(SEED + 3)
    for name, case in CASES.items():
        cfg = case["guidance_scale"] > 1
        b = len(case["prompts"])
        first = pics[case["refs"][0]]
        height = case["height"] or (first.size[1] // multiple) * multiple
        width = case["width"] or (first.size[0] // multiple) * multiple
        h, w = height // multiple, width // multiple
        noise = torch.randn((b, 4 * 8, h, w), generator=g, dtype=torch.float32)
        cond = f32(ctx[case["prompts"]])
        neg = f32(ctx[2:3]).repeat(b, 1, 1)
        steps = []

        def cb(_pipe, i, t, kwargs):
            steps.append(unpack(kwargs["latents"], h, w).clone())
            return kwargs

        kw = dict(image=[pics[r] for r in case["refs"]], prompt_embeds=cond,
                  negative_prompt_embeds=neg if cfg else None, guidance_scale=case["guidance_scale"],
                  num_inference_steps=case["steps"], height=case["height"], width=case["width"],
                  latents=noise.clone())
        with torch.no_grad():
            lat = pipe(output_type="latent", callback_on_step_end=cb, callback_on_step_end_tensor_inputs=["latents"],
                       **kw).images
            timesteps, sigmas = pipe.scheduler.timesteps.clone(), pipe.scheduler.sigmas.clone()
            decoded = pipe.vae.decode(lat, return_dict=False)[0]
        assert len(steps) == case["steps"] and lat.shape == (b, 8, 2 * h, 2 * w), lat.shape
        out[f"{name}.noise"], out[f"{name}.context"] = noise, cond
        if cfg:
            out[f"{name}.neg_context"] = neg
        for i, c in enumerate(seen["cond"]):
            out[f"{name}.cond.{i}"] = c
        out[f"{name}.image_latents"], out[f"{name}.image_ids"] = seen["image_latents"], seen["image_ids"].float()
        out[f"{name}.timesteps"], out[f"{name}.sigmas"] = timesteps, sigmas
        for i, s in enumerate(steps):
            out[f"{name}.latents.{i}"] = s
        out[f"{name}.latent"], out[f"{name}.decoded"] = lat, decoded
        print(f"  {name}: {b} prompt(s), references {case['refs']}, latents {tuple(noise.shape)}")
    # big.png through the same size rules and preprocessing as __call__ (no denoising).
    big = Flux2ImageProcessor._resize_to_target_area(pics["big"], 1024 * 1024)
    bw, bh = (big.size[0] // multiple) * multiple, (big.size[1] // multiple) * multiple
    big = pipe.image_processor.preprocess(big, height=bh, width=bw, resize_mode="crop")
    out["big.cond"] = big[0, :, 100:132, 200:232]
    save = {k: f32(v) for k, v in out.items()}
    from safetensors.torch import save_file
    save_file(save, os.path.join(OUT, "outputs.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(OUT, "cases.json"), "w") as f:
        json.dump({"captions": CAPTIONS, "refs": {n: list(s) for n, s in REFS.items()},
                   "cases": {n: dict(c, cfg=c["guidance_scale"] > 1) for n, c in CASES.items()},
                   "forward": {n: dict(c) for n, c in FORWARD.items()},
                   "sizes": {f"{w}x{h}": {"16": size_rules(w, h, 16), "4": size_rules(w, h, 4)} for w, h in SIZE_CASES},
                   "big_shape": [bh, bw],
                   "versions": {"diffusers": diffusers.__version__, "transformers": transformers.__version__,
                                "torch": torch.__version__}}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
