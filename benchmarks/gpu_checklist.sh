#!/usr/bin/env bash
# The GPU checklist of BENCHMARKS.md ("GPU"), in one script: the machine, the kernel and engine
# tests on the GPU, a smoke run of the default model, and nano-vllm's workload.
#   bash benchmarks/gpu_checklist.sh OUTDIR [tests|smoke|serve|nano|nano-eager|all]...
# Each step writes OUTDIR/<step>.log (and nano_gpu*.json); a failing step does not stop the rest.
set -uo pipefail
out=${1:?usage: gpu_checklist.sh OUTDIR [STEP...]}; shift
mkdir -p "$out"
steps=${*:-all}
PY=${PY:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
want() { [[ " $steps " == *" all "* || " $steps " == *" $1 "* ]]; }
step() {   # step NAME TIMEOUT CMD...: runs CMD, logs it, records its exit status and wall time
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "== $name: $*" | tee -a "$out/summary.txt"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "   rc=$? in $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
}

{ nvidia-smi; $PY -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__,
  'cuda', torch.version.cuda, torch.cuda.get_device_name(), 'triton', triton.__version__)"
  lscpu | grep -E 'Model name|^CPU\(s\)'; } >"$out/env.txt" 2>&1

# Compiled kernels only: test_triton_kernels.py sets TRITON_INTERPRET=1 for its whole process.
want tests && step tests 420 $PY -m pytest -q -p no:cacheprovider -rs \
    tests/test_gpu.py tests/test_device_args.py
want smoke && step smoke 180 $PY -m kvflow.cli generate --device cuda --max-tokens 32 \
    "The capital of France is"
want serve && step serve 300 $PY benchmarks/gpu_serve_smoke.py
want nano && step nano 560 $PY benchmarks/nano_bench.py --device cuda --roofline \
    ${NANO_HF:+--hf} --json "$out/nano_gpu.json"
want nano-eager && step nano-eager 400 $PY benchmarks/nano_bench.py --device cuda \
    --enforce-eager --json "$out/nano_gpu_eager.json"
cat "$out/summary.txt"
