"""The trainer, the math of one step, the optimizer and evaluation."""
