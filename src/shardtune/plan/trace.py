"""One training step traced under fake tensors: the memory one rank would hold, by category and
by phase of the step, without allocating any of it.

The step is the one `train` runs: the same model class built on meta, LoRA/freezing, the chunked
loss, `apply_parallelism`, the optimizer, gradient scaler and `step.train_step`, on rank 0 of a
fake process group of the requested world size (torch's "fake" backend: collectives return at
once). Tensors are `FakeTensor`s (shapes, no storage); torch's `FSDPMemTracker` counts every
storage created and freed and files it under FSDP's categories. The peak is kept per phase of
the step (micro-step x forward/backward/after backward/optimizer x before/inside/after the
decoder blocks): each such peak grows linearly with the number of decoder blocks, which lets the
planner trace a 3- and a 4-block copy of a deep model and extrapolate (`extrapolate`).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

from shardtune import families
from shardtune.config.schema import RunConfig
from shardtune.errors import UserError
from shardtune.plan.phases import CATEGORIES, PhaseTracker

# Saved activations that activation offloading keeps in host memory (`OffloadedActivations`).
HOST_ONLY = ("host_activations",)
# What CPU offload keeps in host memory instead of on the GPU: the sharded states, and so what
# the optimizer step holds beside them (it runs where they are: "optimizer_step", the low-bit
# step's transient, priced.STEP_TRANSIENT). Gathered parameters and the full gradients backward
# computes stay on the GPU, as do (not traced: a CPU trace copies nothing) each unit's shard on
# its way in and its gradient shard on its way out.
OFFLOADED = ("sharded_params", "gradients", "optimizer_state", "optimizer_step")


@dataclass
class StepTrace:
    """Bytes by category at the peak of each phase of one optimizer step, for `layers` blocks."""
    phases: dict[tuple, dict[str, int]]
    layers: int
    steady: dict[str, int] = field(default_factory=dict)  # held between steps (params, optimizer state)
    params: dict[str, int] = field(default_factory=dict)  # total, trainable, matmul, matmul_trainable (unsharded)

    def peak(self, leave_out: tuple[str, ...] = HOST_ONLY) -> tuple[tuple, dict[str, int]]:
        """(phase, bytes by category) of the largest phase, not counting `leave_out` categories."""
        def total(item):
            return sum(v for k, v in item[1].items() if k not in leave_out)
        return max(self.phases.items(), key=total)

    def peak_bytes(self, leave_out: tuple[str, ...] = HOST_ONLY) -> int:
        _, cats = self.peak(leave_out)
        return sum(v for k, v in cats.items() if k not in leave_out)

    def with_state(self, state: str) -> StepTrace:
        """This step with its optimizer state in `state` precision: the traced bytes less those of
        the precision traced, plus this one's (counted per parameter shard in `trace_step`), and
        in the optimizer phase the step's own transient (priced.step_transient) as
        "optimizer_step": held where the states are (host memory under CPU offload)."""
        from shardtune.plan.priced import step_transient

        traced = self.params.get("state_traced", "fp32")
        if state == traced:
            return self
        delta = self.params[f"state_{state}"] - self.params[f"state_{traced}"]
        largest = self.params.get("largest_shard", 0)
        transient = step_transient(state, largest) - step_transient(traced, largest)

        def swap(cats: dict[str, int], phase: tuple = ()) -> dict[str, int]:
            out = {**cats, "optimizer_state": max(0, cats.get("optimizer_state", 0) + delta)}
            if "optimizer" in phase:
                out["optimizer_step"] = max(0, cats.get("optimizer_step", 0) + transient)
            return out
        return StepTrace({k: swap(v, k) for k, v in self.phases.items()}, self.layers, swap(self.steady),
                         {**self.params, "state_traced": state})


def extrapolate(traces: dict[tuple[int, int], StepTrace], layers: int, micro_batch: int) -> StepTrace:
    """The trace at (`layers`, `micro_batch`) from traces at two depths x two micro-batch sizes
    (keys (layers, micro_batch)). Each phase's peak is bilinear in depth and micro-batch size
    (activations grow with both, states with depth only); phases are keyed by position (first,
    middle, last block, ...), so a key means the same place at every depth. Per category only
    the states (parameters, gradients, optimizer state) are extrapolated: the moment of a phase's
    peak can differ between the small copies, so its transient categories are split as in the
    deeper copy."""
    (l0, m0), (l1, m1) = min(traces), max(traces)
    x = (layers - l0) / (l1 - l0) if l1 != l0 else 0.0
    y = (micro_batch - m0) / (m1 - m0)

    def blend(value) -> float:
        return (value((l0, m0)) * (1 - x) * (1 - y) + value((l1, m0)) * x * (1 - y) + value((l0, m1)) * (1 - x) * y
                + value((l1, m1)) * x * y)

    def phase(key) -> dict[str, int]:
        cats = {c: max(0, round(blend(lambda lm, c=c: traces[lm].phases[key].get(c, 0))))
                for c in OFFLOADED + HOST_ONLY}
        total = blend(lambda lm: sum(v for c, v in traces[lm].phases[key].items() if c not in HOST_ONLY)) \
            + sum(cats[c] for c in HOST_ONLY)
        deep = {c: (1 - y) * traces[(l1, m0)].phases[key].get(c, 0) + y * traces[(l1, m1)].phases[key].get(c, 0)
                for c in CATEGORIES if c not in OFFLOADED + HOST_ONLY}
        rest, share = max(0.0, total - sum(cats.values())), sum(deep.values()) or 1.0
        return {**cats, **{c: round(rest * v / share) for c, v in deep.items()}}

    keys = set.intersection(*(set(t.phases) for t in traces.values()))
    steady = {c: max(0, round(blend(lambda lm, c=c: traces[lm].steady.get(c, 0)))) for c in CATEGORIES}
    params = {n: round(blend(lambda lm, n=n: traces[lm].params[n])) if isinstance(v, int) else v
              for n, v in traces[(l0, m0)].params.items()}
    return StepTrace({key: phase(key) for key in keys}, layers, steady, params)


def layer_count(hf_config) -> int:
    """The language model's depth (families.layer_count); a config without one cannot be planned."""
    layers = families.layer_count(hf_config)
    if layers is None:
        raise UserError(f"the {getattr(hf_config, 'model_type', '?')!r} config names no number of layers "
                        f"({', '.join(families.LAYERS)}), so plan cannot size it; set one in model.config")
    return layers


