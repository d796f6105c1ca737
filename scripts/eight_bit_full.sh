#!/usr/bin/env bash
# The loss of a 500-step LoRA run on a full-size random FLUX.1-dev pipeline with the frozen
# base's products in bf16, FP8 and int8 (docs/TRAINING.md, "8-bit products: accuracy"), from
# the eight generated pictures of scripts/circle_images.py at 512 pixels, validation every 100
# steps. Usage, on a GPU machine, from the repository root:
#   [IMAGES=FOLDER] [TAG=NAME] bash scripts/eight_bit_full.sh DIR TRAIN_EXE [STEPS] [CODES]
# DIR holds the pipeline (made by benches/torch_encoders.py --make DIR --transformer when it
# has no transformer yet); CODES default "bf16 fp8 int8" (the first is the reference).
# IMAGES: a folder of pictures with .txt captions to train on instead of the generated ones
# (photographs, for the comparison on real pictures); TAG names the runs' folders
# (out-TAG-CODE, default out-CODE) so runs on other pictures sit beside them. A run that
# finished before (its done file) is not run again, so the runs can be spread over several
# calls.
set -euo pipefail
dir=$1
exe=$2
steps=${3:-500}
codes=${4:-bf16 fp8 int8}
here=$(dirname "$0")
[ -d "$dir/transformer" ] || python3 "$here/../benches/torch_encoders.py" --make "$dir" --transformer
images=${IMAGES:-$dir/images}
[ -n "${IMAGES:-}" ] || [ -d "$images" ] || python3 "$here/circle_images.py" "$images"
tag=${TAG:+$TAG-}
for code in $codes; do
  out="$dir/out-$tag$code"
  [ -f "$out/done" ] && continue
  cat > "$dir/$tag$code.toml" <<TOML
[model]
arch = "flux"
path = "$dir"
dtype = "bf16"
compute = "$code"
guidance = 1.0

[adapter]
rank = 16
alpha = 16.0
targets = ["double_blocks.*_attn.qkv", "double_blocks.*_attn.proj", "double_blocks.*_mlp.*", "single_blocks.*.linear*"]

[optimizer]
lr = 1e-4

[train]
steps = $steps
batch_size = 1
seed = 1
output_dir = "$out"
device = "cuda"
validate_every = 100
save_every = $steps
log_every = 10

[data]
resolution = 512
validation_split = 0.25

[[data.dirs]]
path = "$images"
TOML
  start=$(date +%s)
  "$exe" "$dir/$tag$code.toml" --overwrite > "$dir/$tag$code.log" 2>&1 && touch "$out/done"
  grep -E "validation loss|error|Error" "$dir/$tag$code.log" || true
  echo "$code: $(( $(date +%s) - start )) s"
done
DIR=$dir CODES=$codes TAG=$tag python3 - <<'PY'
import json, os, statistics as st
d, codes, tag = os.environ["DIR"], os.environ["CODES"].split(), os.environ["TAG"]
def losses(c):
    p = f"{d}/out-{tag}{c}/loss.jsonl"
    return [(r["step"], r["loss"]) for r in map(json.loads, open(p)) if "loss" in r and "step" in r]
ref = losses(codes[0])
last = max(s for s, _ in ref)
for c in codes[1:]:
    got = losses(c)
    ma, mb = st.mean(x for _, x in ref), st.mean(x for _, x in got)
    print(f"mean loss over {last} steps: {codes[0]} {ma:.5f}, {c} {mb:.5f} ({100 * (mb - ma) / ma:+.2f}%)")
    for lo in range(1, last + 1, 100):
        sa = [x for s, x in ref if lo <= s < lo + 100]
        sb = [x for s, x in got if lo <= s < lo + 100]
        if sa and sb:
            a, b = st.mean(sa), st.mean(sb)
            print(f"  steps {lo}-{lo + 99}: {a:.5f} {b:.5f} ({100 * (b - a) / a:+.2f}%)")
def val(c):
    p = f"{d}/out-{tag}{c}/loss.jsonl"
    return {r["step"]: r["val_loss"] for r in map(json.loads, open(p)) if "val_loss" in r}
vals = {c: val(c) for c in codes}
for s in sorted(vals[codes[0]]):
    row = " ".join(f"{c} {vals[c][s]:.5f}" for c in codes if s in vals[c])
    print(f"validation loss at step {s}: {row}")
PY
