"""Configurations whose step is both traced and really run on 2 ranks (tests/dist_harness.py
measures them inside test_distributed's one launch; plan.measure counts what the allocator
holds, the backend's own copies included), and the check that the trace agrees."""

from __future__ import annotations

import json

# Small activations, a large vocabulary: the peak is the embedding's reduce-scatter at the end of
# backward, where gloo holds a clone of the reduce-scatter input (issue 36).
REDUCE_SCATTER_PEAK = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                       "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 32000,
                       "max_position_embeddings": 64, "tie_word_embeddings": False}
# Tied embeddings, every block checkpointed: the peak is the tied weight's two gradients summed at
# the end of backward, which autograd sums in place; the trace's dispatch mode made it sum out of
# place, one vocab x hidden more (issue 36: GPT-2 small on 2 ranks +4.8 %, this one +10.8 %).
TIED_CHECKPOINTED = {"model_type": "gpt2", "n_layer": 2, "n_embd": 256, "n_head": 4, "vocab_size": 50257,
                     "n_positions": 64}
# The same with more blocks and a small vocabulary: the peak is in the blocks' backward, where the
# tied pair (one FSDP unit of two modules) stays gathered; torch's FSDPMemTracker dropped the
# group's own forward hooks, so the trace resharded it after the head's backward (issue 36: -3.2 %).
TIED_BLOCKS = {**TIED_CHECKPOINTED, "n_layer": 4, "vocab_size": 4096, "bos_token_id": 0, "eos_token_id": 0}
MEASURED = {
    "reduce_scatter_peak": [f"model.config={json.dumps(REDUCE_SCATTER_PEAK)}", "data.path=unused", "data.seq_len=16",
                            "train.micro_batch_size=1", "train.global_batch_size=2", "device=cpu"],
    **{name: [f"model.config={json.dumps(model)}", "data.path=unused", "data.seq_len=64", "train.micro_batch_size=2",
              "train.global_batch_size=4", "device=cpu", "activation_checkpointing=full"]
       for name, model in (("tied_checkpointed", TIED_CHECKPOINTED), ("tied_blocks", TIED_BLOCKS))},
}
# the planner's goals on CPU (bench/plan_accuracy.py): never under by more than 1 %, never over by more than 3 %
UNDER, OVER = 0.01, 0.03


def traced_error(overrides: list[str], measured: int, world_size: int) -> float:
    """(traced peak - measured peak) / measured of the step `overrides` configure."""
    from shardtune.config.load import load_config
    from shardtune.model.hf import load_hf_config
    from shardtune.plan.trace import trace_step

    cfg = load_config(None, overrides, defaults={})
    predicted = trace_step(cfg, load_hf_config(cfg.model), world_size).peak_bytes()
    return (predicted - measured) / measured
