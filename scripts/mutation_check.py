"""Mutation check: plant each of five deliberate bugs in a copy of the library and show that the tests catch it.

Each mutation is one textual edit of `hf_mot/`. For each, the script copies the repository to a temporary folder,
applies the edit, runs the test selection there (the copy first on the import path) and reports the failing tests.
A mutation no test catches is reported as SURVIVED and the script exits 1.

Usage:
    python scripts/mutation_check.py                       # tests without the real models (a few minutes)
    python scripts/mutation_check.py --real-models         # also the real-model tests (slower)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (file, original text, mutated text). Each original must occur exactly once.
MUTATIONS = {
    "wrong RoPE base": (
        "hf_mot/kv.py",
        "        tables = [rotary(like, position_ids)]",
        # A copy of the rotary module whose frequencies are base ** 1.05's: a different RoPE base.
        "        import copy\n        wrong = copy.deepcopy(rotary)\n        wrong.inv_freq = wrong.inv_freq ** 1.05\n"
        "        tables = [wrong(like, position_ids)]",
    ),
    "off-by-one alignment": (
        "hf_mot/alignment.py",
        "    index = np.where(weight > 0, text_tokens[candidates], 0)",
        "    index = np.where(weight > 0, text_tokens[np.minimum(candidates + 1, len(text_tokens) - 1)], 0)",
    ),
    "wrong sliding window": (
        "hf_mot/cache.py",
        "                keys, values = keys[..., given - needed :, :], values[..., given - needed :, :]",
        "                keys, values = keys[..., given - needed + 1 :, :], values[..., given - needed + 1 :, :]",
    ),
    "dropped target-token path": (
        "hf_mot/mixture.py",
        "            hidden = hidden + self.target_tokens(cast(target_embeddings, hidden.dtype))",
        "            hidden = hidden + 0 * self.target_tokens(cast(target_embeddings, hidden.dtype))",
    ),
    "swapped keys and values": (
        "hf_mot/modeling_mot.py",
        "            key_blocks=[heads(block) for _, block in keys],\n"
        "            value_blocks=[heads(block) for _, block in values],",
        "            key_blocks=[heads(block) for _, block in values],\n"
        "            value_blocks=[heads(block) for _, block in keys],",
    ),
}

TESTS = ["tests/test_oracle.py", "tests/test_alignment.py", "tests/test_kv.py", "tests/test_heterogeneous.py",
         "tests/test_generate.py", "tests/test_recompute.py", "tests/test_shipped.py"]


def run(name: str, real_models: bool) -> list[str]:
    path, original, mutated = MUTATIONS[name]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".venv", ".git", ".gpu", "runs", "__pycache__"))
        source = (copy / path).read_text(encoding="utf-8")
        if source.count(original) != 1:
            raise SystemExit(f"{name}: the text to mutate is not in {path} exactly once; update MUTATIONS.")
        (copy / path).write_text(source.replace(original, mutated), encoding="utf-8")
        selection = [] if real_models else ["-m", "not real_models"]
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *selection, *TESTS],
            cwd=copy, env={**os.environ, "PYTHONPATH": str(copy)}, capture_output=True, text=True,
        )
        return [line.split(" ", 1)[1].split(" - ")[0] for line in result.stdout.splitlines()
                if line.startswith("FAILED ")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real-models", action="store_true", help="also run the tests on the real models")
    parser.add_argument("--only", nargs="+", choices=sorted(MUTATIONS), help="run these mutations only")
    args = parser.parse_args()
    survived = []
    for name in args.only or MUTATIONS:
        failed = run(name, args.real_models)
        print(f"## {name}: {'caught by ' + str(len(failed)) + ' tests' if failed else 'SURVIVED'}")
        for test in failed:
            print(f"   {test}")
        if not failed:
            survived.append(name)
    sys.exit(1 if survived else 0)


if __name__ == "__main__":
    main()
