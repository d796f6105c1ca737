"""PyTorch's scaled_dot_product_attention on the shapes of benches/attention.rs, timed the same
way in the same call: the default backend choice, FlashAttention-2 and cuDNN, bf16. As there,
ROUNDS rounds over all rows of a backend interleave the rows, each row's forward and forward +
backward timed over ITERS launches per round, and a row reports the median round.
TORCH_ATTENTION_CUDNN_ONLY=1 times the cuDNN backend alone (quick calls)."""
import contextlib
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torch_timing import timed

ITERS = 10
ROUNDS = 5


def row(name, b, h, l, d, causal):
    x = [torch.randn(b, h, l, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    leaves = [t.detach().requires_grad_() for t in x[:3]]

    def fwd():
        F.scaled_dot_product_attention(x[0], x[1], x[2], is_causal=causal)

    def both():
        for t in leaves:
            t.grad = None
        F.scaled_dot_product_attention(*leaves, is_causal=causal).backward(x[3])

    return {"name": name, "dims": (b, h, l, d), "causal": causal, "fwd": fwd, "both": both,
            "t_fwd": [], "t_both": [], "peak": 0}


def run(rows, backend):
    tag = "default" if backend is None else str(backend).split(".")[-1]
    ctx = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
    with ctx:
        for r in rows:
            r["t_fwd"], r["t_both"] = [], []
        for rnd in range(ROUNDS):
            for r in rows:
                try:
                    r["t_fwd"].append(timed(r["fwd"], warmup=2, iters=ITERS))
                except RuntimeError as e:
                    if rnd == 0:
                        print(f"torch {tag} unavailable: {str(e).splitlines()[0]}")
                    return
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                r["t_both"].append(timed(r["both"], warmup=2, iters=ITERS))
                if rnd == 0:
                    r["peak"] = torch.cuda.max_memory_allocated() - base
    for r in rows:
        b, h, l, d = r["dims"]
        causal = r["causal"]
        fwd, tot = statistics.median(r["t_fwd"]), statistics.median(r["t_both"])
        flops = 4 * b * h * l * l * d / (2 if causal else 1)
        bwd = tot - fwd
        print(f"torch {tag:<16} {r['name']:<4} B={b:<2} H={h:<2} L={l:<5} D={d:<3} causal={str(causal):<5} "
              f"fwd {fwd*1e3:8.3f} ms {flops/fwd/1e12:6.1f} TFLOP/s | bwd {bwd*1e3:8.3f} ms "
              f"{2.5*flops/bwd/1e12:6.1f} TFLOP/s | fwd+bwd peak +{r['peak']/2**20:.0f} MiB")


def main():
    print(torch.__version__, torch.cuda.get_device_name())
    shapes = [("flux", 1, 24, 4608, 128)]
    for d in (128, 64):
        for l in (1024, 4096, 16384):
            shapes.append(("", 16384 // l, 2048 // d, l, d))
    rows = [row(*s, causal) for s in shapes for causal in (False, True)]
    backends = (None, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION)
    if os.environ.get("TORCH_ATTENTION_CUDNN_ONLY") == "1":
        backends = (SDPBackend.CUDNN_ATTENTION,)
    for backend in backends:
        run(rows, backend)


if __name__ == "__main__":
    main()
