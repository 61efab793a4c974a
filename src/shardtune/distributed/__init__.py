"""The process group, collectives and FSDP2 application. Launches no process."""
