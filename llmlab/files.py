"""Text files written whole or not at all: a temporary file beside the target, then one rename over it.

    from llmlab import files
    files.write_atomically(Path("site/index.html"), text)   # a reader sees the old file or the new one, never half

Used for the pages `llmlab site` writes and the report `llmlab grade --report` writes. (A training checkpoint,
llmlab.train.state, also fsyncs and cleans a killed writer's temporaries: it has its own writer.)
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomically"]


def write_atomically(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` through a temporary file in the same folder and `os.replace`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a page from a web server
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
