"""How much of SDXL's small-kernel work two CUDA streams overlap, and how steady the GPU's
pace is from one fresh set of layers to the next, measured with PyTorch alone.

A stack of SDXL base's level-2 transformer layers (1024 tokens of 1280 channels at 1024²,
20 heads of 64, cross-attention over 77 tokens of 2048, GEGLU 5120) with rank-16 LoRA on
every Linear, bf16, base weights frozen. Each workload is captured as a CUDA graph, so the
host's issue takes no part:
- F: the forward of one stack (what a checkpoint's re-run issues);
- B: the forward and backward of another stack (a unit's backward with its own work);
- F then B on one stream, against F and B replayed at once on two streams.
Then `--rounds` rounds of an eager forward and backward of a fresh stack, each round's mean
step and the GPU's SM clock, power and temperature (nvidia-smi) around it.

Usage: python3 benches/torch_unet_overlap.py [--layers 10] [--rounds 6]
"""

import argparse
import subprocess

import torch
import torch.nn.functional as F
from torch_timing import timed as timed_s

N, C, HEADS, CTX, CTX_DIM, FF = 1024, 1280, 20, 77, 2048, 5120
RANK = 16


class Lora(torch.nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.base = torch.nn.Linear(i, o, bias=False)
        self.base.weight.requires_grad_(False)
        self.down = torch.nn.Parameter(torch.randn(RANK, i) * 0.01)
        self.up = torch.nn.Parameter(torch.randn(o, RANK) * 0.01)

    def forward(self, x):
        return self.base(x) + (x @ self.down.t()) @ self.up.t()


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2, self.n3 = (torch.nn.LayerNorm(C) for _ in range(3))
        self.q1, self.k1, self.v1, self.o1 = (Lora(C, C) for _ in range(4))
        self.q2, self.o2 = Lora(C, C), Lora(C, C)
        self.k2, self.v2 = Lora(CTX_DIM, C), Lora(CTX_DIM, C)
        self.ff1, self.ff2 = Lora(C, 2 * FF), Lora(FF, C)
        for n in (self.n1, self.n2, self.n3):
            n.requires_grad_(False)

    def attn(self, q, k, v):
        b = q.shape[0]
        split = lambda t: t.view(b, -1, HEADS, C // HEADS).transpose(1, 2)
        o = F.scaled_dot_product_attention(split(q), split(k), split(v))
        return o.transpose(1, 2).reshape(b, -1, C)

    def forward(self, x, ctx):
        h = self.n1(x)
        x = x + self.o1(self.attn(self.q1(h), self.k1(h), self.v1(h)))
        h = self.n2(x)
        x = x + self.o2(self.attn(self.q2(h), self.k2(ctx), self.v2(ctx)))
        a, g = self.ff1(self.n3(x)).chunk(2, dim=-1)
        return x + self.ff2(a * F.gelu(g))


def stack(layers):
    return torch.nn.Sequential(*[Layer() for _ in range(layers)]).cuda().to(torch.bfloat16)


def run(mods, x, ctx):
    for m in mods:
        x = m(x, ctx)
    return x


def graph(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def timed(fn, iters=20):
    """ms a call (`torch_timing.timed`)."""
    return timed_s(fn, iters=iters) * 1e3


def smi():
    q = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"
    r = subprocess.run(
        ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    return r.stdout.strip()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    x = torch.randn(1, N, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ctx = torch.randn(1, CTX, CTX_DIM, device="cuda", dtype=torch.bfloat16)
    fa, fb = stack(a.layers), stack(a.layers)

    def forward_only():
        with torch.no_grad():
            run(fa, x, ctx)

    def forward_backward():
        for p in fb.parameters():
            p.grad = None
        run(fb, x, ctx).float().square().mean().backward()

    gf, gb = graph(forward_only), graph(forward_backward)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def serial():
        gf.replay()
        gb.replay()

    def together():
        s1.wait_stream(torch.cuda.current_stream())
        s2.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s1):
            gf.replay()
        with torch.cuda.stream(s2):
            gb.replay()
        torch.cuda.current_stream().wait_stream(s1)
        torch.cuda.current_stream().wait_stream(s2)

    tf, tb = timed(gf.replay), timed(gb.replay)
    ts, tt = timed(serial), timed(together)
    ts2, tt2 = timed(serial), timed(together)
    print(
        f"graphs, {a.layers} layers: F {tf:.2f} ms, F+B {tb:.2f} ms; one stream {ts:.2f} / "
        f"{ts2:.2f} ms, two streams {tt:.2f} / {tt2:.2f} ms: the two streams hide "
        f"{(ts - tt) / tf * 100:.0f}% / {(ts2 - tt2) / tf * 100:.0f}% of F"
    )
    del gf, gb, fa, fb
    for r in range(a.rounds):
        m = stack(a.layers)

        def step():
            for p in m.parameters():
                p.grad = None
            run(m, x, ctx).float().square().mean().backward()

        before = smi()
        ms = timed(step, 10)
        print(f"round {r}: eager step {ms:.2f} ms | before {before} | after {smi()}")
        del m
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
