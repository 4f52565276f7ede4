"""Plots are optional: matplotlib comes with the `bench` extra (`pip install "hf-mot[bench]"`)."""

from __future__ import annotations

import warnings


def pyplot():
    """matplotlib's `pyplot` on a file-only backend, or `None` with a warning that names the extra, when matplotlib
    is not installed: whatever was being plotted is then written without its figure, never lost."""
    try:
        import matplotlib
    except ImportError:
        warnings.warn('matplotlib is not installed, so no plot is written: pip install "hf-mot[bench]".',
                      stacklevel=3)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
