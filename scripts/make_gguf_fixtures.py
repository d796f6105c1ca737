#!/usr/bin/env python3
"""Ground truth for FLAME's GGUF reader and GGML dequantization, made with gguf-py.

Usage:  /work/pyenv/bin/python3 scripts/make_gguf_fixtures.py [OUT_DIR]
        (default OUT_DIR: tests/fixtures/gguf; needs `pip install gguf`, made with gguf 0.19.0)

Writes, with gguf-py's own GGUFWriter:
  types.gguf          metadata of every value type (arrays included, one nested) and, for
                      every type FLAME reads, tensors with odd row counts:
                        <type>.random     random block bytes with sane f16 scales (any
                                          bytes are valid codes), shape (rows, cols)
                        <type>.quantized  gguf.quants.quantize of normal values, where gguf-py
                                          can quantize that type
                      plus a 3-D F32 tensor (dims reversed on disk) and a 1-D F16 bias.
  values.safetensors  gguf.quants.dequantize of every tensor (f32), under the same names.
  meta.json           the metadata values written, for the reader's test.

Every number comes from numpy's PCG64 with a fixed seed; running it twice gives identical
files.
"""
import json
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from safetensors.numpy import save_file

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(__file__), "..", "tests", "fixtures", "gguf")
os.makedirs(OUT, exist_ok=True)
rng = np.random.default_rng(20261129)

# (type, rows, blocks per row); rows odd. Byte offsets of the f16 scales in each block (ggml's
# ggml-common.h layouts) get sane values so the random blocks decode to finite numbers.
TYPES = [
    (T.F32, 5, 7, []),
    (T.F16, 3, 9, []),
    (T.BF16, 7, 5, []),
    (T.Q4_0, 5, 3, [0]),
    (T.Q4_1, 3, 3, [0, 2]),
    (T.Q5_0, 7, 1, [0]),
    (T.Q5_1, 5, 2, [0, 2]),
    (T.Q8_0, 9, 3, [0]),
    (T.Q2_K, 3, 2, [80, 82]),
    (T.Q3_K, 5, 1, [108]),
    (T.Q4_K, 3, 3, [0, 2]),
    (T.Q5_K, 5, 2, [0, 2]),
    (T.Q6_K, 3, 2, [208]),
]


def random_blocks(qtype, rows, nblocks, scales):
    bv, bb = gguf.GGML_QUANT_SIZES[qtype]
    if bv == 1:
        vals = rng.standard_normal((rows, nblocks)).astype(np.float32)
        if qtype == T.F32:
            return vals.view(np.uint8).reshape(rows, -1), vals
        if qtype == T.F16:
            return vals.astype(np.float16).view(np.uint8).reshape(rows, -1), None
        return gguf.quants.quantize(vals, qtype), None
    b = rng.integers(0, 256, size=(rows, nblocks, bb), dtype=np.uint8)
    for at in scales:
        d = (rng.uniform(0.01, 0.1, size=(rows, nblocks)) * rng.choice([-1, 1], size=(rows, nblocks)))
        b[:, :, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(rows, nblocks, 2)
    return b.reshape(rows, nblocks * bb), None


w = gguf.GGUFWriter(os.path.join(OUT, "types.gguf"), arch="flame-test")
meta = {
    "test.u8": ("uint8", 200), "test.i8": ("int8", -100), "test.u16": ("uint16", 60000),
    "test.i16": ("int16", -30000), "test.u32": ("uint32", 4000000000),
    "test.i32": ("int32", -2000000000), "test.f32": ("float32", 1.5), "test.bool": ("bool", True),
    "test.string": ("string", "grüße"), "test.u64": ("uint64", 2**40), "test.i64": ("int64", -2**40),
    "test.f64": ("float64", 0.1),
}
for k, (kind, v) in meta.items():
    getattr(w, "add_" + kind)(k, v)
w.add_array("test.ints", [1, 2, 3])
w.add_array("test.strings", ["a", "bc", ""])
w.add_array("test.nested", [[1, 2], [3]])
w.add_custom_alignment(64)

values = {}
for qtype, rows, nblocks, scales in TYPES:
    name = qtype.name.lower()
    bv, _ = gguf.GGML_QUANT_SIZES[qtype]
    raw, _ = random_blocks(qtype, rows, nblocks, scales)
    w.add_tensor(f"{name}.random", raw, raw_dtype=qtype)
    values[f"{name}.random"] = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    x = rng.standard_normal((rows, nblocks * bv)).astype(np.float32)
    try:
        q = gguf.quants.quantize(x, qtype)
    except NotImplementedError:
        continue
    w.add_tensor(f"{name}.quantized", q, raw_dtype=qtype)
    values[f"{name}.quantized"] = gguf.quants.dequantize(q, qtype).astype(np.float32)

cube = rng.standard_normal((3, 5, 2)).astype(np.float32)
w.add_tensor("cube", cube)
values["cube"] = cube
bias = rng.standard_normal(7).astype(np.float16)
w.add_tensor("bias", bias)
values["bias"] = bias.astype(np.float32)

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
save_file(values, os.path.join(OUT, "values.safetensors"))
meta_out = {k: v for k, (_, v) in meta.items()}
meta_out.update({"test.ints": [1, 2, 3], "test.strings": ["a", "bc", ""], "test.nested": [[1, 2], [3]],
                 "general.alignment": 64, "general.architecture": "flame-test"})
with open(os.path.join(OUT, "meta.json"), "w") as f:
    json.dump(meta_out, f, indent=1, ensure_ascii=False, sort_keys=True)
print("wrote", sorted(values))
