#!/usr/bin/env bash
# The GPU suite in one command, on a machine with one CUDA GPU, its own PyTorch and no network:
#   bash bench/gpu/run.sh RESULTS_DIR
# 1. installs shardtune without touching the machine's torch (--no-deps, no build isolation) and
#    the wheels bench/gpu/wheels.sh brought into .whl/ (datasets, bitsandbytes, ...);
# 2. runs the CUDA tests (tests/test_cuda.py: bf16/fp16 through the CLI, the chunked loss's CUDA
#    layout, QLoRA, checkpointing/compile/offload, NCCL under torchrun, NVML telemetry + report);
# 3. runs the GPU benchmarks it has time for (shardtune vs HF Trainer, bf16 ~1B Llama; the
#    planner's predictions against torch.cuda.max_memory_allocated/reserved where it exists).
# 4. with SOAK_MINUTES=N, also the soak (bench/soak.py --device cuda): N minutes more.
# Everything it measures lands in RESULTS_DIR (logs, JUnit XML, JSON, PNGs). About 9 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
results=${1:?usage: bash bench/gpu/run.sh RESULTS_DIR}
mkdir -p "$results"
exec > >(tee "$results/suite.log") 2>&1
python=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
$python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

site=/tmp/shardtune-site
if compgen -G ".whl/*.whl" > /dev/null; then
  $python -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl || exit 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
$python -m pip install -q --no-deps --no-build-isolation -e . || exit 1
$python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|peft|datasets|bitsandbytes|accelerate) ' \
  > "$results/versions.txt"

export SHARDTUNE_GPU_RESULTS="$results" PYTHONUNBUFFERED=1
status=0
timeout 240 $python -m pytest -q -m cuda tests/test_cuda.py --junitxml "$results/cuda-tests.xml" || status=1
timeout 150 $python bench/vs_hf_trainer.py --gpu --repeats 1 --sharding full_shard --steps 12 \
  > "$results/vs_hf_trainer.md" || status=1
if [ -f bench/plan_accuracy.py ]; then
  timeout 120 $python bench/plan_accuracy.py --gpu --rows 3 > "$results/plan_accuracy.md" || status=1
fi
if [ "${SOAK_MINUTES:-0}" != 0 ]; then  # optional: RSS and CUDA memory flat over a long run (bench/soak.py)
  timeout $((SOAK_MINUTES * 60 + 300)) $python bench/soak.py --device cuda --minutes "$SOAK_MINUTES" \
    --warmup-minutes 1 --bucket-minutes 1 --checkpoint-minutes 1 --eval-minutes 0.5 > "$results/soak.md" || status=1
fi
echo "GPU suite finished with status $status; results in $results"
exit $status
