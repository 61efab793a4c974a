"""DCP checkpoints, the run folder, loading a trained model, export to a plain HF folder."""
