"""Cut-through: a merge served onward while it is still arriving.

A relay downloads each global merge from the aggregator and serves the same bytes to
its islands.  Served only once the download ended, the islands' downloads followed the
relay's (two model-sized transfers one after the other on the merge's way back).  With
cut-through an island's fetch that comes while the relay's download is under way is
served from the relay's buffer as it fills:

- ``CutThrough`` is the download's tap (``chunks.receive_merge(tap=...)``): it learns
  the header and the buffer when the header arrives (``begin``), how far the buffer is
  filled as each chunk is copied in (``advance``), and that an attempt failed
  (``fail``).  Each ``begin`` starts a new attempt: a download the relay retries (a
  dropped connection, a corrupt transfer) fills its buffer again (the same one where
  the relay downloads into its fp32 forward's memory, ``RegionCore.forward_room``; a
  new one otherwise), and every stream served from the old attempt is cut short: one
  that read bytes the next attempt wrote over never gets its last chunk (below).
- The relay serves a stream with the header its node will serve the merge with
  (``RelayNode.preview_global``), then the chunks filled so far, then each one as it is
  filled, except the last: that one is held back until the relay's node applied the
  merge (``end(APPLIED)``), so no island holds a merge before its relay does, and then
  only if what the node serves is the same merge under the same header.  Otherwise
  (the download failed, ``end(ABANDONED)``: the node refused it, the relay stops) the
  stream ends UNAVAILABLE and the island asks again.  The island checks the bytes against the
  header's digest as it would any merge.

Nothing here decides anything: the node's state changes only in ``on_global``, as
without cut-through, and the bytes served are those the node then serves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import NamedTuple

import grpc
import torch

from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.chunks import CHUNK_BYTES, fp32_bytes
from hypertrain.wire.errors import WireError

#: How often a stream waiting for more bytes checks that its caller and the daemon are
#: still there.
POLL_S = 0.5

APPLIED = "applied"
ABANDONED = "abandoned"


class Through(NamedTuple):
    """One island's download from a ``CutThrough``: which attempt, under which header."""

    cut: CutThrough
    attempt: int
    header: pb.MergeHeader
    tensor: torch.Tensor


class CutThrough:
    """One global merge's download, as the streams served from it see it."""

    def __init__(self, sync_step: int, takers: tuple[str, ...], wake: Callable[[], None]) -> None:
        """``sync_step``: the merge it is (the relay's forward); ``takers``: who may be
        served from it (the islands that download this merge); ``wake``: wakes the
        fetches waiting for a merge (the board's condition), called when a header
        arrives."""
        self.sync_step = sync_step
        self.takers = takers
        self.wake = wake
        self.cond = threading.Condition()
        self.attempt = 0
        """Which download attempt the fields below are of (0: none began yet)."""
        self.header: pb.MergeHeader | None = None
        """The aggregator's header of the current attempt."""
        self.tensor: torch.Tensor | None = None
        self.filled = 0
        """Bytes of ``tensor`` filled, from its start."""
        self.failed = False
        """The current attempt failed (a next one may begin)."""
        self.outcome: str | None = None
        """APPLIED (the relay's node applied the merge) or ABANDONED; None while open."""
        self.served: list[str] = []
        """Who got the whole merge this way (noted by the relay's ``finish``)."""
        self.preview: tuple[int, pb.MergeHeader | None] | None = None
        """(attempt, the header the relay serves it with, or None: not served this way),
        worked out once per attempt by the relay."""

    # -- the download's side (chunks.MergeTap) ----------------------------------------
    def begin(self, header: pb.MergeHeader, tensor: torch.Tensor) -> None:
        with self.cond:
            self.attempt += 1
            self.header, self.tensor, self.filled, self.failed = header, tensor, 0, False
            self.cond.notify_all()
        self.wake()

    def advance(self, end: int) -> None:
        with self.cond:
            self.filled = end
            self.cond.notify_all()

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.tensor = None  # the streams of this attempt stop; the next fills the buffer anew
            self.cond.notify_all()

    # -- the relay's side -----------------------------------------------------------
    def end(self, outcome: str) -> None:
        """The node applied the merge (APPLIED), or it will not (ABANDONED)."""
        with self.cond:
            if self.outcome is None:
                self.outcome = outcome
            self.cond.notify_all()

    def current(self) -> tuple[int, pb.MergeHeader, torch.Tensor] | None:
        """The attempt streams may be served from now (None: none is under way)."""
        with self.cond:
            # (no tensor: no attempt began yet, or the last one failed)
            if self.outcome is not None or self.tensor is None or self.header is None:
                return None
            return self.attempt, self.header, self.tensor

    def stream(
        self,
        attempt: int,
        header: pb.MergeHeader,
        tensor: torch.Tensor,
        alive: Callable[[], bool],
        finish: Callable[[], bool],
        chunk_bytes: int = CHUNK_BYTES,
    ) -> Iterator[object]:
        """The parts of one island's download from ``attempt``: ``header`` (the relay's),
        then ``tensor``'s bytes as they are filled, the last chunk only once the node
        applied the merge and ``finish()`` (under the relay's lock: the node serves the
        same merge; it notes the download) said so.  UNAVAILABLE, to be asked again, if
        the attempt fails, the node does not apply it, ``finish`` says no or ``alive()``
        turns false (the caller left, the daemon stops)."""
        view = fp32_bytes(tensor)
        size = view.nbytes
        last = ((size - 1) // chunk_bytes) * chunk_bytes if size else 0
        yield pb.MergeChunk(header=header)
        sent = 0
        while True:
            with self.cond:
                while True:
                    self._check(attempt, alive)
                    ready = min(self.filled - self.filled % chunk_bytes, last)
                    if ready > sent or (sent == last and self.outcome == APPLIED):
                        break
                    self.cond.wait(POLL_S)
            if ready > sent:
                for start in range(sent, ready, chunk_bytes):
                    # (read without the lock: a stale value only delays this by a chunk)
                    # stop at once, so that this stream lets go of a failed attempt's
                    # buffer before the next attempt fills it (or another) again
                    self._check_attempt(attempt)
                    yield view[start : start + chunk_bytes]
                sent = ready
                continue
            if not finish():
                raise self._cut_short("the merge the relay applied is not the one it served")
            yield view[last:]
            return

    def _check_attempt(self, attempt: int) -> None:
        """UNAVAILABLE if ``attempt`` failed or another began."""
        if self.attempt != attempt or self.failed:
            raise self._cut_short("its download from the aggregator was cut short")

    def _check(self, attempt: int, alive: Callable[[], bool]) -> None:
        """(under ``cond``) Raise UNAVAILABLE if the stream of ``attempt`` cannot go on."""
        self._check_attempt(attempt)
        if self.outcome == ABANDONED:
            raise self._cut_short("the relay did not apply it")
        if not alive():
            raise self._cut_short("the relay is stopping or the caller left")

    def _cut_short(self, why: str) -> WireError:
        return WireError(
            grpc.StatusCode.UNAVAILABLE,
            f"the global merge of step {self.sync_step} was served while it arrived, and "
            f"{why}; ask again",
        )
