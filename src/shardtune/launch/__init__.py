"""Starting ranks: the local elastic launcher, signals, Slurm scripts, cache downloads."""
