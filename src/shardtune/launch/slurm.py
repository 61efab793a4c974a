"""`shardtune slurm RECIPE --nodes N --gpus-per-node G`: an sbatch script that runs the recipe
with srun + torchrun (c10d rendezvous on the first node), checkpoints when Slurm warns of the
end of the allocation, and requeues itself to resume.

How the pieces meet: `--signal=USR1@LEAD` makes Slurm send SIGUSR1 to every job step LEAD
seconds before the time limit; torchrun is told to handle SIGUSR1 and to pass it on to its
workers (waiting up to --shutdown_timeout for them, where its torch has that option); each
worker finishes the steps under way, all write one checkpoint, and rank 0 leaves a PREEMPTED
marker in the output folder. The script sees the marker and requeues the job, which starts
again with `resume=auto` (a job given resume=PATH starts from PATH, and from PATH again until the run
has a checkpoint of its own).
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from shardtune.checkpoint.rundir import PREEMPTED_MARKER
from shardtune.config.load import override_word
from shardtune.distributed.process_group import SLURM_PORT_BASE, SLURM_PORT_SPAN
from shardtune.errors import EXIT_PREEMPTED, UserError


def time_limit_s(text: str) -> int:
    """A Slurm time limit in seconds: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."""
    days, _, rest = text.strip().rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:  # D-HH[:MM[:SS]]
        parts += [0] * (3 - len(parts))
        return int(days) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
    scale = {1: (60,), 2: (60, 1), 3: (3600, 60, 1)}[len(parts)]
    return sum(p * s for p, s in zip(parts, scale, strict=True))


def shell_word(path: str) -> str:
    """A path as one word a shell passes to a command as a file (spaces quoted, a leading - no option)."""
    return shlex.quote(os.path.join(".", path) if path.startswith("-") else path)


def sbatch_script(recipe: str, output_dir: str, nodes: int, gpus_per_node: int, *, overrides: list[str],
                  job_name: str | None = None, time: str = "24:00:00", partition: str | None = None,
                  account: str | None = None, cpus_per_gpu: int = 8, signal_lead_s: int = 300,
                  offline: bool = True, workdir: str | None = None, resume: str | None = None) -> str:
    """The script; it runs in `workdir` (default: this process's folder), where the recipe, the output
    folder and the recipe's own relative paths were meant: sbatch runs a script in the folder it is
    submitted from, and a script submitted later from elsewhere read and wrote other files. `resume`:
    the run's resume (recipe or override), a checkpoint the job starts from."""
    if nodes < 1 or gpus_per_node < 1:
        raise UserError(f"--nodes and --gpus-per-node must be at least 1, got {nodes} and {gpus_per_node}")
    if signal_lead_s >= (limit := time_limit_s(time)):
        raise UserError(f"--signal-lead {signal_lead_s} (seconds) is not below --time {time} ({limit} s): the job "
                        "would be told to stop as it starts, and requeue for ever; lower --signal-lead or raise --time")
    job_name = job_name or re.sub(r"[^\w.-]", "-", Path(recipe).stem)  # a recipe's file name may hold a space
    for option, value in (("--job-name", job_name), ("--partition", partition), ("--account", account),
                          ("--time", time)):
        if value is not None and re.search(r"[\s\x00-\x1f\x7f]", value):
            # an #SBATCH line ends at a newline (the rest would run as a command) and splits at a space
            raise UserError(f"{option} {value!r} holds a space or a control character, which an #SBATCH line "
                            "cannot carry; give a name without them")
    if re.search(r"[/%]", job_name):
        # the log is {job_name}-%j.log: a slash names a folder Slurm does not make, `%` is its file-name pattern
        raise UserError(f"--job-name {job_name!r} holds '/' or '%', which the job's log file name "
                        f"({job_name}-%j.log) cannot carry; give a name without them")
    out = shell_word(output_dir)  # `rm -f -x/PREEMPTED` took -x for its options
    train_args = " ".join(shlex.quote(a) for a in [recipe, *overrides, override_word("output_dir", str(output_dir))])
    # resume=auto comes last, and the last override wins: a resume=PATH given (a run to go on from, a rewind)
    # would never be read. The job starts from PATH; a requeue takes the run's own newest checkpoint once it
    # has one, PATH again before that.
    start, train_args = "", f"{train_args} resume=auto"
    if resume not in (None, "auto"):
        start = (f"resume={shlex.quote(override_word('resume', resume))}\n"
                 f'if [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ] && [ -f {out}/checkpoints/latest ]; then '
                 "resume='resume=auto'; fi  # requeued: the run's own newest checkpoint\n")
        train_args = train_args.removesuffix(" resume=auto") + ' "$resume"'
    optional = "".join(f"#SBATCH --{key}={value}\n" for key, value in
                       (("partition", partition), ("account", account)) if value)
    offline_env = ("export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1  "
                   "# compute nodes: use the cache filled by `shardtune download`\n") if offline else ""
    return f"""#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus_per_node}
#SBATCH --cpus-per-task={cpus_per_gpu * gpus_per_node}
#SBATCH --time={time}
#SBATCH --signal=USR1@{signal_lead_s}
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={job_name}-%j.log
{optional}
# Written by `shardtune slurm`. One torchrun agent per node, {gpus_per_node} rank(s) each.
set -uo pipefail
cd -- {shlex.quote(workdir or os.getcwd())} || exit 1  # the folder the script was written in
{offline_env}export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{cpus_per_gpu}}}  # a rank's share of the cores
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# the job's own port: two jobs whose first node is the same one met on a fixed port (one joined
# the other's rendezvous, and died with it)
port=$(({SLURM_PORT_BASE} + SLURM_JOB_ID % {SLURM_PORT_SPAN}))
rm -f {out}/{PREEMPTED_MARKER}
{start}
# How long torchrun waits for the ranks' checkpoint after the signal; torchrun of torch 2.11
# and older has no such option and waits a fixed 30 s.
grace=$(torchrun --help 2>&1 | grep -q -e --shutdown_timeout && echo --shutdown_timeout={max(30, signal_lead_s - 30)})
# srun does not pass --cpus-per-task on to the step by itself (Slurm >= 22.05): say it again.
srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" torchrun \\
  --nnodes="$SLURM_NNODES" --nproc_per_node={gpus_per_node} \\
  --rdzv_backend=c10d --rdzv_endpoint="$head_node:$port" --rdzv_id="$SLURM_JOB_ID" \\
  --signals_to_handle=SIGTERM,SIGINT,SIGUSR1 $grace \\
  -m shardtune train {train_args}
status=$?

if [ -f {out}/{PREEMPTED_MARKER} ] || [ "$status" -eq {EXIT_PREEMPTED} ]; then
  echo "preempted: checkpoint written; requeueing job $SLURM_JOB_ID to resume"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit $status
"""
