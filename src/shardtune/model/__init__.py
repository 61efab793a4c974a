"""Hugging Face models: loading, adapters, the chunked loss, the one build path."""
