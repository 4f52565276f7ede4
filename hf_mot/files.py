"""Writing files whole: through a temporary file in the same folder, then a rename, so that a killed run leaves
the previous file intact and never a half-written one."""

from __future__ import annotations

import json
import os
import tempfile


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    path = os.fspath(path)
    with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path) or ".", delete=False, suffix=".tmp",
                                     encoding="utf-8") as tmp:
        tmp.write(text)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp.name, 0o666 & ~umask)  # temporary files are private; what they become is not
    os.replace(tmp.name, path)


def write_safetensors_atomically(path: str | os.PathLike, tensors: dict, metadata: dict[str, str]) -> None:
    """Write `tensors` (name -> contiguous tensor) and `metadata` to a safetensors file at `path`."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(path) or ".", suffix=".tmp", delete=False) as tmp:
        pass
    try:
        save_file(tensors, tmp.name, metadata=metadata)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp.name, 0o666 & ~umask)
        os.replace(tmp.name, path)
    finally:
        if os.path.exists(tmp.name):
            os.unlink(tmp.name)


def write_json_atomically(path: str | os.PathLike, report: dict) -> None:
    """Write `report` as indented JSON, creating the folder."""
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    write_text_atomically(path, json.dumps(report, indent=2, default=float))
