#!/usr/bin/env bash
# Run the whole test suite N times in a row (default 3) while two CPU-bound processes keep both cores busy:
# the check that the suite holds on a loaded machine. Stops at the first failing run; the busy loops always end.
#   tools/suite_under_load.sh [N] [pytest args...]
set -u
cd "$(dirname "$0")/.."
runs=${1:-3}
shift || true
hogs=()
for _ in 1 2; do
    python3 -c 'while True: pass' &
    hogs+=($!)
done
trap 'kill "${hogs[@]}" 2>/dev/null' EXIT
for i in $(seq 1 "$runs"); do
    echo "=== run $i of $runs (two busy loops beside it) ==="
    start=$(date +%s)
    .venv/bin/pytest -q -p no:cacheprovider "$@" || { echo "=== run $i FAILED ==="; exit 1; }
    echo "=== run $i passed in $(( $(date +%s) - start )) s ==="
done
echo "=== all $runs runs passed ==="
