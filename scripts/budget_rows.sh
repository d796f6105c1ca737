#!/usr/bin/env bash
# The whole-run memory proof on the GPU machine: a second process holds all but BUDGET GiB of
# the card, so the card itself enforces the budget, not FLAME's own count. A random full-size
# pipeline folder (made by `benches/torch_encoders.py --make DIR --transformer` for Flux-dev)
# trains from 8 generated pictures through the `train` binary under memory.budget_gb =
# BUDGET, with validation, sample images and checkpoints every 10 steps (20 steps). The
# device's memory is sampled every 200 ms through the run: the run's driver-side peak is the
# device's used memory less what the holder took, printed beside the budget with the exit
# status, the files written and each phase's lines.
# PIPELINE_DIR may also be a ComfyUI `models/` folder, the pieces found by their keys: those of
# `torch_encoders.py --make PIPES --family flux-gguf` (PIPES/flux-q8, PIPES/flux-q4k) hold a
# GGUF Flux-dev, whose packed Linears stay packed and whose other tensors load in model.dtype
# (bf16, the default, is the one to give it).
# MODEL_DTYPE (default bf16) and OPTIMIZER (default adamw) set model.dtype and optimizer.kind;
# ARCH (flux, the default; sd3, sdxl, flux2 (FLUX.2 [klein]) or zimage, pipelines made by
# `torch_encoders.py --make DIR --family sd3|sdxl|klein4b|klein9b|zimage`) picks the family,
# its adapter targets and its guidance.
#   [SAMPLE_EXE=.../sample] bash scripts/budget_rows.sh PIPELINE_DIR WORK_DIR TRAIN_EXE BUDGET_GB [EXTRA_TOML]
# With SAMPLE_EXE, the `sample` binary then makes a 1024² image with the trained LoRA under
# the same budget, the holder still in place, and its peak and time are printed too (after
# the training's summary, so a time limit that cuts the sample run leaves that); the script
# exits non-zero if either run failed (their status), if a holder did not take its card (3)
# or if a driver-side peak passed the budget (4).
# EXTRA_TOML is appended to the config (e.g. 'model.dtype = "fp8"' lines go under [model]:
# pass a whole section, "[optimizer]\nkind = \"adamw8bit\"").
# EDIT=1 (ARCH=flux2 only) makes it an edit dataset: each picture has a reference image of
# the same name (`circle_images.py OUT REFS`) and an instruction caption; the samples and the
# `sample` run are conditioned on a reference.
# SAMPLE_STEPS (default 20) sets the denoising steps of the run's sample images and of the
# `sample` run: every step of a sampler runs the same forward, so its first holds the peak,
# and fewer steps prove the same memory in less device time.
# TRIAL_STEPS (default 0) sets memory.trial_steps: the planner's pick timed beside its rivals
# that many steps each before the first step, the fastest kept; TRIAL_SHARE (default 1000:
# the rows' 20 steps are far too few for the default share) sets memory.trial_share.
# DEFAULT_BUDGET=1 gives the run no budget (memory.budget_gb = 0, `sample` without
# --budget): the holder still keeps only BUDGET GiB of the card free, so the row proves the
# default budget, the memory free at start, on a card that has only that much.
# GPUS (default 0) lists the GPUs: with several (GPUS=0,1) the run is data-parallel over
# them (`train --gpus`), every one held to the budget by its own holder, and each GPU's
# driver-side peak is printed.
set -euo pipefail
pipe=$1
work=$2
exe=$3
budget=$4
extra=${5:-}
mkdir -p "$work"
arch=${ARCH:-flux}
# The budget the config and `sample` are given: BUDGET, or none with DEFAULT_BUDGET=1.
given=$budget
sample_budget=(--budget "$budget")
if [ "${DEFAULT_BUDGET:-0}" = 1 ]; then given=0; sample_budget=(); fi
sample_steps=${SAMPLE_STEPS:-20}
case "$arch" in
  flux) targets='"double_blocks.*_attn.qkv", "double_blocks.*_attn.proj", "double_blocks.*_mlp.*", "single_blocks.*.linear*"'
        guidance=3.5 ;;
  sd3) targets='"joint_blocks.*.attn.qkv", "joint_blocks.*.attn.proj", "joint_blocks.*.mlp.*"'
       guidance=4.5 ;;
  sdxl) targets='"*transformer_blocks.*.attn1.to_*", "*transformer_blocks.*.attn2.to_*", "*transformer_blocks.*.ff.net.*"'
        guidance=5.0 ;;
  flux2) targets='"double_blocks.*_attn.qkv", "double_blocks.*_attn.proj", "double_blocks.*_mlp.*", "single_blocks.*.linear*"'
         guidance=4.0 ;;
  zimage) targets='"layers.*.attention.qkv", "layers.*.attention.out", "layers.*.feed_forward.w*"'
          guidance=6.0 ;;
  *) echo "ARCH=$arch: flux, sd3, sdxl, flux2 or zimage" >&2; exit 2 ;;
