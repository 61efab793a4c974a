"""What `plan` makes of every config key: priced (the traced step or the cost model takes it),
refused (it changes memory or speed in a way plan does not price: one line), or irrelevant (with
the reason it changes neither). tests/plan/test_plan_keys.py walks the schema: a new key must
land in one of these tables."""

from __future__ import annotations

from shardtune.config.schema import RunConfig
from shardtune.errors import UserError

TRACED = "traced: the step plan traces is built from it"
SHAPE = "traced: it sets the batches' shape"
HOST = "priced in host RAM (cost.host_memory)"
SEARCHED = "searched: plan tries its values and prices each"
DATA = "which data, not its shape: data.seq_len / cutoff_len and the format set the batches"
LOOP = "the training loop around the step: no tensor of the step, no time of it"
WEIGHTS = "the weights' values or their init, not their shape"

PRICED = {
    "precision": SEARCHED,
    # auto: plan searches the modes as for any value and ranks none of them as a change to the
    # recipe; train resolves auto with the same speed model on its own device (plan.fit.resolve_layout)
    "activation_checkpointing": SEARCHED + " (auto: a mode left to the search, as train.micro_batch_size=auto)",
    "activation_checkpointing_every": SEARCHED,
    "activation_offload": SEARCHED, "fsdp.sharding": SEARCHED, "fsdp.cpu_offload": SEARCHED,
    "fsdp.reduce_dtype": SEARCHED, "train.micro_batch_size": SEARCHED, "train.optimizer_state": SEARCHED,
    "train.global_batch_size": "priced: the accumulation and the tokens per step",
    "float8": "traced (the converted layers) and priced (cost.float8_seconds)",
    "compile": ("priced: a compiled layout at the measured compiled MFU (cost.compiled: auto compiles on the GPU "
                "but with activation offload or QLoRA), float8's casts too; its memory is the eager trace's, an "
                "upper bound (compiled blocks hold less)"),
    "loss_chunk_tokens": TRACED, "model.name_or_path": TRACED, "model.config": TRACED,
    "model.trust_remote_code": TRACED, "model.sharded_load": HOST, "model.random_init": HOST + " (made on rank 0)",
    "save_final": HOST + " (no final/ save)", "checkpoint.sharded_final": HOST,
    "checkpoint.async_save": HOST + " (each rank's staged shards)",
    "data.seq_len": SHAPE, "data.format": SHAPE, "data.cutoff_len": SHAPE, "data.packing": SHAPE,
    "data.document_mask": SHAPE, "data.padding_free": SHAPE,
    "fsdp.wrap": TRACED, "fsdp.min_num_params": TRACED, "fsdp.block_class": TRACED, "fsdp.replicate_size": TRACED,
    "fsdp.shard_size": TRACED, "fsdp.forward_prefetch": TRACED, "fsdp.backward_prefetch": TRACED,
    "train.max_grad_norm": TRACED + " (clipping)", "peft.method": TRACED, "peft.r": TRACED,
    "peft.target_modules": TRACED, "peft.feedforward_modules": TRACED, "peft.num_virtual_tokens": TRACED,
    "peft.adapter_len": TRACED, "peft.adapter_layers": TRACED, "peft.dropout": TRACED + " (its masks)",
    "peft.lora_plus_ratio": TRACED + " (the optimizer's groups)",
    "peft.quantize": "priced: the LoRA step with its base in NF4 (plan.qlora)",
    "freeze.trainable_blocks": TRACED, "freeze.head_only": TRACED, "freeze.embeddings": TRACED,
}

# key -> (whether a config sets it so that plan cannot price it, the one-line refusal)
REFUSED = {
    "kernels": (lambda cfg: cfg.kernels != "none",
                "kernels=liger is not priced by plan: it traces the step on fake tensors, which Liger's Triton "
                "kernels do not run on; plan without it (the chunked head loss), then add kernels=liger"),
    "eval.micro_batch_size": (lambda cfg: cfg.eval.micro_batch_size is not None,
                              "eval.micro_batch_size is not priced by plan: it traces the training step; drop it "
                              "(evaluation then uses train.micro_batch_size, which plan checks)"),
}

IRRELEVANT = {
    "output_dir": "a folder name",
    "device": "plan plans for the GPU of --gpu / --gpu-mem (device=cpu: its blocks priced eager, as train runs them)",
    "resume": "where to start from, not what a step holds", "on_nan": "a skipped update holds what a step holds",
    "recipe": "a name", "model.tokenizer": "the vocabulary comes from the model config",
    **{f"data.{k}": DATA for k in ("path", "name", "split", "val_split", "val_size", "text_field", "start_idx",
                                   "end_idx", "template", "list_sep", "instruction_field", "input_field",
                                   "output_field", "messages_field", "chat_template")},
    "data.num_proc": "tokenization before training, in worker processes",
    "data.train_on_inputs": "which tokens the labels mask: the same shapes, the head runs over every position",
    "data.group_by_length": "plan traces full-length rows, the longest any batch reaches",
    **{f"train.{k}": "AdamW's numbers or the schedule: the same tensors and kernels"
       for k in ("lr", "min_lr_ratio", "lr_schedule", "warmup_steps", "weight_decay", "betas", "eps")},
    **{f"train.{k}": LOOP for k in ("max_steps", "epochs", "seed")},
    **{f"eval.{k}": "when and how much to evaluate: a forward at the training micro-batch, less than a step"
       for k in ("every_steps", "max_batches", "at_start")},
    **{f"log.{k}": LOOP for k in ("every_steps", "progress", "trackers", "project", "peak_tflops")},
    "log.live_memory": "slows only the first N steps (their tracker), not the steady step priced",
    "log.profile_steps": "slows only the profiled steps",
    "log.watch": "norms every log.watch_every steps, not in the steady step",
    "log.watch_every": "norms every N steps, not in the steady step",
    **{f"checkpoint.{k}": "how often and how many checkpoints are kept: disk, not the step"
       for k in ("every_steps", "at_epoch_end", "keep_last")},
    "checkpoint.hf_format": "each rank writes its own rows tensor by tensor: no gathered copy",
    **{f"peft.{k}": WEIGHTS for k in ("alpha", "rslora", "init", "prompt_init_text")},
    **{f"publish.{k}": "uploads from the saved files on a background thread of rank 0"
       for k in ("hub_repo", "private", "revision", "checkpoints", "required", "wandb_artifacts", "retries",
                 "wait_s")},
}


def refuse_unpriced(cfg: RunConfig, target) -> None:
    """One line for a config plan cannot price: a key of REFUSED as set, or QLoRA on a machine or
    in a layout its one-GPU run does not take."""
    for check, message in REFUSED.values():
        if check(cfg):
            raise UserError(message)
    if cfg.peft.quantize != "none":
        if target.world > 1:
            raise UserError(f"peft.quantize=4bit (QLoRA) runs on one GPU, not {target.world}: plan it with --gpus 1, "
                            "or drop peft.quantize for LoRA sharded over the GPUs")
        if target.gpu is not None and not target.gpu.supports("bf16"):
            raise UserError(f"peft.quantize=4bit (QLoRA) computes in bf16, which {target.gpu.name} lacks; plan "
                            "LoRA without peft.quantize, or a card with bf16")
