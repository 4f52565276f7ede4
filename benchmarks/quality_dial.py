"""The speed/quality dial: QA retention against speed-up over the target's own prefill, one run, with its control.

For every context, side by side:

- `native`: the target reads the context itself (the re-read, 1x, 100% by definition);
- `recompute=r` for each `--budgets` r: `translate_context(..., recompute=r)` from the source's cache, which is
  read once per context and given (the shared-document case translation is for);
- `bottom r` for each `--bottom` r: `translate_context(..., recompute=r, strategy="bottom")`, the same budget
  spent on the target reading its bottom layers itself, the translation above them;
- `deviation r` for each `--deviation` r: `translate_context(..., recompute=r, strategy="deviation")`, the same
  budget spent on the tokens whose translation deviates most, recomputed at their places;
- `control r`: the target reads only the `floor(r * tokens)` tokens the dial would have it recompute, and no
  translation; at r = 0 that is no context at all. A dial setting is worth its translation only above this line;
- `no_context`: the floor.

Retention is a condition's mean score over the native mean score, with a 95% bootstrap interval from
resampling contexts (paired: the same resample for both means); `paired` in the JSON (and printed for all contexts)
holds differences over the same contexts: each setting minus its control and minus pure translation, each other
strategy minus the tail at the same budget, and pure translation minus each `--compare` translator. Speed-up is
the native prefill's time over the condition's time to give the target its context (median over contexts,
bootstrap interval), with the source cache given, and also counting the source's own prefill. Times include
tokenizing and aligning; answers are greedy and not timed.

Beside retention, `answer found` is the share of questions whose reply contains a gold answer as whole words
(`hf_mot.evaluation.metrics.answer_found`), native's in brackets: token F1 also counts phrasing ("He works as a
ferry captain." scores 0.57 against "Ferry captain."), so the two together tell a missed fact from one found and
put otherwise.

`--compare NAME=PATH` adds other translators at pure translation (r = 0), side by side on the same contexts (the
source cache and the native answers are shared); one whose dedicated maps read the target's residual stream
(`hf-mot fit-layers --bottom-layers`) is measured instead at each `--bottom` r that pays for the layers it reads
(its recommended `recompute` or more), as `NAME bottom r`.

Tasks: `synthetic` (extractive QA over made-up people, one question per document), `needle` (a made-up fact at
10/50/90% depth of a Wikipedia article cut to each `--needle-lengths`), `quac` (first questions of QuAC
dialogues) and `reuse` (multi-agent reuse: a document read once, 8 questions answered from copies of its cache;
the speed-up counts the one build). None of these texts is in the training corpus.

Usage:
    python benchmarks/quality_dial.py --examples 60 --needles 20 --reuse-documents 4
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_mot import MoTTranslator, load_model, translate_context
from hf_mot.alignment import encode_contexts
from hf_mot.evaluation.qa import answer, native_cache
from hf_mot.evaluation.report import machine_info
from hf_mot.evaluation.tasks import (
    QAExample,
    long_context_examples,
    quac_examples,
    synthetic_document,
    synthetic_qa_examples,
)
from hf_mot.files import write_json_atomically
from hf_mot.pipeline import prefill_source, read_into_cache
from hf_mot.plotting import pyplot


def _items(args, target_tok) -> list[tuple[str, str, list[QAExample]]]:
    """`(task, context, questions)`: one question per context, except in `reuse`."""
    items = [("synthetic", e.context, [e]) for e in synthetic_qa_examples(args.examples, args.seed + 1)]
    per_cell = -(-args.needles // 3)  # three depths per length
    for e in long_context_examples(target_tok, tuple(args.needle_lengths), per_cell=per_cell, seed=args.seed + 2):
        items.append((f"needle {e.meta['length']}", e.context, [e]))
    rng = random.Random(args.seed + 4)
    for _ in range(args.reuse_documents):
        document, qa = synthetic_document(rng)
        questions = [QAExample("reuse", document, q, answers=[a]) for q, a in rng.sample(qa, min(8, len(qa)))]
        items.append(("reuse", document, questions))
    items += [("quac", e.context, [e]) for e in quac_examples(args.quac, args.seed + 3)]
    return items


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _answers(questions, target, target_tok, cache, mask) -> dict:
    """Each question's score and whether its reply contains an answer (`found`, beside F1's exactness)."""
    # Each question gets its own copy: generation extends the cache it is given.
    answers = [answer(q, target, target_tok, copy.deepcopy(cache) if len(questions) > 1 else cache, mask)
               for q in questions]
    return {"scores": [a["score"] for a in answers], "found": [a["found"] for a in answers]}


@torch.no_grad()
def measure(item, budgets, translator, source, source_tok, target, target_tok, compare=None, others=()) -> dict:
    """One context under every setting; `others` holds `(strategy, r)` pairs measured beside the tail."""
    task, context, questions = item
    row = {"task": task, "questions": [q.question for q in questions]}
    target_enc = encode_contexts(target_tok, [context])
    tokens = target_enc.input_ids.shape[1]
    row["context_tokens"] = tokens
    (cache, mask), row["native_seconds"] = _timed(lambda: native_cache(target, target_tok, context))
    native = _answers(questions, target, target_tok, cache, mask)
    row["native"], row["native_found"] = native["scores"], native["found"]
    row["no_context"] = [answer(q, target, target_tok)["score"] for q in questions]
    source_enc = encode_contexts(source_tok, [context])
    source_cache, row["source_seconds"] = _timed(lambda: prefill_source(source, source_enc))

    def translated(translator, r, strategy="tail"):
        cache, seconds = _timed(lambda: translate_context(
            context, translator=translator, source_model=source, source_tokenizer=source_tok, target_model=target,
            target_tokenizer=target_tok, source_cache=source_cache, recompute=r, strategy=strategy))
        return {**_answers(questions, target, target_tok, cache, cache.attention_mask), "seconds": seconds,
                "native_tokens": cache.native_tokens}

    for name, (other, r, strategy) in (compare or {}).items():
        row[name] = translated(other, r, strategy)
    for strategy, r in others:
        row[f"{strategy} {r:g}"] = translated(translator, r, strategy)
    for r in budgets:
        row[f"recompute={r:g}"] = translated(translator, r)
        tail = int(r * tokens)
        if tail:
            # The control reads what the dial recomputes, after the BOS the target always starts from.
            def read_tail(tail=tail):
                ids = target_enc.input_ids[:, -tail:]
                if target_tok.bos_token_id is not None and tail < tokens:
                    ids = torch.cat([torch.tensor([[target_tok.bos_token_id]]), ids], dim=1)
                control = DynamicCache(config=target.config)
                read_into_cache(target, control, ids, torch.ones_like(ids))
                return control, torch.ones_like(ids)

            (control, control_mask), seconds = _timed(read_tail)
            row[f"control {r:g}"] = {**_answers(questions, target, target_tok, control, control_mask),
                                     "seconds": seconds}
    return row


def _bootstrap(values_fn, n: int, resamples: int, seed: int) -> tuple[float, float]:
    rng = random.Random(seed)
    stats = sorted(values_fn([rng.randrange(n) for _ in range(n)]) for _ in range(resamples))
    return stats[int(0.025 * resamples)], stats[int(0.975 * resamples) - 1]


def _context_scores(rows: list[dict], name: str) -> list[float]:
    """Each context's mean score under condition `name` (timed conditions keep theirs under "scores")."""
    return [statistics.fmean(r[name]["scores"] if isinstance(r[name], dict) else r[name]) for r in rows]


