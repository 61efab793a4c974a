"""What mauve-text's own featurisation accepts, and whether its featuriser gives shardtune's
features (issue 35): a tiny random GPT-2 saved in a folder with and without "gpt2" in its path,
`compute_mauve(p_text=..., featurize_model_name=FOLDER)`; then the per-text forward loop shardtune
had against `mauve.utils.featurize_tokens_from_model` (batched, what `textscores.mauve_score` calls
now). `--try-hub` also asks for a hub id that is not in the cache (HF_HUB_OFFLINE unset: it tries
the network). Needs the `mauve` extra. Seconds on a CPU.

    PYTHONPATH=src .venv/bin/python bench/mauve_featurizer.py [--try-hub]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main() -> int:
    import mauve
    import torch
    from mauve.utils import featurize_tokens_from_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from shardtune.data.quickstart import build_quickstart_assets
    from shardtune.evaluation.textscores import load_featurizer

    work = Path(os.environ.get("SHARDTUNE_BENCH_DIR", "/tmp/shardtune-bench")) / "mauve"
    assets = build_quickstart_assets(work / "assets", vocab_size=300, max_docs=400)
    tok = AutoTokenizer.from_pretrained(assets["tokenizer"])
    cfg = AutoConfig.for_model(model_type="gpt2", n_layer=2, n_embd=64, n_head=2, n_positions=128,
                               vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    for name in ("my-featurizer", "gpt2-local"):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(work / name)
        tok.save_pretrained(work / name)
    texts = [f"Return the value number {i} of the given object." * (1 + i % 4) for i in range(20)]
    names = [str(work / "my-featurizer"), str(work / "gpt2-local")] + (["gpt2-xl"] if "--try-hub" in sys.argv else [])
    for name in names:
        try:
            result = mauve.compute_mauve(p_text=texts, q_text=texts, featurize_model_name=name, device_id=-1,
                                         max_text_length=100)
            print(f"featurize_model_name={name}: mauve {result.mauve:.3f}")
        except Exception as exc:  # noqa: BLE001  what the library raises is the finding
            print(f"featurize_model_name={name}: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
    model, tok = load_featurizer(str(work / "my-featurizer"))
    ids = [tok(t or tok.eos_token, return_tensors="pt", truncation=True, max_length=100).input_ids
           for t in [*texts, ""]]
    with torch.no_grad():  # the loop shardtune had before issue 35
        loop = torch.stack([model(input_ids=i).last_hidden_state[0, -1] for i in ids])
    batched = featurize_tokens_from_model(model, ids, batch_size=8).float()
    print(f"features: {tuple(batched.shape)}, largest difference loop vs mauve-text batch 8: "
          f"{(loop - batched).abs().max().item():.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
