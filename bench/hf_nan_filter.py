"""What transformers.Trainer shows of a NaN gradient, as bench/vs_hf_trainer.py ran it before the
curve stage: a tiny GPT-2 whose gradients go NaN at step 3 only, with `logging_nan_inf_filter` at
its default (True) and off. Prints each logged step's (step, loss, grad norm) and whether the
weights are still finite. Seconds on a CPU.

    .venv/bin/python bench/hf_nan_filter.py
"""

from __future__ import annotations

import sys
import warnings


def main() -> int:
    import datasets
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=2, vocab_size=300, n_positions=64)
    first = AutoModelForCausalLM.from_config(config).state_dict()
    ids = torch.randint(0, 300, (16, 32)).tolist()
    data = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids}).with_format("torch")
    for nan_filter in (True, False):
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(first)
        calls = []

        def poison(module, grad_input, grad_output, calls=calls):  # the 3rd backward only
            calls.append(1)
            return (grad_input[0] * float("nan"),) if len(calls) == 3 else None

        model.transformer.h[1].mlp.c_proj.register_full_backward_hook(poison)
        args = TrainingArguments(output_dir="/tmp/hf_nan_filter", per_device_train_batch_size=2, max_steps=6,
                                 learning_rate=1e-3, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                                 report_to="none", disable_tqdm=True, use_cpu=True,
                                 logging_nan_inf_filter=nan_filter)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        logged = [(h["step"], round(h["loss"], 4), h.get("grad_norm")) for h in trainer.state.log_history
                  if "loss" in h]
        finite = all(torch.isfinite(p).all().item() for p in model.parameters())
        print(f"logging_nan_inf_filter={nan_filter}: {logged}; weights finite after: {finite}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
