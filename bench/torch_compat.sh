#!/usr/bin/env bash
# The test suite under another torch than constraints.txt pins: by default the GPU image's (2.11.0
# when last seen), so what differs there (torch 2.11's FSDP group hook broke `plan` on the H200,
# 2026-11-26) shows up on this CPU before a GPU call is spent on it.
#   bash bench/torch_compat.sh [TORCH_VERSION] [PYTEST_ARGS ...]     e.g. bash bench/torch_compat.sh 2.11.0 tests/plan
# The venv is kept (TORCH_COMPAT_VENV, default /tmp/shardtune-torch-VERSION): PyPI's torch wheel is
# the CUDA build, ~3.5 GB with its NVIDIA libraries, and runs on a CPU. The rest as the README's set-up.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-2.11.0}
shift $(( $# > 0 ? 1 : 0 ))
venv=${TORCH_COMPAT_VENV:-/tmp/shardtune-torch-$version}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, shardtune" 2> /dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "torch==$version"
  "$venv/bin/pip" install -q -c <(grep -v '^torch==' constraints.txt) -e '.[test]'
fi
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 "$@"
