#!/usr/bin/env python3
"""A random FLUX.1-dev GGUF in city96's layout (huggingface.co/city96/FLUX.1-dev-gguf), made in
seconds: the key names of BFL's `flux1-dev.safetensors`, every tensor typed as city96's tools
type it, and random contents. Quantized tensors are random block bytes whose f16 scales make
the weights' spread about 0.02 (any bytes are valid codes); nothing is quantized here.

Usage:
    python3 scripts/random_flux_gguf.py OUT.gguf --type Q8_0|Q4_K [--tiny] [--seed N]
    python3 scripts/random_flux_gguf.py --wheel .whl     the installed gguf as a wheel there

--tiny: the same code at small widths (1 double and 1 single block, hidden 256 in two heads of
128 so that the shapes give the config as for the full model; text width 32, pooled width 16
and 16 input channels, the tiny demo's encoders' and autoencoder's (`train --make-tiny`)).

Types, as city96's tools choose them (ComfyUI-GGUF tools/convert.py and tools/lcpp.patch,
`img_tensor_get_type`): 1-D tensors and tensors of at most 1024 values in F32; `img_in.`,
`time_in.in_layer.`, `vector_in.in_layer.`, `guidance_in.in_layer.` and `final_layer.linear.`
in F32; the rest of `txt_in.`, `time_in.`, `vector_in.`, `guidance_in.` and `final_layer.` in
F16; every other 2-D weight in the file's type (Q8_0, or Q4_K for Q4_K_S, whose other rules
match no Flux name), F16 where a K-quant's rows are not whole 256-blocks.

Needs numpy and gguf-py (made with gguf 0.19.0). Without an installed gguf, a wheel or
tarball of it in the repository's .whl/ (e.g. .whl/gguf-0.19.0-py3-none-any.whl) is put on
the import path: gguf is pure Python, so Python imports it from the zip as it is.
"""
import glob
import os
import sys
import time

import numpy as np

try:
    import gguf
except ImportError:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    wheels = sorted(glob.glob(os.path.join(root, ".whl", "gguf-*.whl")))
    if not wheels:
        sys.exit("random_flux_gguf.py: no gguf module and no .whl/gguf-*.whl to import it from")
    sys.path.insert(0, wheels[-1])
    import gguf

T = gguf.GGMLQuantizationType

# FLUX.1-dev (BFL's flux/util.py `flux-dev` FluxParams): in 64, vec 768, context 4096,
# hidden 3072, mlp ratio 4, 24 heads (head dim 128), 19 double and 38 single blocks, qkv bias,
# guidance embedding.
DEV = dict(in_ch=64, vec=768, ctx=4096, hidden=3072, mlp=12288, head=128, double=19,
           single=38)
TINY = dict(in_ch=16, vec=16, ctx=32, hidden=256, mlp=512, head=128, double=1, single=1)


def flux_keys(c):
    """BFL's Flux single-file keys in its order, with shapes (rows, cols) or (n,)."""
    h, mlp, hd = c["hidden"], c["mlp"], c["head"]
    out = []

    def linear(name, rows, cols, bias=True):
        out.append((name + ".weight", (rows, cols)))
        if bias:
            out.append((name + ".bias", (rows,)))

    linear("img_in", h, c["in_ch"])
    linear("time_in.in_layer", h, 256)
    linear("time_in.out_layer", h, h)
    linear("vector_in.in_layer", h, c["vec"])
    linear("vector_in.out_layer", h, h)
    linear("guidance_in.in_layer", h, 256)
    linear("guidance_in.out_layer", h, h)
    linear("txt_in", h, c["ctx"])
    for i in range(c["double"]):
        for s in ("img", "txt"):
            p = f"double_blocks.{i}.{s}_"
            linear(p + "mod.lin", 6 * h, h)
            linear(p + "attn.qkv", 3 * h, h)
            out.append((p + "attn.norm.query_norm.scale", (hd,)))
            out.append((p + "attn.norm.key_norm.scale", (hd,)))
            linear(p + "attn.proj", h, h)
            linear(p + "mlp.0", mlp, h)
            linear(p + "mlp.2", h, mlp)
    for i in range(c["single"]):
        p = f"single_blocks.{i}."
        linear(p + "linear1", 3 * h + mlp, h)
        linear(p + "linear2", h, h + mlp)
        out.append((p + "norm.query_norm.scale", (hd,)))
        out.append((p + "norm.key_norm.scale", (hd,)))
        linear(p + "modulation.lin", 3 * h, h)
    linear("final_layer.linear", c["in_ch"], h)
    linear("final_layer.adaLN_modulation.1", 2 * h, h)
    return out


F32_PREFIXES = ("img_in.", "time_in.in_layer.", "vector_in.in_layer.", "guidance_in.in_layer.",
                "final_layer.linear.")
F16_PREFIXES = ("txt_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer.")


def type_of(name, shape, qtype):
    """The ggml type city96's tools give the tensor `name` of `shape` in a `qtype` file."""
    if len(shape) == 1 or int(np.prod(shape)) <= 1024 or name.startswith(F32_PREFIXES):
        return T.F32
    if name.startswith(F16_PREFIXES):
        return T.F16
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return qtype if shape[-1] % block == 0 else T.F16


