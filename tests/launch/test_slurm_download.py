"""Offline clusters: `shardtune download` (what a recipe needs, refused when offline), the
one-line error for a model or dataset missing from the cache, and `shardtune slurm`'s script."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT, child_env, run_cli, tiny_overrides


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ----------------------------------------------------------------------------- slurm


def test_slurm_script_runs_torchrun_under_srun_and_requeues_on_preemption(tmp_path, capsys):
    from shardtune.cli.main import main

    script = tmp_path / "job.sbatch"
    code = main(["slurm", "recipes/llama2-7b-alpaca-lora.yaml", "--nodes", "2", "--gpus-per-node", "4",
                 "--partition", "gpu", "--account", "proj1", "--time", "02:00:00", "--output-dir", "runs/alpaca",
                 "train.lr=5e-5", "-o", str(script)])
    assert code == 0, capsys.readouterr().err
    assert f"sbatch {script}" in capsys.readouterr().out
    text = script.read_text()
    assert text.startswith("#!/bin/bash\n")
    subprocess.run(["bash", "-n", str(script)], check=True)

    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", text, flags=re.M))
    assert sbatch["nodes"] == "2" and sbatch["gpus-per-node"] == "4" and sbatch["ntasks-per-node"] == "1"
    assert sbatch["cpus-per-task"] == "32" and "OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}" in text  # 8 per GPU
    # a node of fewer cores than 8 per GPU: sbatch refused the job, and only an edit of the script could help
    assert main(["slurm", "recipes/gpt2-wikitext2.yaml", "--nodes", "1", "--gpus-per-node", "4", "--cpus-per-gpu",
                 "3"]) == 0
    fewer = capsys.readouterr().out
    assert "#SBATCH --cpus-per-task=12\n" in fewer and "OMP_NUM_THREADS=${OMP_NUM_THREADS:-3}" in fewer
    assert sbatch["partition"] == "gpu" and sbatch["account"] == "proj1" and sbatch["time"] == "02:00:00"
    assert sbatch["signal"].startswith("USR1@") and "requeue" in sbatch  # warning before the limit, requeueable

    launch = re.search(r"^srun .*?-m shardtune train .*$", text, flags=re.M | re.S).group(0)
    assert "torchrun" in launch and "--nproc_per_node=4" in launch and '--nnodes="$SLURM_NNODES"' in launch
    assert "--rdzv_backend=c10d" in launch and '--rdzv_endpoint="$head_node:' in launch
    handled = re.search(r"--signals_to_handle=(\S+)", launch).group(1).split(",")
    assert "SIGUSR1" in handled and "SIGTERM" in handled
    assert "recipes/llama2-7b-alpaca-lora.yaml train.lr=5e-5 output_dir=runs/alpaca resume=auto" in launch
    assert "HF_HUB_OFFLINE=1" in text  # compute nodes read the cache `shardtune download` filled
    assert '[ -f runs/alpaca/PREEMPTED ] || [ "$status" -eq 75 ]' in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert text.index("srun ") < text.index("scontrol requeue")


def test_slurm_script_marker_check_and_requeue_work_in_bash(tmp_path):
    """Run the script's tail with fake srun/scontrol: the marker (or exit 75) leads to a requeue."""
    from shardtune.distributed.process_group import slurm_port
    from shardtune.launch.slurm import sbatch_script

    out = tmp_path / "run dir"
    text = sbatch_script("recipes/gpt2-wikitext2.yaml", str(out), 1, 2, overrides=[], offline=False)
    assert "HF_HUB_OFFLINE" not in text
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[ "$1" = requeue ] && echo "REQUEUED $2" || echo node1\n')
    for status, marker, requeued, grace in [(0, False, False, True), (1, False, False, False),
                                            (75, False, True, True), (1, True, True, False)]:
        out.mkdir(exist_ok=True)
        write = f'mkdir -p "{out}"; echo 3 > "{out}/PREEMPTED"; ' if marker else ""
        (bin_dir / "srun").write_text(f'#!/bin/bash\necho "$@" > "{tmp_path}/srun-args"\n{write}exit {status}\n')
        # torchrun of torch >= 2.12 has --shutdown_timeout; 2.11's does not
        option = "--shutdown_timeout SHUTDOWN_TIMEOUT" if grace else "--signals_to_handle SIGNALS"
        (bin_dir / "torchrun").write_text(f"#!/bin/bash\necho 'usage: torchrun {option}'\n")
        for f in bin_dir.iterdir():
            f.chmod(0o755)
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "SLURM_NNODES": "1",
               "SLURM_JOB_NODELIST": "node1", "SLURM_CPUS_PER_TASK": "16"}
        proc = subprocess.run(["bash", "-c", text], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert ("REQUEUED 42" in proc.stdout) == requeued, (status, marker, proc.stdout, proc.stderr)
        assert proc.returncode == (0 if requeued else status), (status, marker, proc.returncode)
        srun_args = (tmp_path / "srun-args").read_text()
        assert ("--shutdown_timeout=270" in srun_args) == grace
        # the job's own rendezvous port, as srun alone picks it: not a fixed one that jobs sharing a node meet on
        assert f"--rdzv_endpoint=node1:{slurm_port(42)} " in srun_args, srun_args


def _fake_slurm(bin_dir, srun: str) -> None:
    """Stand-ins for what the script calls: scontrol (one node, requeue echoed), torchrun, `srun`."""
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[ "$1" = requeue ] && echo "REQUEUED $2" || echo node1\n')
    (bin_dir / "torchrun").write_text("#!/bin/bash\necho 'usage: torchrun --shutdown_timeout SHUTDOWN_TIMEOUT'\n")
    (bin_dir / "srun").write_text(f"#!/bin/bash\n{srun}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)


def test_slurm_script_runs_in_the_folder_it_was_written_in(tmp_path, monkeypatch, capsys):
    """The script named the recipe and output_dir as given (relative), and sbatch runs a script in the
    folder it is submitted from: submitted later from elsewhere, its job read another recipe (or none),
    trained into another folder and looked for its PREEMPTED marker there (no requeue)."""
    from shardtune.cli.main import main

    project, elsewhere = tmp_path / "my project", tmp_path / "elsewhere"
    (project / "recipes").mkdir(parents=True)
    elsewhere.mkdir()
    (project / "recipes" / "r.yaml").write_text((ROOT / "recipes" / "gpt2-wikitext2.yaml").read_text())
    monkeypatch.chdir(project)
    assert main(["slurm", "recipes/r.yaml", "--nodes", "1", "--gpus-per-node", "2", "--output-dir", "runs/a",
                 "-o", "jobs/job.sbatch"]) == 0
    capsys.readouterr()
    # the job's ranks: where they run, and a preemption's marker written into their (relative) output_dir
    _fake_slurm(tmp_path / "bin", 'pwd > "$FAKE_PWD"; mkdir -p runs/a; echo 3 > runs/a/PREEMPTED; exit 75')
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "SLURM_NNODES": "1",
           "SLURM_JOB_NODELIST": "node1", "SLURM_CPUS_PER_TASK": "16", "FAKE_PWD": str(tmp_path / "pwd")}
    proc = subprocess.run(["bash", str(project / "jobs" / "job.sbatch")], capture_output=True, text=True, env=env,
                          cwd=elsewhere)
    assert (tmp_path / "pwd").read_text().strip() == str(project), proc.stderr
    assert "REQUEUED 42" in proc.stdout and proc.returncode == 0, (proc.stdout, proc.stderr)
    assert not list(elsewhere.iterdir())


def test_slurm_refuses_bad_input_in_one_line(capsys):
    from shardtune.cli.main import main

    assert main(["slurm", "recipes/gpt2-wikitext2.yaml", "--nodes", "0", "--gpus-per-node", "4"]) == 2
    assert "--nodes" in _one_line_error(capsys.readouterr().err)
    assert main(["slurm", "recipes/gpt2-wikitext2.yaml", "--nodes", "1", "--gpus-per-node", "4", "train.lr=x"]) == 2
    assert "train.lr" in _one_line_error(capsys.readouterr().err)
    # an #SBATCH value with a newline would put a command line into the script; a space splits it
    for option, value in (("--account", "x\ntouch /tmp/pwned"), ("--job-name", "a b"), ("--partition", "p\tq"),
                          ("--job-name", "logs/run"), ("--job-name", "a%j")):  # its log file's name
        assert main(["slurm", "recipes/gpt2-wikitext2.yaml", "--nodes", "1", "--gpus-per-node", "4", option,
                     value]) == 2
        assert option in _one_line_error(capsys.readouterr().err)
    # Slurm's lead is 16 bits: sbatch rejected the script of --signal-lead 86399 (--time 2-0)
    assert main(["slurm", "recipes/gpt2-wikitext2.yaml", "--nodes", "1", "--gpus-per-node", "4", "--time", "2-0",
                 "--signal-lead", "65536"]) == 2
    assert "--signal-lead" in _one_line_error(capsys.readouterr().err)


def test_slurm_script_of_a_recipe_with_a_space_into_new_folders(tmp_path, capsys):
    from shardtune.cli.main import main

    recipe, script = tmp_path / "my recipe.yaml", tmp_path / "new" / "deep" / "job.sbatch"
    recipe.write_text((ROOT / "recipes" / "gpt2-wikitext2.yaml").read_text())
    assert main(["slurm", str(recipe), "--nodes", "1", "--gpus-per-node", "4", "-o", str(script)]) == 0
    capsys.readouterr()
    assert "#SBATCH --job-name=my-recipe\n" in script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_slurm_names_a_recipe_and_a_script_starting_with_a_dash_as_files(tmp_path, monkeypatch, capsys):
    """A recipe given after `--` and a script named `-job x.sbatch`: the script's command line and
    the printed `sbatch` line name each so that a shell passes it as one file, not as an option
    (the job's ranks refused `train -my.yaml`; `sbatch -job x.sbatch` was two words)."""
    from shardtune.cli.main import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "-my recipe.yaml").write_text((ROOT / "recipes" / "gpt2-wikitext2.yaml").read_text())
    assert main(["slurm", "--nodes", "1", "--gpus-per-node", "4", "--out=-job x.sbatch", "--", "-my recipe.yaml"]) == 0
    said = capsys.readouterr().out.strip().rpartition("submit it with: ")[2]
    assert shlex.split(said) == ["sbatch", "./-job x.sbatch"]
    launch = re.search(r"-m shardtune train (.*)$", (tmp_path / "-job x.sbatch").read_text(), flags=re.M).group(1)
    assert shlex.split(launch)[0] == "./-my recipe.yaml"


