"""Regenerate docs/RESULTS.md from the benchmark outputs in `benchmarks/results/`.

    python scripts/update_results.py          # rewrite the section from the existing results
    python scripts/update_results.py --run    # run the benchmarks first (about 50 minutes on 2 CPU cores)

The generated part sits between the `<!-- results:start -->` and `<!-- results:end -->` markers of
docs/RESULTS.md; the README keeps a short summary that links there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SHIPPED = "hf-mot/smollm2-135m-to-gemma3-270m"
RUNS = [
    [sys.executable, "benchmarks/lm_fidelity.py", "--translator", f"shipped={SHIPPED}", "--native-tail", "16",
     "--lengths", "64", "128", "256", "512", "--per-length", "50"],
    [sys.executable, "benchmarks/translation_cost.py", "--lengths", "512", "1024", "2048", "4096", "--trials", "5"],
    [sys.executable, "-m", "hf_mot.cli", "evaluate", "--translator", SHIPPED, "--limit", "12", "--lengths", "512",
     "1024", "2048", "4096", "--native-tail", "16", "--output-dir", "benchmarks/results/evaluation"],
    [sys.executable, "benchmarks/layer_attribution.py", "--translator", SHIPPED],
]
START, END = "<!-- results:start -->", "<!-- results:end -->"
# Which translator the benchmarks that `--run` redoes last measured, when it is not the shipped one; "" once they
# have been run again.
BEFORE = "lcq, `hf_mot/pretrained/smollm2-135m-to-gemma3-270m` at commit 082ec94"


def load_result(name: str) -> dict | None:
    """A benchmark's JSON in `benchmarks/results/`, or `None` if that benchmark has not been run."""
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def ablations() -> list[str]:
    """The equal-budget ablation table: it needs the ablation training runs, so `--run` does not redo it."""
    report = load_result("ablations.json")
    if report is None:
        return []
    return [
        "### Ablations and baselines (LM fidelity on held-out text)",
        "",
        report["description"],
        "",
        f"`{report['command']}`; {report['data']}. Window mode injects translated layers "
        f"{report['window'][0]}-{sum(report['window']) - 1}; the last column is the KL right after the context, "
        "where last-state shift shows.",
        "",
        report["table"],
        "",
        "![ablations](benchmarks/results/ablations.png)",
        "",
    ]


def fidelity() -> list[str]:
    report = load_result("lm_fidelity.json")
    if report is None:
        return []
    return [
        "### Language-modelling fidelity on held-out text",
        "",
        *([report["description"], ""] if "description" in report else []),
        f"`{report['command']}`; {report['data']}."
        + (f" Window mode injects translated layers {report['window'][0]}-{sum(report['window']) - 1} into the "
           "target's own pass." if "| window |" in report["table"] else "")
        + " The last column is the KL right after the context, where last-state shift shows.",
        "",
        report["table"],
        "",
        "![LM fidelity](benchmarks/results/lm_fidelity.png)",
        "",
        *wikipedia_fidelity(),
    ]


def wikipedia_fidelity() -> list[str]:
    """LM fidelity on a domain no training document comes from (`lm_fidelity.py --domain wikipedia`)."""
    report = load_result("lm_fidelity_wikipedia.json")
    if report is None:
        return []
    return [f"{report['description']} `{report['command']}`; {report['data']}.", "",
            report["table"], ""]


def cost() -> list[str]:
    report = load_result("translation_cost.json")
    if report is None:
        return []
    machine, trials = report["machine"], len(report["rows"][0]["translate"]["times_s"])
    return [
        "### Cost of translation against re-prefill",
        "",
        f"`{report['command']}` on {machine['cpu']} ({', '.join(machine.get('cpu_features', []))}, "
        f"{machine['threads']} threads, {report['dtype']}): medians of {trials} calls; the source cache already "
        "exists; +MB is the peak resident memory the step added (measured in a separate run); the last column "
        "counts top-level PyTorch operators, each a kernel launch or more on a GPU.",
        "",
        report["table"],
        "",
        "![cost](benchmarks/results/translation_cost.png)",
        *gpu_cost(),
    ]


def gpu_cost() -> list[str]:
    """One line on the GPU measurement, which cannot be rerun here (see benchmarks/results/h200/README.md)."""
    report = load_result("h200/translation_cost_h200_bfloat16.json")
    if report is None:
        return []
    longest = report["rows"][-1]
    translate = longest.get("translate", longest.get("translate_full"))
    full, prefill = translate["median_s"], longest["native_target_prefill"]["median_s"]
    return [
        "",
        f"On one {report['machine']['gpu']} (bfloat16, the same architectures with random weights; "
        f"`{report['command']}`) at {longest['target_tokens']:,} tokens full mode took {1000 * full:.0f} ms against "
        f"{1000 * prefill:.0f} ms for the target's prefill (torch {report['machine']['torch']}, "
        f"{'before' if 'translate_full' in longest else 'after'} the hot path was rewritten as a few operations for "
        "all layers at once); see [the H200 notes](benchmarks/results/h200/README.md).",
        "",
    ]


