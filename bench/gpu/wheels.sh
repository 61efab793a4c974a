#!/usr/bin/env bash
# Run where pip reaches the registry: downloads into .whl/ (git-ignored) the wheels that GPU
# machines without network lack (their image has torch, transformers 5.17, peft, accelerate, pyarrow,
# xxhash, fsspec, huggingface-hub, tensorboard, matplotlib, nvidia-ml-py; not datasets and its
# own needs, nor bitsandbytes, torchao; nor the transformers the project pins). bench/gpu/run.sh installs them with --no-deps: nothing of the
# machine's own torch is replaced.
#   bash bench/gpu/wheels.sh [PYTHON_VERSION]   (default 3.12, the GPU image's python)
#   QLORA=1 bash bench/gpu/wheels.sh           also bitsandbytes (then carry less of the tree)
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${1:-3.12}
pip=${PIP:-python3 -m pip}
mkdir -p .whl
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
           --platform any)
datasets=$(grep '^datasets==' constraints.txt)
torchao=$(grep '^torchao==' constraints.txt)  # train.optimizer_state=bf16/8bit/4bit
# the project's transformers (pyproject needs >= 5.18: older OPT syncs the host every forward) with
# what it needs above the image's; huggingface-hub stays 1.x like the image's other libraries
transformers=$(grep '^transformers==' constraints.txt)
# kernels=liger: pure Python over Triton, which the image's CUDA torch brings (its own pinned triton)
liger=$(grep '^liger-kernel==' constraints.txt)
# bitsandbytes (43 MB) only with QLORA=1: with it .whl is 63 MB, and a device call carries 64 MiB in
# all, the working tree included (2026-11-26: left behind, so the QLoRA test skipped on the H200)
qlora=(); [ "${QLORA:-0}" = 1 ] && qlora=(bitsandbytes)
for wheel in "$datasets" dill multiprocess "${qlora[@]}" "$torchao" "$transformers" "tokenizers>=0.23.1,<0.24" \
             "huggingface-hub>=1.31,<2" "$liger"; do
  $pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp "${platforms[@]}" \
    -d .whl "$wheel"
done
ls -1 .whl
