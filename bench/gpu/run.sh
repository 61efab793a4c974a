#!/usr/bin/env bash
# The GPU suite in one command, on a machine with one CUDA GPU, its own PyTorch and no network:
#   bash bench/gpu/run.sh RESULTS_DIR [BRING_BACK_DIR]
#   bash bench/gpu/run.sh --rehearse RESULTS_DIR      (or REHEARSE=1): every stage on CPU, tiny sizes
#
# Stages, in order; each has a time cap, and the whole suite a budget (BUDGET_S, default 540 s =
# 9 minutes, so it ends inside a 10-minute call): a stage gets min(its cap, what is left), a stage
# with under 30 s left is skipped, and every stage writes its own files whatever the later ones do.
#   setup        install shardtune without touching the machine's torch (--no-deps, no build
#                isolation; PYTHONPATH=src if that fails) + the wheels bench/gpu/wheels.sh put in
#                .whl/; env.txt (GPU, driver, versions), a list of missing modules. ~20 s
#   tests  360 s tests/e2e/test_cuda.py (-m cuda): bf16/fp16 through the CLI with eval/generate/export,
#                the chunked loss's CUDA layout, QLoRA, checkpointing/compile/offload, the step
#                under set_sync_debug_mode("error") and its NaN skip on the device, NCCL under
#                torchrun, NVML telemetry and the report's PNGs. cuda-tests.xml, tests/ (JSON
#                records, PNGs). ~12 short CLI runs, one compile: 335 s serially on an H100 (2026-11-25),
#                159 s on 4 pytest-xdist workers on an H200 (2026-11-26; TESTS_WORKERS, default 4 on a
#                GPU where xdist imports, 0 = serial, as the rehearsal) (float8 and liger: stages of their own)
#   bench-llama 120 s, bench-opt 120 s   bench/vs_hf_trainer.py --gpu, Llama ~1B and OPT-1.3B
#                shapes, seq 2048, bf16, random init, full_shard on 1 GPU against HF Trainer,
#                shardtune/HF alternating, as many pairs as the cap allows (REPEATS, default 2).
#                vs_hf_{llama,opt}.{md,json}. Estimate per run: ~25 s set-up (imports, random
#                init of 1-1.3B parameters on the CPU, copy to the GPU) + BENCH_STEPS (8) steps of
#                BENCH_GLOBAL (8) x 2048 tokens at 10-20k tokens/s (0.8-1.6 s each) = 35-40 s, a
#                pair ~80 s: one pair (A B) fits the cap; A B A B needs a call of its own (below).
#   curve  240 s bench/vs_hf_trainer.py --gpu --steps 30 --global-batch 32 --lr 1e-4 --warmup-steps 10
#                --loss-tolerance 0.03 (CURVE_LR, CURVE_WARMUP; at the speed arms' 3e-4 / 3 both sides went
#                NaN at step 4 on 2026-11-26, so the curve runs the gentler schedule, not run on a GPU yet): the
#                Llama ~1B loss curve against HF Trainer's (its NaN filter off; shardtune on_nan=skip, so a NaN
#                step shows on both sides instead of ending the pair), every step finite and
#                within 3 % (0.7 % apart at step 8 on the H100); per-step losses and gradient norms of
#                both sides in curve.md; exit 1 otherwise. ~150 s (shardtune ~65 s, HF ~80 s)
#   offload 240 s bench/gpu/variants.py: the Llama ~1B setup, 4 steps, plain and fsdp.cpu_offload=true,
#                losses equal within 1e-3 at every step (offload.md). ~100 s (CPU AdamW over 1.1B params)
#   nan-hunt 200 s bench/gpu/variants.py: global 8, 16 steps, on_nan=skip, with the chunked head loss and
#                with the model's own head (loss_chunk_tokens=0): a step that goes non-finite names its
#                gradients and samples (nan-hunt.md). ~90 s
#   nan-origin 200 s  only when STAGES names it: bench/gpu/variants.py, global 8, 16 steps, on_nan=skip, HF's
#                SDPA attention (flash / cuDNN kernels) against its eager attention (softmax in fp32): steps 13-14
#                went NaN in layer 3's dQ/dK with both SDPA kernels on 2026-11-26 (results/2026-11-26-h200-b).
#                nan-origin.md. ~35 s a variant
#   profile 90 s bench/profile_step.py: the Llama setup, global batch 8, 3 untraced + 3 traced
#                steps (log.profile_steps): profile/{trace.json.gz, ops.txt, metrics.jsonl,
#                train.log}, profile.md. ~50 s; the trace ~2-5 MB compressed
#   plan   90 s  bench/plan_accuracy.py --gpu --rows PLAN_ROWS (3): the planner's predictions
#                against max_memory_allocated/reserved. plan_accuracy.md. ~25 s a small row, ~47 s a 1B one
#   speed-order 330 s bench/speed_order.py --gpu: the Llama ~1B setup, 1 GPU, activation checkpointing
#                none / selective / every 2nd / full and activation offload, SPEED_STEPS (6) steps each,
#                SPEED_ROUNDS (1) rounds: measured s/step and its order against the planner's
#                predicted order (issue 33, item 5); exit 1 on a pair ordered the other way beyond 5 %.
#                speed_order.md. 292 s on the H200 (2026-11-27: a compile per arm); only when STAGES names it
#   float8-tests 120 s, float8 420 s   only when STAGES names them (a call of their own, below):
#                tests/e2e/test_cuda.py -k float8 (rowwise/tensorwise within 2 % of bf16 over 12
#                steps, or refused in one line below compute capability 8.9) -> float8-tests.log/.xml;
#                bench/float8_speed.py: the Llama ~1B setup, compiled, bf16 / rowwise / tensorwise,
#                FLOAT8_STEPS (50) steps each, FLOAT8_REPEATS (1) rounds -> float8.md (tok/s, peak,
#                loss against bf16). Estimate ~25 s set-up + ~40 s compile + 50 x ~0.7 s per arm.
#   liger-tests 120 s, liger 420 s   only when STAGES names them (issue 34, a call of their own):
#                tests/e2e/test_cuda.py -k liger (kernels=liger's losses within 1e-3 (fp32) / 2 % (bf16)
#                of the plain run's over 6 steps on a tiny Llama) -> liger-tests.log/.xml;
#                bench/liger_speed.py: the Llama ~1B setup, plain / liger / both compiled, LIGER_STEPS
#                (20) steps each -> liger.md (tok/s, peak reserved/allocated, losses against the plain
#                twin). Needs the liger wheel from bench/gpu/wheels.sh in .whl/ (the image's torch brings
#                triton). Estimate ~25 s set-up per arm + ~40 s compile in two arms + 20 x ~0.4 s.
#   liger-bisect 150 s  only when STAGES names it: bench/gpu/liger_bisect.py, each Liger piece alone on a tiny
#                Llama (RMSNorm, rotary, SwiGLU, the fused loss), then shardtune's build with kernels=liger and
#                without, each in its own process under CUDA_LAUNCH_BLOCKING=1: the first phase that faults
#                (every kernels=liger run hit an illegal memory access on 2026-11-26). liger_bisect.md. ~10 s a case
#   head-chunks 300 s   only when STAGES names it: bench/head_chunks.py, the Llama ~1B setup, the
#                chunked head loss at its default chunk, HEAD_CHUNKS (1024 2048 4096) tokens and full
#                logits, HEAD_STEPS (12) steps each -> head_chunks.md (tok/s, peak reserved, losses
#                against full logits): the CUDA default chunk by measurement. ~25 s set-up + 12 x ~0.4 s an arm.
#   soak         only with SOAK_MINUTES=N: bench/soak.py --device cuda, N minutes more (the
#                budget grows by N minutes + 2). soak.md
# STAGES="tests bench-llama ..." runs only those (setup always runs). After every stage the
# folder gets summary.md (bench/gpu/summarize.py), stages.tsv and results.tar.gz (everything
# but itself; without the trace if that would pass 15 MiB), and BRING_BACK_DIR, if given, a
# copy of exactly three files: summary.md, suite.log, results.tar.gz.
#
# On the device tool (at most 8 files of 16 MiB come back from $OUT): name $OUT as BRING_BACK_DIR,
# and the stages done before a kill still come back; carry .whl (git-ignored) for the wheels:
# Before a GPU session's first call, on the CPU: `bash bench/torch_compat.sh 2.11.0` (the suite under
# the image's torch) and `bash bench/gpu/run.sh --rehearse DIR` with PYTHON= that venv's python.
# A session has 15 minutes of device time (machine start, ~30 s on 2026-11-26, included; 10 min a call; a
# warm machine waits only 30 s for the next call, so send the next one at once, or give it back and
# start again while 4 minutes are left). Done on the H200 on 2026-11-26 (bench/gpu/results/2026-11-26-h200/,
# -h200-b/ and -h200-c/): tests, curve (HF Trainer goes NaN at step 4 too: the bench's random-init 1B at lr
# 3e-4 / warmup 3 is unstable in bf16 on both sides, so the curve stage exits 1 past step 3), offload,
# nan-hunt, nan-origin (eager attention NaN at the same steps), one Llama A B A B eager and one pair
# compiled (1.34x HF), compile's gain (1.34x), profile, every planner row but 12-15, Liger's pieces one
# by one (each works; the fault was the FLOP count's meta forward, fixed since). compile=auto is the
# default since: the CUDA tests and every bench arm without compile=false now run compiled blocks.
# Done on 2026-11-27 (results/2026-11-27-h200/, 769 s of device time in two calls): planner rows 12-15
# (`STAGES=plan PLAN_PICK=12,13,14,15`, 190 s) and the speed order (`STAGES=speed-order CAP_SPEED_ORDER=370`,
# 292 s; its first try, after the plan rows in one call, stopped at 193 s): what was the 5th call.
# The calls left, in order of value:
#   1st call (~8 min):  STAGES="tests liger-tests" BUDGET_S=540 bash bench/gpu/run.sh /tmp/gpu-t "$OUT"
#                       (the CUDA tests under the compile=auto default, and Liger's after the hf_patches fix)
#   2nd call (~6 min):  STAGES="liger" LIGER_STEPS=20 BUDGET_S=420 bash bench/gpu/run.sh /tmp/gpu-liger "$OUT"
#                       (plain / liger eager and compiled: Liger-Kernel's gain on top of compile, or not)
#   3rd call (~7 min):  STAGES="float8-tests float8" BUDGET_S=420 bash bench/gpu/run.sh /tmp/gpu-f8 "$OUT"
#                       (float8's loss and speed; FLOAT8_EFFICIENCY in plan/cost.py)
#   4th call (~9 min):  STAGES="bench-llama bench-opt" CAP_BENCH=250 REPEATS=2 BUDGET_S=540 bash bench/gpu/run.sh /tmp/gpu-ab "$OUT"
#                       (A B A B on both shapes, compiled by default: issue 34's proof; OPT's HF side never finished before)
#   (the 5th, STAGES="plan speed-order" PLAN_PICK=12,13,14,15, done 2026-11-27: needs ~500 s, two calls)
#   a QLoRA planner row: STAGES=plan PLAN_PICK=16 after QLORA=1 bash bench/gpu/wheels.sh (skipped without bitsandbytes)
#   6th call:           STAGES="head-chunks profile" (the head's chunk sizes; the compiled step's profile)
#   QLoRA's CUDA test:  QLORA=1 bash bench/gpu/wheels.sh, then carry .whl with a lighter tree (bitsandbytes is 43 MB)
#   issue 20 (one call, ~8 min): memory savers on CUDA, device=auto
#     python bench/memory_savers.py activations --micro-batch 8 --steps 6 precision=bf16 > "$OUT/savers_act.md"
#     python bench/memory_savers.py quality --steps 300 > "$OUT/savers_quality.md"   (compiled torchao step)
#     python bench/memory_savers.py activations --micro-batch 8 --steps 6 precision=bf16 fsdp.reduce_dtype=bf16 \
#       train.optimizer_state=8bit > "$OUT/savers_act_8bit.md"
# Knobs: PYTHON, BUDGET_S, LIGER_TESTS_BLOCKING (1: the faulting kernel's traceback), TESTS_WORKERS, BENCH_SET (shardtune settings for the bench stages), REPEATS, BENCH_STEPS, BENCH_GLOBAL, PLAN_ROWS, PLAN_PICK (rows by index, e.g. 8,10,11), SOAK_MINUTES, LIGER_STEPS, LIGER_ARMS (e.g. "plain plain-compiled": compile's gain alone), HEAD_CHUNKS, HEAD_STEPS, CURVE_LR, CURVE_WARMUP, CAP_<STAGE>.
# The CPU rehearsal (no install; .venv/bin/python) takes about 4 minutes on 2 cores (BENCHMARKS.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
rehearse=${REHEARSE:-0}
positional=()
for arg in "$@"; do
  case $arg in
    --rehearse) rehearse=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "unknown option $arg; usage: bash bench/gpu/run.sh [--rehearse] RESULTS_DIR [BRING_BACK_DIR]" >&2; exit 2 ;;
    *) positional+=("$arg") ;;
  esac