@contextlib.contextmanager
def fake_world(world_size: int, local_world_size: int):
    """Rank 0 of a fake process group of `world_size` ranks in this process."""

    from shardtune.distributed.process_group import Dist

    if dist.is_initialized():
        raise RuntimeError("a memory trace needs a process without a process group (it makes a fake one)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield Dist(rank=0, world_size=world_size, local_world_size=local_world_size,
                   device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def trace_step(cfg: RunConfig, hf_config, world_size: int, local_world_size: int | None = None,
               layers: int | None = None, target: str = "cpu") -> StepTrace:
    """Trace one optimizer step of `cfg` on rank 0 of `world_size` ranks (`layers` decoder
    blocks instead of the model's own, for extrapolation). It runs on CPU whatever the target;
    for target "cuda" the step makes the choices a GPU run makes: the loss chunk sized for CUDA
    and attention through the flash / memory-efficient kernels (no seq x seq scores held)."""

    from shardtune.config.load import check_world
    from shardtune.distributed.fsdp import build_mesh
    from shardtune.model import float8
    from shardtune.model import loss as loss_lib
    from shardtune.model.build import ModelSpec, build_model
    from shardtune.plan.fake_step import (
        BACKEND_COPIES,
        AnswerScalars,
        backend_of,
        cuda_attention,
        dtensor_meta_outside_trace,
        fake_grouped_mm,
        fused_adamw_on_shards,
        one_sequence_per_row,
    )
    from shardtune.plan.priced import offloaded_activations, state_bytes
    from shardtune.train.optim import build_grad_scaler, build_optimizer
    from shardtune.train.step import train_step

    hf_config = copy.deepcopy(hf_config)
    state = cfg.train.optimizer_state  # traced as fp32 (torchao's compiled step cannot run on fake tensors)
    cfg = copy.deepcopy(cfg)
    cfg.train.optimizer_state = "fp32"
    cfg.compile = False  # the eager step: compiled blocks hold less, so its memory is an upper bound
    if target == "cuda" and cfg.loss_chunk_tokens is None:
        cfg.loss_chunk_tokens = loss_lib.chunk_tokens(None, families.config_value(hf_config, "vocab_size"), "cuda")
    if layers is not None:
        families.set_layer_count(hf_config, layers)
    accum = check_world(cfg, world_size)
    with fake_world(world_size, local_world_size or world_size) as dist:
        spec = ModelSpec.of_run(cfg, hf_config)
        spec.device_type = target  # the target's sharding policy (fsdp.reshard_after_forward)
        built = build_model(spec, build_mesh(cfg.fsdp, dist), dist.device)
        model = built.model
        params = parameter_counts(model, cfg.data.seq_len)
        params.update(state_bytes(model))  # state_fp32, state_bf16, ...: this rank's moments per precision
        params.update(float8.matmul_shapes(model))  # float8_matmul, float8_widths: what float8 changes in time
        blocks = [f"{type(model).__name__}.{name}" for name, m in model.named_modules()
                  if isinstance(m, built.block_cls)]
        # two micro-steps show what accumulation holds across them (unsharded gradients)
        micro = [[0] * cfg.train.micro_batch_size for _ in range(min(accum, 2))]
        real_batches, count_tokens = shape_only_batches(cfg, micro, dist.device)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device=dist.device)
            if hasattr(model, "tie_weights"):
                model.tie_weights()
            model.train()
            optimizer = build_optimizer(model, cfg.train, dist.device, cfg.precision, cfg.peft.lora_plus_ratio)
            create_optimizer_state(model, optimizer)
            scaler = build_grad_scaler(cfg.precision, dist.device)
            tracker = PhaseTracker(model, optimizer, blocks, BACKEND_COPIES[backend_of(target)],
                                   cpu_kernels=target == "cpu")
            attention = cuda_attention() if target == "cuda" else contextlib.nullcontext()
            # a CUDA run's offloaded activations go to the host; on CPU offloading moves nothing
            offload = offloaded_activations(tracker, model) if target == "cuda" and cfg.activation_offload \
                else contextlib.nullcontext()
            # rows that bring their positions (documents, padding-free) restart them: packed, as traced
            packed = any("position_ids" in b for b in real_batches)
            rows = contextlib.nullcontext() if packed else one_sequence_per_row()
            with tracker, AnswerScalars(), dtensor_meta_outside_trace(), fake_grouped_mm(), fused_adamw_on_shards(), \
                    attention, offload, rows:
                handle = model.register_forward_pre_hook(tracker.next_micro_step, prepend=True)
                try:
                    batches = _faked(real_batches)
                    train_step(model, optimizer, scaler, batches, cfg, dist, count_tokens,
                               sync_each=built.sync_grads_each_micro_step)
                finally:
                    handle.remove()
            steady = tracker.current()
    params["offloaded_activations"] = tracker.host_peak
    return StepTrace(tracker.peaks, layer_count(hf_config), steady, params).with_state(state)


