"""Shared fixtures: a small local corpus + tokenizer, and tiny model configs (no hub access)."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# plan's on-disk trace cache is keyed by code and config, not by a test's monkeypatches: off in the
# suite (and its child processes); tests/plan/test_trace_cache.py gives it a folder of its own
os.environ["SHARDTUNE_PLAN_CACHE"] = "off"

# Dropout off: equivalence tests compare runs step by step.
TINY = {
    "gpt2": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 128,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "opt": {"model_type": "opt", "num_hidden_layers": 2, "hidden_size": 64, "ffn_dim": 128,
            "num_attention_heads": 2, "word_embed_proj_dim": 64, "max_position_embeddings": 128,
            "dropout": 0.0, "attention_dropout": 0.0},
    "llama": {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128},
}


def pytest_collection_modifyitems(config, items):
    """Tests marked `early` first. xdist hands out the last tests of the collection a pair at a
    time: two long ones there (test_train's quickstart and compile, 5th and 6th from the end) went
    to one worker while the other, done, waited for them."""
    items.sort(key=lambda item: item.get_closest_marker("early") is None)  # stable: the rest keep their order


def pytest_unconfigure(config):
    """The last hook of a run (and of each xdist worker, which the run waits for): the interpreter's
    teardown collections over every object the tests made take seconds; reference counting frees
    the rest as before."""
    gc.freeze()


def readme_renderer():
    """tools/render_readme_reference.py, which writes README's generated blocks: tests compare them."""
    import importlib.util

    tool = ROOT / "tools" / "render_readme_reference.py"
    spec = importlib.util.spec_from_file_location("render_readme_reference", tool)
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    return render


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread_per_worker():
    """Every test process trains tiny models on 2 cores that the other xdist worker and the child
    processes share: a second intra-op thread only spins there. A test may still ask for more."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def single_thread():
    """Two cores shared with other ranks and tests: more torch threads only spin."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def one_rank():
    """A world-of-one process group on CPU for in-process builds; gone after the test."""
    import torch.distributed as dist

    from shardtune.distributed.process_group import init_distributed

    d = init_distributed("cpu")
    yield d
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    from shardtune.data.quickstart import build_quickstart_assets

    return build_quickstart_assets(tmp_path_factory.mktemp("assets"), vocab_size=300, max_docs=400)


def tiny_overrides(assets: dict, out: Path, arch: str = "gpt2", **extra) -> list[str]:
    """CLI overrides for a fast, deterministic run on the local corpus."""
    base = {
        "model.config": json.dumps(TINY[arch]),
        "model.tokenizer": assets["tokenizer"],
        "data.path": str(Path(assets["train"]).parent),
        "data.seq_len": 64,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 8,
        "train.max_steps": 6,
        "train.lr": 1e-3,
        "train.warmup_steps": 0,
        "eval.max_batches": 4,
        "log.every_steps": 1,
        "log.progress": "false",
        "output_dir": str(out),
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@functools.cache
def llama_tokenizer(add_eos: bool = False):
    """A Llama/Mistral-style tokenizer built offline: BPE over `▁`-marked words with byte fallback,
    whose post-processor puts <s> before text (and </s> after it with `add_eos`, as
    add_eos_token=True does); ChatML's markers are special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    words = "The capital of France is Paris café naïve 日本語 🙂 x=1; question answer user assistant hello world"
    tk.train_from_iterator([words] * 4, trainers.BpeTrainer(vocab_size=160, special_tokens=specials, initial_alphabet=[
        f"<0x{b:02X}>" for b in range(256)], show_progress=False))
    tk.post_processor = processors.TemplateProcessing(single="<s> $A" + " </s>" * add_eos, special_tokens=[
        ("<s>", 1), ("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   additional_special_tokens=specials[3:])


def spread_alpaca(path: Path, rows: int = 48) -> Path:
    """A JSON-lines file of seeded alpaca-shaped examples (instruction, input, output) whose
    prompts and responses spread from a few words to tens."""
    import random

    rng = random.Random(0)
    words = "the of and to in is for that with on as by it this be are from at or an".split()
    examples = [{"instruction": " ".join(rng.choices(words, k=rng.randint(3, 30))), "input": "",
                 "output": " ".join(rng.choices(words, k=rng.randint(1, 60)))} for _ in range(rows)]
    path.write_text("".join(json.dumps(r) + "\n" for r in examples))
    return path


def losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


# what torchrun / Slurm set: a child must not believe it is a rank of the job running the tests
AGENT_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
              "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
              "SLURM_LOCALID")


def child_env(**extra: str) -> dict:
    """The environment of every process a test starts: one thread each, unbuffered output."""
    env = {k: v for k, v in os.environ.items() if k not in AGENT_VARS}
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


def run_cli(args: list[str], timeout: int = 300, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardtune", *args], capture_output=True, text=True,
                          timeout=timeout, env=child_env(**(env or {})), cwd=kw.pop("cwd", ROOT), **kw)


def main_in_process(argv: list[str], main=None, context=contextlib.nullcontext) -> tuple[int, str]:
    """(exit code, stderr) of `shardtune argv` run in this process, stdout kept off the console.
    Anything escaping main fails the test with its traceback (that is the finding); a process
    group the run left behind is ended, so later tests on this worker start without one."""
    import io
    import traceback

    import torch

    if main is None:
        from shardtune.cli.main import main
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), context():
            rc = main(argv)
    except BaseException as exc:  # noqa: BLE001 - anything escaping main is the finding
        raise AssertionError(f"escaped main for {argv!r}: {type(exc).__name__}\n{traceback.format_exc()}") from None
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return rc, err.getvalue()


def wandb_afresh(monkeypatch) -> None:
    """W&B's settings (its WANDB_* variables and files) read again at their next use, as in a new
    process: wandb keeps the first it read in a process (the earlier ones come back after the test)."""
    monkeypatch.setattr(pytest.importorskip("wandb.sdk.wandb_setup"), "_singleton", None)


# In-process training helpers shared by tests/train, tests/model and tests/e2e/test_cuda.py.

def train_tiny(assets, out, **extra) -> list[float]:
    """Per-step losses of an in-process run of a tiny model (quickstart defaults dropped)."""
    from shardtune.config.load import load_config
    from shardtune.resolve.run import resolve_machine
    from shardtune.train.trainer import run

    # the machine's values as train resolves them (on CUDA: compile=auto compiles, as the CLI's runs do)
    run(resolve_machine(load_config(None, tiny_overrides(assets, out, **extra), defaults={})), overwrite=True)
    return losses(out)


def lift_float8_device_check(set_attribute=setattr) -> None:
    """float8 on CPU, for tests: the product's refusal of the CPU is lifted, every block linear with
    dimensions divisible by 16 is converted (torchao's own filter leaves layers this small in bf16,
    where float8 is slower), and the float8 matmuls run as _ScaledMatmulOnCpu."""
    import torch
    import torchao.float8 as f8

    from shardtune.model import float8

    set_attribute(float8, "check_device", lambda recipe, device: None)
    set_attribute(f8, "_auto_filter_for_recipe", lambda recipe, filter_fqns:
                  lambda m, fqn: m.in_features % 16 == 0 and m.out_features % 16 == 0)
    if not isinstance(torch._scaled_mm, _ScaledMatmulOnCpu):
        set_attribute(torch, "_scaled_mm", _ScaledMatmulOnCpu(torch._scaled_mm))


class _ScaledMatmulOnCpu:
    """torch's CPU `_scaled_mm` is a reference loop, 100-500x slower than a matmul of the same float8
    values upcast (2026-11-27: 44 ms a call, 100 of test_float8.py's 125 s): real CPU tensors take
    the upcast product, scaled, in fp32 (exact products of float8 values, an fp32 sum as the kernel's);
    fake ones (plan's traces) and every other device, torch's own."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        from torch._subclasses.fake_tensor import is_fake

        if a.device.type != "cpu" or is_fake(a) or scale_result is not None:
            return self.kernel(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, scale_result=scale_result,
                               out_dtype=out_dtype, use_fast_accum=use_fast_accum)
        out = (a.float() @ b.float()) * scale_a.float() * scale_b.float()
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype or a.dtype)


def make_trainer(assets, out, arch: str = "llama", **extra):
    """An in-process one-rank Trainer of a tiny model (tests/e2e/test_cuda.py makes one on CUDA)."""
    from shardtune.config.load import load_config
    from shardtune.resolve.run import resolve_machine
    from shardtune.train.trainer import Trainer

    return Trainer(resolve_machine(load_config(None, tiny_overrides(assets, out, arch=arch, **extra), defaults={})),
                   overwrite=True)


def step(trainer, batches):
    from shardtune.train.step import train_step

    return train_step(trainer.model, trainer.optimizer, trainer.scaler, batches, trainer.cfg, trainer.dist,
                      count_tokens=True, sync_each=trainer.built.sync_grads_each_micro_step)


def optimizer_state(optimizer) -> list:
    return [v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
            for s in optimizer.state.values() for v in s.values()]


def check_a_nonfinite_update_is_skipped(trainer, monkeypatch) -> None:
    """A NaN step leaves weights, moments and step counts bit-identical; the next one applies."""
    import torch

    import shardtune.train.step as step_mod

    assert trainer.optimizer.defaults["fused"]  # the device-side skip; other kernels ask the host
    prefetcher = trainer.prefetcher()
    try:
        step(trainer, prefetcher.take(0)[0])  # optimizer state exists from here on
        weights = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}
        state = optimizer_state(trainer.optimizer)
        real = step_mod.token_loss

        def poisoned(*args, **kw):
            loss, *rest = real(*args, **kw)
            return (loss * float("nan"), *rest)

        monkeypatch.setattr(step_mod, "token_loss", poisoned)
        out = step(trainer, prefetcher.take(1)[0])
        monkeypatch.setattr(step_mod, "token_loss", real)
        assert not torch.isfinite(out.grad_norm)
        assert all(torch.equal(p.full_tensor(), weights[n]) for n, p in trainer.model.named_parameters())
        after = optimizer_state(trainer.optimizer)
        assert all(torch.equal(a, b) for a, b in zip(after, state, strict=True))  # moments, step counts
        out = step(trainer, prefetcher.take(2)[0])  # and the next finite step applies again
        assert torch.isfinite(out.grad_norm)
        assert any(not torch.equal(p.full_tensor(), weights[n]) for n, p in trainer.model.named_parameters())
    finally:
        prefetcher.close()


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A small tmpfs at `path`, or a skip where this machine does not allow mounting."""
    path.mkdir(exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


# The peft methods beyond LoRA, as tests/model/test_peft_methods.py checks them after 3 steps of tiny
# Llama and tests/e2e/test_distributed.py runs them again on 2 ranks (the same runs: one baseline).
LORA_PLUS, PEFT_LR = 8.0, 1e-2
PEFT_METHODS = {
    # checkpoint.every_steps=1 everywhere: the resume tests start at step-2
    "dora": {"peft.method": "dora", "peft.rslora": "true", "peft.dropout": 0.0, "checkpoint.every_steps": 1},
    "pissa": {"peft.method": "lora", "peft.init": "pissa", "peft.lora_plus_ratio": LORA_PLUS, "peft.dropout": 0.0,
              "checkpoint.every_steps": 1},
    "olora": {"peft.method": "lora", "peft.init": "olora", "peft.dropout": 0.0, "checkpoint.every_steps": 1},
    "ia3": {"peft.method": "ia3", "checkpoint.every_steps": 1},
    "adaption_prompt": {"peft.method": "adaption_prompt", "peft.adapter_len": 4, "checkpoint.every_steps": 1},
    # the prefix encoder as an FSDP unit of its own; prompt tuning's text init and its labels'
    # offset through many loss chunks; step-2 checkpoints for tests/model/test_prompt_learning.py
    "prefix_tuning": {"peft.method": "prefix_tuning", "peft.num_virtual_tokens": 4, "train.lr": 5e-2,
                      "fsdp.wrap": "size", "fsdp.min_num_params": 400, "checkpoint.every_steps": 1},
    "prompt_tuning": {"peft.method": "prompt_tuning", "peft.num_virtual_tokens": 4, "train.lr": 5e-2,
                      "peft.prompt_init_text": "Return the value", "loss_chunk_tokens": 24,
                      "checkpoint.every_steps": 1},
}


def peft_overrides(assets, out, name: str, **extra) -> list[str]:
    return tiny_overrides(assets, out, "llama", **{"train.max_steps": 3, "eval.max_batches": 1, "train.lr": PEFT_LR,
                                                   "checkpoint.every_steps": 3, **PEFT_METHODS[name], **extra})


def logits_of(model):
    """The model's logits of a fixed probe, in eval mode (left in train mode)."""
    import torch

    model.eval()
    with torch.no_grad():
        out = model(input_ids=(torch.arange(32).reshape(2, 16) * 7) % 250).logits.detach().clone()
    model.train()
    return out


@pytest.fixture(scope="session")
def peft_runs(assets, tmp_path_factory):
    """Each method's 1-process run: stdout, per-step losses, full weights before/after (and after
    step 1), the base's, initial and trained logits, final/, the optimizer's groups."""
    import contextlib
    import io

    import torch

    from shardtune.checkpoint.export import gather_full_state_dict
    from shardtune.config.load import load_config
    from shardtune.model.hf import load_source_model
    from shardtune.train.trainer import Trainer

    def full(model):
        return {k: v.detach().clone() for k, v in gather_full_state_dict(model).items()}

    results, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: more threads only spin on 2 shared cores
    for name in PEFT_METHODS:
        out = tmp_path_factory.mktemp(name)
        cfg = load_config(None, peft_overrides(assets, out, name), defaults={})
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            trainer = Trainer(cfg, overwrite=True)
            model = trainer.model
            # parameter objects before any forward (FSDP swaps in unsharded ones during one)
            run = {"out": out, "trainable": {n for n, p in model.named_parameters() if p.requires_grad},
                   "groups": [(g["lr"], {id(p) for p in g["params"]}) for g in trainer.optimizer.param_groups],
                   "ids": {n: id(p) for n, p in model.named_parameters()}, "stepped": []}
            run.update(before=full(model), initial=logits_of(model),
                       base=logits_of(load_source_model(cfg.model, trainer.hf_config, cfg.train.seed)))
            trainer.optimizer.register_step_post_hook(
                lambda *_, run=run, model=model: run["stepped"].append(full(model)) if not run["stepped"] else None)
            trainer.fit()
            run.update(after=full(model), logits=logits_of(model), final=trainer.export())
            trainer.close()
        run.update(stdout=printed.getvalue(), losses=losses(out))
        results[name] = run
    torch.set_num_threads(threads)
    return results


def adapter_probe():
    """The token ids adapter_folder's logits are of."""
    import torch

    return (torch.arange(40).reshape(2, 20) * 7) % 250


def adapter_folder(tmp_path, assets, targets: list[str], dtype=None):
    """(adapter folder, the peft model's logits of PROBE): LoRA with random (non-zero) weights on
    `targets` of a tiny GPT-2 whose head is tied to its input embeddings, its base saved in `dtype`
    and trained in fp32 (as a run reads its base)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**TINY["gpt2"], "n_layer": 1, "n_embd": 32, "vocab_size": 300})
    AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(tmp_path / "base")
    AutoTokenizer.from_pretrained(assets["tokenizer"]).save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)  # the adapter names it
    assert base.config.tie_word_embeddings
    model = get_peft_model(base, LoraConfig(r=4, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.3)
        want = model.eval()(input_ids=adapter_probe()).logits
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter", want
