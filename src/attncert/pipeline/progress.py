"""Progress of long loops, on the console of whoever runs the stage, never in its report.

Every long loop of the package iterates through :func:`bar`. Where it writes:

- under :mod:`attncert.pipeline.nbrun` (every pipeline stage) to the file named by
``ATTNCERT_CONSOLE``,
  which nbrun relays to its own terminal or log while the notebook runs: the executed
  notebook (the report) receives none of it;
- elsewhere (a script, a test, an interactive notebook) to ``sys.stderr``.

On a terminal a bar updates in place (``ATTNCERT_CONSOLE_TTY=1`` says nbrun's stderr is one);
on anything else (CI, a log file) a loop shorter than :data:`LINE_SECONDS` writes nothing and a
longer one a plain line every :data:`LINE_SECONDS` and one when it ends, so a log has no carriage
returns and no line per update. :func:`write` puts a message line on the same stream.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable
from typing import IO, Any

#: the file progress goes to (set by nbrun for the notebook's kernel)
CONSOLE_ENV = "ATTNCERT_CONSOLE"
#: "1" when the console nbrun relays to is a terminal (bars update in place)
TTY_ENV = "ATTNCERT_CONSOLE_TTY"
#: seconds between two plain lines of one loop when the console is not a terminal
LINE_SECONDS = 30.0

_lock = threading.Lock()
_streams: dict[str, IO[str]] = {}


def console() -> IO[str]:
    """The stream progress goes to (see the module docstring)."""
    path = os.environ.get(CONSOLE_ENV)
    if not path:
        return sys.stderr
    with _lock:
        stream = _streams.get(path)
        if stream is None or stream.closed:
            stream = _streams[path] = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        return stream


def is_terminal() -> bool:
    """Whether :func:`console` is a terminal (bars update in place there)."""
    if os.environ.get(CONSOLE_ENV):
        return os.environ.get(TTY_ENV) == "1"
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def write(message: str) -> None:
    """One line on the console (between the bars on a terminal)."""
    from tqdm import tqdm

    tqdm.write(message, file=console())


class _Lines:
    """A file for tqdm that turns its in-place updates into whole lines (no carriage return,
    no empty clear-line writes)."""

    def __init__(self, stream: IO[str]):
        self.stream = stream
        self.last = ""

    def write(self, text: str) -> None:
        line = text.replace("\r", "").replace("\x1b[A", "").strip()
        if line and line != self.last:  # tqdm repeats its last update when it closes
            self.stream.write(line + "\n")
            self.last = line

    def flush(self) -> None:
        self.stream.flush()


def bar(iterable: Iterable | None = None, desc: str = "", total: int | None = None,
        enabled: bool = True, **kwargs: Any):
    """A tqdm bar over ``iterable`` on :func:`console`: in place on a terminal, else plain
    lines every :data:`LINE_SECONDS` of a loop that lasts longer (and its final count and
    time). ``enabled=False``
    iterates silently. Extra ``kwargs`` go to tqdm (``leave``, ``unit``, ...)."""
    from tqdm import tqdm

    if not enabled:
        return tqdm(iterable, total=total, disable=True)
    stream = console()
    if is_terminal():
        return tqdm(iterable, desc=desc, total=total, file=stream, dynamic_ncols=True,
                    **kwargs)
    kwargs.pop("leave", None)  # a line log keeps every loop's last line
    return tqdm(iterable, desc=desc, total=total, file=_Lines(stream), ascii=True, ncols=100,
                delay=LINE_SECONDS, mininterval=LINE_SECONDS, maxinterval=LINE_SECONDS,
                leave=True, **kwargs)


def elapsed(seconds: float) -> str:
    """``seconds`` as the console and nbrun print them: 42 s, 3 min 05 s, 2 h 07 min."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Relay:
    """Copies what a kernel writes to a console file onto ``out`` while it runs (nbrun's side
    of :data:`CONSOLE_ENV`); on a stream that is not a terminal it also prints a line after
    every ``heartbeat`` seconds without output, so no stage is ever silent for longer."""

    def __init__(self, path: str, out: IO[str], label: str, heartbeat: float = 60.0,
                 poll: float = 0.5):
        self.path, self.out, self.label = path, out, label
        self.heartbeat, self.poll = heartbeat, poll
        self.start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._offset = 0
        self._last = self.start

    def __enter__(self) -> Relay:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._copy()

    def _copy(self) -> bool:
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                f.seek(self._offset)
                text = f.read()
                self._offset = f.tell()
        except FileNotFoundError:
            return False
        if text:
            self.out.write(text)
            self.out.flush()
        return bool(text)

    def _run(self) -> None:
        tty = bool(getattr(self.out, "isatty", lambda: False)())
        while not self._stop.wait(self.poll):
            now = time.monotonic()
            if self._copy():
                self._last = now
            elif not tty and now - self._last >= self.heartbeat:
                self.out.write(f"{self.label}: running, {elapsed(now - self.start)}\n")
                self.out.flush()
                self._last = now
