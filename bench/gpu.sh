#!/usr/bin/env bash
# Issue #15's GPU figures on the GPU machine (../shared/NOTES-gpu.md: torch + transformers there, no vLLM, no
# registry): the learner against a bare loop on a Qwen2.5-0.5B-shaped model in bf16, and the GPU file snapshot
# (write + load); the GPU tests first. Issue #40: the bucketed broadcast receive with its buffers on the GPU
# (one bucket of device memory, the version staged in pinned host memory, then loaded into a model on the GPU),
# its peak device memory above the model against the bucket size: the script fails if it is over one bucket.
# (One GPU cannot hold two NCCL ranks: the bytes travel over gloo, which moves CUDA tensors through the host.)
# JSON goes to bench/results/*_gpu.json.
#
#   bash bench/gpu.sh fetch   # here, with the registry: the wheels the GPU image lacks, into .gpu-wheels/
#   bash bench/gpu.sh         # there (the device tool: carry .gpu-wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
if [ "${1:-}" = fetch ]; then
    # msgspec and structlog (imported by the learner) for the image's CPython 3.12 on x86_64 Linux.
    python3 -m pip download --quiet --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$WHEELS" msgspec structlog
    ls "$WHEELS"
    exit 0
fi
deps=$(mktemp -d)
python3 -m pip install --quiet --no-deps --no-index --target "$deps" "$WHEELS"/*.whl
export PYTHONPATH="$deps:$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_learner_gpu.py
python3 bench/weight_publish.py --versions 20 --json-out bench/results/weight_publish_gpu.json
python3 bench/weight_sync.py --models qwen2.5-0.5b --buckets 64,256,0 --device cuda --versions 2 \
    --json-out bench/results/weight_sync_buckets_gpu.json
python3 - <<'CHECK'
import json
rows = json.load(open("bench/results/weight_sync_buckets_gpu.json"))["results"]
for r in rows:
    print(f"bucket {r['bucket_mb']} MiB: peak device memory above the model {r['peak_device_above_model'] / 2**20:.0f} MiB, "
          f"receive {r['receive_s']} s, load {r['load_s']} s, pinned staging {r['pinned']}")
bad = [r["bucket_mb"] for r in rows if not r["within_one_bucket"] or not r["pinned"]]
assert not bad, f"over one bucket of device memory (or staging not pinned) at bucket_mb {bad}"
CHECK
python3 bench/learner.py --model qwen2.5-0.5b --device cuda --dtype bfloat16 --generation-batch-size 64 \
    --per-device-train-batch-size 8 --prompt-len 128,256 --completion-len 256,768 --max-tokens-per-batch 8192 \
    --repeats 10 --json-out bench/results/learner_gpu.json
