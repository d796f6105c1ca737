#!/usr/bin/env bash
# The rows of BENCHMARKS.md's train-step memory table, on a GPU after
# ../shared/gpu/bundle staged bench-train_step in .gpu/. Usage: bash scripts/train_step_rows.sh
# GROUP: "a" Flux-dev plans by hand (resident, checkpointed, 24 and 12 GiB caps), "b" FP8
# rows, "c" Flux-dev plans the planner picks for 24/16/12/8 GiB (bf16) and 6 GiB (fp8,
# AdamW8bit), "d" SD3.5-large and SDXL, resident and planned. One process a row; a cap is
# FLAME_GPU_MEMORY_LIMIT in bytes, a budget is the planner's (which caps the allocator too).
set -uo pipefail
G=$((1 << 30))
row() { # cap_gib args...
  local cap=$1; shift
  echo "== cap ${cap} GiB: $*"
  if [ "$cap" = none ]; then bash .gpu/run.sh bench-train_step "$@"
  else FLAME_GPU_MEMORY_LIMIT=$((cap * G)) bash .gpu/run.sh bench-train_step "$@"; fi
}
case "${1:-a}" in
  a)
    row none
    row none --checkpoint all
    row none --checkpoint all --keep-attention
    row 24 --checkpoint all --stream 16 --prefetch 2 --keep-attention
    row 12 --checkpoint all --stream 46 --prefetch 2 --keep-attention
    row 12 --checkpoint all --stream 52 --prefetch 2 --keep-attention
    ;;
  b)
    row none --fp8
    row 6 --checkpoint all --stream 57 --prefetch 1 --fp8 --adam8bit
    row 6 --checkpoint all --stream 57 --prefetch 1 --fp8 --adam8bit --keep-attention
    ;;
  c)
    row none
    for gb in 24 16 12 8; do row none --budget $gb; done
    row none --budget 6 --fp8 --adam8bit
    ;;
  d)
    for m in sd35 sdxl; do row none --model $m; done
    row none --model sd35 --budget 16
    row none --model sd35 --budget 8
    row none --model sdxl --budget 8
    row none --model sdxl --budget 4
    ;;
esac