def summarize(rows: list[dict], budgets: list[float], resamples: int = 2000, compare: tuple[str, ...] = (),
              others: tuple[tuple[str, float], ...] = ()) -> dict:
    """Per task (and all tasks pooled): per condition mean score, retention and speed-ups, with intervals."""
    tasks = sorted({r["task"] for r in rows}) + ["all"]
    out = {}
    for task in tasks:
        chosen = [r for r in rows if task in ("all", r["task"])]
        native = [statistics.fmean(r["native"]) for r in chosen]

        def condition(name, chosen=chosen, native=native):
            scores = _context_scores(chosen, name)

            def retention(idx):
                base = sum(native[i] for i in idx)
                return sum(scores[i] for i in idx) / base if base else float("nan")

            entry = {"score": statistics.fmean(scores), "retention": retention(range(len(chosen))),
                     "retention_interval": _bootstrap(retention, len(chosen), resamples, 0)}
            if isinstance(chosen[0][name], dict):
                entry["found"] = statistics.fmean(statistics.fmean(r[name]["found"]) for r in chosen)
                for label, extra in (("speedup", "zero"), ("speedup_with_source", "source")):
                    ratios = [r["native_seconds"] / (r[name]["seconds"] + (r["source_seconds"] if extra == "source"
                                                                            else 0.0)) for r in chosen]
                    entry[label] = statistics.median(ratios)
                    entry[f"{label}_interval"] = _bootstrap(
                        lambda idx, ratios=ratios: statistics.median(ratios[i] for i in idx), len(ratios),
                        resamples, 1)
            return entry

        names = ["no_context", *compare] + [f"recompute={r:g}" for r in budgets] + [f"{k} {r:g}" for k, r in others]
        names += [f"control {r:g}" for r in budgets if all(f"control {r:g}" in row for row in chosen)]
        out[task] = {"contexts": len(chosen), "questions": sum(len(r["native"]) for r in chosen),
                     "context_tokens": statistics.median(r["context_tokens"] for r in chosen),
                     "native_score": statistics.fmean(native),
                     "native_found": statistics.fmean(statistics.fmean(r["native_found"]) for r in chosen),
                     "native_seconds": statistics.median(r["native_seconds"] for r in chosen),
                     **{name: condition(name) for name in names}}
    return out


