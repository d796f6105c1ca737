#!/usr/bin/env python3
"""Fixture for tests/data.rs: PIL's float resize of a small smooth image, the reference of
`flame::data`'s resize (the `image` crate's Lanczos3 and Catmull-Rom filters).

The source image is defined by a formula that tests/data.rs repeats exactly:
    v(c, y, x) = 0.5 + 0.4 * sin(0.3 * x + 0.2 * y + 1.1 * c)   for c in 0..3,
an RGB image of 29 x 18 (width x height) in [0.1, 0.9], computed in f32.

Each channel is resized alone as a 32-bit float image ("F" mode, no 8-bit rounding) with
PIL's LANCZOS (a = 3) and BICUBIC (a = -0.5, Catmull-Rom), down to 20 x 12 and up to
40 x 25. Both libraries centre pixel i at i + 0.5, stretch the kernel by the scale when
downsampling and normalise the weights of each output pixel, so they agree up to float
rounding. The smooth image keeps every value inside [0, 1] (the `image` crate clamps there).

Writes tests/fixtures/data/resize.json:
    {"source": [29, 18], "cases": [{"filter": "lanczos3" | "catmullrom",
      "size": [w, h], "values": [c][y][x] in [0, 1]}, ...]}

Deterministic. Run: python3 scripts/make_data_fixtures.py
Made with Pillow 13.0.0, numpy 2.4.6.
"""

import json
import os

import numpy as np
from PIL import Image

W, H = 29, 18


def source():
    x = np.arange(W, dtype=np.float32)[None, :]
    y = np.arange(H, dtype=np.float32)[:, None]
    return [
        (np.float32(0.5) + np.float32(0.4) * np.sin(np.float32(0.3) * x + np.float32(0.2) * y
                                                    + np.float32(1.1 * c))).astype(np.float32)
        for c in range(3)
    ]


def main():
    chans = source()
    cases = []
    for name, filt in [("lanczos3", Image.LANCZOS), ("catmullrom", Image.BICUBIC)]:
        for size in [(20, 12), (40, 25)]:
            out = [np.asarray(Image.fromarray(ch, mode="F").resize(size, filt)) for ch in chans]
            assert all(0.0 <= o.min() and o.max() <= 1.0 for o in out)
            cases.append({
                "filter": name,
                "size": list(size),
                "values": [[[round(float(v), 7) for v in row] for row in o] for o in out],
            })
    here = os.path.dirname(os.path.abspath(__file__))
    dst = os.path.join(here, "..", "tests", "fixtures", "data")
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "resize.json"), "w") as f:
        json.dump({"source": [W, H], "cases": cases}, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
