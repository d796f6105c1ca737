"""Reference values for FLAME's loss and noise options (src/diffusion/loss.rs), computed
with PyTorch from the formulas of kohya's sd-scripts (commit 48d368fa):
library/train_util.py `get_huber_threshold_if_needed`, `conditional_loss`;
library/custom_train_functions.py `apply_noise_offset`, `pyramid_noise_like`,
`apply_masked_loss`; train_util.py's `get_noise_noisy_latents_and_timesteps` (the random
strengths of noise_offset and ip_noise_gamma, input perturbation through the scheduler's
`add_noise`) and flux_train_utils.py's `get_noisy_model_input_and_timesteps` (input
perturbation for flow matching); and train_network.py's reduction (loss * mask, mean over (C, H, W),
times the loss weights, mean). The random draws kohya makes inside those functions
(torch.randn, random.random) are inputs here, so FLAME's functions can be fed the same.

    /work/pyenv/bin/python scripts/make_lossdata_fixtures.py

writes tests/fixtures/lossdata/reference.json (float64 throughout; deterministic).
"""
import json
import math
import os

import torch
from diffusers import DDPMScheduler

torch.manual_seed(0)
OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "lossdata")


def flat(t):
    return [float(v) for v in t.reshape(-1).tolist()]


def huber_threshold(schedule, huber_c, huber_scale, timesteps, alphas_cumprod):
    # kohya get_huber_threshold_if_needed, num_train_timesteps = 1000.
    if schedule == "exponential":
        alpha = -math.log(huber_c) / 1000
        return torch.exp(-alpha * timesteps) * huber_scale
    if schedule == "snr":
        ab = torch.index_select(alphas_cumprod, 0, timesteps.long())
        sigmas = ((1.0 - ab) / ab) ** 0.5
        return (1 - huber_c) / (1 + sigmas) ** 2 + huber_c
    return torch.full((timesteps.shape[0],), huber_c * huber_scale, dtype=torch.float64)


def conditional_loss(pred, target, loss_type, huber_c):
    # kohya conditional_loss with reduction="none".
    if loss_type == "l2":
        return (pred - target) ** 2
    if loss_type == "l1":
        return torch.abs(pred - target)
    c = huber_c.view(-1, *([1] * (pred.ndim - 1)))
    if loss_type == "huber":
        return 2 * c * (torch.sqrt((pred - target) ** 2 + c**2) - c)
    return 2 * (torch.sqrt((pred - target) ** 2 + c**2) - c)