done
results=${positional[0]:-}
bring=${positional[1]:-}
if [ -z "$results" ]; then
  echo "usage: bash bench/gpu/run.sh [--rehearse] RESULTS_DIR [BRING_BACK_DIR]" >&2
  exit 2
fi
mkdir -p "$results" && results=$(cd "$results" && pwd)
if [ -n "$bring" ]; then mkdir -p "$bring" && bring=$(cd "$bring" && pwd); fi
rm -f "$results/stages.tsv" "$results/suite.log"
if [ "$rehearse" = 1 ]; then default_python=.venv/bin/python; else default_python=python3; fi
[ -x "$default_python" ] || default_python=python3
python=${PYTHON:-$default_python}
started=$(date +%s)
budget=$(( ${BUDGET_S:-540} + ${SOAK_MINUTES:-0} * 60 + (${SOAK_MINUTES:-0} > 0 ? 120 : 0) ))
deadline=$(( started + budget ))
reserve=15  # for the last summary and tarball
stages=${STAGES:-tests bench-llama${SOAK_MINUTES:+ soak}}
workers=${TESTS_WORKERS:-$([ "$rehearse" = 1 ] && echo 0 || echo 4)}
[[ $workers =~ ^[0-9]+$ ]] || { echo "TESTS_WORKERS=$workers is not a count; use 0 (serial) or a number of workers" >&2; exit 2; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export SHARDTUNE_BENCH_DIR=${SHARDTUNE_BENCH_DIR:-/tmp/shardtune-bench}
rh=()  # what a script adds to rehearse
if [ "$rehearse" = 1 ]; then rh=(--rehearse); export SHARDTUNE_TEST_DEVICE=cpu; fi
collect=()  # ARGS_ONLY=1: every stage's command line is parsed by its script, nothing runs (seconds)
if [ -n "${ARGS_ONLY:-}" ]; then collect=(--collect-only); export SHARDTUNE_BENCH_ARGS_ONLY=1; fi

say() { echo "$*" | tee -a "$results/suite.log"; }
wanted() { [[ " $stages " == *" $1 "* ]]; }
time_for() {  # time_for CAP: seconds a stage may take now
  local left=$(( deadline - $(date +%s) - reserve ))
  echo $(( $1 < left ? $1 : left ))
}

pack() {  # summary.md, results.tar.gz and the copies in BRING_BACK_DIR
  $python bench/gpu/summarize.py "$results" > "$results/summary.md.tmp" 2>> "$results/suite.log" \
    && mv "$results/summary.md.tmp" "$results/summary.md"
  local tarball=$results/results.tar.gz
  tar -czf "$tarball.tmp" -C "$results" --exclude=./results.tar.gz --exclude=./results.tar.gz.tmp . 2>/dev/null
  if [ "$(stat -c %s "$tarball.tmp")" -gt $((15 * 1024 * 1024)) ]; then  # too big to come back: drop the traces
    tar -czf "$tarball.tmp" -C "$results" --exclude=./results.tar.gz --exclude=./results.tar.gz.tmp \
      --exclude='*.json.gz' . 2>/dev/null
    say "  results.tar.gz leaves out the Chrome traces (over 15 MiB with them); they stay in $results"
  fi
  mv "$tarball.tmp" "$tarball"
  if [ -n "$bring" ]; then cp "$results/summary.md" "$results/suite.log" "$tarball" "$bring/"; fi
}

leftovers() {  # GPU processes of this suite still alive after a stage (a killed stage's ranks)
  command -v nvidia-smi > /dev/null || return 0
  local pid
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    if tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qE 'shardtune|bench/'; then
      say "  stopping leftover GPU process $pid: $(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-120)"
      kill "$pid" 2>/dev/null; sleep 5; kill -9 "$pid" 2>/dev/null
    fi
  done
}

stage() {  # stage NAME SECONDS OUTFILE COMMAND...: COMMAND's output to RESULTS/OUTFILE, at most SECONDS
  local name=$1 limit=$2 out=$3
  shift 3
  wanted "$name" || return 0
  if [ "$limit" -lt 30 ]; then
    say "stage $name: skipped, the budget is spent"
    printf '%s\tskipped (budget)\t0\t%s\n' "$name" "$out" >> "$results/stages.tsv"
    pack
    return 0
  fi
  say "stage $name: up to ${limit}s -> $out ($(date +%H:%M:%S))"
  local t0
  t0=$(date +%s)
  timeout -k 20 "$limit" "$@" > "$results/$out" 2>&1
  local rc=$?
  [ $rc = 124 ] && echo "(stopped by run.sh after ${limit}s)" >> "$results/$out"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$out" >> "$results/stages.tsv"
  say "stage $name: exit $rc after $(( $(date +%s) - t0 ))s; last lines:"
  tail -n 4 "$results/$out" | cut -c1-200 | sed 's/^/    /' | tee -a "$results/suite.log"
  [ $rc = 0 ] || status=1
  leftovers
  if [ $rc = 124 ] || [ $rc = 137 ]; then  # a run stopped by SIGTERM saves a checkpoint: scratch, GBs at 1B
    find "$SHARDTUNE_BENCH_DIR" -maxdepth 4 -type d -name checkpoints -prune -exec rm -rf {} + 2>/dev/null
  fi
  pack
}

# ---------------------------------------------------------------------------- setup
status=0
say "GPU suite$([ "$rehearse" = 1 ] && echo ' (CPU rehearsal)'): stages '$stages', budget ${budget}s, results in $results"
if [ "$rehearse" != 1 ] && [ -z "${ARGS_ONLY:-}" ]; then
  site=/tmp/shardtune-site
  if compgen -G ".whl/*.whl" > /dev/null; then
    $python -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl 2>&1 \
      | tail -3 | tee -a "$results/suite.log"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  if ! $python -m pip install -q --no-deps --no-build-isolation -e . > "$results/install.log" 2>&1; then
    say "pip install -e . failed (install.log; e.g. setuptools < 77 and no network); using PYTHONPATH=src"
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
{
  echo "date $(date -u '+%Y-%m-%d %H:%M UTC'), host $(hostname), $(nproc) CPUs, git $(git rev-parse --short HEAD 2>/dev/null)"
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  else
    echo "no nvidia-smi"
  fi
  if [ -n "${ARGS_ONLY:-}" ]; then  # command lines only: no library is imported (seconds each time)
    echo "ARGS_ONLY=1: library versions not probed"
  else
  $python -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda',
torch.version.cuda, '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')" 2>&1
  $python - <<'EOF' 2>&1
import importlib
found, missing = [], []
for name in ("shardtune", "transformers", "datasets", "peft", "accelerate", "bitsandbytes", "pynvml", "tensorboard",
             "triton", "liger_kernel"):
    try:
        module = importlib.import_module(name)
        found.append(f"{name} {getattr(module, '__version__', '')}".strip())
    except Exception as exc:  # noqa: BLE001 - any import failure is worth one line
        missing.append(f"{name} ({type(exc).__name__})")
print("found:", ", ".join(found))
print("missing:", ", ".join(missing) or "none")
EOF
  fi
} > "$results/env.txt"
tee -a "$results/suite.log" < "$results/env.txt"

