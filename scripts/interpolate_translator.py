"""Interpolate a fine-tuned translator with the one it started from: weights `alpha * run + (1 - alpha) * start`.

When the run widened its start (`hf-mot train --init-from X --hidden-size ...`), the start is X widened again
with the run's seed, as the training script did, so the added units interpolate toward their own
initialisation. This gives the points between a start and a run (for example: LM fidelity against QA), as
measured with `benchmarks/lm_fidelity.py` and `hf-mot evaluate`.

    python scripts/interpolate_translator.py --start runs/lc-main --run runs/wd-main --alpha 0.5 \\
        --output-dir runs/wdi50-main

Several `--run` translators (checkpoints of one run, say) are averaged first: their mean is the run. With
`--alpha k/(k+1)` for k checkpoints, the result is the plain mean of the start and the checkpoints (weight
averaging along the run's trajectory, which cancels part of the noise of small-batch steps):

    python scripts/interpolate_translator.py --start hf-mot/smollm2-135m-to-gemma3-270m \\
        --run runs/x/checkpoint-40 runs/x/checkpoint-80 runs/x/checkpoint-120 --alpha 0.75 --output-dir runs/xa
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hf_mot import MoTTranslator
from hf_mot.files import write_json_atomically
from hf_mot.training.train import INTERPOLATION_RECORD, RECORD
from hf_mot.training.widen import widen_translator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start", required=True, help="the translator the run started from (--init-from)")
    parser.add_argument("--run", type=Path, nargs="+", required=True,
                        help="the trained run's output dir, or several translators of one run (its checkpoints) "
                        "to average")
    parser.add_argument("--alpha", type=float, required=True, help="weight of the run (0: start, 1: run)")
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args()
    if not 0.0 <= args.alpha <= 1.0:
        parser.error(f"--alpha must be between 0 and 1, got {args.alpha}.")
    # The training run the translators come from: a checkpoint's run is the folder around it.
    trained = {path.parent if path.name.startswith("checkpoint-") else path for path in args.run}
    if len(trained) != 1:
        parser.error(f"--run translators come from {len(trained)} runs ({sorted(map(str, trained))}); average the "
                     "checkpoints of one run.")
    trained = trained.pop()
    runs = [MoTTranslator.from_pretrained(path) for path in args.run]
    run = runs[0]
    start = MoTTranslator.from_pretrained(args.start)
    if (start.config.hidden_size, start.config.expert_hidden_size) != (
        run.config.hidden_size, run.config.expert_hidden_size
    ):
        seed = json.loads((trained / RECORD).read_text())["args"]["seed"]
        start = widen_translator(start, run.config.hidden_size, run.config.expert_hidden_size, seed=seed)
    start_state, run_states = start.state_dict(), [r.state_dict() for r in runs]
    if any(state.keys() != start_state.keys() for state in run_states):
        parser.error(f"{args.start} and {args.run} do not have the same weights; interpolate a run with its start.")
    mean = {k: sum(state[k] for state in run_states) / len(run_states) for k in start_state}
    run.load_state_dict({k: args.alpha * v + (1 - args.alpha) * start_state[k] for k, v in mean.items()})
    run.save_pretrained(args.output_dir)
    # The model card of a shipped interpolation lists the run's phases and then this step (ship_translator.py).
    write_json_atomically(
        Path(args.output_dir) / INTERPOLATION_RECORD,
        {"argv": sys.argv[1:], "start": args.start, "run": str(trained), "runs": [str(p) for p in args.run],
         "alpha": args.alpha},
    )
    print(f"wrote {args.output_dir}")


if __name__ == "__main__":
    main()
