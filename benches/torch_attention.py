"""PyTorch's scaled_dot_product_attention on the shapes of benches/attention.rs, timed the same
way in the same call: the default backend choice, FlashAttention-2 and cuDNN, bf16."""
import contextlib
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torch_timing import timed


def run(name, b, h, l, d, causal, backend):
    x = [torch.randn(b, h, l, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    leaves = [t.detach().requires_grad_() for t in x[:3]]
    ctx = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
    with ctx:
        try:
            fwd = timed(lambda: F.scaled_dot_product_attention(x[0], x[1], x[2], is_causal=causal))
        except RuntimeError as e:
            print(f"torch {backend} unavailable: {str(e).splitlines()[0]}")
            return
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()

        def both():
            for t in leaves:
                t.grad = None
            F.scaled_dot_product_attention(*leaves, is_causal=causal).backward(x[3])

        tot = timed(both)
        peak = torch.cuda.max_memory_allocated() - base
    flops = 4 * b * h * l * l * d / (2 if causal else 1)
    bwd = tot - fwd
    tag = "default" if backend is None else str(backend).split(".")[-1]
    print(f"torch {tag:<16} {name:<4} B={b:<2} H={h:<2} L={l:<5} D={d:<3} causal={str(causal):<5} "
          f"fwd {fwd*1e3:8.3f} ms {flops/fwd/1e12:6.1f} TFLOP/s | bwd {bwd*1e3:8.3f} ms "
          f"{2.5*flops/bwd/1e12:6.1f} TFLOP/s | fwd+bwd peak +{peak/2**20:.0f} MiB")


def main():
    print(torch.__version__, torch.cuda.get_device_name())
    shapes = [("flux", 1, 24, 4608, 128)]
    for d in (128, 64):
        for l in (1024, 4096, 16384):
            shapes.append(("", 16384 // l, 2048 // d, l, d))
    backends = (None, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION)
    if os.environ.get("TORCH_ATTENTION_CUDNN_ONLY") == "1":  # the cuDNN rows alone (quick calls)
        backends = (SDPBackend.CUDNN_ATTENTION,)
    for backend in backends:
        for s in shapes:
            for causal in (False, True):
                run(*s, causal, backend)


if __name__ == "__main__":
    main()