# ---------------------------------------------------------------------------- stages
export SHARDTUNE_GPU_RESULTS=$results/tests
xdist=()  # the image has pytest-xdist; without it the tests run serially
if [ "$workers" -gt 0 ] && $python -c "import xdist" 2> /dev/null; then xdist=(-n "$workers"); fi
stage tests "$(time_for "${CAP_TESTS:-360}")" cuda-tests.log \
  $python -m pytest -q -p no:cacheprovider -m cuda tests/e2e/test_cuda.py -k "not float8 and not liger" \
  "${xdist[@]}" --junitxml "$results/cuda-tests.xml" "${collect[@]}"
bench_args=(--repeats "${REPEATS:-2}" --sharding full_shard --nproc 1 --steps "${BENCH_STEPS:-8}"
            --global-batch "${BENCH_GLOBAL:-8}")
[ "$rehearse" = 1 ] && bench_args+=(--peak-tflops 1)  # the MFU columns, against a nominal peak
for setting in ${BENCH_SET:-}; do bench_args+=(--shardtune-set "$setting"); done  # e.g. BENCH_SET=compile=true
for model in llama opt; do
  setup=gpu; [ $model = opt ] && setup=gpu-opt
  limit=$(time_for "${CAP_BENCH:-120}")
  stage "bench-$model" "$limit" "vs_hf_$model.md" $python bench/vs_hf_trainer.py --setup $setup "${bench_args[@]}" \
    --budget-s $(( limit - 10 )) --json "$results/vs_hf_$model.json" "${rh[@]}"
