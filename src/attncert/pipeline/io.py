"""Atomic file writes: a crash never leaves a half-written result behind."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path: str | Path, data: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def merge_rows(path: str | Path, rows: list[dict], key: Callable[[dict], Any],
               field: str = "rows", update: Callable[[dict], None] | None = None,
               ordered: bool = False) -> dict:
    """A measurement record (JSON, ``{field: [row, ...], ...}``) with ``rows`` merged in: each
    replaces the kept row of the same ``key``, the others stay (``ordered``: sorted by key);
    ``update(record)`` may change the record before it is written (atomically). Returns the
    record."""
    path = Path(path)
    record = json.loads(path.read_text()) if path.is_file() else {field: []}
    if update is not None:
        update(record)
    keys = {key(r) for r in rows}
    record[field] = [r for r in record[field] if key(r) not in keys] + list(rows)
    if ordered:
        record[field].sort(key=key)
    write_json(path, record)
    return record


def torch_save(obj: Any, path: str | Path) -> None:
    """torch.save, atomically and byte-reproducibly: saving to a path stores the (random)
    temporary file name inside the archive, so the bytes go through a buffer instead and the
    same object always gives the same file (DVC then sees unchanged outputs as unchanged)."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    with atomic_path(path) as tmp:
        tmp.write_bytes(buf.getvalue())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
