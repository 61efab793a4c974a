"""Publishing from a run: checkpoints and the final model to the Hugging Face Hub while it
trains (`hub`), with a model card (`card`)."""
