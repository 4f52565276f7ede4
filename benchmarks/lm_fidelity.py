"""Language-modelling fidelity of translators on held-out text, side by side in one run.

For each translator and condition: continuation NLL with no context, with the native context and with
the translated cache; the share of the no-context-to-native gap that translation closes; top-1 agreement
with the native next-token predictions; KL to them. Contexts of several lengths (target tokens) are cut from
the validation documents of `hf_mot.training.data` (split by document; never trained on). With several
translators, each after the first is compared with it pair by pair: the differences in gap closed and top-1
agreement, with 95% bootstrap intervals over the pairs.

Usage:
    python benchmarks/lm_fidelity.py --translator shipped=hf-mot/smollm2-135m-to-gemma3-270m \
        --translator untrained=untrained --lengths 64 128 256 512 --per-length 60

Choose among a run's checkpoints on the selection part (documents disjoint from the test part's), then report
the chosen one on the test part:
    python benchmarks/lm_fidelity.py --part selection --no-window --translator c200=runs/x/checkpoint-200 \
        --translator c250=runs/x/checkpoint-250 --lengths 128 256 512 --per-length 12 --output runs/x-sel.json
(The validation split is small: past 12 pairs at 512 tokens the selection pairs would reach the test documents,
which the script refuses.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from hf_mot import MoTConfig, MoTTranslator, load_model
from hf_mot.evaluation.fidelity import (
    HELDOUT_DOMAINS,
    HELDOUT_PARTS,
    PAIRS_PER_ARTICLE,
    evaluate_fidelity,
    heldout_examples,
    paired_difference,
    summarize,
)
from hf_mot.evaluation.report import machine_info
from hf_mot.files import write_json_atomically

# The test pairs every reported figure (README, benchmarks/results, the model card) comes from.
REPORTED_LENGTHS, REPORTED_PER_LENGTH = (64, 128, 256, 512), 50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="smollm2-135m")
    parser.add_argument("--target", default="gemma3-270m")
    parser.add_argument(
        "--translator", action="append", required=True, metavar="NAME=PATH",
        help="translator to evaluate (repeatable); PATH 'untrained' is a random translator of the default config",
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--per-length", type=int, default=60)
    parser.add_argument("--continuation-tokens", type=int, default=32)
    parser.add_argument("--window", type=int, nargs=2, default=[0, 6], metavar=("START", "COUNT"),
                        help="target layers injected into the target's own pass (the window-injection diagnostic)")
    parser.add_argument("--no-window", action="store_true", help="leave out the window-injection diagnostic")
    parser.add_argument("--full-only", nargs="+", default=[], metavar="NAME",
                        help="translators to run in full mode only")
    parser.add_argument("--native-tail", type=int, default=0, metavar="K",
                        help="also run full mode with the last K context tokens read by the target itself "
                             "(`native_tail`), and the floor for it: the target reading those K tokens alone")
    parser.add_argument("--bottom", type=float, default=None, metavar="R",
                        help="also run recompute=R spent on the target reading its bottom layers "
                             "(strategy='bottom'); a translator whose dedicated maps read the target's residual "
                             "stream (hf-mot fit-layers --bottom-layers) runs in this mode only")
    parser.add_argument("--part", choices=HELDOUT_PARTS, default="test",
                        help="held-out documents to cut pairs from: 'test' (the reported figures) or 'selection' "
                             "(disjoint from them: for choosing a checkpoint or a setting)")
    parser.add_argument("--domain", choices=HELDOUT_DOMAINS, default="corpus",
                        help="'corpus': the validation split, same domains as training (the reported figures); "
                             "'wikipedia': long Wikipedia articles, a domain no training document comes from")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/lm_fidelity.json"))
    args = parser.parse_args()
    if args.domain != "corpus" and args.output == parser.get_default("output"):
        parser.error(f"--domain {args.domain} would replace the reported figures in {args.output}; pass --output.")
    if args.part == "selection" and args.output == parser.get_default("output"):
        parser.error("--part selection would replace the reported test-part figures in "
                     f"{args.output}; pass --output elsewhere (e.g. runs/selection.json).")

    source, source_tok = load_model(args.source)
    target, target_tok = load_model(args.target)
    examples = heldout_examples(
        target_tok, tuple(args.lengths), args.per_length, args.continuation_tokens, part=args.part,
        domain=args.domain,
    )
    if args.part == "selection" and args.domain == "corpus":
        reported = heldout_examples(target_tok, REPORTED_LENGTHS, REPORTED_PER_LENGTH, args.continuation_tokens)
        shared = {e.document for e in examples} & {e.document for e in reported}
        if shared:
            sys.exit(f"The selection pairs would read {len(shared)} of the documents the reported figures come from "
                     f"({REPORTED_PER_LENGTH} test pairs at each of {REPORTED_LENGTHS} tokens); lower --per-length "
                     "or leave out the longest --lengths.")
    # `full`: every layer translated. `window`: the window-injection diagnostic (`hf_mot.evaluation.injection`).
    modes = {"full": {"recompute": 0.0}}
    if not args.no_window:
        modes["window"] = {"window": tuple(args.window)}
    if args.native_tail:
        modes[f"full+tail{args.native_tail}"] = {"native_tail": args.native_tail}
    if args.bottom is not None:
        if not 0 < args.bottom < 1:
            parser.error(f"--bottom must lie in (0, 1), got {args.bottom}.")
        modes[f"bottom{args.bottom:g}"] = {"recompute": args.bottom, "strategy": "bottom"}

    # One pass over the examples: the native and no-context scores are shared by every translator.
    conditions, paths = {}, {}
    for spec in args.translator:
        name, _, path = spec.partition("=")
        if path == "untrained":
            torch.manual_seed(0)
            translator = MoTTranslator(MoTConfig.from_models(
                source.config, target.config, source_tokenizer=source_tok, target_tokenizer=target_tok
            ))
        else:
            translator = MoTTranslator.from_pretrained(path)
        paths[name] = path
        conditioned = translator.config.dedicated_bottom_layers is not None
        if conditioned and args.bottom is None:
            parser.error(f"{path} reads the target's residual stream: it runs only with --bottom R.")
        for mode, options in modes.items():
            if conditioned and not mode.startswith("bottom"):
                continue
            if mode.startswith(("full", "bottom")) or name not in args.full_only:
                conditions[f"{name}/{mode}"] = {**options, "translator": translator.eval()}
    start = time.perf_counter()
    rows = evaluate_fidelity(
        examples, translator=None, source_model=source, source_tokenizer=source_tok,
        target_model=target, target_tokenizer=target_tok, conditions=conditions, tail_only=args.native_tail,
    )
    seconds = time.perf_counter() - start

    def per_translator(summary: dict, name: str) -> dict:
        shared = {k: v for k, v in summary.items() if not isinstance(v, dict)}
        return {**shared, **{c.split("/")[1]: v for c, v in summary.items() if c.startswith(f"{name}/")}}

    results = {}
    for name, path in paths.items():
        by_length = {
            length: per_translator(
                summarize([r for r in rows if r["context_tokens"] == length], list(conditions)), name
            )
            for length in args.lengths
        }
        results[name] = {"path": path, "overall": per_translator(summarize(rows, list(conditions)), name),
                         "by_length": by_length, "seconds_all_translators": seconds}

    tail_by_length, tail_overall = {}, {}
    if args.native_tail:
        tail_by_length = {
            length: summarize([r for r in rows if r["context_tokens"] == length], ["tail_only"])
            for length in args.lengths
        }
        tail_overall = summarize(rows, ["tail_only"])

    lines = [
        "| translator | mode | context tokens | examples | NLL no context | NLL native | NLL translated "
        "| gap closed | top-1 agreement | KL | KL at the first position |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        for mode in [m for m in modes if m in result["overall"]]:
            for label, summary in [*result["by_length"].items(), ("all", result["overall"])]:
                m = summary[mode]
                lines.append(
                    f"| {name} | {mode} | {label} | {summary['examples']} | {summary['nll_no_context']:.3f} "
                    f"| {summary['nll_native']:.3f} | {m['nll']:.3f} | {100 * m['gap_closed']:.1f}% "
                    f"| {100 * m['top1_agreement']:.1f}% | {m['kl']:.3f} | {m['kl_by_position'][0]:.3f} |"
                )
    if args.native_tail:
        floor = "tail_only"
        for label, summary in [*tail_by_length.items(), ("all", tail_overall)]:
            m = summary[floor]
            lines.append(
                f"| none: last {args.native_tail} tokens only | - | {label} | {summary['examples']} "
                f"| {summary['nll_no_context']:.3f} | {summary['nll_native']:.3f} | {m['nll']:.3f} "
                f"| {100 * m['gap_closed']:.1f}% | {100 * m['top1_agreement']:.1f}% | {m['kl']:.3f} "
                f"| {m['kl_by_position'][0]:.3f} |"
            )
    table = "\n".join(lines)
    print(table)
    # Each later translator against the first, on the same pairs: is the difference more than noise?
    first, *others = paths
    for name in others:
        results[name]["paired"] = {"against": first}
        for mode in modes:
            if f"{first}/{mode}" in conditions and f"{name}/{mode}" in conditions:
                d = paired_difference(rows, f"{first}/{mode}", f"{name}/{mode}")
                results[name]["paired"][mode] = d
                print(f"{name} - {first} ({mode}, paired over {d['examples']} pairs): gap closed "
                      f"{100 * d['gap_closed']:+.1f} points {_points(d['gap_closed_interval'])}, top-1 agreement "
                      f"{100 * d['top1_agreement']:+.1f} {_points(d['top1_agreement_interval'])}")

    report = {
        "benchmark": "lm_fidelity",
        "command": "python benchmarks/lm_fidelity.py " + " ".join(sys.argv[1:]),
        # Each context's first token comes from the target itself (`pipeline.first_token_states`) since hf_mot
        # 0.2; tables without this field were measured before, with it translated.
        "first_token": "target",
        "machine": machine_info(),
        "source": args.source, "target": args.target, "part": args.part, "domain": args.domain,
        "data": ("validation split of hf_mot.training.data (5% of documents by hash; never trained on)"
                 if args.domain == "corpus" else "gensim's Wikipedia articles (a domain no training document comes "
                 f"from), at most {PAIRS_PER_ARTICLE} pairs per article and length")
                + f", {args.part} part; {args.per_length} pairs per context length, "
                f"{args.continuation_tokens}-token continuations",
        "window": args.window, "results": results, "table": table,
        "tail_only": {"tokens": args.native_tail, "overall": tail_overall, "by_length": tail_by_length}
        if args.native_tail else None,
    }
    write_json_atomically(args.output, report)
    plot(results, args.output.with_suffix(".png"), tail_by_length, args.native_tail)
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")


def _points(interval: list[float]) -> str:
    return f"[{100 * interval[0]:+.1f}, {100 * interval[1]:+.1f}]"


def plot(results: dict, path: Path, tail_by_length: dict, tail: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for name, result in results.items():
        lengths = list(result["by_length"])
        for mode in [m for m, v in result["overall"].items() if isinstance(v, dict)]:
            gap = [100 * result["by_length"][n][mode]["gap_closed"] for n in lengths]
            agree = [100 * result["by_length"][n][mode]["top1_agreement"] for n in lengths]
            axes[0].plot(lengths, gap, marker="o", label=f"{name} ({mode})")
            axes[1].plot(lengths, agree, marker="o", label=f"{name} ({mode})")
            by_position = result["overall"][mode]["kl_by_position"]
            axes[2].plot(range(1, len(by_position) + 1), by_position, label=f"{name} ({mode})")
    if tail_by_length:
        lengths = list(tail_by_length)
        for ax, metric in ((axes[0], "gap_closed"), (axes[1], "top1_agreement")):
            values = [100 * tail_by_length[n]["tail_only"][metric] for n in lengths]
            ax.plot(lengths, values, color="grey", linestyle="--", marker="x", label=f"last {tail} tokens only")
    axes[0].set_ylabel("share of the NLL gap closed (%)")
    axes[1].set_ylabel("top-1 agreement with native (%)")
    axes[2].set_xlabel("prediction position after the context")
    axes[2].set_ylabel("KL(native || translated), mean")
    axes[2].set_title("last-state shift: error right after the context", fontsize=9)
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=8)
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (target tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Held-out LM fidelity of translated caches")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
