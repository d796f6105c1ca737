#!/usr/bin/env python3
"""Ground-truth fixtures for FLAME's adapter kinds (LoRA incl. Conv2d, DoRA, LoKr, LoHa), made
with PEFT's own implementations on a tiny float64 model.

Usage:  PYTHONPATH=/tmp/peftsite python3 scripts/make_adapter_fixtures.py [OUT_DIR]
        (default OUT_DIR: tests/fixtures/adapters)

Made with peft 0.17.0 and torch 2.15.0 (CPU). peft 0.17.0 imports transformers' HybridCache,
which transformers 5 no longer has, so it runs against transformers 4.56.2 installed beside it:
    pip install --target /tmp/peftsite --no-deps peft==0.17.0 accelerate transformers==4.56.2 \
        tokenizers==0.22.1 huggingface_hub==0.35.3
(accelerate 1.15.0). Nothing is downloaded by the script; runs on CPU, one thread, float64.

Determinism: every number comes from numpy's PCG64 (`numpy.random.default_rng`, stable across
torch versions): base weights from SEED, the adapter values from SEED + 1 + kind index, inputs
and cotangents from SEED + 100. PEFT keeps target_modules as a set, so adapter_config.json lists
them in string-hash order; the script re-executes itself with PYTHONHASHSEED=0 so that order is
fixed too. Running it twice gives byte-identical files.

Independent check: besides PEFT's own consistency (forward == base op with the merged weight,
merged - base == get_delta_weight), the script recomputes y, the merged weight and every
gradient from the formulas written below, on the stored tensors, and asserts they match PEFT
to 1e-12 relative.

Base model (the same for every kind; float64):
  lin  nn.Linear(12, 10, bias=True)                     weight N(0, (0.7/sqrt(fan_in))^2)
  conv nn.Conv2d(4, 6, kernel_size=3, padding=1)        biases 0.1 * N(0, 1)
  pw   nn.Conv2d(4, 6, kernel_size=1)                   (fan_in = in * kh * kw)

Kinds (one folder each), all targeting ["lin", "conv", "pw"] (PEFT refused none of them):
  lora       LoraConfig(r=4, lora_alpha=8, lora_dropout=0)                      scaling 2
  dora       the same with use_dora=True                                        scaling 2
  lokr       LoKrConfig(r=1, alpha=3, decompose_both=True, decompose_factor=-1)  scaling 3
             -> low-rank w2 (lokr_w2_a/_b) on all three; lin also has low-rank w1
                (lokr_w1_a/_b), conv/pw have a full lokr_w1 (r < max(2,2)/2 is impossible)
  lokr_full  LoKrConfig(r=4, alpha=8, decompose_both=False, decompose_factor=-1) scaling 2
             -> full lokr_w1 and lokr_w2 everywhere
  loha       LoHaConfig(r=4, alpha=8)                                           scaling 2
  lokr_tucker LoKrConfig(r=2, alpha=3, decompose_factor=1, use_effective_conv2d=True) scaling 1.5
             -> factor 1 puts every side in w2 ((1, 6), (1, 4) on conv), so w2 is low-rank at
                r = 2 and conv takes the Tucker form (lokr_t2 (2, 2, 3, 3), lokr_w2_a (2, 6),
                lokr_w2_b (2, 4)); lin and pw (1x1) the plain low-rank w2
  loha_tucker LoHaConfig(r=4, alpha=8, use_effective_conv2d=True)               scaling 2
             -> conv: hada_t1/t2 (4, 4, 3, 3), hada_w?_a (4, 6), hada_w?_b (4, 4); lin, pw plain
  The two Tucker kinds were made with peft 0.21.2 and torch 2.15 (transformers 5.24, no pins):
      python3 scripts/make_adapter_fixtures.py tests/fixtures/adapters lokr_tucker loha_tucker
  (named kinds only: the shared base and inputs files are read, not written).
  Other LoKr/LoHa kinds: rank_dropout=0, module_dropout=0, use_effective_conv2d=False (so no
  lokr_t2 and no hada_t1/t2). Why lokr is r=1: PEFT keeps w2 full unless r < max(out_k, in_n)/2, and with
  these dims that is max(5,4)/2 = 2.5 for lin and max(3,2)/2 = 1.5 for conv/pw, so r=4 (the
  brief's value) gives full matrices everywhere; that is what lokr_full is.

After get_peft_model EVERY adapter parameter is overwritten with 0.3 * N(0, 1) (PEFT zero-inits
lora_B / hada_w2_b / lokr_w1 and would hide errors). DoRA's magnitude is PEFT's own initial
value (the weight norm it computed at init, when lora_B was still 0, i.e. the norm of the base
weight rows) times (1 + 0.1 * N(0, 1)).

Files. What does not depend on the kind is stored once, at the top (the brief's per-kind copies
came to ~260 KB; this is ~165 KB, README included ~170 KB):
  OUT_DIR/base.safetensors    the base weights, plain names lin.weight, lin.bias, conv.weight,
                      conv.bias, pw.weight, pw.bias (f64)
  OUT_DIR/inputs.safetensors  f64; every kind's io.safetensors pairs with it:
    x.lin (2,3,12), x.conv (2,4,5,7), x.pw (2,4,5,7)    inputs
    base_y.<m>        the base layer alone on x.<m>
    g.<m>             fixed random cotangents, shape of y.<m>; loss = sum_m (y.<m> * g.<m>).sum()
  OUT_DIR/README.md   written by hand (formulas, layout), not by this script.
Per kind in OUT_DIR/<kind>/:
  peft.safetensors    peft.get_peft_model_state_dict(model) as is (PEFT's key names, e.g.
                      base_model.model.lin.lora_A.weight, base_model.model.conv.lokr_w2_b,
                      base_model.model.pw.lora_magnitude_vector), f64; checked equal to the
                      adapter_model.safetensors that save_pretrained writes
  adapter_config.json the file save_pretrained writes, copied unchanged
  io.safetensors      f64, what depends on the kind (the rest is in ../inputs.safetensors):
    y.<m>             adapted model's output (model in eval mode; dropout is 0 anyway)
    grad.<peft key>   d loss / d every adapter parameter, keyed by the peft.safetensors key
    grad.x.<m>        d loss / d input
    merged.<m>.weight PEFT's merge_and_unload on a deep copy
    delta.<m>         merged.<m>.weight - base weight (for non-DoRA kinds also checked against
                      the layer's get_delta_weight)
  meta.json           kind, versions, config, per-module r/alpha/scaling as PEFT computed them,
                      every adapter tensor's shape, lokr factorizations and low-rank flags,
                      dropped targets (none), the PEFT key list, seeds.
The script also checks that y.<m> equals the base op run with merged.<m>.weight (+ bias).

=====================================================================================
PEFT 0.17.0's formulas (read from peft/tuners/{lora,lokr,loha}/layer.py, lora/dora.py,
lora/variants.py, lycoris_utils.py). W: base weight (out, in[, kh, kw]); s: scaling.

LoRA (lora/layer.py).  s = lora_alpha / r  (lora_alpha / sqrt(r) with use_rslora).
  Linear:  lora_A.weight (r, in), lora_B.weight (out, r).  dW = s * B @ A.
  Conv2d:  lora_A is a Conv2d(in, r, kernel_size, stride, padding, no bias): weight
           (r, in, kh, kw); lora_B is a Conv2d(r, out, 1x1, stride 1): weight (out, r, 1, 1).
           dW[o,i,h,w] = s * sum_r B[o,r] A[r,i,h,w]  (get_delta_weight: 1x1 -> squeeze, matmul,
           unsqueeze; else conv2d(A.transpose(0,1), B).transpose(0,1)).
  Forward: y = base(x) + s * lora_B(lora_A(dropout(x)))  (two convs / two matmuls, added to the
           base output; the merged weight is not formed).  Merge: W += dW.

DoRA (lora/dora.py + lora/variants.py; use_dora=True).  V = W + s * B @ A (conv: B.view(out,r) @
  A.view(r,-1) reshaped to W's shape).
  norm: Linear: ||V||_2 over dim 1 (the input axis): one value per OUTPUT row, shape (out,).
        Conv2d: V.norm(p=2, dim=(1,2,3), keepdim=True).transpose(1,0): per OUTPUT channel,
        shape (1, out, 1, 1).  The magnitude parameter lora_magnitude_vector has that shape:
        (10,) for lin, (1, 6, 1, 1) for conv and pw.  Initialised to the norm at init (B = 0, so
        ||W rows||).
  Forward: the norm is recomputed each call from the current A, B and then DETACHED
        (weight_norm.detach(), DoRA paper sec. 4.3; no gradient flows through it).
        f = m / ||V||  (per output channel)
        y = base(x) + (f - 1) * (base(x) - bias) + f * s * lora_B(lora_A(x))
          = bias + f * (W x + s * B A x)          (in value: the merged weight below)
  Merge: W' = (m / ||W + dW||)[:, None(, None, None)] * (W + dW), dW = s B A; bias unchanged.

LoKr (lokr/layer.py).  s = alpha / r, ALWAYS (also when w1 and w2 are both full and r is used by
  no matrix; LyCORIS/ComfyUI use 1 there, see below).
  Factors: (in_m, in_n) = factorization(in, decompose_factor), (out_l, out_k) =
  factorization(out, decompose_factor); Conv2d uses in/out CHANNELS (the kernel stays in w2).
  w1 is (out_l, in_m): full lokr_w1, or lokr_w1_a (out_l, r) @ lokr_w1_b (r, in_m) when
        decompose_both and r < max(out_l, in_m) / 2.
  w2 is (out_k, in_n[, kh, kw]): full lokr_w2 unless r < max(out_k, in_n) / 2 (kernel dims not
        counted), then lokr_w2_a (out_k, r) @ lokr_w2_b (r, in_n) for Linear, and for Conv2d
        lokr_w2_a (out_k, r) @ lokr_w2_b (r, in_n*kh*kw) -> a 2-D (out_k, in_n*kh*kw).
        (use_effective_conv2d instead: lokr_t2 (r, r, kh, kw), lokr_w2_a (r, out_k), lokr_w2_b
        (r, in_n), w2 = einsum('ijkl,ip,jr->prkl'); not used here.)
  dW = s * kron(w1, w2) reshaped to W's shape.  Full 4-D w2: w1 is unsqueezed to
        (out_l, in_m, 1, 1) and kron gives (out_l*out_k, in_m*in_n, kh, kw).  2-D low-rank conv
        w2: kron gives (out, in_m*in_n*kh*kw), reshaped to (out, in, kh, kw).  Both are
        dW[a*out_k + b, c*in_n + d, h, w] = s * w1[a, c] * w2[b, d, h, w].
  Forward: y = base(x) + F.linear(x, dW) / F.conv2d(x, dW, stride, padding, dilation, groups)
        (the delta weight is built and applied as an extra op added to the base output).
  factorization(dim, factor): if factor > 0 and dim % factor == 0 return (factor, dim/factor)
        unsorted.  Otherwise (factor -1 means factor = dim) start at (m, n) = (1, dim) and step
        m through the divisors of dim in increasing order, n = dim/m, stopping once m >= n or the
        next divisor exceeds factor; swap so m <= n.  (The "m + n > length" test compares with
        1 + dim, fixed at the start, so it never fires.)  With -1 this returns
        (largest divisor <= sqrt(dim), dim / it); a prime p gives (1, p).
          dim    10     12     4      6      36     3072      12288
          (-1)   (2,5)  (3,4)  (2,2)  (2,3)  (6,6)  (48,64)   (96,128)
  Here: lin out 10 -> (out_l, out_k) = (2, 5), in 12 -> (in_m, in_n) = (3, 4);
        conv/pw out 6 -> (2, 3), in 4 -> (2, 2).

LoHa (loha/layer.py).  s = alpha / r.
  Linear: hada_w1_a (out, r), hada_w1_b (r, in), hada_w2_a (out, r), hada_w2_b (r, in).
  Conv2d (use_effective_conv2d False, and always for 1x1): the same with in -> in*kh*kw, so
        hada_w?_b is (r, in*kh*kw); dW = (w1_a @ w1_b) * (w2_a @ w2_b) * s  (Hadamard product,
        out x in*kh*kw) reshaped to (out, in, kh, kw).  (Effective conv: hada_t1/t2 (r,r,kh,kw)
        and hada_w?_a (r, out), hada_w?_b (r, in); not used here.)
  Forward: y = base(x) + F.linear / F.conv2d(x, dW) as LoKr.  Merge (LoKr and LoHa): W += dW.

=====================================================================================
LyCORIS / kohya / ComfyUI names for the same tensors (for the loaders). Sources read: LyCORIS
(KohakuBlueleaf/LyCORIS) at f49d30d (2025-10-04) and lycoris/modules/lokr.py at 01eed77;
ComfyUI (comfyanonymous/ComfyUI) comfy/lora.py, comfy/weight_adapter/{lora,lokr,loha}.py and
comfy/weight_adapter/base.py at 14c2085 and at 9c0cf36 (the newer one, by its content).
  Module prefix: kohya/LyCORIS write lora_unet_<path with . -> _> (lora_te_ for text
  encoders): LyCORIS lycoris/kohya.py LORA_PREFIX_UNET = "lora_unet"; ComfyUI comfy/lora.py
  model_lora_keys_unet maps "lora_unet_" + key.replace(".", "_"); the weight_adapter-era
  comfy/lora.py also maps "lycoris_" + path.replace(".", "_") (SimpleTuner's LyCORIS files) and,
  for some models, PEFT's "base_model.model.<path>" and "transformer.<path>".
  LoRA/LoCon: <p>.lora_down.weight = PEFT lora_A.weight (r, in[, kh, kw]), <p>.lora_up.weight =
    PEFT lora_B.weight (out, r[, 1, 1]); <p>.alpha scalar; scale alpha / r with r =
    lora_down.shape[0] (ComfyUI comfy/weight_adapter/lora.py: alpha / mat2.shape[0]; no alpha
    key -> scale 1).  ComfyUI also accepts PEFT-style <p>.lora_B.weight / <p>.lora_A.weight.
  LoKr: <p>.lokr_w1, .lokr_w1_a, .lokr_w1_b, .lokr_w2, .lokr_w2_a, .lokr_w2_b, .lokr_t2 (same
    names and orientation as PEFT, no ".weight"), plus <p>.alpha.  ComfyUI
    comfy/weight_adapter/lokr.py calculate_weight: dim = lokr_w1_b.shape[0] if w1 is low-rank,
    then overridden by lokr_w2_b.shape[0] if w2 is low-rank; scale = alpha / dim when an alpha
    key exists and some factor is low-rank, ELSE 1.0 (both full, or no alpha);
    dW = scale * kron(w1, w2) reshaped (w1 unsqueezed to 4-D when w2 is 4-D).  LyCORIS
    lycoris/modules/lokr.py: when both w1 and w2 are full it sets alpha = lora_dim (scale 1)
    and saves that alpha; otherwise scale = alpha / lora_dim.  So a PEFT LoKr with full
    w1/w2 (lokr_full here, s = 2) does NOT mean the same thing in a LyCORIS file: exporting it
    needs s baked into a factor.
  LoHa: <p>.hada_w1_a (out, r), .hada_w1_b (r, in*k*k), .hada_w2_a, .hada_w2_b, (.hada_t1,
    .hada_t2), <p>.alpha.  ComfyUI comfy/weight_adapter/loha.py: scale = alpha / hada_w1_b.shape[0]
    (1.0 without alpha); dW = (w1_a @ w1_b) * (w2_a @ w2_b) * scale reshaped.  Same layout as
    PEFT (LyCORIS lycoris/modules/loha.py: hada_w1_a (out, r), hada_w1_b (r, in*k*k)).
  DoRA: <p>.dora_scale (the weight_adapter-era ComfyUI comfy/lora.py load_lora reads
    "{x}.dora_scale" beside "{x}.alpha" and hands it to every adapter kind; the old 00728eb
    has no dora_scale).  Orientation differs from PEFT: LyCORIS (modules/lokr.py, loha.py,
    locon.py) at f49d30d has wd_on_out (default True): dora_scale = per-OUTPUT-row norm, shape
    (out, 1[, 1, 1]); with wd_on_out=False, and in older LyCORIS (lokr.py at 01eed77 has only
    this), it is the per-INPUT-column norm, shape (1, in[, 1, 1]) (norm over the out and
    kernel axes).  PEFT's lora_magnitude_vector is (out,) for Linear and (1, out, 1, 1) for
    Conv2d (reshape to (out, 1[, 1, 1]) for LyCORIS).  ComfyUI weight_decompose
    (comfy/weight_adapter/base.py): W' = (W + alpha*dW) * dora_scale / norm.  At 14c2085 the
    norm is always per input column of W + alpha*dW.  At 9c0cf36 it tests
    dora_scale.shape[0] == out: then the norm is per output row of the ORIGINAL W (not of
    W + alpha*dW, unlike PEFT and LyCORIS), else per input column of W + alpha*dW; eps
    (finfo.eps) is added to the norm.
"""

