"""Inside a rank that trains on the CPU: the C library's allocator keeps what a step frees.

By default glibc hands large freed blocks back to the kernel: blocks above its mmap threshold
are unmapped, and the heap is trimmed once enough at its top is free. A training step frees
and allocates the same activations, logits and gradients every step, so each step faulted
their pages in again; on a 2-core VM that was 13 % of a GPT-2 step's time (BENCHMARKS.md,
thirteenth session). Fixing the mmap threshold at glibc's ceiling and never trimming keeps
blocks up to 32 MiB in the process for the next step; larger ones are still mapped per use.

An allocator already tuned through the environment is left as it is: a user's choice, or a
`sweep --mem-limit` trial's (sweep/trial.CAPPED_ENV), which wants freed memory returned so that
its cap binds on tensors, not on glibc's cache.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD_MAX = 32 * 2 ** 20  # glibc's ceiling on 64-bit (4 MiB * sizeof(long)); larger is refused
NEVER_TRIM = 2 ** 31 - 1  # mallopt takes a C int
# glibc's own settings of the same things, read at start-up: whoever set them has chosen
TUNED_BY_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def tuned_by_environment() -> bool:
    return any(name in os.environ for name in TUNED_BY_ENV) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")


def keep_freed_memory() -> bool:
    """Tune glibc's allocator for a training loop (process-wide, idempotent). False, and nothing
    changed, where the C library is not glibc (macOS, musl) or the environment has tuned it."""
    if not sys.platform.startswith("linux") or tuned_by_environment():
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  glibc's alone: elsewhere mallopt may be a stub
    except (OSError, AttributeError):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                         NEVER_TRIM))
