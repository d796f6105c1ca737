"""Reads TensorBoard event files FLAME wrote with TensorBoard's own reader
(`tensorboard.backend.event_processing.event_accumulator`) and checks them against the
values FLAME logged: each step's loss, learning rate and gradient norm (as float32), once
per step though the run was interrupted and resumed (the resumed file's restart marker
drops the steps the first file logged past the checkpoint), and the sample image's PNG.

    /work/pyenv/bin/pip install tensorboard
    /work/pyenv/bin/python3 scripts/check_tensorboard.py [FOLDER]

FOLDER defaults to tests/fixtures/tensorboard (written by tests/runlogs.rs,
`the_tensorboard_fixture_decodes`, with FLAME_WRITE_FIXTURES=1): its event files and
expected.json (the run's loss.jsonl lines and the image's tag, step and size).
"""
import io
import json
import os
import struct
import sys

import numpy as np
from tensorboard.backend.event_processing import event_accumulator


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    folder = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "tests", "fixtures", "tensorboard")
    with open(os.path.join(folder, "expected.json")) as f:
        expected = json.load(f)
    acc = event_accumulator.EventAccumulator(
        folder, size_guidance={event_accumulator.SCALARS: 0, event_accumulator.IMAGES: 0}
    )
    acc.Reload()
    tags = acc.Tags()
    for tag in ("train/loss", "train/lr", "train/grad_norm"):
        assert tag in tags["scalars"], (tag, tags)
    checked = 0
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm")):
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        want_steps = [line["step"] for line in expected["scalars"] if key in line]
        assert steps == want_steps, f"{tag}: steps {steps}, expected {want_steps}"
        for e, line in zip(events, [l for l in expected["scalars"] if key in l]):
            assert e.value == f32(line[key]), f"{tag} at {e.step}: {e.value} vs {line[key]}"
            checked += 1
    for img in expected["images"]:
        events = acc.Images(img["tag"])
        assert len(events) == 1, events
        e = events[0]
        assert e.step == img["step"] and e.width == img["width"] and e.height == img["height"], e
        try:
            from PIL import Image

            im = Image.open(io.BytesIO(e.encoded_image_string))
            assert im.size == (img["width"], img["height"]), im.size
            assert np.asarray(im).shape[:2] == (img["height"], img["width"])
        except ImportError:
            assert e.encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"
        checked += 1
    print(f"ok: {checked} values checked with tensorboard's event_accumulator in {os.path.normpath(folder)}")


if __name__ == "__main__":
    main()
