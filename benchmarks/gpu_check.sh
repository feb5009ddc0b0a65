#!/usr/bin/env bash
# The GPU check of issue 44, one command: installs the wheels in .whl/ (if any; made by
# benchmarks/gpu_wheels.sh), then runs benchmarks/gpu_check.py with these arguments. Results go
# to --out: results.json, summary.md, gpu_check.log, logs.tar.gz. benchmarks/GPU_CHECK.md has
# the device call and the measured or estimated cost of each step.
#
#     bash benchmarks/gpu_check.sh --out "$OUT"                 # GPU machine, 540 s budget
#     bash benchmarks/gpu_check.sh --arch tiny --out /tmp/gc    # CPU, tiny sizes
#
# Seconds per step. H100: measured in two calls on 2026-11-27 (benchmarks/GPU_CHECK.md), or an
# estimate where a step did not finish or run. CPU tiny: measured with --arch tiny --budget 1800
# --demo-jobs 1 on the 2-core development VM while other jobs loaded it (torch 2.13,
# OMP_NUM_THREADS=1): upper bounds, compiled steps with a cold cache.
#
#   step             need (H100)  H100                                      CPU tiny (measured)
#   wheels install   -            17-24 (measured)                          -
#   build-sd35       60           43 (measured)                             9
#   grpo-compiled    150          192 (measured; 100 s of it compiling)     206
#   grpo-eager       90           112 (measured)                            25
#   demos            60           more than 300 (estimate; 15 at once)      603 (one at a time)
#   ocr (reserved)   80           77 (measured)                             28
#   crd-compiled     200          more than 159 (cut while compiling)       230
#   nft-compiled     200          160-250 (estimate)                        237
#   build-flux       90           40-160 (estimate, disk-bound)             15
#   dance-compiled   180          200-400 (estimate)                        233
#   grpo-no-tf32     90           about grpo-eager's (estimate)             21
#
# In 540 s expect build-sd35, grpo-compiled, grpo-eager and, in what is left, the start of the
# demos and ocr. The rest needs a second call on the warm machine, e.g.
#     bash benchmarks/gpu_check.sh --out "$OUT" --only ocr crd-compiled nft-compiled --budget 540
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
