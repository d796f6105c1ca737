#!/usr/bin/env bash
# The loss of a 500-step LoRA run with 8-bit products against the same run without, on the
# README's tiny Flux (docs/TRAINING.md, "8-bit products: accuracy"). Usage, from the
# repository root: bash scripts/fp8_accuracy.sh [WORKDIR] [CODE]  (default /tmp/fp8-accuracy;
# CODE fp8 (default) or int8, the `model.compute` of the second run; runs on the CPU unless a
# GPU is found, as `train.device = "auto"` does)
set -euo pipefail
root=$(pwd)
work=${1:-/tmp/fp8-accuracy}
code=${2:-fp8}
mkdir -p "$work"
cargo build --release --bin train
train="$root/target/release/train"
cd "$work"
sed 's/^steps = 200/steps = 500/; s/^save_every = 50/save_every = 500/; s/^validate_every = 50/validate_every = 100/; s/^every = 100/every = 1000/' \
  "$root/examples/flux-tiny.toml" > base.toml
sed "s|output_dir = \"tiny/out\"|output_dir = \"tiny/out-$code\"|; s|^guidance = 1.0|guidance = 1.0\ncompute = \"$code\"|" \
  base.toml > "$code.toml"
[ -d tiny ] || "$train" --make-tiny base.toml
[ -f tiny/out/loss.jsonl ] || "$train" base.toml 2>&1 | grep "validation loss"
"$train" "$code.toml" 2>&1 | grep "validation loss"
CODE=$code python3 - <<'PY'
import json, os, statistics as st
def losses(p):
    return [(d["step"], d["loss"]) for d in map(json.loads, open(p)) if "loss" in d and "step" in d]
a, b = losses("tiny/out/loss.jsonl"), losses(f"tiny/out-{os.environ['CODE']}/loss.jsonl")
ma, mb = st.mean(x for _, x in a), st.mean(x for _, x in b)
print(f"mean loss: without {ma:.5f}, with {os.environ['CODE']} products {mb:.5f} ({100 * (mb - ma) / ma:+.2f}%)")
for lo in range(1, 501, 100):
    sa = st.mean(x for s, x in a if lo <= s < lo + 100)
    sb = st.mean(x for s, x in b if lo <= s < lo + 100)
    print(f"steps {lo}-{lo + 99}: {sa:.5f} {sb:.5f} ({100 * (sb - sa) / sa:+.2f}%)")
PY
