"""shardtune: fine-tune Hugging Face causal LMs with PyTorch FSDP2 from one YAML config."""

__version__ = "0.1.0"

# torchao (train.optimizer_state; transformers and peft import it too when installed) warns at
# import about its CUDA kernel libraries that cannot load on a CPU machine, and through torch's
# pytree logger about enum registrations torch.compile deprecates: nothing shardtune uses needs
# either, and each warning would be a stray line beside the one line of an error.
for _name in ("torchao", "torch.utils._pytree"):
    __import__("logging").getLogger(_name).setLevel("ERROR")
