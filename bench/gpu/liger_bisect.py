"""Where `kernels=liger`'s illegal memory access comes from (H200, 2026-11-26: every Liger run
failed with `CUDA error: an illegal memory access`, surfacing in `torch.manual_seed` after the
model was built, before the first step, also under CUDA_LAUNCH_BLOCKING=1).

Each case runs in a process of its own (an illegal access poisons the CUDA context), on a tiny
Llama in bf16, and synchronizes after every phase, so the first phase that fails is named:

  rms_norm / rope / swiglu   that one Liger patch on the plain HF model: forward, backward
  patches                    all three
  fused_ce                   shardtune's Liger head loss (model/kernels.head_loss) alone
  build                      shardtune's build with kernels=liger (Liger patches, FSDP2 on one rank,
                             weights from rank 0), then manual_seed, then two training steps
  build_plain                the same with kernels=none (the control)

    python bench/gpu/liger_bisect.py [CASE ...]       (CUDA; every case by default)
    python bench/gpu/liger_bisect.py --rehearse       (CPU: each case must stop in one line)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common as C  # noqa: E402

CASES = ["rms_norm", "rope", "swiglu", "patches", "fused_ce", "build_plain", "build"]
TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 256}


def phase(name: str, device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"phase {name}: ok", flush=True)


def plain_model(device, patches: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**TINY)).to(device=device, dtype=torch.bfloat16)
    phase("model", device)
    if patches:
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model, **{"rope": False, "rms_norm": False, "swiglu": False,
                                                  "cross_entropy": False, "fused_linear_cross_entropy": False,
                                                  **patches})
        phase("patch", device)
    return model


def run_case(case: str, device_name: str) -> None:
    import torch

    device = torch.device(device_name)
    if device.type != "cuda" and case != "build_plain":  # the rehearsal runs the control's code path on CPU
        raise SystemExit("error: liger_bisect needs a CUDA GPU (Liger's kernels are Triton kernels)")
    ids = torch.randint(0, TINY["vocab_size"], (2, 128), device=device)
    if case in ("rms_norm", "rope", "swiglu", "patches"):
        patches = {"rms_norm": True, "rope": True, "swiglu": True} if case == "patches" else {case: True}
        model = plain_model(device, patches)
        out = model(input_ids=ids, labels=ids)
        phase("forward", device)
        out.loss.backward()
        phase("backward", device)
    elif case == "fused_ce":
        from shardtune.model.kernels import head_loss

        hidden = torch.randn(256, TINY["hidden_size"], device=device, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(TINY["vocab_size"], TINY["hidden_size"], device=device, dtype=torch.bfloat16,
                             requires_grad=True)
        labels = ids.flatten()[:256].clone()
        labels[:10] = -100
        loss = head_loss(hidden, weight, labels, False, -100)
        phase("forward", device)
        loss.backward()
        phase("backward", device)
        both = head_loss(hidden, weight, labels, True, -100)
        phase(f"with accuracy ({both.tolist()})", device)
    else:
        from shardtune.config.load import load_config
        from shardtune.distributed.process_group import init_distributed
        from shardtune.model import build as model_build
        from shardtune.model.hf import load_hf_config
        from shardtune.plan import measure

        cfg = load_config(None, [f"model.config={json.dumps(TINY)}", "data.path=unused", "data.seq_len=128",
                                 "train.micro_batch_size=2", "train.global_batch_size=2",
                                 f"precision={'bf16' if device.type == 'cuda' else 'fp32'}", f"device={device.type}",
                                 f"kernels={'liger' if case == 'build' else 'none'}"])
        dist = init_distributed(device.type)
        build = model_build.build_model  # measure_step imports it when it runs

        def built(*args, **kwargs):
            out = build(*args, **kwargs)
            phase("build", device)
            torch.manual_seed(0)
            phase("manual_seed", device)
            return out

        model_build.build_model = built
        measure.measure_step(cfg, load_hf_config(cfg.model), dist)
        phase("two steps", device)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="*", metavar="CASE", help=f"of {', '.join(CASES)} (default: all)")
    p.add_argument("--rehearse", action="store_true", help="on CPU: every case must stop in one line")
    p.add_argument("--case", help=argparse.SUPPRESS)
    a = p.parse_args()
    device = "cpu" if a.rehearse else "cuda"
    if unknown := [c for c in a.cases if c not in CASES]:
        p.error(f"no case {unknown[0]!r}; the cases: {', '.join(CASES)}")
    if a.case:
        run_case(a.case, device)
        return 0
    if C.args_only():
        return 0
    print(f"# Liger-Kernel bisect ({'rehearsal on CPU' if a.rehearse else 'GPU'})\n\n{C.machine_line()}\n")
    rows = []
    for case in a.cases or CASES:
        t0 = time.time()
        cmd = [sys.executable, __file__, "--case", case, *(["--rehearse"] if a.rehearse else [])]
        env = {**C.torchrun_env(1), "CUDA_LAUNCH_BLOCKING": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        passed = [line.split(":")[0].removeprefix("phase ") for line in proc.stdout.splitlines()
                  if line.startswith("phase ")]
        rows.append([case, "ok" if proc.returncode == 0 else f"exit {proc.returncode}", " > ".join(passed) or "-",
                     "" if proc.returncode == 0 else C.last_error_line(proc), f"{time.time() - t0:.0f}"])
        print(f"- {case}: {rows[-1][1]} after {rows[-1][2]} {rows[-1][3]}", flush=True)
    print("\n" + C.markdown_table(["case", "result", "phases passed", "error", "s"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
