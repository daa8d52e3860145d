#!/usr/bin/env bash
# make demo-tinker: a forge_rl Tinker service on tiny-warm (configs/tinker/demo.yaml), and against it RL on addition
# written only with the tinker client (examples/tinker/rl_addition.py). The service stops (Ctrl-C) when the loop ends.
#   bash examples/tinker/demo.sh [rl_addition.py options, e.g. --steps 150]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=outputs/tinker
rm -f "$OUT/service.json"
"$PY" -m apps.tinker.main --config configs/tinker/demo.yaml output_dir="$OUT" &
SERVICE=$!
trap 'kill -INT $SERVICE 2>/dev/null; wait $SERVICE 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    [ -s "$OUT/service.json" ] && break
    kill -0 $SERVICE 2>/dev/null || { echo "make demo-tinker: the service did not start (its output is above)"; exit 1; }
    sleep 0.5
done
"$PY" examples/tinker/rl_addition.py --service-json "$OUT/service.json" --out outputs/tinker_demo --pipelined "$@"