# Byte offsets of the f16 scales of a block and the values they get: weights of spread about
# 0.02 (ggml-common.h block layouts). Q8_0: d, then 32 int8 (spread ~74): d = 0.02 / 74.
# Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit codes; a value is
# d * sc * q - dmin * m (sc, m in 0..63, q in 0..15): d = 1e-4 spreads d * sc * q by ~0.02
# and dmin = 7.5e-4 centres the sub-blocks' means near 0.
SCALES = {T.Q8_0: [(0, 0.02 / 74)], T.Q4_K: [(0, 1e-4), (2, 7.5e-4)]}


def tensor_bytes(rng, name, shape, ty):
    """The tensor's data: norm scales 1, biases 0, F32 / F16 weights N(0, 0.02), quantized
    weights random blocks with the scales of SCALES."""
    if ty in (T.F32, T.F16):
        dt = np.float32 if ty == T.F32 else np.float16
        if len(shape) == 1:
            fill = 1.0 if name.endswith(".scale") else 0.0
            return np.full(shape, fill, dtype=dt)
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dt)
    values, size = gguf.GGML_QUANT_SIZES[ty]
    rows, cols = shape
    blocks = rows * cols // values
    # Random 64-bit words are ten times faster to draw than `rng.bytes`.
    words = rng.integers(0, np.iinfo(np.uint64).max, size=-(-blocks * size // 8),
                         dtype=np.uint64, endpoint=True)
    b = words.view(np.uint8)[:blocks * size].reshape(blocks, size)
    for at, d in SCALES[ty]:
        b[:, at:at + 2] = np.array([d], dtype=np.float16).view(np.uint8)
    return b.reshape(rows, cols // values * size)


def write(path, qtype, cfg, seed=0):
    """Writes the random Flux of `cfg` in `qtype` to `path`; returns {name: type}."""
    rng = np.random.default_rng(seed)
    keys = flux_keys(cfg)
    types = {n: type_of(n, s, qtype) for n, s in keys}
    w = gguf.GGUFWriter(path, arch="flux")
    # city96's files: general.architecture "flux", the quantization version, the file type.
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type({T.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
                     T.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_S}[qtype])
    for n, s in keys:
        ty = types[n]
        if ty in (T.F32, T.F16):
            nbytes = int(np.prod(s)) * (4 if ty == T.F32 else 2)
            dt = np.float32 if ty == T.F32 else np.float16
            w.add_tensor_info(n, s, np.dtype(dt), nbytes)
        else:
            values, size = gguf.GGML_QUANT_SIZES[ty]
            byte_shape = (s[0], s[1] // values * size)
            w.add_tensor_info(n, byte_shape, np.dtype(np.uint8), s[0] * byte_shape[1],
                              raw_dtype=ty)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    # One tensor at a time: the file is streamed, never held whole.
    for n, s in keys:
        w.write_tensor_data(tensor_bytes(rng, n, s, types[n]))
    w.close()
    return types


def wheel(out_dir):
    """The imported gguf package as a wheel in `out_dir` (its .py files, METADATA, WHEEL and a
    RECORD of their hashes), for a machine without it: `pip install --no-deps` takes it, and
    this script imports it from .whl/ as it is."""
    import base64
    import hashlib
    import zipfile
    import importlib.metadata as md
    version = md.version("gguf")
    pkg = os.path.dirname(gguf.__file__)
    info = f"gguf-{version}.dist-info"
    files = {}
    for dirpath, dirnames, names in os.walk(pkg):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for n in sorted(names):
            if n.endswith((".py", ".typed")):
                full = os.path.join(dirpath, n)
                rel = os.path.join("gguf", os.path.relpath(full, pkg))
                with open(full, "rb") as f:
                    files[rel] = f.read()
    files[f"{info}/METADATA"] = md.distribution("gguf").read_text("METADATA").encode()
    files[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: random_flux_gguf.py\n"
                              b"Root-Is-Purelib: true\nTag: py3-none-any\n")
    record = []
    for rel, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        record.append(f"{rel},sha256={digest.decode()},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"gguf-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for rel, data in files.items():
            z.writestr(rel, data)
    print(f"wrote {path}: {os.path.getsize(path) / 1024:.0f} KiB")


def main():
    args = sys.argv[1:]
    if args[:1] == ["--wheel"] and len(args) == 2:
        return wheel(args[1])
    if not args or "--type" not in args:
        sys.exit(__doc__)
    out = args[0]
    qtype = {"Q8_0": T.Q8_0, "Q4_K": T.Q4_K}.get(args[args.index("--type") + 1])
    if qtype is None:
        sys.exit("--type: Q8_0 or Q4_K")
    seed = int(args[args.index("--seed") + 1]) if "--seed" in args else 0
    cfg = TINY if "--tiny" in args else DEV
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    t = time.perf_counter()
    types = write(out, qtype, cfg, seed)
    counts = {}
    for ty in types.values():
        counts[ty.name] = counts.get(ty.name, 0) + 1
    print(f"wrote {out}: {len(types)} tensors ({counts}), "
          f"{os.path.getsize(out) / 2**30:.2f} GiB in {time.perf_counter() - t:.1f} s",
          flush=True)


if __name__ == "__main__":
    main()