import copy
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import peft
import transformers
from peft import LoHaConfig, LoKrConfig, LoraConfig, get_peft_model, get_peft_model_state_dict
from peft.tuners.lokr.layer import factorization
from safetensors.torch import load_file, save_file

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SEED = 4242
TARGETS = ["lin", "conv", "pw"]
MODULES = ["lin", "conv", "pw"]
INPUT_SHAPES = {"lin": (2, 3, 12), "conv": (2, 4, 5, 7), "pw": (2, 4, 5, 7)}
ADAPTER_STD = 0.3
KINDS = ["lora", "dora", "lokr", "lokr_full", "loha", "lokr_tucker", "loha_tucker"]
# peft 0.21.2's HadaWeightCP.backward (peft/tuners/loha/layer.py, copied from LyCORIS) builds
# the gradients of hada_w1_a and hada_w2_a from the other half's core (`temp` of t2 for w1_a,
# of t1 for w2_a); its forward is right.
PEFT_TUCKER_LOHA_GRAD_BUG = {"hada_w1_a", "hada_w2_a"}
FACTOR_TABLE_DIMS = [10, 12, 4, 6, 36, 3072, 12288]


def config_for(kind):
    """PEFT config per kind (see the module docstring for why lokr is r=1)."""
    if kind in ("lora", "dora"):
        return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0,
                          use_dora=(kind == "dora"))
    if kind == "lokr":
        return LoKrConfig(r=1, alpha=3, target_modules=TARGETS, decompose_factor=-1,
                          decompose_both=True, rank_dropout=0.0, module_dropout=0.0,
                          use_effective_conv2d=False)
    if kind == "lokr_full":
        return LoKrConfig(r=4, alpha=8, target_modules=TARGETS, decompose_factor=-1,
                          decompose_both=False, rank_dropout=0.0, module_dropout=0.0,
                          use_effective_conv2d=False)
    if kind == "loha":
        return LoHaConfig(r=4, alpha=8, target_modules=TARGETS, rank_dropout=0.0,
                          module_dropout=0.0, use_effective_conv2d=False)
    if kind == "lokr_tucker":
        return LoKrConfig(r=2, alpha=3, target_modules=TARGETS, decompose_factor=1,
                          decompose_both=False, rank_dropout=0.0, module_dropout=0.0,
                          use_effective_conv2d=True)
    if kind == "loha_tucker":
        return LoHaConfig(r=4, alpha=8, target_modules=TARGETS, rank_dropout=0.0,
                          module_dropout=0.0, use_effective_conv2d=True)
    raise ValueError(kind)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 10, bias=True)
        self.conv = nn.Conv2d(4, 6, kernel_size=3, padding=1, bias=True)
        self.pw = nn.Conv2d(4, 6, kernel_size=1, bias=True)

    def forward(self, x):  # unused: each module is called on its own input
        return self.lin(x)


