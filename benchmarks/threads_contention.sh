#!/usr/bin/env bash
# Why the test suite runs its workers with one torch thread each (tests/conftest.py): the demo
# config's median step time, alone and beside one busy core, with 2 threads, 2 threads and
# OMP_WAIT_POLICY=PASSIVE, and 1 thread. Each setting trains STEPS steps (default 150); ROUNDS
# rounds interleave the settings (A B C ... A B C ...).
#
#   [STEPS=60] bash benchmarks/threads_contention.sh [WORK_DIR] [ROUNDS]
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${1:-/tmp/impasto-threads}"
ROUNDS="${2:-1}"
STEPS="${STEPS:-150}"
mkdir -p "$WORK"

train() {  # train TAG ENV...: STEPS demo steps, prints TAG and the median step time
    local tag=$1
    shift
    rm -rf "${WORK:?}/$tag"
    env "$@" python -m impasto train "$REPO/configs/demo.yaml" --set train.output_dir="$WORK/$tag" \
        --set data.path="$WORK/data" --set train.max_steps="$STEPS" --set sample.every_steps=0 \
        --set eval.every_steps=0 --set checkpoint.every_steps=100000 \
        --set checkpoint.save_final=false --set log.every_steps=5 --set log.progress_bar=false \
        --set log.tensorboard=false > "$WORK/$tag.log" 2>&1
    python - "$WORK/$tag/metrics.jsonl" "$tag" <<'PYEOF'
import json, statistics, sys
times = [json.loads(line)["step_time"] for line in open(sys.argv[1]) if '"step_time"' in line]
print(f"{sys.argv[2]:<28} median step {statistics.median(times[1:]):.4f} s")
PYEOF
}

busy=""
trap '[[ -z "$busy" ]] || kill "$busy" 2>/dev/null' EXIT
for _ in $(seq "$ROUNDS"); do
    train "alone, 2 threads" OMP_NUM_THREADS=2
    train "alone, 1 thread" OMP_NUM_THREADS=1
    python -c "while True: pass" &
    busy=$!
    train "busy core, 2 threads" OMP_NUM_THREADS=2
    train "busy core, 2 threads passive" OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE
    train "busy core, 1 thread" OMP_NUM_THREADS=1
    kill "$busy"
    busy=""
done
