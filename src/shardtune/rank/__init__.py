"""Code that runs inside a rank of a job: preemption and Ctrl-C, the completion mark, leaving."""
