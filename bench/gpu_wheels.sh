#!/bin/bash
# The Python packages the GPU machine lacks, or holds at a release we do not pin, carried there as wheels.
#   bash bench/gpu_wheels.sh fetch     # here, with PyPI reachable: the wheels into gpu_wheels/ (git-ignored)
#   bash bench/gpu_wheels.sh install   # on the GPU machine, no network: pip installs them from gpu_wheels/
#
# The GPU machine we are lent reaches no package registry. Its Python is 3.12 with torch 2.11, transformers 5.17,
# safetensors, accelerate, huggingface_hub, xxhash, pyarrow, fsspec, pandas and a peft of unknown release
# (docs/dependencies.md). It lacks datasets and two of datasets' dependencies (dill, multiprocess); peft is carried
# at our pin; fsspec rides along only as a fallback, for pip to take should the machine's be outside datasets' range.
# torch and transformers are not carried: the project supports the machine's (common/versions.py).
# PYTHON: the interpreter to install into (default python3, which on the GPU machine holds its torch);
# PY_VERSION: the Python release to fetch wheels for (default 3.12, the GPU machine's).
set -euo pipefail
cd "$(dirname "$0")/.."
FOLDER=gpu_wheels
PYTHON=${PYTHON:-python3}
PY_VERSION=${PY_VERSION:-3.12}

pin() {  # the name==version line of requirements.txt, the one place a pin is kept
  grep -E "^$1==" requirements.txt | cut -d' ' -f1
}

# installed by name; datasets 5.2.0 asks for dill<0.4.2 and multiprocess<0.70.20
PACKAGES=("$(pin datasets)" "dill==0.4.1" "multiprocess==0.70.19" "$(pin peft)")
FALLBACK=("fsspec==2026.9.0")  # datasets 5.2.0 asks for fsspec<=2026.9.0

fetch() {
  rm -rf "$FOLDER"
  # --no-deps: the list above is the whole set; every other dependency is on the GPU machine already
  python3 -m pip download --quiet --dest "$FOLDER" --no-deps --only-binary=:all: --implementation cp \
    --python-version "$PY_VERSION" --abi "cp${PY_VERSION/./}" \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    "${PACKAGES[@]}" "${FALLBACK[@]}"
  echo "gpu_wheels: $(ls "$FOLDER" | wc -l) wheels, $(du -sh "$FOLDER" | cut -f1) in $FOLDER/: $(ls "$FOLDER" | tr '\n' ' ')"
}

install() {
  if [ ! -d "$FOLDER" ]; then
    echo "error: no $FOLDER/ folder: run 'bash bench/gpu_wheels.sh fetch' where PyPI is reachable, and carry it" >&2
    exit 1
  fi
  local log
  log=$(mktemp)
  if ! "$PYTHON" -m pip install --no-index --find-links "$FOLDER" --disable-pip-version-check "${PACKAGES[@]}" \
      >"$log" 2>&1; then
    echo "error: pip could not install ${PACKAGES[*]} from $FOLDER/: $(grep -m1 '^ERROR' "$log" || tail -n1 "$log")" >&2
    exit 1
  fi
  local installed_now
  installed_now=$(grep -m1 '^Successfully installed' "$log" | sed 's/^Successfully installed //' || true)
  rm -f "$log"
  # what the project needs of this interpreter, beyond the wheels: torch/transformers releases, xxhash's XXH3-128
  "$PYTHON" -c 'import sys, datasets, peft, transformers, xxhash, torch
from common.versions import unsupported_versions
problem = unsupported_versions() or (None if hasattr(xxhash, "xxh3_128") else "xxhash has no xxh3_128: install xxhash>=2")
if problem:
    sys.exit(f"error: {problem}")
print(f"gpu_wheels: installed {sys.argv[1]}; using torch {torch.__version__}, "
      f"transformers {transformers.__version__}, datasets {datasets.__version__}, peft {peft.__version__}")' \
    "${installed_now:-nothing, all there already}"
}

case "${1:-}" in
  fetch) fetch ;;
  install) install ;;
  *) echo "error: usage: bash bench/gpu_wheels.sh fetch|install" >&2; exit 2 ;;
esac
