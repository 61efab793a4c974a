"""Every causal-LM architecture the installed transformers lists (the families table's 33 too):
which build from a tiny config (tests/archs.tiny_config), take one optimizer step through
shardtune's train step, take LoRA with no target list (a step that moves only the adapters), are
traced by `plan` on 2 fake ranks, and keep packed documents apart, in one process on CPU: the
counts behind README's "Beyond the table" (tests/test_every_architecture.py checks them).

`.venv/bin/python bench/architectures.py [--types a b ...]` prints one markdown row per type and
the totals. A type whose tiny config does not build is "no tiny config" (it needs keys of its own)."""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from archs import DOCS, optimizer_step, packed_batch, packed_vs_alone, run_config, tiny_config  # noqa: E402

MAX_PARAMS = 20_000_000


def _why(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1][:70] if lines else ''}"


def check(model_type: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.config.schema import PeftConfig
    from shardtune.families import family
    from shardtune.model.adapters import add_adapter, default_lora_targets

    row = {"type": model_type, "in table": family(model_type) is not None}
    try:
        config = tiny_config(model_type)
        with torch.device("meta"):  # sized first: keys the tiny config misses can leave a big model
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMS:
            return {**row, "build": f"no tiny config ({size / 1e6:.0f} M params)"}
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    except Exception as exc:  # noqa: BLE001  the row says why
        return {**row, "build": f"no tiny config ({_why(exc)})"}
    row["build"] = f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params"
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(2, 250, (n,), generator=gen).tolist() for n in DOCS]  # below the special ids
    batch = packed_batch(rows)
    try:
        worst = packed_vs_alone(model, batch, rows)
        row["packed == alone"] = "yes" if worst <= 1e-5 else f"no ({worst:.1e})"
    except Exception as exc:  # noqa: BLE001
        row["packed == alone"] = f"error ({_why(exc)})"
    if row["packed == alone"] != "yes":
        batch = {k: v for k, v in batch.items() if k != "position_ids"}
    try:  # shardtune's own step (train.step), as a run takes it
        row["train step"] = "ok" if optimizer_step(model_type, model, batch) else "nothing moved"
    except Exception as exc:  # noqa: BLE001
        row["train step"] = f"error ({_why(exc)})"
    targets = default_lora_targets(model_type, model)
    if not targets:
        row["LoRA default"] = "none: needs peft.target_modules"
    else:
        try:
            wrapped = add_adapter(model, PeftConfig(method="lora", r=4), seed=0)
            moved = optimizer_step(model_type, wrapped, batch)
            only = moved and all("lora_" in n for n in moved)
            row["LoRA default"] = ", ".join(targets) if only else "the step moved no adapter (or more)"
        except Exception as exc:  # noqa: BLE001
            row["LoRA default"] = f"error ({_why(exc)})"
    try:
        from shardtune.plan.trace import trace_step

        trace_step(run_config(model_type, "train.global_batch_size=2", "peft.method=lora", "peft.r=4"), config,
                   world_size=2)
        row["plan"] = "ok"
    except Exception as exc:  # noqa: BLE001
        row["plan"] = f"error ({_why(exc)})"
    return row


def main() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="*", default=sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cols = ["type", "in table", "build", "train step", "LoRA default", "plan", "packed == alone"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols), flush=True)
    results, start = [], time.time()
    for model_type in args.types:
        try:
            row = check(model_type)
        except Exception:  # noqa: BLE001
            row = {"type": model_type, "build": "crash: " + traceback.format_exc().splitlines()[-1][:80]}
        results.append(row)
        print("| " + " | ".join(str(row.get(c, "")) for c in cols) + " |", flush=True)
    built = [r for r in results if r.get("train step")]
    print(f"\n{len(results)} types in {time.time() - start:.0f} s: {len(built)} build from a tiny config, "
          f"{sum(r['train step'] == 'ok' for r in built)} train a step, "
          f"{sum(not r.get('LoRA default', 'none').startswith(('none', 'error', 'the step')) for r in built)} "
          f"take LoRA with no target list (a step moves only the adapters), "
          f"{sum(r.get('plan') == 'ok' for r in built)} plan on 2 fake ranks, "
          f"{sum(r.get('packed == alone') == 'yes' for r in built)} keep packed documents apart")


if __name__ == "__main__":
    main()
