"""Train a Mixture-of-Translators translator for a pair of causal LMs.

Usage:
    python examples/training/train_translator.py --source smollm2-135m --target gemma3-270m \
        --output-dir runs/smollm2-to-gemma3 --max-steps 2000 --bf16
    torchrun --standalone --nproc_per_node 2 examples/training/train_translator.py --source ... --target ... ...

See `--help` for every option; `hf-mot train` runs the same script.
"""

from hf_mot.training.train import main

if __name__ == "__main__":
    main()
