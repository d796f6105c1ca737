#!/usr/bin/env bash
# The memory-cap rows of the README's train-step table (issue 18), on the GPU machine after
# ../shared/gpu/bundle staged bench-train_step in .gpu/. Usage: bash scripts/train_step_rows.sh
# [group], group "a" (resident, checkpointed, 24 and 12 GiB rows) or "b" (6 GiB and fp8 rows).
# Each row is one process: a cap is FLAME_GPU_MEMORY_LIMIT in bytes.
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
esac
