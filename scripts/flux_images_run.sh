#!/usr/bin/env bash
# A full-size run on a GPU: a random FLUX.1-dev pipeline (made by
# benches/torch_encoders.py --make DIR --transformer) trained from a folder of generated
# 1024-pixel pictures with captions through the `train` binary: caching, 20 steps under a
# memory budget (24 GiB unless given), validation, and one 1024² sample at the end; every phase timed.
#   bash scripts/flux_images_run.sh DIR TRAIN_EXE [BUDGET_GB]
set -euo pipefail
dir=$1
exe=$2
budget=${3:-24}
python3 "$(dirname "$0")/circle_images.py" "$dir/images"
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