def paired(rows: list[dict], budgets: list[float], compare: tuple[str, ...] = (), resamples: int = 2000,
           others: tuple[tuple[str, float], ...] = ()) -> dict:
    """Differences over the same contexts, per task and all pooled, as points of native score: each dial setting
    minus its control, each setting above 0 minus pure translation, each other strategy minus the tail at its
    budget, pure translation minus each compared translator; with a paired 95% bootstrap interval and how many
    contexts score higher and lower."""
    pairs = [(f"control {r:g}", f"recompute={r:g}") for r in budgets]
    pairs += [(f"recompute={r:g}", f"{k} {r:g}") for k, r in others if r in budgets]
    pairs += [("recompute=0", f"recompute={r:g}") for r in budgets if r > 0 and 0 in budgets]
    pairs += [(name, "recompute=0") for name in compare if 0 in budgets]
    out = {}
    for task in sorted({r["task"] for r in rows}) + ["all"]:
        chosen = [r for r in rows if task in ("all", r["task"])]
        native = [statistics.fmean(r["native"]) for r in chosen]
        out[task] = {}
        for a, b in pairs:
            if not all(a in r and b in r for r in chosen):
                continue
            score_a, score_b = _context_scores(chosen, a), _context_scores(chosen, b)

            def difference(idx, score_a=score_a, score_b=score_b, native=native):
                base = sum(native[i] for i in idx)
                return sum(score_b[i] - score_a[i] for i in idx) / base if base else float("nan")

            out[task][f"{b} - {a}"] = {
                "difference": difference(range(len(chosen))),
                "interval": _bootstrap(difference, len(chosen), resamples, 2),
                "higher": sum(y > x for x, y in zip(score_a, score_b, strict=True)),
                "lower": sum(y < x for x, y in zip(score_a, score_b, strict=True))}
    return out


def table(summary: dict, budgets: list[float], compare: tuple[str, ...] = (),
          others: tuple[tuple[str, float], ...] = ()) -> str:
    lines = ["| task | contexts | tokens | native score | setting | score | retention [95% CI] | answer found "
             "(native) | speed-up [95% CI] | with source prefill |", "|---|---|---|---|---|---|---|---|---|---|"]
    for task, s in summary.items():
        head = f"| {task} | {s['contexts']} | {s['context_tokens']:.0f} | {s['native_score']:.3f} "
        native_found = f"({100 * s['native_found']:.0f}%)"
        settings = [f"{kind}{r:g}" for r in budgets for kind in ("recompute=", "control ")]
        settings += [f"{k} {r:g}" for k, r in others]
        for name in ["no_context", *compare, *settings]:
            if name not in s:
                continue
            e = s[name]
            low, high = e["retention_interval"]
            speed = (f"{e['speedup']:.1f}x [{e['speedup_interval'][0]:.1f}, {e['speedup_interval'][1]:.1f}] | "
                     f"{e['speedup_with_source']:.1f}x" if "speedup" in e else "- | -")
            found = f"{100 * e['found']:.0f}% {native_found}" if "found" in e else "-"
            lines.append(f"{head}| {name} | {e['score']:.3f} | {100 * e['retention']:.0f}% [{100 * low:.0f}, "
                         f"{100 * high:.0f}] | {found} | {speed} |")
    return "\n".join(lines)


