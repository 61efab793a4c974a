"""Reading a `datasets.Dataset` a chunk of rows at a time in memory that does not grow with it.

Every pass over a corpus (the checks of its cells, tokenization, packing) goes through
`ArrowChunks`: a column read whole is a copy of the corpus (a dataset with an indices mapping,
such as the training split once the validation documents are held out, is gathered into new
memory), and even a zero-copy read leaves every page of the memory-mapped arrow file it touched
counted in the process's resident set. A chunk is `rows` rows as a pyarrow table, and the pages
one read pulled in are paged out before the next.
"""

from __future__ import annotations

import os

CHUNK_ROWS = 1000  # rows per read (and documents per tokenizer call): bounds memory whatever the corpus size


class ReadPages:
    """Keeps the pages of memory-mapped dataset files that were read out of this process's
    resident set: `datasets` reads its arrow files through a memory map, and every page of the
    corpus read once would otherwise stay counted in RSS (reclaimable, but RSS would grow with the
    corpus). `release()` asks Linux to page them out (MADV_PAGEOUT, a hint: nothing changes for
    the program; elsewhere, or on kernels before 5.4, it does nothing)."""

    MADV_PAGEOUT = 21

    def __init__(self, paths: list[str]):
        self.ranges, self.madvise = [], None
        wanted = {os.path.realpath(p) for p in paths}
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    fields = line.split(None, 5)
                    if len(fields) == 6 and fields[5].strip() in wanted:
                        start, end = (int(x, 16) for x in fields[0].split("-"))
                        self.ranges.append((start, end - start))
            import ctypes

            self.madvise = ctypes.CDLL(None, use_errno=True).madvise
            self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            self.ranges = []

    def release(self) -> None:
        for start, length in self.ranges:
            if self.madvise(start, length, self.MADV_PAGEOUT) != 0:
                self.ranges = []  # not supported here: stop asking
                return


class ArrowChunks:
    """`ds` (only `columns`, if given) as pyarrow tables of `rows` rows: `chunks[i]` is rows
    i*rows to (i+1)*rows, iteration yields them in order. Each read first pages out what the
    previous one read from the dataset's files (a zero-copy table is only touched after it is
    returned), and iteration does so after the last."""

    def __init__(self, ds, columns: list[str] | None = None, rows: int = CHUNK_ROWS):
        self.table = (ds.select_columns(columns) if columns is not None else ds).with_format("arrow")
        self.rows, self.num_rows = rows, len(ds)
        self.pages = ReadPages([f["filename"] for f in ds.cache_files])

    def __len__(self) -> int:
        return -(-self.num_rows // self.rows)

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(f"chunk {i} of {len(self)}")
        self.pages.release()
        return self.table[i * self.rows:(i + 1) * self.rows]

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]
        self.pages.release()
