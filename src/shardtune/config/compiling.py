"""What `compile` means for a run: each decoder block compiled (torch.compile, in place, before
sharding) or not. `compile=auto`, the default, compiles where it pays and combines: on a CUDA
device, where it measured 1.34x eager on the Llama ~1B (H200, 2026-11-26: 51,034 -> 68,172
tokens/s, 4 GiB less reserved; the compile itself about 15 s, paid back after about a minute of
training). Not on CPU (not measured to pay there; inductor's C++ compile takes minutes), not with
activation offload (its hooks cannot run inside compiled blocks) and not with QLoRA (bitsandbytes'
4-bit matmul breaks the graph; not measured). train resolves it once (resolve.run); plan prices
each layout as train would run it on the GPU."""

from __future__ import annotations


def compiles(compile: bool | str, device: str, activation_offload: bool, quantize: str = "none") -> bool:
    """Whether the decoder blocks are compiled for `compile` (true, false or auto) on `device`
    ("cuda" or "cpu"); never with activation offload (config validation refuses compile=true with it)
    nor with QLoRA, whose model is built apart (model.adapters.load_qlora_model) and never compiled:
    compile=true there is resolved to false (resolve.run says so), not refused, so that the saved
    config of a QLoRA run that set it still loads."""
    if activation_offload or quantize != "none":
        return False
    if compile != "auto":
        return bool(compile)
    return device == "cuda"