# A bootstrap interval of a ratio over few contexts need not contain the ratio itself: no bar below zero then.
def _below(entry: dict) -> float:
    return max(0.0, 100 * (entry["retention"] - entry["retention_interval"][0]))


def _above(entry: dict) -> float:
    return max(0.0, 100 * (entry["retention_interval"][1] - entry["retention"]))


def plot(summary: dict, budgets: list[float], path: Path, compare: tuple[str, ...] = (),
         others: tuple[tuple[str, float], ...] = (), recommended: float | None = None) -> Path | None:
    """One panel per task; `recommended`, the translator's recommended `recompute`, is ringed where measured."""
    plt = pyplot()
    if plt is None:
        return None
    from matplotlib.ticker import LogLocator, ScalarFormatter

    tasks = list(summary)
    columns = min(4, len(tasks))
    rows = -(-len(tasks) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.8 * columns, 3.6 * rows), sharey=True, squeeze=False)
    for ax in axes.flat[len(tasks):]:
        ax.set_visible(False)
    for ax, task in zip(axes.flat, tasks, strict=False):
        s = summary[task]
        labels = {"recompute=": "translate + recompute the tail", "control ": "control: recompute only",
                  "bottom ": "translate + read the bottom layers",
                  "deviation ": "translate + recompute the most deviating tokens"}
        for kind, style, values in (("recompute=", "o-", budgets), ("control ", "s--", budgets),
                                    ("bottom ", "^-", [r for k, r in others if k == "bottom"]),
                                    ("deviation ", "v-", [r for k, r in others if k == "deviation"])):
            points = [(s[f"{kind}{r:g}"], r) for r in values if f"{kind}{r:g}" in s]
            if kind == "control " and "no_context" in s:
                points = [(s["no_context"] | {"speedup": float("nan")}, 0.0)] + points
            points = [(e, r) for e, r in points if e.get("speedup") == e.get("speedup")]
            if not points:
                continue
            xs = [e["speedup"] for e, _ in points]
            ys = [100 * e["retention"] for e, _ in points]
            errors = [[_below(e) for e, _ in points], [_above(e) for e, _ in points]]
            ax.errorbar(xs, ys, yerr=errors, fmt=style, capsize=2, label=labels[kind])
            for x, y, (_, r) in zip(xs, ys, points, strict=True):
                ax.annotate(f"{r:g}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
        for name in compare:
            e = s[name]
            ax.errorbar([e["speedup"]], [100 * e["retention"]], fmt="D", capsize=2, label=name,
                        yerr=[[_below(e)], [_above(e)]])
        point = s.get(f"recompute={recommended:g}") if recommended is not None else None
        if point is not None and point.get("speedup") == point.get("speedup"):
            ax.plot([point["speedup"]], [100 * point["retention"]], "o", markersize=14, markerfacecolor="none",
                    markeredgecolor="black", label=f"recommended (recompute={recommended:g})")
        ax.plot([1.0], [100.0], "k*", markersize=10, label="native (re-read)")
        ax.axhline(100 * s["no_context"]["retention"], color="grey", linewidth=0.8, linestyle=":", label="no context")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        # Labels at 2, 3 and 5 only: every minor tick labelled runs together between 5 and 10.
        ax.xaxis.set_minor_locator(LogLocator(subs=(2, 3, 5)))
        ax.xaxis.set_minor_formatter(ScalarFormatter())
        ax.tick_params(axis="x", which="minor", labelsize=7)
        ax.set(title=f"{task} ({s['contexts']} contexts)", xlabel="speed-up over the target's prefill")
    for row in axes:
        row[0].set_ylabel("QA retention of native (%)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="smollm2-135m")
    parser.add_argument("--target", default="gemma3-270m")
    parser.add_argument("--translator", default="hf-mot/smollm2-135m-to-gemma3-270m")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0, 0.05, 0.1, 0.2, 0.3, 0.5],
                        help="dial settings r in [0, 1)")
    parser.add_argument("--examples", type=int, default=60, help="synthetic contexts")
    parser.add_argument("--quac", type=int, default=60, help="QuAC contexts")
    parser.add_argument("--needles", type=int, default=21, help="needle contexts per length (a multiple of 3)")
    parser.add_argument("--needle-lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--reuse-documents", type=int, default=4, help="documents of 8 questions each")
    parser.add_argument("--compare", action="append", default=[], metavar="NAME=PATH",
                        help="another translator, measured at r = 0 beside the dial, or at each --bottom R at or "
                             "above its recommended recompute if its dedicated maps read the target's residual "
                             "stream (repeatable)")
    parser.add_argument("--bottom", type=float, nargs="*", default=[],
                        help="budgets r in (0, 1) also spent on the target reading its bottom layers "
                             "(strategy='bottom'), beside the tail (default: none)")
    parser.add_argument("--deviation", type=float, nargs="*", default=[],
                        help="budgets r in (0, 1) also spent on recomputing the tokens whose translation deviates "
                             "most (strategy='deviation'), beside the tail (default: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/quality_dial.json"))
    args = parser.parse_args()
    if any("=" not in spec for spec in args.compare):
        parser.error("--compare takes NAME=PATH, e.g. --compare fitted=runs/fitted.")
    if any(not 0 <= r < 1 for r in args.budgets):
        parser.error(f"--budgets must lie in [0, 1): 1 is the native point, always measured; got {args.budgets}.")
    if any(not 0 < r < 1 for r in args.bottom):
        parser.error(f"--bottom must lie in (0, 1): r = 0 reads no layer; got {args.bottom}.")
    if any(not 0 < r < 1 for r in args.deviation):
        parser.error(f"--deviation must lie in (0, 1): r = 0 recomputes nothing; got {args.deviation}.")
    bottom = tuple(args.bottom)
    others = tuple(("bottom", r) for r in bottom) + tuple(("deviation", r) for r in args.deviation)

    source, source_tok = load_model(args.source)
    target, target_tok = load_model(args.target)
    translator = MoTTranslator.from_pretrained(args.translator).eval()
    if translator.config.dedicated_bottom_layers is not None:
        parser.error(f"{args.translator} reads the target's residual stream (strategy 'bottom' only): measure it "
                     "with --compare NAME=PATH beside --bottom R, and a plain translator as --translator.")
    compare = {}  # row name -> (translator, r, strategy)
    for name, path in (spec.split("=", 1) for spec in args.compare):
        other = MoTTranslator.from_pretrained(path).eval()
        if other.config.dedicated_bottom_layers is None:
            compare[name] = (other, 0.0, "tail")
        else:
            # Below its recommended recompute the budget does not pay for the layers its maps read from.
            paid = [r for r in bottom if r >= other.config.recompute]
            if not paid:
                parser.error(f"{path} reads the target's residual stream entering layer "
                             f"{other.config.dedicated_bottom_layers}, which costs recompute={other.config.recompute}"
                             f": it is measured at each --bottom R at least that, and none was given.")
            compare.update({f"{name} bottom {r:g}": (other, r, "bottom") for r in paid})
    names = tuple(compare)
    items = _items(args, target_tok)
    # Once untimed first: the first calls pay one-off costs (kernel selection, allocations, the first-token cache).
    measure(items[0], args.budgets, translator, source, source_tok, target, target_tok, compare, others)
    rows = []

    def report(complete: bool) -> dict:
        summary = summarize(rows, args.budgets, compare=names, others=others)
        return {
            "command": "python " + " ".join(sys.argv), "machine": machine_info(), "complete": complete,
            "models": {"source": args.source, "target": args.target, "translator": args.translator,
                       "compare": dict(spec.split("=", 1) for spec in args.compare)},
            "budgets": args.budgets, "bottom": list(bottom), "deviation": args.deviation, "summary": summary,
            "table": table(summary, args.budgets, names, others),
            "paired": paired(rows, args.budgets, names, others=others), "rows": rows,
        }

    for item in tqdm(items, desc="contexts"):
        rows.append(measure(item, args.budgets, translator, source, source_tok, target, target_tok, compare, others))
        if len(rows) % 10 == 0:  # a long run that is stopped keeps what it measured, marked incomplete
            write_json_atomically(args.output, report(complete=False))
    final = report(complete=True)
    print(final["table"])
    for name, d in final["paired"]["all"].items():
        low, high = (100 * end for end in d["interval"])
        print(f"paired, all contexts: {name}: {100 * d['difference']:+.1f} points of native [{low:+.1f}, {high:+.1f}] "
              f"({d['higher']} contexts higher, {d['lower']} lower)")
    write_json_atomically(args.output, final)
    summary = final["summary"]
    figure = plot(summary, args.budgets, args.output.with_suffix(".png"), names, others, translator.config.recompute)
    print(f"wrote {args.output}" + (f" and {figure}" if figure else ""))


if __name__ == "__main__":
    main()
