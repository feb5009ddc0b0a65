#!/usr/bin/env bash
# Downloads, on a networked machine, the wheels that benchmarks/gpu_check.sh installs on a GPU
# machine without network: into .whl/ at the repository root (git-ignored through
# .git/info/exclude), for that machine's Python 3.12 on x86-64 Linux.
#
#     bash benchmarks/gpu_wheels.sh            # then: carry [".whl"] in the run call
#     bash benchmarks/gpu_wheels.sh --no-ocr   # without the OCR row's wheels (smaller)
#
# The GPU image (as its description lists it) already has CUDA torch 2.11, numpy, pillow,
# safetensors 0.8, tokenizers 0.23.2, huggingface_hub 1.33, accelerate, sentencepiece, tqdm, pyyaml,
# requests, filelock, packaging, typer, onnxruntime 1.30, opencv-python-headless, six and older
# transformers (5.17) and peft. With --no-deps this fetches:
# - what it lacks: diffusers, tyro and its docstring-parser and typeguard; for the OCR reward
#   rapidocr-onnxruntime (PP-OCR's weights ship inside it), pyclipper and shapely (rapidocr's
#   opencv-python need is met by the image's opencv-python-headless: the same cv2);
# - the transformers and peft that the test suite runs on (requirements.txt), and what
#   transformers 5.24 checks at import or tyro needs newer than the image may have: regex
#   (>= 2025.10.22) and typing_extensions (>= 4.14). Carried packages win over the image's
#   through PYTHONPATH; the image's huggingface_hub and tokenizers meet transformers' bounds.
# Versions are those the CPU test suite ran on when this was written; change them here only.
# Prints the total size and whether it fits the device tool's 64 MiB working-tree limit together
# with the tree that travels.
set -euo pipefail
cd "$(dirname "$0")/.."

CORE=(diffusers==0.42.1 transformers==5.24.0 peft==0.21.2 regex==2026.11.19
      typing_extensions==4.16.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1)
OCR=(rapidocr_onnxruntime==1.4.4 pyclipper==1.4.0 shapely==2.2.0)
LIMIT_MIB=64

packages=("${CORE[@]}")
if [[ "${1:-}" != "--no-ocr" ]]; then
    packages+=("${OCR[@]}")
fi
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
rm -rf .whl
mkdir .whl
PYTHON="${PYTHON:-python3}"
for spec in "${packages[@]}"; do  # one at a time: pip matches the platform tags per wheel
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .whl "$spec"
done
ls -l .whl
wheels=$(du -sb .whl | cut -f1)
# what else travels: tracked files plus untracked files that git does not ignore
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- | tail -1 \
       | cut -f1)
total=$((wheels + tree))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
echo "wheels $(mib "$wheels") MiB + working tree $(mib "$tree") MiB = $(mib "$total") MiB" \
     "(limit ${LIMIT_MIB} MiB)"
if (( total > LIMIT_MIB * 1048576 )); then
    echo "does NOT fit: rerun with --no-ocr (gpu_check.sh then skips the OCR row)" >&2
    exit 1
fi
