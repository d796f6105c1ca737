#!/usr/bin/env bash
# The full-size check of issue 21 on the GPU machine: a random FLUX.1-dev pipeline (made by
# benches/torch_encoders.py --make DIR --transformer) trained from a folder of generated
# 1024-pixel pictures with captions through the `train` binary: caching, 20 steps under a
# memory budget (24 GiB unless given), validation, and one 1024² sample at the end; every phase timed.
#   bash scripts/flux_images_run.sh DIR TRAIN_EXE [BUDGET_GB]
set -euo pipefail
dir=$1
exe=$2
budget=${3:-24}
python3 - "$dir/images" <<'PY'
import os, sys
from PIL import Image, ImageDraw
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
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
    open(f"{out}/img-{i}.txt", "w").write(f"a {name} circle on a white background")
PY
cat > "$dir/run.toml" <<TOML
[model]
arch = "flux"
path = "$dir"
dtype = "bf16"
guidance = 1.0

[adapter]
rank = 16
alpha = 16.0
targets = ["double_blocks.*_attn.qkv", "double_blocks.*_attn.proj", "double_blocks.*_mlp.*", "single_blocks.*.linear*"]
format = "peft"

[optimizer]
lr = 1e-4

[train]
steps = 20
batch_size = 1
seed = 1
output_dir = "$dir/out"
device = "cuda"
validate_every = 10
log_every = 5

[memory]
budget_gb = $budget

[data]
resolution = 1024
validation_split = 0.2

[[data.dirs]]
path = "$dir/images"

[sample]
prompts = ["a red circle on a white background"]
steps = 20
guidance = 3.5
TOML
"$exe" "$dir/run.toml" --overwrite 2>&1 | python3 -u -c '
import sys, time
t = time.time()
for line in sys.stdin:
    print(f"{time.time() - t:7.1f} s  {line}", end="", flush=True)
' 
ls -la "$dir/out" "$dir/out/samples"
