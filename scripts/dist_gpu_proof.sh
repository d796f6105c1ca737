#!/usr/bin/env bash
# The two-GPU proof of data-parallel training, on a machine with two GPUs of one host.
# Build the CUDA executables elsewhere (`cargo test --no-run` / `cargo build --release` with
# `--features cuda` for the dist test, the train_step bench and the train binary), pack them
# into .gpu/bins.tar.xz (test-*, bench-*, train), and run `bash scripts/dist_gpu_proof.sh
# [PHASE ...]` on the GPU machine; the phases (default: suites nccl dist flux sdxl budget,
# in this order: two runs of 10 minutes each; net and stall by name):
#   suites  every other staged test-* executable (GPU 0 and GPU 1 in parallel)
#   nccl    NCCL's bus bandwidth through PyTorch (benches/torch_allreduce.py)
#   dist    tests/dist.rs with the ignored GPU tests (two GPUs over NCCL, resume, a killed rank)
#   flux    the Flux-dev LoRA step: 1 GPU batch 1, 1 GPU batch 2, 2 GPUs batch 2 (losses, samples/s,
#           FLAME's bus bandwidth)
#   sdxl    the same for SDXL
#   budget  Flux under a 24 GiB budget: 1 GPU batch 1, 2 GPUs batch 2
#   net     across machines as NCCL sees them: each rank started as torchrun starts one on its own
#           host (LOCAL_RANK 0, only its GPU visible) and NCCL forced onto its network transport
#           (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, sockets on loopback); the Flux-dev step,
#           batch 1 a rank, against 1 GPU at batch 1 (scaling) and batch 2 (loss parity), and
#           2 GPUs over NVLink
#   (RANKS=4 runs `net` with four ranks, on a machine with four GPUs.)
#   stall   the tiny model on 2 GPUs with rank 1 stuck at step 3 (FLAME_FAULT=hang:step@3):
#           the watchdog names it within FLAME_STALL_TIMEOUT and every process exits
# Scaling efficiency = samples/s (2 GPUs, batch 2) / (2 x samples/s (1 GPU, batch 1)); loss parity:
# the 2-GPU losses against 1 GPU at batch 2 (which needs checkpointing where batch 2 does not fit
# one GPU: it is retried under a 76 GiB budget).
[ -x .gpu/train ] || { cd .gpu && xz -dc bins.tar.xz | tar xf - && cd ..; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export RUST_BACKTRACE=1
L=$OUT/log; exec > >(tee -a "$L") 2>&1
[ $# -gt 0 ] || set -- suites nccl dist flux sdxl budget
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if ! ls /usr/lib/x86_64-linux-gnu/libnccl.so >/dev/null 2>&1; then
  mkdir -p /tmp/nccl && ln -sf /usr/lib/x86_64-linux-gnu/libnccl.so.2 /tmp/nccl/libnccl.so
  export LD_LIBRARY_PATH=/tmp/nccl:$LD_LIBRARY_PATH
fi
# RANKS (default 2): how many ranks `run2` and `run2net` start, one a GPU.
ranks=${RANKS:-2}
run2() {
  local port=$((29600 + RANDOM % 300))
  local pids=()
  for r in $(seq 0 $((ranks - 1))); do
    WORLD_SIZE=$ranks RANK=$r LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 170 \
      .gpu/bench-train_step "$@" >/tmp/r$r.log 2>&1 &
    pids+=($!)
  done
  # Only these: a bare `wait` would also wait for the tee of the log (a process substitution).
  wait "${pids[@]}"; cat /tmp/r0.log; grep -iE "error|panic" /tmp/r[1-9]*.log | head
}
step() { echo "== $*"; timeout 170 .gpu/bench-train_step "$@"; }
# Two ranks as two hosts would start them: each sees one GPU, NCCL over sockets on loopback.
run2net() {
  local port=$((29600 + RANDOM % 300))
  local pids=()
  for r in $(seq 0 $((ranks - 1))); do
    CUDA_VISIBLE_DEVICES=$r NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo \
      NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET WORLD_SIZE=$ranks RANK=$r LOCAL_RANK=0 \
      MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 170 .gpu/bench-train_step "$@" \
      >/tmp/n$r.log 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  grep -v "NCCL INFO" /tmp/n0.log
  grep -E "NCCL INFO.*(via NET|Using network|NET/)" /tmp/n0.log | head -4
  grep -iE "error|panic" /tmp/n[1-9]*.log | head
  # The transport NCCL took, from every rank's log: channels through the network (sockets)
  # and none through P2P or shared memory, or the run proves nothing across machines.
  local net other
  net=$(cat /tmp/n*.log | grep -cE "NCCL INFO Channel .* via NET/")
  other=$(cat /tmp/n*.log | grep -cE "NCCL INFO Channel .* via (P2P|SHM)")
  if [ "${net:-0}" -gt 0 ] && [ "${other:-0}" = 0 ]; then
    echo "== transport: ${net} channel connections over NET (sockets), none over P2P or SHM"
  else
    echo "== transport: NOT the network (${net:-0} over NET, ${other:-0} over P2P or SHM)"
    return 1
  fi
}
for phase in "$@"; do
  case $phase in
  suites)
    nvidia-smi topo -m | head -4
    n=0 pids=()
    for t in .gpu/test-*; do
      [ "$t" = .gpu/test-dist ] && continue
      (CUDA_VISIBLE_DEVICES=$((n % 2)) timeout 280 "$t" --include-ignored >"/tmp/$(basename "$t").log" 2>&1
       echo "== $t: exit $?"; grep -E "^test result|FAILED|panicked|failures:" "/tmp/$(basename "$t").log" | head -20) &
      pids+=($!) n=$((n + 1))
    done
    wait "${pids[@]}" ;;
  nccl)
    env | grep -E "NCCL|MULTICAST|NVSHMEM"
    echo "== torch NCCL"; timeout 120 python3 benches/torch_allreduce.py 64 256 1024 ;;
  dist)
    echo "== test-dist"
    FLAME_TRAIN_EXE=$PWD/.gpu/train timeout 240 .gpu/test-dist --include-ignored --test-threads 1 2>&1 | tail -25 ;;
  flux | sdxl)
    step --model "$phase"
    step --model "$phase" --batch 2 || step --model "$phase" --batch 2 --budget 76
    echo "== $phase 2 GPUs batch 2"; run2 --model "$phase" --batch 2 --allreduce-mib 256 ;;
  budget)
    step --model flux --budget 24
    echo "== flux 2 GPUs batch 2, 24 GiB budget each"; run2 --model flux --budget 24 --batch 2 ;;
  net)
    step --model flux
    step --model flux --batch "$ranks" || step --model flux --batch "$ranks" --budget 120
    echo "== flux $ranks GPUs over NVLink, batch 1 each"; run2 --model flux
    echo "== flux $ranks ranks over NCCL's network transport, batch 1 each"; run2net --model flux ;;
  stall)
    d=/tmp/stall && rm -rf $d && mkdir -p $d
    sed -e "s#tiny/#$d/tiny/#g" -e 's/device = "auto"/device = "cuda"/' \
      -e 's/batch_size = 4/batch_size = 2/' examples/flux-tiny-encoded.toml > $d/t.toml
    .gpu/train $d/t.toml --make-tiny >/dev/null
    start=$(date +%s)
    FLAME_FAULT=hang:step@3 FLAME_FAULT_RANK=1 FLAME_STALL_TIMEOUT=20 timeout 200 \
      .gpu/train $d/t.toml --gpus 0,1 2>&1 | tail -n 4
    echo "== stall: exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s"
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | head ;;
  esac
done
