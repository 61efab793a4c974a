"""What a run reports: metrics.jsonl (always, rank 0) and a progress bar (rank 0)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path


class MetricsLog:
    """Appends one JSON object per line. Only the main rank writes."""

    def __init__(self, path: Path, enabled: bool):
        self.enabled = enabled
        self._file = open(path, "a", buffering=1) if enabled else None

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class Throughput:
    """Tokens per second between two reports."""

    def __init__(self):
        self._t = time.perf_counter()
        self._tokens = 0

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def rate(self) -> float:
        now = time.perf_counter()
        rate = self._tokens / max(now - self._t, 1e-9)
        self._t, self._tokens = now, 0
        return rate


class Progress:
    """tqdm bar on the main rank; nothing elsewhere."""

    def __init__(self, total: int, initial: int, is_main: bool, bar: bool = True):
        self.is_main, self.bar = is_main, None
        if is_main and bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", file=sys.stderr,
                            dynamic_ncols=True, disable=None)

    def update(self, steps: int, **fields) -> None:
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in fields.items()}, refresh=False)
            self.bar.update(steps)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        elif self.is_main:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")