def test_slurm_refuses_an_output_dir_its_job_would_refuse(tmp_path, capsys):
    """An output_dir that is a file or lies inside a run's checkpoints/ or final/ wrote a script whose
    job train refused at its start, after its wait in the queue; one starting with '-' made the
    script's `rm -f -x/PREEMPTED` take it for options."""
    from shardtune.cli.main import main

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl"):
        (run / name).write_text("")
    argv = ["slurm", "recipes/gpt2-wikitext2.yaml", "--nodes", "1", "--gpus-per-node", "4", "-o",
            str(tmp_path / "job.sbatch")]
    for given, words in ((f"--output-dir={run / 'checkpoints' / 'new'}", "inside checkpoints/ of the run"),
                         (f"output_dir={run / 'metrics.jsonl'}", "output_dir '")):
        assert main([*argv, given]) == 2 and not (tmp_path / "job.sbatch").exists()
        assert words in _one_line_error(capsys.readouterr().err)
    assert main([*argv, "--output-dir=-x"]) == 0
    assert "rm -f ./-x/PREEMPTED\n" in (tmp_path / "job.sbatch").read_text()


# ----------------------------------------------------------------------------- download


@pytest.mark.parametrize("recipe,expected", [
    ("gpt2-wikitext2", [("model", "openai-community/gpt2", None),
                        ("dataset", "Salesforce/wikitext", "wikitext-2-raw-v1")]),
    ("gpt2-large-wikitext103", [("model", "openai-community/gpt2-large", None),
                                ("dataset", "Salesforce/wikitext", "wikitext-103-raw-v1")]),
    ("opt-1.3b-arxiv", [("model", "facebook/opt-1.3b", None), ("dataset", "CShorten/ML-ArXiv-Papers", None)]),
    ("llama2-7b-alpaca-lora", [("model", "meta-llama/Llama-2-7b-hf", None),
                               ("dataset", "yahma/alpaca-cleaned", None)]),
    ("codellama-7b-chess", [("model", "codellama/CodeLlama-7b-hf", None),
                            ("dataset", "angeluriot/chess_games", None)]),
])
def test_download_targets_of_a_recipe(recipe, expected):
    from shardtune.launch.download import targets_from_recipe

    assert targets_from_recipe(str(ROOT / "recipes" / f"{recipe}.yaml")) == expected


def test_download_targets_skip_local_paths_and_repeat_nothing(assets, tmp_path):
    from shardtune.launch.download import targets_from_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  name_or_path: {tmp_path}\n  tokenizer: org/tok\ndata:\n  path: {assets['train']}\n")
    assert targets_from_recipe(str(recipe)) == [("tokenizer", "org/tok", None)]  # its repo's weights are not needed
    recipe.write_text("model:\n  name_or_path: org/m\n  tokenizer: org/m\ndata:\n  path: ./data/train.jsonl\n")
    assert targets_from_recipe(str(recipe)) == [("model", "org/m", None)]
    recipe.write_text("model:\n  name_or_path: org/m\n  random_init: true\ndata:\n  path: ./data/train.jsonl\n")
    assert targets_from_recipe(str(recipe)) == [("config", "org/m", None)]  # fresh weights: the repo's are never read


@pytest.mark.parametrize("flag", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])  # huggingface_hub reads either
def test_download_is_refused_when_offline(monkeypatch, capsys, flag):
    from shardtune.cli.main import main

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv(flag, "1")
    assert main(["download", "openai-community/gpt2", "dataset:Salesforce/wikitext:wikitext-2-raw-v1"]) == 2
    assert flag in _one_line_error(capsys.readouterr().err)
    assert main(["download", "recipes/gpt2-wikitext2.yaml"]) == 2
    assert flag in _one_line_error(capsys.readouterr().err)
    assert main(["download", "model:a:b"]) == 2
    assert "model:a:b" in _one_line_error(capsys.readouterr().err)


def test_download_passes_dataset_configs_and_an_hf_home_cache(monkeypatch, tmp_path, capsys):
    """What reaches the hub clients, with them replaced (no network here)."""
    import shardtune.launch.download as dl
    from shardtune.cli.main import main

    calls = []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(dl, "_download_model", lambda repo, cache, weights: calls.append(("model", repo, cache)) or "m")
    monkeypatch.setattr(dl, "_download_dataset",
                        lambda repo, name, cache: calls.append(("dataset", repo, name, cache)) or "d")
    cache = tmp_path / "my cache"
    monkeypatch.chdir(tmp_path)  # given relative: the line to paste on another machine names it absolute
    assert main(["download", str(ROOT / "recipes/gpt2-wikitext2.yaml"), "openai-community/gpt2", "dataset:org/d:cfg",
                 "--cache-dir", "my cache"]) == 0
    assert calls == [("model", "openai-community/gpt2", "my cache/hub"),
                     ("dataset", "Salesforce/wikitext", "wikitext-2-raw-v1", "my cache/datasets"),
                     ("dataset", "org/d", "cfg", "my cache/datasets")]
    line = capsys.readouterr().out.splitlines()[-1]
    assert shlex.split(line.split("export ")[1])[0] == f"HF_HOME={cache.resolve()}", line


@pytest.mark.parametrize("inner", ["checkpoints", "final"])
def test_a_cache_inside_a_runs_own_folders_is_refused(monkeypatch, tmp_path, capsys, inner):
    """--cache-dir RUN/checkpoints/hf was made and filled there, where that run's --overwrite (or its
    final save, for final/) deletes the downloads: refused before any folder is made or any network use."""
    from shardtune.cli.main import main

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    run = tmp_path / "run"
    (run / inner).mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl"):
        (run / name).write_text("")
    assert main(["download", "some-org/model", "--cache-dir", str(run / inner / "hf")]) == 2
    assert f"inside {inner}/ of the run" in _one_line_error(capsys.readouterr().err)
    assert not (run / inner / "hf").exists()


@pytest.mark.parametrize("missing, names, command", [
    ({"model.name_or_path": "some-org/not-cached", "model.tokenizer": "null"},
     "some-org/not-cached", "shardtune download some-org/not-cached"),
    ({"data.path": "some-org/not-cached-data", "data.name": "cfg1"},
     "some-org/not-cached-data", "shardtune download dataset:some-org/not-cached-data:cfg1"),
], ids=["model", "dataset"])
def test_missing_offline_names_it_and_shardtune_download(assets, tmp_path, missing, names, command):
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-cache")}
    proc = run_cli(["train", *tiny_overrides(assets, tmp_path / "run", **missing)], env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = _one_line_error(proc.stderr)
    assert names in line and command in line


def test_srun_without_torchrun_maps_slurm_variables(monkeypatch):
    """Under `srun` alone, shardtune reads rank and world from Slurm's variables."""
    import os

    from shardtune.distributed.process_group import _adopt_slurm_env, launched_by_agent, slurm_port

    torch_keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    # a private copy of the environment: what _adopt_slurm_env sets must not leak into other tests
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in torch_keys})
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu-node-7")
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol here: the first host is taken from the list
    assert launched_by_agent()
    _adopt_slurm_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("5", "8", "1")
    assert os.environ["LOCAL_WORLD_SIZE"] == "4" and os.environ["MASTER_ADDR"] == "gpu-node-7"
    assert os.environ["MASTER_PORT"] == str(slurm_port(1234))


def test_a_task_of_srun_without_torchrun_plans_and_checks_for_the_whole_job(monkeypatch, capsys, tmp_path):
    """Under `srun` alone the task read WORLD_SIZE before Slurm's variables were translated, took
    itself for a world of one and checked the batch for one rank (the job then failed later, in
    the trainer). The check now sees the job's 8 ranks."""
    import os

    from shardtune.cli.main import main

    torch_keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in torch_keys})
    task = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "4",
            "SLURM_JOB_NODELIST": "127.0.0.1", "PATH": "/nonexistent"}
    for name, value in task.items():
        monkeypatch.setenv(name, value)
    import shardtune.train.trainer as trainer  # imported unpatched: the name it holds is the one patched

    def unchecked(*args):
        raise AssertionError("the task reached its process group with the batch checked for another world")
    monkeypatch.setattr(trainer, "init_distributed", unchecked)
    code = main(["train", "train.global_batch_size=4", "train.micro_batch_size=1", f"data.path={tmp_path / 'no.jsonl'}",
                 f"output_dir={tmp_path / 'out'}"])
    assert code == 2 and "1 x 8" in capsys.readouterr().err


def test_slurm_script_command_starts_shardtune_train(tmp_path):
    """The script's own command line, run with stand-ins for srun and torchrun that start the real
    `python -m shardtune` it names (as torchrun's workers do): shardtune parses the recipe and the
    overrides (a misspelt key here) and reaches the config check: its one line, exit 2."""
    from shardtune.launch.slurm import sbatch_script

    recipe = tmp_path / "job.yaml"
    recipe.write_text(f"model:\n  name_or_path: gpt2\ndata:\n  path: {tmp_path / 'missing.jsonl'}\n")
    text = sbatch_script(str(recipe), str(tmp_path / "out"), 1, 2, overrides=["train.lrr=5e-5"], offline=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node1\n")
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [ "$1" != torchrun ]; do shift; done\nexec "$@"\n')
    (bin_dir / "torchrun").write_text(f'#!/bin/bash\n[ "$1" = --help ] && exit 0\nwhile [ "$1" != -m ]; do shift; '
                                      f'done\nexec {sys.executable} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = child_env(PATH=f"{bin_dir}:/usr/bin:/bin", SLURM_JOB_ID="42", SLURM_NNODES="1",
                    SLURM_JOB_NODELIST="node1", SLURM_CPUS_PER_TASK="16")
    proc = subprocess.run(["bash", "-c", text], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = _one_line_error(proc.stderr)
    assert "train.lrr" in line and "did you mean train.lr?" in line, line


@pytest.mark.parametrize("args, names", [
    (["download", "model:some-org/m"], "some-org/m"),
    (["download", "dataset:some-org/d"], "some-org/d"),
    (["train", "model.name_or_path=some-org/m", "train.max_steps=1"], "some-org/m"),
], ids=["download-model", "download-dataset", "train"])
def test_a_failing_hub_client_is_one_line_whatever_it_raises(tmp_path, args, names):
    """HF_HUB_OFFLINE unset and the Hub's client failing with its HTTP library's own error (httpx's,
    not an OSError: here an endpoint of a scheme it does not speak, which it does not retry; a
    refused connection is the same kind after ~25 s of retries, each a line that noise.py keeps off)."""
    env = {"HF_ENDPOINT": "hf-test://127.0.0.1:1", "HF_HOME": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "0",
           "HF_DATASETS_OFFLINE": "0"}
    proc = run_cli([*args, f"output_dir={tmp_path / 'run'}"] if args[0] == "train" else args, env=env,
                   cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert names in _one_line_error(proc.stderr)


class ConnectError(Exception):  # as httpx's: the hub client's network errors are not OSErrors
    pass


@pytest.mark.parametrize("raised", [ConnectError("[Errno -2] Name or service not known"),
                                    OSError(111, "Connection refused"), ValueError("Repo id must be in the form")])
def test_download_model_failures_of_any_kind_are_one_line(monkeypatch, capsys, raised):
    """A machine without network got httpx's ConnectError as a traceback: the catch listed the
    kinds requests raised (OSErrors), and huggingface_hub's client is httpx now."""
    import huggingface_hub

    from shardtune.cli.main import main

    def fail(*args, **kwargs):
        raise raised
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", fail)
    assert main(["download", "model:some-org/some-model"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "could not download model 'some-org/some-model'" in line and type(raised).__name__ in line, line


@pytest.mark.parametrize("job, needle", [
    (["--nodes", "3", "--gpus-per-node", "1"], "not divisible by micro_batch_size x ranks = 24 x 3"),
    (["--nodes", "1", "--gpus-per-node", "5", "train.micro_batch_size=auto"], "which 5 ranks do not divide"),
    (["--nodes", "2", "--gpus-per-node", "2", "fsdp.sharding=hybrid_shard", "fsdp.shard_size=3"],
     "hybrid_shard needs replicate_size x shard_size = world size 4, got 1 x 3"),
])
def test_a_job_its_ranks_cannot_run_is_refused_before_the_queue(capsys, tmp_path, job, needle):
    """The script was written, and the job failed on the cluster after its wait in the queue: the
    recipe was checked, but not against the job's number of ranks."""
    from shardtune.cli.main import main

    script = tmp_path / "job.sbatch"
    assert main(["slurm", str(ROOT / "recipes" / "gpt2-wikitext2.yaml"), *job, "-o", str(script)]) == 2
    assert needle in _one_line_error(capsys.readouterr().err) and not script.exists()
    assert main(["slurm", str(ROOT / "recipes" / "gpt2-wikitext2.yaml"), "--nodes", "2", "--gpus-per-node", "2",
                 "fsdp.sharding=hybrid_shard", "-o", str(script)]) == 0  # 96 = 24 x 4: fits, 2 x 2 mesh


@pytest.mark.parametrize("limit, seconds", [("5", 300), ("10:00", 600), ("0:10:00", 600), ("2-0", 172800),
                                            ("1-02:03", 93780), ("1-02:03:04", 93784), ("24:00:00", 86400),
                                            ("18:12:15", 65535)])
def test_a_signal_lead_not_below_the_time_limit_is_refused(capsys, tmp_path, limit, seconds):
    """--signal-lead 3600 with --time 5 wrote a job Slurm signals as it starts: it checkpointed,
    stopped and requeued, for ever."""
    from shardtune.cli.main import main
    from shardtune.launch.slurm import time_limit_s

    assert time_limit_s(limit) == seconds
    if seconds > 65535:  # above --signal-lead's own bound
        return
    argv = ["slurm", str(ROOT / "recipes" / "gpt2-wikitext2.yaml"), "--nodes", "1", "--gpus-per-node", "4",
            "--time", limit, "-o", str(tmp_path / "job.sbatch")]
    assert main([*argv, "--signal-lead", str(seconds)]) == 2
    assert f"is not below --time {limit} ({seconds} s)" in _one_line_error(capsys.readouterr().err)
    assert not (tmp_path / "job.sbatch").exists()
    assert main([*argv, "--signal-lead", str(seconds - 1)]) == 0


def test_slurm_refuses_a_model_here_that_cannot_take_the_run(tmp_path, capsys):
    """The job failed on the cluster after its wait in the queue (train and plan refuse at once):
    a model whose config is here (model.config, a folder, the Hub cache) is checked as plan checks it."""
    import yaml

    from shardtune.cli.main import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"config": {"model_type": "gpt2", "n_layer": 1, "n_embd": 32,
                                                           "n_head": 2, "n_positions": 64}},
                                      "data": {"path": "d.jsonl", "seq_len": 128}}))
    assert main(["slurm", str(recipe), "--nodes", "1", "--gpus-per-node", "2"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "data.seq_len=128" in line and "64" in line, line
    assert main(["slurm", str(recipe), "--nodes", "1", "--gpus-per-node", "2", "data.seq_len=64"]) == 0


def test_a_job_started_from_a_checkpoint_starts_there_and_a_requeue_goes_on_from_its_own(tmp_path, capsys):
    """`shardtune slurm RECIPE resume=PATH` (or `resume:` in the recipe): the script's own resume=auto came
    last and won, so the job trained from step 0 (a rewind in its own folder went on from the abandoned newer
    checkpoint). Now the job starts from PATH; a requeue goes on from the run's newest checkpoint once it
    has one, from PATH before that."""
    from shardtune.cli.main import main
    from shardtune.config.load import load_config

    out, start = tmp_path / "run dir", tmp_path / "other run" / "checkpoints" / "step-000006"
    recipe = tmp_path / "r.yaml"
    recipe.write_text((ROOT / "recipes" / "gpt2-wikitext2.yaml").read_text() + f"resume: '{start}'\n")
    assert main(["slurm", str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--output-dir", str(out),
                 "-o", str(tmp_path / "job.sbatch")]) == 0, capsys.readouterr().err
    text = (tmp_path / "job.sbatch").read_text()
    _fake_slurm(tmp_path / "bin", f'printf "%s\\n" "$@" > "{tmp_path}/args"; exit 0')
    for restarts, latest, resumed in [(None, False, str(start)), ("1", False, str(start)), ("2", True, "auto")]:
        if latest:
            (out / "checkpoints").mkdir(parents=True)
            (out / "checkpoints" / "latest").write_text("step-000008\n")
        env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "SLURM_NNODES": "1",
               "SLURM_JOB_NODELIST": "node1", "SLURM_CPUS_PER_TASK": "16", **({"SLURM_RESTART_COUNT": restarts}
                                                                            if restarts else {})}
        proc = subprocess.run(["bash", "-c", text], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        args = (tmp_path / "args").read_text().splitlines()
        at = args.index(str(recipe))
        assert load_config(args[at], args[at + 1:]).resume == resumed, (restarts, args)
