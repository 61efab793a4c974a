"""What the check's structure check adds to a command's start-up: Llama-2-7B's meta skeleton with
LoRA (peft targets, freezing and fsdp.block_class are refused on it before any data is read), and
the same run without an adapter, where it builds nothing. Three calls each, seconds.

    .venv/bin/python bench/check_structure_time.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import shardtune
from shardtune.config.load import load_config
from shardtune.config.schema import ModelConfig
from shardtune.model.build import ModelSpec, check_structure
from shardtune.model.hf import load_hf_config

CONFIG = Path(shardtune.__file__).parent / "plan" / "model_configs" / "meta-llama--Llama-2-7b-hf.json"


def main() -> None:
    config = json.loads(CONFIG.read_text())
    hf_config = load_hf_config(ModelConfig(config=config))
    for method in ("lora", "none"):
        cfg = load_config(None, [f"model.config={json.dumps(config)}", "data.path=unused.jsonl",
                                 f"peft.method={method}"])
        spec = ModelSpec.of_run(cfg, hf_config)
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            check_structure(spec)
            seconds.append(time.perf_counter() - start)
        print(f"peft.method={method}: check_structure " + ", ".join(f"{s:.3f}" for s in seconds) + " s")


if __name__ == "__main__":
    main()
