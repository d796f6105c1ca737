"""Eight generated pictures with captions for the full-size runs on the GPU machine: a
coloured circle on a light ground at 1024x1024 (4), 832x1216 (2) and 1216x832 (2), each with
a .txt caption beside it. With REFERENCE_DIR, an edit dataset: each picture's reference
image of the same name there (a grey circle on the same ground and size) and an instruction
as its caption.
    python3 scripts/circle_images.py OUT_DIR [REFERENCE_DIR]"""
import os
import sys

from PIL import Image, ImageDraw

out = sys.argv[1]
refs = sys.argv[2] if len(sys.argv) > 2 else None
os.makedirs(out, exist_ok=True)
if refs:
    os.makedirs(refs, exist_ok=True)
sizes = [(1024, 1024)] * 4 + [(832, 1216)] * 2 + [(1216, 832)] * 2
colours = [("red", (220, 40, 40)), ("green", (40, 200, 60)), ("blue", (40, 70, 220)),
           ("yellow", (230, 210, 40))]
for i, (w, h) in enumerate(sizes):
    name, c = colours[i % 4]
    im = Image.new("RGB", (w, h), (240, 240, 240))
    d = ImageDraw.Draw(im)
    r = min(w, h) // 4
    d.ellipse((w // 2 - r, h // 2 - r, w // 2 + r, h // 2 + r), fill=c)
    im.save(f"{out}/img-{i}.png")
    if refs:
        ref = Image.new("RGB", (w, h), (240, 240, 240))
        ImageDraw.Draw(ref).ellipse((w // 2 - r, h // 2 - r, w // 2 + r, h // 2 + r),
                                    fill=(128, 128, 128))
        ref.save(f"{refs}/img-{i}.png")
    with open(f"{out}/img-{i}.txt", "w") as f:
        f.write(f"make the circle {name}" if refs else f"a {name} circle on a white background")
