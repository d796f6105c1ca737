#!/usr/bin/env bash
# The two-GPU proof of data-parallel training (issue 23), for nvidia-h200-x2. Build here:
#   ../shared/gpu/bundle --test dist --bench train_step --bin train --features cuda
#   cd .gpu && rm -f sample && tar cf - test-* bench-* train | xz -T2 -3 > bins.tar.xz && rm test-* bench-* train
# then run `bash scripts/dist_gpu_proof.sh` there with carry [".gpu"]. Prints NCCL bus bandwidth through
# PyTorch and FLAME, the 2-GPU tests, and 1- vs 2-GPU Flux and SDXL steps (losses, samples/s).
cd .gpu && xz -dc bins.tar.xz | tar xf - && cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export RUST_BACKTRACE=1
L=$OUT/log; exec > >(tee -a $L) 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nvidia-smi topo -m | head -5
ls -la /usr/lib/x86_64-linux-gnu/libnccl* 2>&1 | head
if ! ls /usr/lib/x86_64-linux-gnu/libnccl.so >/dev/null 2>&1; then
  mkdir -p /tmp/nccl && ln -sf /usr/lib/x86_64-linux-gnu/libnccl.so.2 /tmp/nccl/libnccl.so
  export LD_LIBRARY_PATH=/tmp/nccl:$LD_LIBRARY_PATH; echo "linked libnccl.so"
fi
env | grep -E "NCCL|MULTICAST|NVSHMEM"
echo "== torch NCCL"; timeout 120 python3 benches/torch_allreduce.py 64 256 1024
echo "== test-dist"; FLAME_TRAIN_EXE=$PWD/.gpu/train timeout 200 .gpu/test-dist --include-ignored --test-threads 1 2>&1 | tail -40
run2() { for r in 0 1; do WORLD_SIZE=2 RANK=$r LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29600+RANDOM%100)) timeout 150 .gpu/bench-train_step "$@" > /tmp/r$r.log 2>&1 & done; wait; cat /tmp/r0.log; grep -iE "error|panic" /tmp/r1.log | head; }
for m in flux sdxl; do
  echo "== $m 1 GPU batch 1"; timeout 150 .gpu/bench-train_step --model $m
  echo "== $m 1 GPU batch 2"; timeout 150 .gpu/bench-train_step --model $m --batch 2
  echo "== $m 2 GPUs batch 2"; run2 --model $m --batch 2 --allreduce-mib 256
done
echo "== flux 24 GiB budget: 1 GPU b1, 2 GPUs b2"; timeout 150 .gpu/bench-train_step --model flux --budget 24; run2 --model flux --budget 24 --batch 2
