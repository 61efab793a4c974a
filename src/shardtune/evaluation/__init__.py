"""Evaluation: loss and perplexity of a model or checkpoint, generation, and the text scores of generations."""
