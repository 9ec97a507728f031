"""Cut-through (services/wire/cutthrough.py): a merge served onward while it arrives.

The download side is the real ``receive_merge`` fed the parts of a real merge on a thread;
the serving side is ``CutThrough.stream``, read the way gRPC reads a servicer's generator.
What must hold: the bytes served are the bytes that arrived, the last chunk is held back
until the relay applied the merge (and ``finish`` agreed), and every way the download or
the relay can fail ends the stream UNAVAILABLE (the island asks again), never with a
complete stream of bytes the relay did not apply.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from hypertrain.common.digest import tensor_digest
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.chunks import MergePart, receive_merge
from hypertrain.wire.cutthrough import ABANDONED, APPLIED, CutThrough
from hypertrain.wire.errors import WireError

CHUNK = 4096  # bytes per chunk here: a 10,000-value merge is 10 chunks, the last short
NUMEL = 10_000


def _merge(seed: int = 0) -> tuple[pb.MergeHeader, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(NUMEL, generator=g)
    header = pb.MergeHeader(
        run_id="r", sync_step=4, kind="global", numel=NUMEL, digest=tensor_digest(t)
    )
    return header, t


class Feed:
    """The aggregator's side of one download: parts handed over one at a time, so a test
    decides how far the download has got."""

    def __init__(self, header: pb.MergeHeader, tensor: torch.Tensor) -> None:
        raw = tensor.numpy().tobytes()
        self.parts: list[MergePart] = [pb.MergeChunk(header=header)]
        self.parts += [raw[i : i + CHUNK] for i in range(0, len(raw), CHUNK)]
        self.allowed = threading.Semaphore(0)
        self.broken = False

    def release(self, n: int) -> None:
        for _ in range(n):
            self.allowed.release()

    def __iter__(self) -> Iterator[MergePart]:
        for part in self.parts:
            self.allowed.acquire()
            if self.broken:
                raise WireError(grpc.StatusCode.UNAVAILABLE, "connection dropped")
            yield part


def _download(cut: CutThrough, feed: Feed) -> dict[str, object]:
    """``receive_merge`` of ``feed`` into a fresh tensor on a thread, tapped by ``cut``."""
    got: dict[str, object] = {}

    def run() -> None:
        try:
            got["merge"] = receive_merge(iter(feed), numel=NUMEL, tap=cut)
        except WireError as e:
            got["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    got["thread"] = thread
    return got


def _wait_for(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    until = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < until, "timed out"
        time.sleep(0.005)


def _serving(cut: CutThrough, finish=lambda: True, alive=lambda: True):  # type: ignore[no-untyped-def]
    now = cut.current()
    assert now is not None
    attempt, header, tensor = now
    return cut.stream(attempt, header, tensor, alive, finish, chunk_bytes=CHUNK)


def _joined(parts: list[object]) -> bytes:
    return b"".join(bytes(p) for p in parts[1:])  # type: ignore[call-overload]


def test_serves_what_arrived_as_it_arrives_and_the_last_chunk_once_applied() -> None:
    header, t = _merge()
    cut = CutThrough(4, ("eu-0",), lambda: None)
    feed = Feed(header, t)
    got = _download(cut, feed)
    feed.release(1)  # the header
    _wait_for(lambda: cut.current() is not None)
    stream = _serving(cut)
    first = next(stream)
    assert isinstance(first, pb.MergeChunk) and first.header == header
    served: list[object] = [first]
    feed.release(3)  # three chunks arrive: three are served, not more
    for _ in range(3):
        served.append(next(stream))
    feed.release(len(feed.parts))  # the rest arrives
    got["thread"].join()  # type: ignore[attr-defined]
    assert "merge" in got
    # ... but the last chunk waits for the relay's node to apply the merge
    for _ in range(len(feed.parts) - 1 - 3 - 1):
        served.append(next(stream))
    held = threading.Thread(target=lambda: served.extend(stream), daemon=True)
    held.start()
    held.join(0.3)
    assert held.is_alive(), "the last chunk went out before the merge was applied"
    cut.end(APPLIED)
    held.join(5)
    assert not held.is_alive()
    assert len(served) == len(feed.parts)
    assert _joined(served) == t.numpy().tobytes()
    assert cut.filled == 4 * NUMEL


def test_a_stream_that_attaches_late_catches_up() -> None:
    header, t = _merge(1)
    cut = CutThrough(4, ("eu-0",), lambda: None)
    feed = Feed(header, t)
    got = _download(cut, feed)
    feed.release(len(feed.parts))
    got["thread"].join()  # type: ignore[attr-defined]
    cut.end(APPLIED)
    # (the relay serves an applied merge the ordinary way; a stream that attached
    # before it was applied reads to the end)
    attempt, hdr, tensor = cut.attempt, cut.header, cut.tensor
    assert hdr is not None and tensor is not None
    parts = list(cut.stream(attempt, hdr, tensor, lambda: True, lambda: True, chunk_bytes=CHUNK))
    assert _joined(parts) == t.numpy().tobytes()


@pytest.mark.parametrize(
    "how", ["dropped", "corrupt", "abandoned", "finish_says_no", "caller_left"]
)
def test_every_failure_ends_the_stream_unavailable_before_its_last_chunk(how: str) -> None:
    header, t = _merge(2)
    if how == "corrupt":
        header.digest = "0" * 64
    cut = CutThrough(4, ("eu-0",), lambda: None)
    feed = Feed(header, t)
    got = _download(cut, feed)
    feed.release(1)
    _wait_for(lambda: cut.current() is not None)
    alive = [True]
    stream = _serving(cut, finish=lambda: how != "finish_says_no", alive=lambda: alive[0])
    served = [next(stream)]
    feed.release(2)
    served += [next(stream), next(stream)]
    if how == "dropped":
        feed.broken = True
        feed.release(1)
    elif how == "corrupt":
        feed.release(len(feed.parts))  # all bytes arrive; the digest check fails at the end
    elif how == "abandoned":
        feed.release(len(feed.parts))
        got["thread"].join()  # type: ignore[attr-defined]
        cut.end(ABANDONED)  # e.g. the node refused the receipts
    elif how == "finish_says_no":
        feed.release(len(feed.parts))
        got["thread"].join()  # type: ignore[attr-defined]
        cut.end(APPLIED)
    else:
        alive[0] = False
    with pytest.raises(WireError) as e:
        served.extend(stream)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert "ask again" in e.value.message
    assert len(served) < len(feed.parts), "a failed download was served to its end"
    feed.release(len(feed.parts))
    got["thread"].join(5)  # type: ignore[attr-defined]
    if how in ("dropped", "corrupt"):
        assert "error" in got and cut.failed and cut.current() is None


def test_a_new_attempt_cuts_the_streams_of_the_old_one_short() -> None:
    """The relay's download fails and its retry begins before a stream of the failed
    attempt looks again: that stream ends (its bytes are of the old buffer), and a stream
    of the new attempt serves the merge to the end."""
    header, t = _merge(3)
    cut = CutThrough(4, ("eu-0",), lambda: None)
    old = Feed(header, t)
    first = _download(cut, old)
    old.release(3)
    _wait_for(lambda: cut.filled >= 2 * CHUNK)
    stream = _serving(cut)
    next(stream)
    old.broken = True  # the connection drops
    old.release(len(old.parts))
    first["thread"].join()  # type: ignore[attr-defined]
    assert "error" in first and cut.failed
    new = Feed(header, t)
    again = _download(cut, new)  # the retry: a new buffer, the failure forgotten
    new.release(1)
    _wait_for(lambda: cut.attempt == 2 and not cut.failed)
    with pytest.raises(WireError) as e:
        list(stream)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    new.release(len(new.parts))
    again["thread"].join()  # type: ignore[attr-defined]
    cut.end(APPLIED)
    assert _joined(list(_serving_applied(cut))) == t.numpy().tobytes()


def _serving_applied(cut: CutThrough) -> Iterator[object]:
    assert cut.header is not None and cut.tensor is not None
    return cut.stream(cut.attempt, cut.header, cut.tensor, lambda: True, lambda: True, CHUNK)


def test_the_tap_sees_the_header_every_chunk_and_a_failure() -> None:
    header, t = _merge(4)
    seen: list[object] = []

    class Tap:
        def begin(self, h: pb.MergeHeader, tensor: torch.Tensor) -> None:
            seen.append(("begin", h.digest, tensor.numel()))

        def advance(self, end: int) -> None:
            seen.append(end)

        def fail(self) -> None:
            seen.append("fail")

    feed = Feed(header, t)
    feed.release(len(feed.parts))
    receive_merge(iter(feed), numel=NUMEL, tap=Tap())
    assert seen[0] == ("begin", header.digest, NUMEL)
    ends = seen[1:]
    assert ends == sorted(ends) and ends[-1] == 4 * NUMEL and "fail" not in ends
    seen.clear()
    header.digest = "f" * 64
    feed = Feed(header, t)
    feed.release(len(feed.parts))
    with pytest.raises(WireError):
        receive_merge(iter(feed), numel=NUMEL, tap=Tap())
    assert seen[-1] == "fail"
