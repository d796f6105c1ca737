"""PyTorch eager on the shapes of benches/layers.rs, timed the same way, in the same call."""
import torch
import torch.nn.functional as F

from torch_timing import timed as timed_n


def timed(f):
    # benches/layers.rs's counts: 5 warm-up launches, then the mean of 100.
    return timed_n(f, warmup=5, iters=100)


def apply_rope(xq, freqs_cis):
    # BFL Flux's apply_rope.
    xq_ = xq.float().reshape(*xq.shape[:-1], -1, 1, 2)
    out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
    return out.reshape(*xq.shape).type_as(xq)


def rope(pos, dim, theta):
    scale = torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim
    omega = 1.0 / (theta**scale)
    out = torch.einsum("...n,d->...nd", pos.double(), omega)
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    return out.reshape(*out.shape[:-1], 2, 2).float()


def layer(name, x, op, copy, params=()):
    """Times op(x, *params) forward and forward+backward; params get gradients too."""
    nbytes = x.numel() * 2
    fwd = timed(lambda: op(x, *params))
    xv = x.detach().requires_grad_()
    pv = [p.detach().requires_grad_() for p in params]
    dy = torch.full_like(op(x, *params), 0.5)

    def both():
        xv.grad = None
        for p in pv:
            p.grad = None
        op(xv, *pv).backward(dy)

    b = timed(both)
    f_gbs, b_gbs = 2 * nbytes / fwd / 1e9, 5 * nbytes / b / 1e9
    print(f"torch {name:<32} fwd {fwd*1e3:7.3f} ms {f_gbs:7.0f} GB/s {100*f_gbs/copy:5.1f}% | "
          f"fwd+bwd {b*1e3:7.3f} ms {b_gbs:7.0f} GB/s {100*b_gbs/copy:5.1f}%")


def main():
    dev = torch.device("cuda")
    bf = torch.bfloat16
    n = 4608 * 3072
    src = torch.zeros(n, dtype=bf, device=dev)
    dst = torch.empty_like(src)
    copy = 2 * 2 * n / timed(lambda: dst.copy_(src)) / 1e9
    print(f"torch copy (4608x3072 bf16)              {copy:7.0f} GB/s")
    x = torch.randn(4608, 3072, device=dev, dtype=bf)
    w = torch.randn(3072, device=dev, dtype=bf)
    shift = torch.randn(1, 3072, device=dev, dtype=bf)
    scale = torch.randn(1, 3072, device=dev, dtype=bf)
    layer("layer_norm (no affine)", x, lambda x: F.layer_norm(x, (3072,), eps=1e-6), copy)
    layer("layer_norm (affine)", x, lambda x: F.layer_norm(x, (3072,), w, w, eps=1e-6), copy)
    layer("layer_norm (affine, dw db)", x, lambda x, a, b: F.layer_norm(x, (3072,), a, b, eps=1e-6), copy,
          (w, w.clone()))
    layer("softmax (4608x3072)", x, lambda x: torch.softmax(x, -1), copy)
    layer("gelu_tanh", x, lambda x: F.gelu(x, approximate="tanh"), copy)
    layer("silu", x, F.silu, copy)
    layer("modulate", x, lambda x: x * (1 + scale) + shift, copy)
    layer("modulate (dshift dscale)", x, lambda x, sh, sc: x * (1 + sc) + sh, copy, (shift, scale))
    q = torch.randn(1, 24, 4608, 128, device=dev, dtype=bf)
    qw = torch.randn(128, device=dev, dtype=bf)
    layer("rms_norm (head dim 128)", q, lambda x: F.rms_norm(x, (128,), qw, eps=1e-6), copy)
    layer("rms_norm (head dim 128, dw)", q, lambda x, a: F.rms_norm(x, (128,), a, eps=1e-6), copy, (qw,))
    pos = torch.arange(4608, device=dev, dtype=torch.float32).reshape(1, 4608)
    freqs = rope(pos, 128, 10000.0).unsqueeze(1)
    layer("apply_rope (1,24,4608,128)", q, lambda x: apply_rope(x, freqs), copy)
    g = torch.randn(2, 320, 128, 128, device=dev, dtype=bf)
    gw = torch.randn(320, device=dev, dtype=bf)
    layer("group_norm SDXL (2,320,128,128)", g, lambda x: F.group_norm(x, 32, gw, gw, eps=1e-5), copy)
    layer("group_norm SDXL (dw db)", g, lambda x, a, b: F.group_norm(x, 32, a, b, eps=1e-5), copy, (gw, gw.clone()))
    cw = torch.randn(320, 320, 3, 3, device=dev, dtype=bf) * 0.02
    flops = 2.0 * 2 * 320 * 128 * 128 * 320 * 9
    fwd = timed(lambda: F.conv2d(g, cw, padding=1))
    gv, wv = g.detach().requires_grad_(), cw.detach().requires_grad_()
    dy = torch.ones_like(F.conv2d(g, cw, padding=1))

    def both():
        gv.grad, wv.grad = None, None
        F.conv2d(gv, wv, padding=1).backward(dy)

    b = timed(both)
    print(f"torch conv2d 3x3 320->320 128x128 b2   fwd {fwd*1e3:7.3f} ms {flops/fwd/1e12:6.1f} TFLOP/s | "
          f"fwd+bwd {b*1e3:7.3f} ms {3*flops/b/1e12:6.1f} TFLOP/s")


if __name__ == "__main__":
    main()
