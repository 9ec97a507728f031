"""One line to stdout, whole: every line a daemon prints goes through ``write_line``.

``print`` writes the text and its newline separately, so two threads printing at once
(the evaluation thread's ``event=eval`` and the main thread's "listening on" announcement)
can join their lines, and ``hypertrain up`` then misreads both.  Here each line is one
write, under one lock, then flushed.
"""

from __future__ import annotations

import sys
import threading

_LOCK = threading.Lock()


def write_line(line: str) -> None:
    """Write ``line`` and its newline to stdout in one piece, and flush."""
    with _LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