esac
refs=""
refs_line=""
prompt='"a red circle on a white background"'
sample_refs=()
if [ "${EDIT:-0}" = 1 ]; then
  refs="$work/refs"
  prompt="{ prompt = \"make the circle red\", references = [\"$refs/img-0.png\"] }"
  sample_refs=(--reference "$refs/img-0.png")
  refs_line="references = [\"$refs\"]"
fi
python3 "$(dirname "$0")/circle_images.py" "$work/images" $refs
cat > "$work/run.toml" <<TOML
[model]
arch = "$arch"
path = "$pipe"
dtype = "${MODEL_DTYPE:-bf16}"

[adapter]
rank = 16
alpha = 16.0
targets = [$targets]
format = "peft"

[optimizer]
lr = 1e-4
kind = "${OPTIMIZER:-adamw}"

[train]
steps = 20
batch_size = 1
seed = 1
output_dir = "$work/out"
device = "cuda"
save_every = 10
validate_every = 10
log_every = 5

[memory]
budget_gb = $given
trial_steps = ${TRIAL_STEPS:-0}
trial_share = ${TRIAL_SHARE:-1000}

[data]
resolution = 1024
validation_split = 0.2

[[data.dirs]]
path = "$work/images"
$refs_line

[sample]
every = 10
prompts = [$prompt]
steps = $sample_steps
guidance = $guidance
seed = 3
TOML
if [ -n "$extra" ]; then printf '%b\n' "$extra" >> "$work/run.toml"; fi

gpus=${GPUS:-0}
IFS=, read -r -a gpu_list <<< "$gpus"
# The holders: all but BUDGET GiB of each card, in 256 MiB blocks, until killed.
holders=()
for g in "${gpu_list[@]}"; do
CUDA_VISIBLE_DEVICES=$g python3 - "$budget" > "$work/holder-$g.log" 2>&1 <<'PY' &
import sys, time, torch
keep = int(float(sys.argv[1]) * 2**30)
free, total = torch.cuda.mem_get_info()
blocks, hold = [], free - keep
while hold >= 2**28:
    blocks.append(torch.empty(2**28, dtype=torch.uint8, device="cuda"))
    hold -= 2**28
if hold >= 2**21:
    blocks.append(torch.empty(hold, dtype=torch.uint8, device="cuda"))
torch.cuda.synchronize()
free_now, _ = torch.cuda.mem_get_info()
print(f"holder: {(total - free_now) / 2**30:.2f} GiB of {total / 2**30:.2f} used, "
      f"{free_now / 2**30:.2f} GiB free", flush=True)
while True:
    time.sleep(60)
PY
holders+=($!)
done
for g in "${gpu_list[@]}"; do
  for _ in $(seq 1 120); do
    grep -q "GiB free" "$work/holder-$g.log" 2>/dev/null && break
    sleep 0.5
  done
  echo "GPU $g: $(cat "$work/holder-$g.log")"
  # Without its holder the card does not hold the run to the budget: no proof, no run.
  if ! grep -q "GiB free" "$work/holder-$g.log" 2>/dev/null; then
    echo "== GPU $g: the holder did not take the card (its log above); nothing run" >&2
    kill "${holders[@]}" 2>/dev/null || true
    exit 3
  fi
done
# Used memory of every GPU (index, MiB) before the run and every 200 ms through it.
nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits > "$work/base.log"
base=$(awk -F', ' -v g="${gpu_list[0]}" '$1 == g {print $2}' "$work/base.log")
nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$work/smi.log" &
smi=$!
start=$(date +%s.%N)
set +e
if [ "${#gpu_list[@]}" -gt 1 ]; then
  "$exe" "$work/run.toml" --gpus "$gpus" > "$work/train.log" 2>&1
