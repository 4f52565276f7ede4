"""Cost measurement shared by the evaluation harness and the benchmarks."""

from __future__ import annotations

import gc
import os
import threading
import time


class PeakRSS:
    """Peak resident set size above the starting point, sampled by a thread while the block runs."""

    def __init__(self, interval: float = 0.001):
        self.interval = interval
        self.page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self):
        gc.collect()
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