def main():
    os.makedirs(OUT, exist_ok=True)
    sched = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                          num_train_timesteps=1000)
    ab = sched.alphas_cumprod.to(torch.float64)
    ref = {}
    ddpm_t = torch.tensor([0.0, 17.0, 500.0, 999.0], dtype=torch.float64)
    flow_t = torch.tensor([0.03, 0.5, 0.97], dtype=torch.float64) * 1000
    hub = []
    for schedule in ["constant", "exponential", "snr"]:
        for c, scale in [(0.1, 1.0), (0.3, 2.5)]:
            for name, t in [("ddpm", ddpm_t), ("flow", flow_t)]:
                if schedule == "snr" and name == "flow":
                    continue
                hub.append({"schedule": schedule, "huber_c": c, "huber_scale": scale,
                            "timesteps": flat(t),
                            "c": flat(huber_threshold(schedule, c, scale, t, ab))})
    ref["huber_threshold"] = hub

    # Loss, mask and reduction on B=2, C=3, H=2, W=3 latents; a mask of 4x the size
    # (factor 4), area-interpolated to the latent grid as apply_masked_loss does.
    b, ch, h, w, f = 2, 3, 2, 3, 4
    pred = torch.randn(b, ch, h, w, dtype=torch.float64)
    target = torch.randn(b, ch, h, w, dtype=torch.float64)
    pixel_mask = torch.rand(b, 1, h * f, w * f, dtype=torch.float64)
    mask = torch.nn.functional.interpolate(pixel_mask, size=(h, w), mode="area")
    c = torch.tensor([0.1, 0.7], dtype=torch.float64)
    weights = torch.tensor([1.0, 0.25], dtype=torch.float64)
    cases = []
    for loss_type in ["l2", "l1", "huber", "smooth_l1"]:
        el = conditional_loss(pred, target, loss_type, c)
        masked = el * mask
        per = masked.mean([1, 2, 3]) * weights
        cases.append({"loss_type": loss_type, "elementwise": flat(el),
                      "reduced": float(per.mean()),
                      "reduced_unmasked": float((el.mean([1, 2, 3]) * weights).mean())})
    ref["loss"] = {"dims": [b, ch, h, w], "factor": f, "pred": flat(pred),
                   "target": flat(target), "pixel_mask": flat(pixel_mask), "mask": flat(mask),
                   "c": flat(c), "weights": flat(weights), "cases": cases}

    # Noise offset with and without the adaptive scale.
    latents = torch.randn(b, ch, h, w, dtype=torch.float64) + 0.5
    noise = torch.randn(b, ch, h, w, dtype=torch.float64)
    draws = torch.randn(b, ch, 1, 1, dtype=torch.float64)
    offs = []
    for offset, adaptive in [(0.1, None), (0.1, 0.05), (0.05, -0.2)]:
        o = offset
        if adaptive is not None:
            latent_mean = torch.abs(latents.mean(dim=(2, 3), keepdim=True))
            o = torch.clamp(offset + adaptive * latent_mean, 0.0, None)
        offs.append({"offset": offset, "adaptive": adaptive, "out": flat(noise + o * draws)})
    # noise_offset_random_strength: torch.rand(1) * noise_offset (the draw u given here), then
    # apply_noise_offset with that offset.
    for offset, adaptive, u in [(0.1, None, 0.37), (0.1, 0.05, 0.81)]:
        o = u * offset
        if adaptive is not None:
            latent_mean = torch.abs(latents.mean(dim=(2, 3), keepdim=True))
            o = torch.clamp(o + adaptive * latent_mean, 0.0, None)
        offs.append({"offset": offset, "adaptive": adaptive, "random_u": u,
                     "out": flat(noise + o * draws)})
    ref["noise_offset"] = {"dims": [b, ch, h, w], "latents": flat(latents), "noise": flat(noise),
                           "draws": flat(draws), "cases": offs}

    # Pyramid noise on (2, 3, 9, 11) with fixed level factors r.
    dims = (2, 3, 9, 11)
    noise = torch.randn(*dims, dtype=torch.float32)
    rs = [2.5, 2.2, 3.7, 2.9]
    discount = 0.3
    bb, cc, hh, ww = dims
    u = torch.nn.Upsample(size=(hh, ww), mode="bilinear")
    acc = noise.clone()
    levels, level_draws = [], []
    for i, r in enumerate(rs):
        hn, wn = max(1, int(hh / (r**i))), max(1, int(ww / (r**i)))
        d = torch.randn(bb, cc, hn, wn, dtype=torch.float32)
        levels.append([hn, wn])
        level_draws.append(flat(d))
        acc += u(d) * discount**i
        if hn == 1 or wn == 1:
            break
    out = acc / acc.std()
    ref["pyramid"] = {"dims": list(dims), "noise": flat(noise), "r": rs, "discount": discount,
                      "levels": levels, "draws": level_draws, "out": flat(out)}

    # Input perturbation (ip_noise_gamma, with the random strength's draw u given): the
    # model's input from noise + gamma * xi, the target from the noise alone. DDPM through
    # the scheduler's add_noise / get_velocity; flow matching as flux_train_utils.py.
    dims = (2, 3, 2, 3)
    latents = torch.randn(*dims, dtype=torch.float64)
    noise = torch.randn(*dims, dtype=torch.float64)
    xi = torch.randn(*dims, dtype=torch.float64)
    ip = {"dims": list(dims), "latents": flat(latents), "noise": flat(noise), "xi": flat(xi),
          "cases": []}
    ddpm_steps = torch.tensor([17, 640])
    sigmas = torch.tensor([0.3, 0.85], dtype=torch.float64)
    for gamma, u in [(0.1, None), (0.2, 0.6)]:
        g = gamma if u is None else u * gamma
        perturbed = noise + g * xi
        s4 = sigmas.view(-1, 1, 1, 1)
        ip["cases"].append({
            "gamma": gamma, "random_u": u,
            "ddpm_timesteps": [int(t) for t in ddpm_steps],
            "ddpm_input": flat(sched.add_noise(latents, perturbed, ddpm_steps)),
            "ddpm_target_eps": flat(noise),
            "ddpm_target_v": flat(sched.get_velocity(latents, noise, ddpm_steps)),
            "flow_sigmas": flat(sigmas),
            "flow_input": flat((1.0 - s4) * latents + s4 * perturbed),
            "flow_target": flat(noise - latents),
        })
    ref["ip_noise"] = ip

    with open(os.path.join(OUT, "reference.json"), "w") as fh:
        json.dump(ref, fh, indent=None, separators=(",", ":"))
        fh.write("\n")


if __name__ == "__main__":
    main()