else
  CUDA_VISIBLE_DEVICES=${gpu_list[0]} "$exe" "$work/run.toml" > "$work/train.log" 2>&1
fi
rc=$?
set -e
end=$(date +%s.%N)
kill "$smi" 2>/dev/null || true
wait "$smi" 2>/dev/null || true
# Each GPU's driver-side peak: its highest reading less what its holder took.
peaks=$(awk -F', ' 'NR == FNR {b[$1] = $2; next} {if ($2 > p[$1]) p[$1] = $2}
  END {for (g in p) printf "GPU %s %.2f GiB; ", g, (p[g] - b[g]) / 1024}' "$work/base.log" "$work/smi.log")
peak=$(awk -F', ' -v g="${gpu_list[0]}" '$1 == g {print $2}' "$work/smi.log" | sort -n | tail -n 1)
# The training's summary before the sample run, which a time limit may cut.
echo "== driver-side peaks: $peaks"
awk -v b="$budget" -v rc="$rc" -v s="$start" -v e="$end" -v base="$base" -v peak="$peak" 'BEGIN {
  printf "== budget %s GiB: exit %d in %.1f s; device used before the run %d MiB (the holder), " \
    "peak %d MiB: the run'"'"'s driver-side peak %.2f GiB\n", b, rc, e - s, base, peak, (peak - base) / 1024 }'
grep -E "memory:|timing plans|validation loss|samples:|done:|error|step 20/20|checkpoint|caching|data-parallel|peaks|^time:|^kernels:" "$work/train.log" | head -n 40
ls -la "$work/out" "$work/out/samples" 2>/dev/null | grep -E "lora|step-|loss" || true
# With SAMPLE_EXE set: the `sample` binary on the trained LoRA under the same budget, the
# holder still in place.
speak=""
src=0
if [ -n "${SAMPLE_EXE:-}" ] && [ "$rc" = 0 ]; then
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 \
    -i "${gpu_list[0]}" > "$work/smi-sample.log" &
  smi=$!
  set +e
  sstart=$(date +%s)
  CUDA_VISIBLE_DEVICES=${gpu_list[0]} "$SAMPLE_EXE" --arch "$arch" --model "$pipe" --lora "$work/out/lora.safetensors" \
    --prompt "$([ -n "$refs" ] && echo "make the circle red" || echo "a red circle on a white background")" \
    "${sample_refs[@]}" --steps "$sample_steps" --guidance "$guidance" \
    --width 1024 --height 1024 "${sample_budget[@]}" --out "$work/sample" > "$work/sample.log" 2>&1
  src=$?
  set -e
  kill "$smi" 2>/dev/null || true
  wait "$smi" 2>/dev/null || true
  speak=$(sort -n "$work/smi-sample.log" | tail -n 1)
  echo "== sample ${sample_budget[*]:-(no --budget, $budget GiB free)}: exit ${src} in $(( $(date +%s) - sstart )) s; driver-side peak $(( (speak - base) )) MiB"
  grep -E "^memory:|^time:|driver-side peaks" "$work/sample.log" | sed 's/^/sample /' | cut -c1-600
  tail -n 5 "$work/sample.log"
fi
kill "${holders[@]}" 2>/dev/null || true
wait "${holders[@]}" 2>/dev/null || true
# The row fails if training or the sample run failed, or a driver-side peak passed the
# budget.
[ "$rc" = 0 ] && rc=$src
# (This row's GPUs only: other rows may run on the host's other GPUs meanwhile.)
over=$(awk -F', ' -v b="$budget" -v gpus=",$gpus," 'index(gpus, "," $1 ",") == 0 {next}
  NR == FNR {base[$1] = $2; next} {if ($2 > p[$1]) p[$1] = $2}
  END {for (g in p) if (p[g] - base[g] > b * 1024) o = o sprintf("GPU %s %.2f GiB; ", g, (p[g] - base[g]) / 1024); print o}' \
  "$work/base.log" "$work/smi.log")
if [ -n "$speak" ] && [ $((speak - base)) -gt $(awk -v b="$budget" 'BEGIN {printf "%d", b * 1024}') ]; then
  over="$over sample $((speak - base)) MiB"
fi
if [ -n "$over" ]; then
  echo "== OVER THE BUDGET of $budget GiB: $over"
  [ "$rc" = 0 ] && rc=4
fi
exit "$rc"