done
stage curve "$(time_for "${CAP_CURVE:-240}")" curve.md $python bench/vs_hf_trainer.py --setup gpu --repeats 1 \
  --sharding full_shard --nproc 1 --steps 30 --global-batch 32 --lr "${CURVE_LR:-1e-4}" --warmup-steps "${CURVE_WARMUP:-10}" \
  --loss-tolerance 0.03 --shardtune-set on_nan=skip \
  --json "$results/curve.json" "${rh[@]}"
stage offload "$(time_for "${CAP_OFFLOAD:-240}")" offload.md $python bench/gpu/variants.py --steps 4 --equal 1e-3 \
  plain= offload=fsdp.cpu_offload=true "${rh[@]}"
stage nan-hunt "$(time_for "${CAP_NAN_HUNT:-200}")" nan-hunt.md $python bench/gpu/variants.py --steps 16 \
  chunked-head=on_nan=skip model-head=on_nan=skip,loss_chunk_tokens=0 "${rh[@]}"
stage nan-origin "$(time_for "${CAP_NAN_ORIGIN:-200}")" nan-origin.md $python bench/gpu/variants.py --steps 16 \
  sdpa=on_nan=skip eager=on_nan=skip,model.config.attn_implementation=eager "${rh[@]}"
stage profile "$(time_for "${CAP_PROFILE:-90}")" profile.md \
  $python bench/profile_step.py --setup gpu --global-batch 8 --out "$results/profile" "${rh[@]}"
