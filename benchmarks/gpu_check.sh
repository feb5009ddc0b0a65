#!/usr/bin/env bash
# The GPU check of issue 44, one command: installs the wheels in .whl/ (if any; made by
# benchmarks/gpu_wheels.sh), then runs benchmarks/gpu_check.py with these arguments. Results go
# to --out: results.json, summary.md, gpu_check.log, logs.tar.gz. benchmarks/GPU_CHECK.md has
# the device call and the measured or estimated cost of each step.
#
#     bash benchmarks/gpu_check.sh --out "$OUT"                 # GPU machine, 540 s budget
#     bash benchmarks/gpu_check.sh --arch tiny --out /tmp/gc    # CPU, tiny sizes
#
# Seconds per step. H100: estimates (no GPU was at hand; GPU_CHECK.md derives each from the H100
# micro-benchmarks of RESULTS.md section 1). CPU tiny: measured with --arch tiny --budget 1800
# --demo-jobs 1 on the 2-core development VM while other jobs loaded it (load average 5-6;
# torch 2.13, OMP_NUM_THREADS=1, 2026-11-27): upper bounds, compiled steps with a cold cache.
#
#   step             need (H100)  expected (H100, estimate)  CPU tiny (measured)
#   wheels install   -            15                         -
#   build-sd35       60           30-110 (disk-bound)        9
#   grpo-compiled    150          180-300                    206
#   grpo-eager       90           90-130                     25
#   demos            60           150-300 (15 at once)       603 (15 runs, one at a time)
#   ocr (reserved)   45           30-45                      28
#   crd-compiled     150          150-250                    230
#   nft-compiled     150          150-250                    237
#   build-flux       90           40-160 (disk-bound)        15
#   dance-compiled   180          200-400                    233
#
# In 540 s expect build-sd35, grpo-compiled and grpo-eager; the demos (cut at their deadline)
# and ocr (45 s kept for it) share what is left; the rest is skipped with a line.
set -uo pipefail
export GPU_CHECK_STARTED="${GPU_CHECK_STARTED:-$(date +%s.%N)}"
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS="${GPU_CHECK_WHEELS-.whl}"  # GPU_CHECK_WHEELS= (empty): install none
if [[ -n "$WHEELS" ]] && compgen -G "$WHEELS/*.whl" > /dev/null; then
    site="${GPU_CHECK_SITE:-/tmp/flowrl-site}"
    echo "installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$WHEELS"/*.whl \
        || { echo "gpu_check: the wheel install failed" >&2; exit 1; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PYTHON" -c "import diffusers, peft, transformers, tyro" \
    || { echo "gpu_check: the packages above do not import" >&2; exit 1; }
exec "$PYTHON" benchmarks/gpu_check.py "$@"
