"""Timing shared by the PyTorch reference benches: synchronise around ITERS launches after a
3-launch warm-up, as benches/*.rs do on the FLAME side."""
import time

import torch

ITERS = 20


def timed(f, warmup=3, iters=ITERS):
    for _ in range(warmup):
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters
