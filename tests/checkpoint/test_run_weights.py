"""What a run folder means to every command given it (`checkpoint.folders.run_weights`): eval,
generate, export and export --push-to-hub read the same weights, its final/ unless a complete
checkpoint of a later step exists, and say which on their first line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import adapter_folder, adapter_probe, tiny_overrides, train_tiny


def fake_run(run: Path, final: str | None, final_step: int | None, steps: list[tuple[int, str]]) -> None:
    """A run folder's files that decide which weights it stands for: final/ ("full", "adapter" or
    None) recording `final_step`, and checkpoints (step, "usable" | "partial" | "corrupt")."""
    run.mkdir()
    (run / "config.yaml").write_text("{}\n")
    (run / "metrics.jsonl").write_text("")
    if final:
        (run / "final").mkdir()
        (run / "final" / ("config.json" if final == "full" else "adapter_config.json")).write_text("{}")
        if final_step is not None:
            (run / "final" / "shardtune.json").write_text(json.dumps({"step": final_step}))
    for step, state in steps:
        folder = run / "checkpoints" / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        config = {"peft": {"method": "lora"}} if final == "adapter" else {}
        (folder / "meta.json").write_text("{" if state == "corrupt" else json.dumps({"step": step, "config": config}))
        if state != "partial":
            (folder / ".metadata").write_text("")


def export_reads(run: Path, tmp_path: Path, monkeypatch) -> Path:
    """The folder `export RUN OUT` reads its weights from (the writers recorded, not run)."""
    from shardtune.checkpoint import export

    read: list[Path] = []
    monkeypatch.setattr(export, "write_export", lambda path, *a, **k: read.append(path))
    monkeypatch.setattr(export, "export_final", lambda path, *a, **k: read.append(path), raising=False)
    out = tmp_path / f"export-{len(list(tmp_path.glob('export-*')))}"
    export.export_checkpoint(str(run), out)
    return read[0]


@settings(max_examples=40, deadline=None)
@given(final=st.sampled_from([None, "full", "adapter"]), final_step=st.none() | st.integers(0, 9),
       steps=st.lists(st.tuples(st.integers(0, 9), st.sampled_from(["usable", "partial", "corrupt"])),
                      max_size=4, unique_by=lambda s: s[0]))
def test_every_command_reads_the_same_weights_of_a_run(tmp_path_factory, final, final_step, steps):
    """eval/generate (resolve_model), export and its --push-to-hub config (export_source) and the step
    eval --generate records agree on any run folder: final/ unless a usable checkpoint of a later
    step exists (a resume that trained on and stopped before its own final/). Export took the newest
    checkpoint even when final/ was newer (checkpoint.every_steps=30 of max_steps=100: step 90)."""
    from shardtune.checkpoint.export import merge_source
    from shardtune.checkpoint.folders import export_source
    from shardtune.checkpoint.loading import model_step, pinned, resolve_model
    from shardtune.errors import UserError

    tmp = tmp_path_factory.mktemp("run")
    run = tmp / "run"
    fake_run(run, final, final_step, steps)
    usable = [s for s, state in steps if state == "usable"]
    newest = max(usable, default=None)
    if final and (newest is None or final_step is None or final_step >= newest):
        want, step = run / "final", final_step
    elif newest is not None:
        want, step = run / "checkpoints" / f"step-{newest:06d}", newest
    else:
        with pytest.raises(UserError):
            export_source(run)
        return
    with pytest.MonkeyPatch.context() as mp:
        assert export_reads(run, tmp, mp) == want
    assert export_source(run).path == want
    assert Path(resolve_model(str(run))[1]) == want
    said: list[str] = []
    assert pinned(str(run), said.append) == str(want)  # eval, eval --generate, generate: chosen once, read after
    if step is not None and not (want.name == "final" and final_step is None):
        assert model_step(str(run)) == step
    if final == "adapter":  # export --merge: final/'s adapter, or told to export the newer checkpoint first
        with pytest.raises(UserError) as refused:
            merge_source(run)  # the adapter of final/ here has no base: refused later, by adapter_parts
        assert ("export that checkpoint first" in str(refused.value)) is (want.name != "final"), refused.value
    else:  # a full model's run has no adapter to merge, whichever of its weights are the newest
        with pytest.raises(UserError, match="is not a peft adapter folder"):
            merge_source(run)
    [line] = said
    assert str(want) in line and (f"step {step}" if step is not None else "step not recorded") in line


def state_of(spec) -> dict[str, torch.Tensor]:
    from shardtune.checkpoint.loading import load_model

    return {k: v.clone() for k, v in load_model(str(spec))[0].state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_resumed_past_its_final_is_read_at_its_newest_step_by_eval_and_export(tmp_path, assets, single_thread,
                                                                                    capsys):
    """A run saved at step 2 ended at 3 (final/); its resume to 5 without a final/ of its own saved
    step 4. Export took step 2 of the finished run (not final/, its trained model), and after the
    resume eval read the old final/ (step 3) while export took step 4: now both read final/, then
    step 4, and say so first."""
    from shardtune.checkpoint.export import export_checkpoint
    from shardtune.config.load import load_config
    from shardtune.resolve.run import resolve_machine
    from shardtune.train import trainer as train

    run = tmp_path / "run"
    few = {"checkpoint.every_steps": 2, "eval.every_steps": 0, "data.seq_len": 32, "train.global_batch_size": 2,
           "train.micro_batch_size": 1}
    train_tiny(assets, run, **{"train.max_steps": 3, **few})
    assert json.loads((run / "final" / "shardtune.json").read_text()) == {"step": 3}
    capsys.readouterr()
    export_checkpoint(str(run), tmp_path / "x3")
    assert capsys.readouterr().out.splitlines()[0] == f"exporting {run}: the run's final model {run / 'final'} (step 3)"
    final = state_of(run / "final")
    assert same(state_of(tmp_path / "x3"), final)
    assert same(state_of(run), final)
    assert not same(state_of(run / "checkpoints" / "step-000002"), final)

    resumed = tiny_overrides(assets, run, resume="auto", save_final="false", **{"train.max_steps": 5, **few})
    train.run(resolve_machine(load_config(None, resumed, defaults={})))
    assert same(state_of(run / "final"), final)  # left as it was: not the run's newest weights
    export_checkpoint(str(run), tmp_path / "x4")
    newest = state_of(run / "checkpoints" / "step-000004")
    assert same(state_of(tmp_path / "x4"), newest)
    assert same(state_of(run), newest)


def test_a_peft_runs_final_exports_as_a_folder_of_its_own(tmp_path, assets, single_thread):
    """export RUN OUT of a peft run whose final/ is its newest: the adapter copied, its config naming
    OUT/base (the copy beside it), not RUN/final/base, so that removing the run leaves a model that loads."""
    from shardtune.checkpoint.export import export_checkpoint
    from shardtune.checkpoint.loading import load_model

    adapter, want = adapter_folder(tmp_path / "made", assets, ["c_attn"])
    run = tmp_path / "run"
    fake_run(run, None, None, [])
    shutil.copytree(adapter, run / "final")
    shutil.copytree(adapter.parent / "base", run / "final" / "base")
    config = json.loads((run / "final" / "adapter_config.json").read_text())
    (run / "final" / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": str((run / "final" / "base").resolve())}))
    export_checkpoint(str(run), tmp_path / "out")
    shutil.rmtree(run)
    shutil.rmtree(tmp_path / "made")
    exported = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert exported["base_model_name_or_path"] == str((tmp_path / "out" / "base").resolve())
    model = load_model(str(tmp_path / "out"))[0]
    torch.testing.assert_close(model(input_ids=adapter_probe()).logits, want, rtol=1e-4, atol=1e-5)