def vllm_ttft() -> list[str]:
    """Serving in vLLM: it runs in vLLM's own environment (scripts/setup_vllm.sh), so `--run` does not redo it."""
    report = load_result("vllm_ttft.json")
    if report is None:
        return []
    machine = report["machine"]
    return [
        "### Time to first token in vLLM, with the translated cache loaded by `MoTConnector`",
        "",
        f"`{report['command']}` on {machine['cpu']} ({', '.join(machine.get('cpu_features', []))}), vLLM "
        f"{report['vllm']} (CPU build), float32: medians of {report['trials']} calls with the prefix cache emptied "
        "before each, 95% bootstrap intervals; the context is followed by a 12-token question. `write entry` is "
        "hf_mot's side (alignment, translation, safetensors write, with the source's cache given; the sliding-"
        "window layers keep what the largest recompute served attends to); the first speed-up is against vLLM "
        "prefilling the prompt, the second counts writing the entry too. vLLM reported exactly the loaded "
        "tokens as not computed in every call (the benchmark stops otherwise).",
        "",
        report["table"],
        "",
        "![vLLM time to first token](benchmarks/results/vllm_ttft.png)",
        "",
    ]


def failure_modes() -> list[str]:
    """The failure-mode table: it compares ablation training runs, so `--run` does not redo it either."""
    report = load_result("failure_modes.json")
    if report is None:
        return []
    return [
        "### The two failure modes, with and without the Context Correction Loss",
        "",
        f"`{report['command']}`; {report['data']}. `window` rows inject the translated layers named and let "
        "the target compute every layer above them (propagated translation shift: the KV error at the window "
        "against the error it grows to at the top layer); the last column is the KL right after the context "
        "in `full` mode (last-state shift).",
        "",
        report["table"],
        "",
        "![failure modes](benchmarks/results/failure_modes.png)",
        "",
    ]


def layer_attribution() -> list[str]:
    report = load_result("layer_attribution.json")
    if report is None:
        return []
    groups = {name: r for name, r in report["results"].items() if not name.startswith("layer ")}
    return [
        "### Where the translation error sits",
        "",
        f"`{report['command']}`; `{report['translator']}`, {report['data']}. Each row puts some target layers "
        "of the full-mode cache back to the target's own keys and values and scores the continuation again: "
        "what that recovers is what the translation of those layers costs.",
        "",
        "| put back to native | top-1 agreement | KL | KL removed |",
        "|---|---|---|---|",
        *(f"| {name} | {100 * r['top1_agreement']:.1f}% | {r['kl']:.3f} | "
          f"{100 * (1 - r['kl'] / groups['translated']['kl']):.0f}% |" for name, r in groups.items()),
        "",
        "One layer at a time (red: the full-attention layers):",
        "",
        "![layer attribution](benchmarks/results/layer_attribution.png)",
        "",
    ]


def quality_dial() -> list[str]:
    """The speed/quality dial: retention against speed-up at each recompute budget, beside its control. Long (over
    an hour here), so `--run` does not redo it."""
    report = load_result("quality_dial.json")
    if report is None:
        return []
    machine = report["machine"]
    return [
        "### The speed/quality dial (`recompute=r`): QA retention against speed-up",
        "",
        f"`{report['command']}`; translator `{report['models']['translator']}`; {machine['cpu']} "
        f"({', '.join(machine['cpu_features'])}), {machine['threads']} threads, torch {machine['torch']}, "
        f"transformers {machine['transformers']}. Retention is the mean score over the target's own reading of the "
        "context (95% bootstrap interval over contexts); speed-up is the target's prefill time over the time to "
        "give it the context that way, with the source cache given (median, interval), and in the last column "
        "counting the source's prefill too. `control r` reads only the tokens `recompute=r` reads natively, with "
        "no translation." + ("" if report.get("complete", True) else " The run was stopped early: the table "
                            "holds the contexts measured by then.")
        + (f" {report['note']}" if "note" in report else ""),
        "",
        report["table"],
        "",
        "![quality dial](benchmarks/results/quality_dial.png)",
        "",
    ]


