"""shardtune: fine-tune Hugging Face causal LMs with PyTorch FSDP2 from one YAML config."""

__version__ = "0.1.0"

# torchao (train.optimizer_state; transformers imports it too when installed) warns at import about
# its CUDA kernel libraries that cannot load on this machine; nothing shardtune uses needs them.
__import__("logging").getLogger("torchao").setLevel("ERROR")
