"""shardtune: fine-tune Hugging Face causal LMs with PyTorch FSDP2 from one YAML config."""

__version__ = "0.1.0"
