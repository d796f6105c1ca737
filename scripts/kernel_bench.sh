#!/usr/bin/env bash
# Builds scripts/kernel_bench.cu against cuda/ with the GPU machine's nvcc and runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc -O3 -std=c++17 -arch=sm_90 -Icuda scripts/kernel_bench.cu -o /tmp/flame_kernel_bench
/tmp/flame_kernel_bench