def rand(rng, shape, std=1.0):
    return torch.from_numpy(rng.standard_normal(shape) * std).to(torch.float64)


def base_model():
    rng = np.random.default_rng(SEED)
    model = Tiny().double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight"):
                fan_in = p[0].numel()
                p.copy_(rand(rng, tuple(p.shape), 0.7 / np.sqrt(fan_in)))
            else:
                p.copy_(rand(rng, tuple(p.shape), 0.1))
    return model


def inputs():
    rng = np.random.default_rng(SEED + 100)
    xs = {m: rand(rng, INPUT_SHAPES[m]) for m in MODULES}
    return xs, rng


def base_op(module, x, weight):
    if isinstance(module, nn.Linear):
        return F.linear(x, weight, module.bias)
    return F.conv2d(x, weight, module.bias, module.stride, module.padding, module.dilation,
                    module.groups)


def contiguous(sd):
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


def reference(kind, base, sd, scaling, xs, gs):
    """The formulas of the docstring, written out independently of PEFT. Returns y per module,
    merged weight per module and d loss / d (every sd tensor, every x)."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in sd.items()}
    xl = {m: xs[m].clone().requires_grad_(True) for m in MODULES}
    ys, merged = {}, {}
    for m in MODULES:
        mod = getattr(base, m)
        w = mod.weight.detach()
        out = w.shape[0]
        s = scaling[m]
        p = {k.rsplit(".", 1)[-1] if "lora_" not in k else k.split(f"model.{m}.")[1]: v
             for k, v in leaves.items() if k.startswith(f"base_model.model.{m}.")}
        if kind in ("lora", "dora"):
            a, b = p["lora_A.weight"], p["lora_B.weight"]
            r = a.shape[0]
            dw = s * (b.reshape(out, r) @ a.reshape(r, -1)).reshape(w.shape)
            if kind == "dora":
                v = w + dw
                norm = v.reshape(out, -1).norm(dim=1).detach()  # per output channel, detached
                f = p["lora_magnitude_vector"].reshape(-1) / norm
                wm = f.reshape(-1, *[1] * (w.dim() - 1)) * v
            else:
                wm = w + dw
        elif kind.startswith("lokr"):
            w1 = p["lokr_w1"] if "lokr_w1" in p else p["lokr_w1_a"] @ p["lokr_w1_b"]
            if "lokr_t2" in p:  # w2[b, d, h, w] = sum_ij t2[i, j, h, w] a[i, b] b[j, d]
                t, a, b = p["lokr_t2"], p["lokr_w2_a"], p["lokr_w2_b"]
                w2 = (a.t()[:, :, None, None, None] * t[None]).sum(1)  # (b, j, h, w)
                w2 = (b.t()[None, :, :, None, None] * w2[:, None]).sum(2)
            else:
                w2 = p["lokr_w2"] if "lokr_w2" in p else p["lokr_w2_a"] @ p["lokr_w2_b"]
            if w2.dim() == 4:
                w1 = w1[:, :, None, None]
            wm = w + s * torch.kron(w1, w2).reshape(w.shape)
        elif "hada_t1" in p:  # Tucker LoHa: each half sum_ij t[i, j, h, w] a[i, o] b[j, c]
            def half(t, a, b):
                return torch.tensordot(torch.tensordot(a.t(), t, dims=([1], [0])), b,
                                       dims=([1], [0])).permute(0, 3, 1, 2)
            dw = half(p["hada_t1"], p["hada_w1_a"], p["hada_w1_b"]) * \
                half(p["hada_t2"], p["hada_w2_a"], p["hada_w2_b"]) * s
            wm = w + dw
        else:  # loha
            dw = (p["hada_w1_a"] @ p["hada_w1_b"]) * (p["hada_w2_a"] @ p["hada_w2_b"]) * s
            wm = w + dw.reshape(w.shape)
        ys[m] = base_op(mod, xl[m], wm)
        merged[m] = wm.detach()
    loss = sum((ys[m] * gs[m]).sum() for m in MODULES)
    keys = sorted(leaves)
    gr = torch.autograd.grad(loss, [leaves[k] for k in keys] + [xl[m] for m in MODULES])
    grads = {f"grad.{k}": g for k, g in zip(keys, gr)}
    grads.update({f"grad.x.{m}": g for m, g in zip(MODULES, gr[len(keys):])})
    return {m: ys[m].detach() for m in MODULES}, merged, grads


def close(a, b, what):
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()
    assert err < 1e-12, (what, err)


def make_kind(kind, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    base = base_model()
    base_sd = {f"{m}.{p}": getattr(getattr(base, m), p).detach()
               for m in MODULES for p in ("weight", "bias")}

    config = config_for(kind)
    model = get_peft_model(copy.deepcopy(base), config)
    model.eval()
    inner = model.base_model.model
    dropped = [t for t in TARGETS if not hasattr(getattr(inner, t), "base_layer")]
    assert not dropped, dropped  # PEFT 0.17.0 accepts every kind on Linear and Conv2d

    # Overwrite every adapter parameter (named_parameters order) from one numpy stream.
    rng = np.random.default_rng(SEED + 1 + KINDS.index(kind))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with torch.no_grad():
        for name, p in trainable:
            if "lora_magnitude_vector" in name:
                continue
            p.copy_(rand(rng, tuple(p.shape), ADAPTER_STD))
        for name, p in trainable:  # DoRA: PEFT's initial norm times (1 + 0.1 N(0,1))
            if "lora_magnitude_vector" in name:
                p.mul_(1.0 + rand(rng, tuple(p.shape), 0.1))

    # PEFT's state dict; map its keys to the live parameters by storage.
    sd = get_peft_model_state_dict(model)
    by_ptr = {p.data_ptr(): n for n, p in trainable}
    key_of_param = {}
    for k, v in sd.items():
        name = by_ptr[v.data_ptr()]
        assert name not in key_of_param, (k, name)
        key_of_param[name] = k
    assert len(key_of_param) == len(trainable) == len(sd), (sorted(sd), [n for n, _ in trainable])
    save_file(contiguous(sd), os.path.join(out_dir, "peft.safetensors"))

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        shutil.copyfile(os.path.join(tmp, "adapter_config.json"),
                        os.path.join(out_dir, "adapter_config.json"))
        saved = load_file(os.path.join(tmp, "adapter_model.safetensors"))
        assert sorted(saved) == sorted(sd)
        for k in sd:
            assert torch.equal(saved[k], sd[k].to(saved[k].dtype)), k

    # Forward / backward.
    xs, rng_io = inputs()
    io = {}
    xs_grad = {m: xs[m].clone().requires_grad_(True) for m in MODULES}
    ys = {m: getattr(inner, m)(xs_grad[m]) for m in MODULES}
    gs = {m: rand(rng_io, tuple(ys[m].shape)) for m in MODULES}
    loss = sum((ys[m] * gs[m]).sum() for m in MODULES)
    params = [p for _, p in trainable]
    grads = torch.autograd.grad(loss, params + [xs_grad[m] for m in MODULES])
    with torch.no_grad():
        base_ys = {m: getattr(base, m)(xs[m]) for m in MODULES}
    for m in MODULES:
        io[f"y.{m}"] = ys[m].detach()
    for (name, _), g in zip(trainable, grads[: len(params)]):
        io[f"grad.{key_of_param[name]}"] = g
    for m, g in zip(MODULES, grads[len(params):]):
        io[f"grad.x.{m}"] = g

    # PEFT's merge on a deep copy.
    merged_model = copy.deepcopy(model).merge_and_unload()
    for m in MODULES:
        w = getattr(merged_model, m).weight.detach()
        io[f"merged.{m}.weight"] = w
        io[f"delta.{m}"] = w - base_sd[f"{m}.weight"].detach()
        layer = getattr(inner, m)
        if kind != "dora":
            with torch.no_grad():
                dw = layer.get_delta_weight("default")
            assert torch.allclose(dw, io[f"delta.{m}"], rtol=0, atol=1e-12), m
        # The adapted forward equals the base op with the merged weight.
        with torch.no_grad():
            want = base_op(getattr(base, m), xs[m], w)
        err = (want - io[f"y.{m}"]).abs().max().item()
        assert err < 1e-12, (kind, m, err)
        assert (io[f"y.{m}"] - base_ys[m]).abs().max().item() > 1e-2, (kind, m)

    # The docstring's formulas, independently of PEFT.
    scaling = {m: getattr(inner, m).scaling["default"] for m in MODULES}
    ref_y, ref_w, ref_g = reference(kind, base, sd, scaling, xs, gs)
    for m in MODULES:
        close(ref_y[m], io[f"y.{m}"], (kind, "y", m))
        close(ref_w[m], io[f"merged.{m}.weight"], (kind, "merged", m))
    assert sorted(ref_g) == sorted(k for k in io if k.startswith("grad.")), kind
    for k, g in ref_g.items():
        if kind == "loha_tucker" and k.endswith(tuple(f"conv.{n}" for n in PEFT_TUCKER_LOHA_GRAD_BUG)):
            # PEFT's hand-written backward (HadaWeightCP) is wrong here: the gradients of the
            # fixture are autograd's, through the forward PEFT computes (checked above).
            err = ((g - io[k]).abs().max() / g.abs().max()).item()
            assert err > 1e-3, (kind, k, err)
            print(f"  {kind} {k}: PEFT's backward off by {err:.2e}; autograd's stored")
            io[k] = g
            continue
        close(g, io[k], (kind, k))
    save_file(contiguous(io), os.path.join(out_dir, "io.safetensors"))

    shared = {f"base.{k}": v for k, v in base_sd.items()}
    for m in MODULES:
        shared[f"x.{m}"] = xs[m]
        shared[f"base_y.{m}"] = base_ys[m]
        shared[f"g.{m}"] = gs[m]

    # Metadata.
    modules = {}
    for m in MODULES:
        layer = getattr(inner, m)
        info = {"type": type(layer.base_layer).__name__,
                "weight_shape": list(layer.base_layer.weight.shape),
                "r": layer.r["default"],
                "scaling": layer.scaling["default"]}
        alphas = layer.lora_alpha if kind in ("lora", "dora") else layer.alpha
        info["alpha"] = alphas["default"]
        if kind.startswith("lokr"):
            bl = layer.base_layer
            in_dim = bl.in_features if isinstance(bl, nn.Linear) else bl.in_channels
            out_dim = bl.out_features if isinstance(bl, nn.Linear) else bl.out_channels
            info["in_m_in_n"] = list(factorization(in_dim, config.decompose_factor))
            info["out_l_out_k"] = list(factorization(out_dim, config.decompose_factor))
            info["w1_low_rank"] = "default" in layer.lokr_w1_a
            info["w2_low_rank"] = "default" in layer.lokr_w2_a
            info["tucker_t2"] = "default" in layer.lokr_t2
        if kind == "dora":
            info["magnitude_shape"] = list(layer.lora_magnitude_vector["default"].weight.shape)
        modules[m] = info
    cfg = {k: v for k, v in config.to_dict().items() if not isinstance(v, (set,))}
    cfg["target_modules"] = sorted(config.target_modules)
    meta = {
        "kind": kind,
        "peft_version": peft.__version__,
        "torch_version": torch.__version__.split("+")[0],
        "transformers_version": transformers.__version__,
        "config_class": type(config).__name__,
        "config": {k: cfg[k] for k in sorted(cfg) if k in (
            "r", "lora_alpha", "alpha", "use_dora", "use_rslora", "lora_dropout", "rank_dropout",
            "module_dropout", "decompose_both", "decompose_factor", "use_effective_conv2d",
            "init_weights", "init_lora_weights", "target_modules", "peft_type")},
        "modules": modules,
        "targets_dropped": dropped,
        "peft_keys": sorted(sd),
        "shapes": {k: list(sd[k].shape) for k in sorted(sd)},
        "io_keys": sorted(io),
        "inputs_keys (../inputs.safetensors)": sorted(k for k in shared
                                                       if not k.startswith("base.")),
        "base_keys (../base.safetensors)": sorted(base_sd),
        "seeds": {"base": SEED, "adapter": SEED + 1 + KINDS.index(kind), "io": SEED + 100},
        "adapter_std": ADAPTER_STD,
        "loss": "sum over m in (lin, conv, pw) of (y.m * g.m).sum()",
    }
    if kind.startswith("lokr"):
        meta["factorization_table"] = {str(d): list(factorization(d, -1))
                                       for d in FACTOR_TABLE_DIMS}
    with open(os.path.join(out_dir, "meta.json"), "w") as f:  # one top-level key a line
        items = [f" {json.dumps(k)}: {json.dumps(meta[k], sort_keys=True)}" for k in sorted(meta)]
        f.write("{\n" + ",\n".join(items) + "\n}\n")
    return shared


def main():
    if os.environ.get("PYTHONHASHSEED") != "0":  # fixes the order of sets (target_modules)
        os.execve(sys.executable, [sys.executable] + sys.argv,
                  dict(os.environ, PYTHONHASHSEED="0"))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "fixtures", "adapters")
    kinds = sys.argv[2:] or KINDS
    shared = None
    if kinds != KINDS:  # some kinds only: the shared files must be the ones already there
        shared = {f"base.{k}": v for k, v in load_file(os.path.join(out, "base.safetensors")).items()}
        shared.update(load_file(os.path.join(out, "inputs.safetensors")))
    for kind in kinds:
        got = make_kind(kind, os.path.join(out, kind))
        if shared is None:
            shared = got
        for k in shared:  # kind-independent by construction; check it
            assert torch.equal(shared[k], got[k]), (kind, k)
        print("wrote", os.path.join(out, kind))
    if kinds != KINDS:
        return
    base = {k[len("base."):]: v for k, v in shared.items() if k.startswith("base.")}
    inputs = {k: v for k, v in shared.items() if not k.startswith("base.")}
    save_file(contiguous(base), os.path.join(out, "base.safetensors"))
    save_file(contiguous(inputs), os.path.join(out, "inputs.safetensors"))
    print("wrote", os.path.join(out, "base.safetensors"), "and inputs.safetensors")


if __name__ == "__main__":
    main()
