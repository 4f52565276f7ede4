"""Evaluating translators: language-modelling fidelity on held-out text."""

from .fidelity import FidelityExample, evaluate_fidelity, heldout_examples, summarize

__all__ = ["FidelityExample", "evaluate_fidelity", "heldout_examples", "summarize"]