plan_rows=(--rows "${PLAN_ROWS:-3}"); [ -n "${PLAN_PICK:-}" ] && plan_rows=(--pick "$PLAN_PICK")
stage plan "$(time_for "${CAP_PLAN:-90}")" plan_accuracy.md \
  $python bench/plan_accuracy.py --gpu "${plan_rows[@]}" "${rh[@]}"
stage speed-order "$(time_for "${CAP_SPEED_ORDER:-330}")" speed_order.md \
  $python bench/speed_order.py --gpu --steps "${SPEED_STEPS:-6}" --rounds "${SPEED_ROUNDS:-1}" "${rh[@]}"
stage float8-tests "$(time_for "${CAP_FLOAT8_TESTS:-120}")" float8-tests.log \
  $python -m pytest -q -p no:cacheprovider -m cuda tests/e2e/test_cuda.py -k float8 \
  --junitxml "$results/float8-tests.xml" "${collect[@]}"
stage float8 "$(time_for "${CAP_FLOAT8:-420}")" float8.md \
  $python bench/float8_speed.py --steps "${FLOAT8_STEPS:-50}" --repeats "${FLOAT8_REPEATS:-1}" "${rh[@]}"
stage liger-tests "$(time_for "${CAP_LIGER_TESTS:-120}")" liger-tests.log \
  env CUDA_LAUNCH_BLOCKING="${LIGER_TESTS_BLOCKING:-0}" $python -m pytest -q -p no:cacheprovider -m cuda tests/e2e/test_cuda.py -k liger \
  --junitxml "$results/liger-tests.xml" "${collect[@]}"
