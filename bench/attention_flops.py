"""What MFU's attention term is, counted (telemetry/flops.py: torch's FlopCounterMode over one
forward of the real model on meta tensors) against the hand formula it replaced (4 x layers x
hidden x seq_len per token), and what the count costs at the start of a run, for well-known
configs built locally (no hub). Prints a markdown table.

    python bench/attention_flops.py [--seq 4096]
"""

from __future__ import annotations

import argparse
import time

from _common import machine_line


def configs() -> dict:
    from transformers import DeepseekV3Config, LlamaConfig, MixtralConfig, Qwen3Config

    return {
        "Llama-2-7B": LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                  num_attention_heads=32, vocab_size=32000),
        "Qwen3-0.6B": Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936),
        "Mixtral-8x7B": MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
        "DeepSeek-V3": DeepseekV3Config(),  # its defaults are the released model's
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()
    from shardtune.families import hidden_size, layer_count
    from shardtune.telemetry.flops import attention_flops

    print(machine_line())
    print("\n| config | count (s) | counted GFLOPs/token | formula GFLOPs/token | counted / formula |\n"
          "|---|---|---|---|---|")
    for name, cfg in configs().items():
        t0 = time.perf_counter()
        counted = attention_flops(cfg, args.seq)
        seconds = time.perf_counter() - t0
        formula = 4.0 * layer_count(cfg) * hidden_size(cfg) * args.seq
        print(f"| {name} | {seconds:.2f} | {counted / 1e9:.3f} | {formula / 1e9:.3f} | {counted / formula:.2f} |")


if __name__ == "__main__":
    main()
