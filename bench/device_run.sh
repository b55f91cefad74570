#!/usr/bin/env bash
# One call on a lent GPU machine: install the carried wheels, build the kernel for
# sm_90, run the GPU tests, then the GPU benchmarks. Every step runs under its own
# timeout and a failing step does not stop the next; results land in $OUT.
#
#   STEPS="tests copy transfer" bash bench/device_run.sh      (the default)
#   steps: tests (all GPU tests), copytests (copy kernel tests only), copy (copy +
#   Save/Load bench), transfer (GPU-to-GPU fetch bench), cuda_thread (the same with
#   UCX's progress thread), host (host-pool fetch bench on the device's CPUs)
#
# Wheels: the image has torch, cupy-cuda13x, numpy, msgpack but not ucxx (CUDA 13
# build), blake3, NIXL, or our grpcio/protobuf pins: `python3 bench/device_wheels.py`
# puts them in .whl/ (pruned to fit a call's carry); name ".whl" in the call's carry.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STEPS=${STEPS:-"tests copy transfer"}
LOG="$OUT/log.txt"
exec > >(tee -a "$LOG") 2>&1

step() { echo; echo "=== $1 ($(date +%T))"; }
run() { # run LIMIT_S cmd...: a step that may fail
    local limit=$1; shift
    timeout -k 5 "$limit" "$@"; local rc=$?
    echo "--- rc=$rc: $*"
    return 0
}

step setup
SITE=$PWD/.site  # ignored by git: kept between calls while the machine is held
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || echo "wheel install failed"
fi
export PYTHONPATH=$SITE:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
python3 - <<'EOF'
import importlib
for m in ("torch", "cupy", "ucxx", "grpc", "google.protobuf", "blake3", "msgpack", "numpy",
          "zmq", "aetcd", "cryptography", "prometheus_client", "hypothesis"):
    try:
        mod = importlib.import_module(m)
        print(f"{m:18} {getattr(mod, '__version__', '?')}")
    except Exception as e:
        print(f"{m:18} IMPORT FAILED: {e!r}")
import torch
cuda = torch.cuda.is_available()
print("cuda", cuda, torch.cuda.get_device_name(0) if cuda else "(no device)")
from kvstore.transfer import rma
print("nixl", rma.nixl_version() or "none (GPU pools fetch two-sided)")
EOF

step "nvcc sm_90 resource report"
run 60 nvcc -arch=sm_90 -Xptxas -v -c kernels/copy.cu -o /tmp/copy.o

if [[ " $STEPS " == *" tests "* ]]; then
    step "GPU tests"
    run 120 python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 90 -rs \
        tests/copy/test_copy.py tests/copy/test_cuda_blocks_host.py tests/service/test_blocks_e2e.py \
        tests/service/test_peer_fetch.py
fi

if [[ " $STEPS " == *" copytests "* ]]; then
    step "GPU copy tests"
    run 60 python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 60 tests/copy/test_copy.py \
        tests/copy/test_cuda_blocks_host.py
fi

if [[ " $STEPS " == *" copy "* ]]; then
    step "copy bench (CudaCopier vs contiguous device copy; Save/Load RPC)"
    run 90 python3 bench/copy_engine.py --device cuda --no-progress
    cp bench/results/copy.json bench/results/copy.png "$OUT/" 2>/dev/null
    step "e2e Save/Load with the server copying by blocks (--gpu-copy blocks)"
    run 60 python3 bench/copy_engine.py --device cuda --no-progress --sections e2e \
        --gpu-copy blocks --out "$OUT/copy_e2e_blocks.json"
fi

if [[ " $STEPS " == *" transfer "* ]]; then
    step "transfer bench, GPU pools (fetch vs raw ucxx vs device memcpy)"
    run 120 python3 bench/transfer.py --mem cuda --total-mib 256 --repeats 7 --latency-iters 50
    cp bench/results/transfer.json bench/results/transfer.png "$OUT/" 2>/dev/null
fi

if [[ " $STEPS " == *" cuda_thread "* ]]; then
    step "transfer bench, GPU pools, UCX progress thread instead of the loop"
    run 60 env UCXPY_PROGRESS_MODE=thread python3 bench/transfer.py --mem cuda --total-mib 256 \
        --repeats 7 --latency-iters 50 --out /tmp/transfer_cuda_thread.json
    cp /tmp/transfer_cuda_thread.json "$OUT/" 2>/dev/null
fi

if [[ " $STEPS " == *" host "* ]]; then
    step "transfer bench, host pools, 16 cores"
    run 120 python3 bench/transfer.py --quick --out "$OUT/transfer_host16.json"
fi
step done