def create_optimizer_state(model, optimizer) -> None:
    """AdamW creates its state on its first step; make it now, so the traced step is a steady one."""

    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def shape_only_batches(cfg: RunConfig, micro: list[list[int]], device) -> tuple[list[dict], bool]:
    """(micro-batches of the recipe's shape, whether a step counts their tokens with a loss),
    made as training makes them (data.collate, data.equal_blocks)."""
    from shardtune.data import batches, packing

    data = _ShapeOnlyData(cfg)
    return [batches.collate(data, indices, device, 0, cfg.data.padding_free) for indices in micro], \
        not packing.equal_blocks(data)


def _faked(batches: list[dict]) -> list[dict]:
    """Fake copies of real micro-batches, made under the tracker so it counts them. The batches
    themselves are built for real, outside fake mode (a few KB of token ids): the data code may
    then use anything a real batch does (numpy for padding-free position ids)."""
    return [{k: v.clone() for k, v in batch.items()} for batch in batches]


class _ShapeOnlyData:
    """Stands in for the tokenized dataset: rows of zeros of the recipe's shape, each the largest
    batch of real data can be. Packed text and packed instruct/chat give equal rows; where
    documents are masked their positions restart mid-row (a row of several documents: the masked
    attention real rows take). Padded instruct/chat give rows up to the cutoff through collate's
    padding (or padding-free) path, as in training: with two rows or more the last is a token
    short, so the batch is padded and carries a mask, as a real padded batch does; one row is
    never padded, and comes stacked (as a tokenized dataset gives equal rows), so the step makes
    no mask. (All rows full and unstacked gave a mask of ones: the traced step priced a seq x seq
    mask that transformers skips on the values, +6 % on a tiny Llama at micro-batch 1.)"""

    def __init__(self, cfg: RunConfig):
        d = cfg.data
        self.padded = d.format != "text" and not d.packing
        self.seq = d.example_cutoff if self.padded else d.seq_len
        self.positions = d.masks_documents and not self.padded
        self.padding_free = d.padding_free
        own_labels = self.positions or (d.format != "text" and not d.train_on_inputs)  # the real data's columns
        self.column_names = ["input_ids"] + (["labels"] if own_labels else []) + (["length"] if self.padded else [])

    def __getitem__(self, indices):
        if self.padded and len(indices) > 1:  # padding-free rows go end to end: all full
            short = -1 if self.padding_free else len(indices) - 1  # the row a token short
            rows = [torch.zeros(self.seq - (i == short), dtype=torch.long) for i in range(len(indices))]
            return {"input_ids": rows, "labels": rows}
        ids = torch.zeros((len(indices), self.seq), dtype=torch.long)
        rows = {"input_ids": ids, **({"labels": ids} if "labels" in self.column_names else {})}
        if self.positions:  # document-masked packing: positions restart per document, two a row
            half = self.seq // 2
            one = torch.cat([torch.arange(half), torch.arange(self.seq - half)])
            rows["position_ids"] = one.expand(len(indices), -1).contiguous()
        return rows


def parameter_counts(model, seq_len: int | None = None) -> dict[str, int]:
    """What the speed model reads of a model: its parameters ("total", "trainable") and the weights
    a token is multiplied by ("matmul", "matmul_trainable": telemetry.flops.matmul_params)."""
    from shardtune.model.hf import count_params
    from shardtune.telemetry.flops import matmul_params

    return dict(zip(("total", "trainable", "matmul", "matmul_trainable"),
                    (*count_params(model), *matmul_params(model, seq_len)), strict=True))
