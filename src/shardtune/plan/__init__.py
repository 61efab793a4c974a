"""Predict memory and speed before the run by tracing one step under fake tensors."""
