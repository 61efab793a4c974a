"""Every causal-LM architecture the installed transformers lists (not the families table's 33):
which build from a tiny config, train one step, take LoRA with no target list, and keep packed
documents apart, in one process on CPU. The suite checks the families table
(tests/test_architectures.py); this shows what lies beyond it, for the next rows to add.

`.venv/bin/python bench/architectures.py [--types a b ...]` prints one markdown row per type and
the totals. A type whose tiny config does not build is "no tiny config" (it needs keys of its own)."""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from archs import tiny_config  # noqa: E402  the suite's tiny configs

MAX_PARAMS = 20_000_000


def _why(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1][:70] if lines else ''}"


def check(model_type: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.config.schema import PeftConfig
    from shardtune.data.docmask import positions
    from shardtune.families import family
    from shardtune.model.adapters import add_lora, default_lora_targets

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
    rows = [[int(x) for x in torch.randint(2, 250, (n,))] for n in (9, 23, 14)]
    ids = torch.tensor([sum(rows, [])])
    try:
        with torch.no_grad():
            packed = model(input_ids=ids, position_ids=torch.from_numpy(positions([9, 32], ids.size(1)))[None],
                           use_cache=False).logits[0]
            start, worst = 0, 0.0
            for r in rows:
                alone = model(input_ids=torch.tensor([r]), use_cache=False).logits[0]
                worst = max(worst, float((packed[start:start + len(r)] - alone).abs().max()))
                start += len(r)
        row["packed == alone"] = "yes" if worst <= 1e-5 else f"no ({worst:.1e})"
    except Exception as exc:  # noqa: BLE001
        row["packed == alone"] = f"error ({_why(exc)})"
    try:
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        row["train step"] = "ok" if torch.isfinite(loss) else "non-finite"
    except Exception as exc:  # noqa: BLE001
        row["train step"] = f"error ({_why(exc)})"
    targets = default_lora_targets(model_type, model)
    if not targets:
        row["LoRA default"] = "none: needs peft.target_modules"
    else:
        try:
            wrapped = add_lora(model, PeftConfig(method="lora", r=4), model_type)
            wrapped(input_ids=ids, labels=ids).loss.backward()  # a step's gradients reach the adapters
            # B starts at zero, so A's gradient is zero: B's shows the adapters are in the graph
            reached = any(p.grad is not None and bool(p.grad.any()) for n, p in wrapped.named_parameters()
                          if "lora_B" in n)
            row["LoRA default"] = ", ".join(targets) if reached else "no gradient reaches the adapters"
        except Exception as exc:  # noqa: BLE001
            row["LoRA default"] = f"error ({type(exc).__name__}: {str(exc).splitlines()[0][:60]})"
    try:
        from shardtune.config.load import load_config
        from shardtune.plan.trace import trace_step

        cfg = load_config(None, [f'model.config={{"model_type": "{model_type}"}}', "data.path=unused",
                                 "data.seq_len=32", "train.micro_batch_size=1", "train.global_batch_size=2",
                                 "device=cpu", "peft.method=lora", "peft.r=4"])
        trace_step(cfg, config, world_size=2)
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
          f"{sum(not r.get('LoRA default', 'none').startswith(('none', 'error', 'no ')) for r in built)} take LoRA "
          f"with no target list (gradients reach the adapters), "
          f"{sum(r.get('plan') == 'ok' for r in built)} plan on 2 fake ranks, "
          f"{sum(r.get('packed == alone') == 'yes' for r in built)} keep packed documents apart")


if __name__ == "__main__":
    main()
