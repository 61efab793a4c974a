"""The first of the three stages every command goes through (resolve -> check -> build): one
frozen RunConfig from the recipe, the overrides, the quickstart's defaults (where there is no
recipe) and the values left to shardtune: `output_dir` (runs/RECIPE-TIME), `device=auto` (CUDA
where one is visible, else CPU), `compile=auto` (each block compiled on CUDA: config.compiling),
`train.micro_batch_size=auto` (the planner's largest that
fits) and `activation_checkpointing=auto` (the planner's fastest mode that fits; with both, the
fastest pair). Nothing changes it afterwards (`config.schema.freeze`); the check (`check.run`) and the
build (`train.trainer`) only read it."""

from __future__ import annotations

import copy

from shardtune.config.compiling import compiles
from shardtune.config.schema import RunConfig, freeze


def resolve_run(cfg: RunConfig, world_size: int = 1, local_world_size: int | None = None, say=None) -> RunConfig:
    """A frozen copy of `cfg` (`config.load.load_config`: the recipe or the quickstart's defaults,
    and the overrides) with its default output folder and `auto` values filled in for
    `world_size` ranks (`local_world_size` on this node); the start-up line saying what auto
    chose goes to `say` (default: printed on rank 0)."""
    from shardtune.checkpoint.rundir import default_output_dir

    resolved = resolve_machine(cfg)
    if cfg.compile == "auto" and resolved.compile:
        (say or _rank0_print)("compile=auto: each decoder block compiled (1.34x eager measured on an H200; about "
                              "15 s of compiling first; compile=false to run eager)")
    elif cfg.compile is True and not resolved.compile:  # QLoRA: its model is built apart, eager
        (say or _rank0_print)("compile=true: not with peft.quantize=4bit (QLoRA's model is built apart, eager); "
                              "running eager")
    if "auto" in (cfg.train.micro_batch_size, cfg.activation_checkpointing):
        from shardtune.plan.fit import resolve_layout

        resolved.train.micro_batch_size, resolved.activation_checkpointing, line = resolve_layout(
            resolved, world_size, local_world_size or world_size)  # the resolved device: the one it plans for
        (say or _rank0_print)(line)
    resolved.output_dir = cfg.output_dir or default_output_dir(cfg.recipe)
    return freeze(resolved)


def resolve_machine(cfg: RunConfig) -> RunConfig:
    """An unfrozen copy of `cfg` with device=auto resolved for this machine and compile as the build
    takes it (auto, and true with QLoRA: config.compiling): the run the layout is planned for (before
    it: the planner ranks the layouts as they will run)."""
    resolved = copy.deepcopy(cfg)  # the caller's config stays as it was
    if cfg.device == "auto":  # what the run will use here: its config.yaml says which
        from shardtune.distributed.process_group import resolve_device

        resolved.device = resolve_device("auto").type
    resolved.compile = compiles(cfg.compile, resolved.device, cfg.activation_offload, cfg.peft.quantize)
    return resolved


def handed_on(cfg: RunConfig) -> list[str]:
    """The overrides that give a rank (or a job) started with the same recipe and overrides the
    values resolve_run filled in for `cfg` (a resolved run), so it resolves none of them again: a
    rank that did said again what auto chose, and measured this machine again."""
    from shardtune.config.load import override_word

    return [override_word("output_dir", cfg.output_dir), f"device={cfg.device}",
            f"compile={str(cfg.compile).lower()}", f"train.micro_batch_size={cfg.train.micro_batch_size}",
            f"activation_checkpointing={cfg.activation_checkpointing}"]


def _rank0_print(line: str) -> None:
    from shardtune.distributed.process_group import is_main_process

    if is_main_process():
        print(line, flush=True)
