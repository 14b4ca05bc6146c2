#!/usr/bin/env bash
# Build the prototype's cubin for H200 (sm_90a); -Xptxas -v prints registers, shared memory and spills per kernel.
set -euo pipefail
cd "$(dirname "$0")"
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || NVCC=/usr/local/cuda/bin/nvcc
"$NVCC" -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -cubin -Xptxas -v -o w4_gemm.cubin w4_gemm.cu 2>&1 \
  | tee build.log