stage liger "$(time_for "${CAP_LIGER:-420}")" liger.md \
  $python bench/liger_speed.py --steps "${LIGER_STEPS:-20}" --repeats "${LIGER_REPEATS:-1}" \
  --arms ${LIGER_ARMS:-plain liger plain-compiled liger-compiled} "${rh[@]}"
stage liger-bisect "$(time_for "${CAP_LIGER_BISECT:-150}")" liger_bisect.md $python bench/gpu/liger_bisect.py "${rh[@]}"
stage head-chunks "$(time_for "${CAP_HEAD_CHUNKS:-300}")" head_chunks.md \
  $python bench/head_chunks.py --steps "${HEAD_STEPS:-12}" --skip 4 --chunks ${HEAD_CHUNKS:-1024 2048 4096} "${rh[@]}"
if [ -n "${SOAK_MINUTES:-}" ]; then
  m=$SOAK_MINUTES
  if [ "$rehearse" = 1 ]; then soak_args=(--device cpu --sample-s 2); else soak_args=(--device cuda); fi
  stage soak "$(time_for $(( m * 60 + 120 )))" soak.md $python bench/soak.py "${soak_args[@]}" --minutes "$m" \
    --warmup-minutes "$(echo "$m" | awk '{print $1 / 3}')" --bucket-minutes "$(echo "$m" | awk '{print $1 / 4}')" \
    --checkpoint-minutes "$(echo "$m" | awk '{print $1 / 2}')" --eval-minutes "$(echo "$m" | awk '{print $1 / 4}')"
fi
say "GPU suite finished with status $status after $(( $(date +%s) - started ))s; results in $results"
pack
exit $status
