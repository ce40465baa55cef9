"""What `make lab`'s JupyterLab server does beyond a stock one: opening a shipped notebook never changes it.

When JupyterLab opens a notebook and its kernel starts, it writes the kernel's ``language_info`` into the
notebook's metadata (the Python version of this machine among it), and its autosave then rewrites the file: the
chapters under git would change on every learner's machine by merely being opened. :func:`keep_language_info`,
the server's pre-save hook (tools/lab.py sets ``ContentsManager.pre_save_hook`` to it), saves the project's own
notebooks — chapters/, exercises/, solutions/ — with the ``language_info`` their file already has (or none), so
a notebook opened, run and saved without an edit is saved as the same bytes. A learner's notebooks elsewhere are
saved as JupyterLab sends them.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

SHIPPED = ("chapters", "exercises", "solutions")  # the folders of the project's own notebooks


def keep_language_info(model: dict, path: str, contents_manager, **_) -> None:
    """Before JupyterLab saves `model` at `path` (relative to the server's root): for a notebook of the project's,
    keep the ``language_info`` of the file on disk (remove it when the file has none). Nothing else changes."""
    if model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
        return
    parts = PurePosixPath(path.strip("/")).parts
    if len(parts) != 2 or parts[0] not in SHIPPED:
        return
    try:
        on_disk = json.loads((Path(contents_manager.root_dir) / path.strip("/")).read_text(encoding="utf-8"))
        kept = on_disk["metadata"].get("language_info")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # new, unreadable, or not a notebook
        return
    metadata = model["content"].setdefault("metadata", {})
    if kept is None:
        metadata.pop("language_info", None)
    else:
        metadata["language_info"] = kept