def dial_strategies() -> list[str]:
    """The ways to spend one budget side by side (the tail, the most deviating tokens), with the paired
    differences at equal budget."""
    report = load_result("quality_dial_strategies.json")
    if report is None:
        return []
    machine = report["machine"]
    differences = [
        f"- {name}: {100 * d['difference']:+.1f} points of native [{100 * d['interval'][0]:+.1f}, "
        f"{100 * d['interval'][1]:+.1f}] ({d['higher']} contexts higher, {d['lower']} lower)"
        for name, d in report["paired"]["all"].items() if not name.endswith(tuple(f"control {r:g}" for r in
                                                                                report["budgets"]))
    ]
    return [
        "### Ways to spend the budget, at equal `recompute`",
        "",
        f"`{report['command']}`; translator `{report['models']['translator']}`; {machine['cpu']} "
        f"({', '.join(machine['cpu_features'])}), {machine['threads']} threads. Retention and speed-up as in the "
        "dial above; `deviation r` is `translate_context(..., recompute=r, strategy=\"deviation\")`."
        + (f" {report['note']}" if "note" in report else ""),
        "",
        "Paired over the same contexts (all tasks):",
        "",
        *differences,
        "",
        report["table"],
        "",
        "![strategies](benchmarks/results/quality_dial_strategies.png)",
        "",
    ]


def dedicated_layers() -> list[str]:
    """The translator with fitted full-attention layers against the one it started from, side by side at r = 0
    (and, from a second run, on 4,096-token needles)."""
    report = load_result("dedicated_layers.json")
    if report is None:
        return []
    machine = report["machine"]
    compared = ", ".join(f"`{name}` = `{path}`" for name, path in report["models"]["compare"].items())
    longer = load_result("dedicated_layers_4096.json")
    extra = [] if longer is None else [
        f"On needles in 4,096-token passages (`{longer['command']}`; {longer.get('note', '')}):", "",
        longer["table"], "",
    ]
    return [
        "### Dedicated full-attention layers: QA retention, side by side",
        "",
        f"`{report['command']}`; `recompute=0` is `{report['models']['translator']}`, compared with {compared}; "
        f"{machine['cpu']} ({', '.join(machine['cpu_features'])}), {machine['threads']} threads. Retention and "
        "speed-up as in the dial below, pure translation for both translators, on the same contexts."
        + (f" {report['note']}" if "note" in report else ""),
        "",
        report["table"],
        "",
        "![dedicated layers](benchmarks/results/dedicated_layers.png)",
        "",
        *extra,
    ]


def evaluation_caveat() -> list[str]:
    """A line saying so when the QA tables were measured on another translator than the shipped one."""
    measured = json.loads((RESULTS / "evaluation" / "evaluation.json").read_text())["translator"]
    if measured == SHIPPED:
        return []
    return [f"These tables were measured on `{measured}`, not on the translator shipped now; "
            "`python scripts/update_results.py --run` measures the shipped one.", ""]


def section(before: str = BEFORE) -> str:
    """The generated part; `before` names the translator the benchmarks `--run` redoes last measured, if not the
    shipped one."""
    evaluation = (RESULTS / "evaluation" / "evaluation.md").read_text()
    return "\n".join([
        "Regenerate with `python scripts/update_results.py --run` (about 50 minutes on this machine).",
        "",
        *dedicated_layers(),
        *quality_dial(),
        *dial_strategies(),
        *fidelity(),
        *cost(),
        *vllm_ttft(),
        # Until `--run` measures them again, the tables below describe the translator shipped before this one.
        *([f"The sections below were measured with the translator shipped before the dedicated layers ({before}); "
           "`python scripts/update_results.py --run` measures the shipped one.", ""] if before else []),
        *ablations(),
        *failure_modes(),
        *layer_attribution(),
        "### QA, long context and multi-agent reuse",
        "",
        *evaluation_caveat(),
        evaluation.strip(),
        "",
        "![long context](benchmarks/results/evaluation/evaluation.png)",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="store_true", help="run the benchmarks before rewriting the section")
    args = parser.parse_args()
    if args.run:
        for command in RUNS:
            print("+", " ".join(command), flush=True)
            subprocess.run(command, cwd=ROOT, check=True)
    page = ROOT / "docs" / "RESULTS.md"
    text = page.read_text()
    if START not in text or END not in text:
        raise ValueError(f"{page} lacks the {START} / {END} markers around its generated part.")
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    # The page sits one folder down from the repository root that the figures' paths start at.
    generated = section("" if args.run else BEFORE)
    generated = generated.replace("](benchmarks/", "](../benchmarks/").replace("\n### ", "\n## ")
    with tempfile.NamedTemporaryFile("w", dir=page.parent, delete=False, suffix=".tmp") as f:
        f.write(f"{head}{START}\n{generated}\n{END}{tail}")
    os.replace(f.name, page)
    print(f"{page.relative_to(ROOT)} rewritten")


if __name__ == "__main__":
    main()
