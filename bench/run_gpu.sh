#!/usr/bin/env bash
# Device-side driver: GPU facts, then bench/decode_gpu.py (and bench/decode_engine.py when present).
# Usage: bash bench/run_gpu.sh PARTS   (results and log under $OUT)
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,power.draw --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
python3 bench/decode_gpu.py --parts "${1:-copy,micro,llama,correct,hf,ctx,mla}" --out "$OUT/decode_gpu.json" 2>&1 | tee "$OUT/decode_gpu.log"
if [ -f bench/decode_engine.py ] && [ "${2:-}" = engine ]; then
  if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site; fi
  timeout 420 python3 bench/decode_engine.py --device cuda --out "$OUT/decode_engine.json" 2>&1 | tail -60 | tee "$OUT/decode_engine.log"
fi
