#!/usr/bin/env bash
# make demo-tinker: a forge_rl Tinker service on tiny-warm (configs/tinker/demo.yaml), and against it RL on addition
# with tinker-cookbook's own RL loop (examples/tinker/cookbook_rl_addition.py). The service stops (Ctrl-C) when the
# loop ends.
#   bash examples/tinker/demo.sh [cookbook_rl_addition.py options, e.g. --steps 150]
#   LOOP=client bash examples/tinker/demo.sh [rl_addition.py options]: the loop written against the tinker client
#   alone, sampling the next step while this one trains
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=outputs/tinker
case "${LOOP:-cookbook}" in
    cookbook) LOOP_COMMAND=(examples/tinker/cookbook_rl_addition.py --out outputs/tinker_cookbook) ;;
    client) LOOP_COMMAND=(examples/tinker/rl_addition.py --out outputs/tinker_demo --pipelined) ;;
    *) echo "make demo-tinker: LOOP=$LOOP: use LOOP=cookbook (tinker-cookbook's RL loop) or LOOP=client"; exit 2 ;;
esac
rm -f "$OUT/service.json"
# the cookbook resumes from checkpoints in its log directory, and a last run's lived in that run's service: start anew
if [ "${LOOP:-cookbook}" = cookbook ]; then rm -rf outputs/tinker_cookbook; fi
"$PY" -m apps.tinker.main --config configs/tinker/demo.yaml output_dir="$OUT" &
SERVICE=$!
trap 'kill -INT $SERVICE 2>/dev/null; wait $SERVICE 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    [ -s "$OUT/service.json" ] && break
    kill -0 $SERVICE 2>/dev/null || { echo "make demo-tinker: the service did not start (its output is above)"; exit 1; }
    sleep 0.5
done
"$PY" "${LOOP_COMMAND[@]}" --service-json "$OUT/service.json" "$@"
