"""Cost measurement shared by the evaluation harness and the benchmarks."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import threading
import time


def release_free_memory() -> None:
    """Hand memory the allocator holds but no longer uses back to the OS (glibc `malloc_trim`; no-op elsewhere).

    Without it, a block that reuses memory an earlier step freed adds nothing to the resident size and its
    peak reads as zero.
    """
    gc.collect()
    name = ctypes.util.find_library("c")
    if name is None:
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is not None:
        trim(0)


class PeakRSS:
    """Peak resident set size above the starting point, sampled by a thread while the block runs.

    The allocator's free memory is released first, so the figure is what the block needs on top of what was
    live before it.
    """

    def __init__(self, interval: float = 0.001):
        self.interval = interval
        self.page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self):
        release_free_memory()
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        self.added_mb = (self.peak - self.start) / 2**20
