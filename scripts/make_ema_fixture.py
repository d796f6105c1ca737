"""Writes tests/fixtures/ema/decay.json: diffusers' EMAModel (training_utils.py) decay
schedule over 300 optimizer steps for a few settings, and the shadow weights it keeps for a
small parameter updated by a fixed sequence, for tests/runlogs.rs.

    /work/pyenv/bin/python3 scripts/make_ema_fixture.py
"""
import json
import os

import torch
from diffusers.training_utils import EMAModel

STEPS = 300
SETTINGS = [
    dict(decay=0.9999, min_decay=0.0, update_after_step=0, use_ema_warmup=False, inv_gamma=1.0, power=2 / 3),
    dict(decay=0.999, min_decay=0.5, update_after_step=10, use_ema_warmup=False, inv_gamma=1.0, power=2 / 3),
    dict(decay=0.9999, min_decay=0.0, update_after_step=0, use_ema_warmup=True, inv_gamma=1.0, power=2 / 3),
    dict(decay=0.995, min_decay=0.1, update_after_step=5, use_ema_warmup=True, inv_gamma=2.0, power=0.75),
]


def main():
    out = {"steps": STEPS, "cases": []}
    for s in SETTINGS:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(7, 3, dtype=torch.float32))
        ema = EMAModel([p], **s)
        decays, shadows = [], []
        for step in range(1, STEPS + 1):
            with torch.no_grad():
                # A fixed, step-dependent parameter path.
                p.copy_(torch.sin(p * 1.1 + step * 0.01) + 0.001 * step)
            ema.step([p])
            decays.append(ema.cur_decay_value)
            if step in (1, 2, 10, 11, 12, 49, 50, STEPS - 1, STEPS):
                shadows.append({"step": step, "param": p.detach().flatten().tolist(),
                                "shadow": ema.shadow_params[0].flatten().tolist()})
        torch.manual_seed(0)
        start = torch.randn(7, 3, dtype=torch.float32).flatten().tolist()
        out["cases"].append({"settings": s, "decay": decays, "start": start, "shadows": shadows})
    path = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "ema", "decay.json")
    with open(path, "w") as f:
        json.dump(out, f)
    print("wrote", os.path.normpath(path))


if __name__ == "__main__":
    main()
