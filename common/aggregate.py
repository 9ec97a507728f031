"""Fixed-order fp32 aggregation and its commitment.

A regional (or global) aggregate is the mean of the decoded deltas of its
members, summed in fp32 in sorted member-id order whatever order they arrived
in, then divided by the member count.  The commitment binds the codec and its
parameters, the ordered (member, input digest) pairs and the output digest, so
anyone holding the published inputs can recompute and check it bit for bit.

Invariants:
- ``aggregate(inputs)`` depends only on the mapping's contents, never on its
  insertion order (members are sorted by their UTF-8 id).
- The sum starts from zeros and adds each decoded delta with one fp32 add per
  element (``Codec.accumulate_range``, bit-identical to ``add_(decode(...))``);
  the mean is one fp32 division by the member count.  It is computed one range of
  values at a time (``streamed_mean``): per value the operations, hence the bits, are
  those of whole-tensor sums, and no whole-model accumulator is needed where the mean
  is only folded into other state.
- Inputs that map spooled files have their pages dropped from the resident set after
  they are read (``common/pages.py``), each input's range as soon as it is added: n
  inputs cost a range of one of them per range in flight, not their size.
- The first inputs of the order may be added before the others arrive (``EarlySum``, a
  relay adding each delta as it is accepted): per value the operations are the same, in
  the same order, so the mean has the same bits whichever way it was computed.  The
  first two may be added in either order: ``(0 + a) + b`` and ``(0 + b) + a`` are the same
  bits for every pair of fp32 values a codec decodes (finite; each side rounds the same
  exact sum once, and ``0 + -0`` is ``+0`` first either way), so a sum may start from the
  second member while the first is still on its way.
- A robust rule (``RobustConfig``: norm clipping, a coordinate-wise trimmed mean, leaving
  out deltas far above the median norm) replaces the mean where the run asks for one;
  it is as deterministic (fixed member order, a stable sort, fp32 adds in order), and
  what it decided (each input's norm, who was left out, the clip or trim) is part of
  the commitment (``Commitment.robust``).  With the plain mean the commitment is what
  it always was, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from statistics import median_low
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hypertrain.common.codec import Codec
from hypertrain.common.codec.header import read_header
from hypertrain.common.digest import CHUNK_BYTES, TensorHasher, blob_digest
from hypertrain.common.errors import CodecError, HypertrainError
from hypertrain.common.pages import drop_pages

if TYPE_CHECKING:
    from hypertrain.common.config import RobustConfig

Blob = bytes | bytearray | memoryview
"""Encoded bytes as received (the transport fills a bytearray)."""


@dataclass(frozen=True, slots=True)
class Commitment:
    """What a relay (or the aggregator) commits to for one aggregate."""

    codec: dict[str, Any]
    """The codec's canonical parameters (``CodecSpec.to_dict()``)."""
    members: tuple[str, ...]
    """Member ids in summation order (sorted; with relay shards, shard by shard)."""
    input_digests: tuple[str, ...]
    """``blob_digest`` of each member's encoded bytes, in the same order."""
    output_digest: str
    """tensor digest of the fp32 mean."""
    robust: dict[str, Any] | None = None
    """What a robust rule decided (``_Rule.record``); None: the plain mean."""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "codec": self.codec,
            "inputs": [[m, d] for m, d in zip(self.members, self.input_digests, strict=True)],
            "output": self.output_digest,
        }
        if self.robust is not None:  # the plain mean's commitments keep their digests
            d["robust"] = self.robust
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Commitment:
        """The inverse of :meth:`to_dict` (a commitment received on the wire or read from a
        checkpoint); HypertrainError naming what is wrong."""
        try:
            pairs = [(str(m), str(x)) for m, x in d["inputs"]]
            codec, output = d["codec"], d["output"]
        except (KeyError, TypeError, ValueError) as e:
            raise HypertrainError(f"malformed commitment: {e!r}") from None
        robust = d.get("robust")
        if not isinstance(codec, dict) or not isinstance(output, str):
            raise HypertrainError("malformed commitment: codec must be an object, output a string")
        if robust is not None and not isinstance(robust, dict):
            raise HypertrainError("malformed commitment: robust must be an object")
        members = tuple(m for m, _ in pairs)
        return cls(codec, members, tuple(x for _, x in pairs), output, robust)

    @property
    def digest(self) -> str:
        """sha256 of the canonical JSON of :meth:`to_dict`."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()


#: Values per range of a streamed mean: 1M fp32 (4 MiB), a whole number of digest
#: chunks; the accumulator range stays in cache while every input is added to it.  It
#: is also what a commit holds besides the node's state: a range-sized scratch sum, and
#: the pages of each spooled input that the range read (dropped after it).  At 4M values
#: a relay of 2 islands at gpt-125m rose 38 MiB above its resting memory at each
#: regional commit, over its bound (2m + 64 MiB); at 1M, 20-25 MiB, with the same bits
#: and the same speed (a 124M-value int8 mean of 2 inputs: 0.76-0.80 s against
#: 0.78-0.84 s at 4M).
MERGE_RANGE = 1 << 20

Visit = Callable[[int, torch.Tensor], None]
"""Called with (start, mean[start : start + n]) for each range of a streamed mean, in
order; with ``parallel`` (``segmented_mean``), from several threads at once, each on its
own range (a wave of ranges at a time, the waves in order)."""


def _usable_cores() -> int:
    """The cores this process may run on (its affinity, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


_WORKERS = max(1, min(4, _usable_cores()))
"""Ranges a parallel mean works on at once: one per core this process may use, at most 4.
Each range in flight beyond the first costs memory at a commit: a scratch range where the
mean is not kept (4 MiB), the int8 codec's work buffer (4 MiB) and the pages the range
reads of the spooled input it is adding (dropped once added): at 4, at most 3 x (8 MiB +
one input's range) more than a mean that works on one range at a time."""
_helpers: tuple[int, ThreadPoolExecutor] | None = None


def _helper_pool() -> ThreadPoolExecutor | None:
    """The threads that work on ranges beside the calling thread (None on one core).
    Per process: a forked child inherits the object but not its threads."""
    global _helpers
    if _WORKERS < 2:
        return None
    if _helpers is None or _helpers[0] != os.getpid():
        _helpers = (os.getpid(), ThreadPoolExecutor(_WORKERS - 1, thread_name_prefix="ranges"))
    return _helpers[1]


def _in_waves(count: int, job: Callable[[int, int], None]) -> None:
    """``job(k, slot)`` for k in ``range(count)``, ``_WORKERS`` at a time: each wave's
    first job on the calling thread, the others on the helpers (``slot``: its place in
    the wave, for a scratch buffer of its own).  Torch's kernels
    and the hashes (BLAKE3) release the GIL, so a wave's jobs run on that many cores.
    A job's exception is raised once its whole wave has ended (no job of this call runs
    after it is raised)."""
    pool = _helper_pool()
    width = _WORKERS if pool is not None else 1
    for first in range(0, count, width):
        ks = range(first, min(count, first + width))
        jobs: list[Future[None]] = []
        error: BaseException | None = None
        try:
            for slot, k in enumerate(ks):
                if slot and pool is not None:
                    jobs.append(pool.submit(job, k, slot))
            job(ks[0], 0)
        except BaseException as e:  # (a failed submit too) the wave's jobs still end first
            error = e
        for f in jobs:
            while True:  # an interrupt while waiting does not leave the job running
                try:
                    f.result()
                    break
                except BaseException as e:
                    error = error or e
                    if f.done():
                        break
        if error is not None:
            raise error


def _range_length(codec: Codec) -> int:
    unit = math.lcm(CHUNK_BYTES // 4, codec.range_align)
    return unit * max(1, MERGE_RANGE // unit)


@dataclass(frozen=True, slots=True)
class Segment:
    """The inputs of one contiguous range ``[start, start + numel)`` of a streamed mean
    (a relay shard's range at the aggregator, ``common/shards.py``).  ``inputs`` are
    keyed by the id that orders the sum (a region); ``names``: the member id each input
    is committed under (default: its key)."""

    start: int
    numel: int
    inputs: Mapping[str, Blob]
    names: Mapping[str, str] | None = None


@dataclass(slots=True)
class EarlySum:
    """The first inputs of a fixed-order sum, added while the rest are still arriving.

    ``acc`` (1-D fp32, the whole tensor) holds zeros plus the decoded input of each of
    ``members``, in sorted member order, one fp32 add per value: what ``segmented_mean``
    holds after adding those inputs.  ``segmented_mean(..., early=...)`` goes on from
    there with the rest, so the mean has the same bits as one computed at once.  An
    input is added only when every member before it in the order is in the sum (the
    order of the sum is the order of arrival only where they agree), but for the first
    two, which commute (module docstring): a sum may hold the second member alone, and
    the first is added after it."""

    acc: torch.Tensor
    shape: tuple[int, ...]
    """The tensor's shape (an input encodes it, or is 1-D of its element count)."""
    members: list[str] = field(default_factory=list)
    blobs: list[Blob] = field(default_factory=list)
    """The very objects added (a commit checks that it aggregates these, not others)."""

    @classmethod
    def zeros(cls, acc: torch.Tensor, shape: tuple[int, ...]) -> EarlySum:
        """A sum of no inputs of ``shape``, kept in ``acc`` (contiguous 1-D fp32)."""
        if acc.dtype != torch.float32 or acc.dim() != 1 or not acc.is_contiguous():
            raise HypertrainError("an early sum needs a contiguous 1-D float32 tensor")
        if acc.numel() != math.prod(shape):
            raise HypertrainError(f"an early sum of shape {shape} has {acc.numel()} values")
        acc.zero_()
        return cls(acc, tuple(shape))

    def add(self, member: str, blob: Blob, codec: Codec) -> None:
        """Add ``member``'s input, after the members already in the sum (raises before
        writing anything if the blob is bad, or out of order): to a sum of one input any
        other (the first two commute), after that only later ones in the order;
        ``begins`` checks that what was summed begins the inputs it is used for."""
        if member in self.members:
            raise HypertrainError(f"early sum: {member} is in the sum already")
        if len(self.members) > 1 and member < (last := max(self.members)):
            raise HypertrainError(f"early sum: {member} comes before {last}")
        header = read_header(blob)  # the same check as segmented_mean's
        numel = self.acc.numel()
        if header.shape not in ((numel,), self.shape):
            raise CodecError(f"blob has shape {header.shape}, accumulator has {self.shape}")
        header, prepared = codec.open(blob)
        step = _range_length(codec)
        for start in range(0, numel, step):
            codec.accumulate_range(header, prepared, self.acc[start : start + step], start)
            drop_pages(blob)
        self.members.append(member)
        self.blobs.append(blob)

    def begins(self, inputs: Mapping[str, Blob]) -> bool:
        """Are this sum's inputs the first of ``inputs`` in the order of the sum (the
        first two in either order), or the second of them alone?  ``segmented_mean``
        then adds the rest in order: with the second alone, the first comes next."""
        return EarlySum._continues(self.members, sorted(inputs)) and all(
            inputs[m] is b for m, b in zip(self.members, self.blobs, strict=True)
        )

    @staticmethod
    def _continues(summed: Sequence[str], order: Sequence[str]) -> bool:
        """Can the rest of ``order`` (every member of the sum, sorted) be added to a sum
        of ``summed`` (in the order they were added) with the bits of the sum in order:
        are they ``order``'s first, added in its order but for the first two, or its
        second alone?"""
        k = len(summed)
        if k == 1 and len(order) > 1 and summed[0] == order[1]:
            return True
        return sorted(summed[:2]) + list(summed[2:]) == list(order[:k])

    @classmethod
    def extended(
        cls,
        early: EarlySum | None,
        memory: Callable[[], torch.Tensor],
        shape: tuple[int, ...],
        codec: Codec,
        members: Iterable[str],
        delivered: Mapping[str, Blob],
    ) -> EarlySum | None:
        """``early`` (None: no sum yet) with the delivered inputs added that continue it
        (``next_of``; ``members``: the step's, delivered or not), a new sum kept in
        ``memory()`` (contiguous 1-D fp32, asked for only once there is an input to add)
        where there was none.  None where adding one failed (any exception: a sum is
        optional work; the commit sums every input and decides as it always did).  What
        a relay (``RegionCore.offer``) and the aggregator (``GlobalCore.offer``) call."""
        wanted = cls.next_of([] if early is None else early.members, members, delivered)
        if not wanted:  # nothing is allocated until an input can be added
            return early
        try:
            if early is None:
                early = cls.zeros(memory(), shape)
            for member in wanted:
                early.add(member, delivered[member], codec)
        except Exception:
            return None
        return early

    @staticmethod
    def next_of(
        summed: Sequence[str], members: Iterable[str], delivered: Mapping[str, Blob]
    ) -> list[str]:
        """The delivered members to add to a sum of ``summed`` next, in order: those
        that continue it with no member of ``members`` (the step's, delivered or not)
        missing before them; or, to an empty sum while the order's first member is not
        delivered, its second alone.  Nothing when the sum no longer begins the order (a
        member before its own joined the step): the commit sums every input then."""
        order = sorted(set(members) | set(delivered))
        if not EarlySum._continues(summed, order):
            return []
        if not summed and order and order[0] not in delivered:
            return order[1:2] if order[1:2] and order[1] in delivered else []
        wanted: list[str] = []
        for m in order:
            if m in summed:
                continue
            if m not in delivered:
                break
            wanted.append(m)
        return wanted


def streamed_mean(
    inputs: Mapping[str, Blob],
    codec: Codec,
    shape: tuple[int, ...],
    visit: Visit | None = None,
    out: torch.Tensor | None = None,
    digests: Mapping[str, str] | None = None,
    prepare: Callable[[], None] | None = None,
    early: EarlySum | None = None,
    robust: RobustConfig | None = None,
    parallel: bool = False,
) -> Commitment:
    """The fixed-order fp32 mean of ``inputs``, one range of values at a time.

    Every input is validated first (nothing is visited unless all are good); then, per
    range of ``MERGE_RANGE`` values: zeros, plus each decoded input in sorted member
    order, divided by the member count (the same per-value operations as summing whole
    tensors, so the same bits); the range is hashed into the output digest and handed
    to ``visit``.  The mean is kept in ``out`` (1-D view of ``shape``'s element count)
    when given, otherwise only in a range-sized scratch buffer: a caller that only
    folds it into other state (a relay's base at a global sync) never holds it whole.
    ``digests``: each input's blob digest where the caller already verified it; ``prepare``:
    called once every input is validated, before the first ``visit`` (a caller that
    allocates state for the visits does it only once nothing can fail).

    ``early``: the sum of the first inputs, already added (``EarlySum.begins`` them; they
    were validated when added).  The mean is then computed in ``early.acc``, range by
    range, and each range is handed to ``visit``, which may write over it; ``out`` must
    be None.

    ``robust``: the rule that replaces the mean where it is not the plain one
    (``_Rule``; no early sum then).

    ``parallel``: work on several ranges at once, one per core (``_in_waves``); ``visit``
    must then take ranges from several threads at once.  Each value's operations, the
    digest's leaves and so the results are the same bits either way."""
    if not inputs:
        raise HypertrainError("aggregate: no inputs")
    segment = Segment(0, math.prod(shape), inputs)
    return segmented_mean(
        [segment], codec, shape, visit, out, digests, prepare, early, robust, parallel
    )


def segmented_mean(
    segments: Sequence[Segment],
    codec: Codec,
    shape: tuple[int, ...],
    visit: Visit | None = None,
    out: torch.Tensor | None = None,
    digests: Mapping[str, str] | None = None,
    prepare: Callable[[], None] | None = None,
    early: EarlySum | None = None,
    robust: RobustConfig | None = None,
    parallel: bool = False,
) -> Commitment:
    """``streamed_mean`` of a tensor whose ranges have their own inputs: ``segments`` tile
    ``[0, numel)`` in order, and each range is the fixed-order mean of its segment's
    inputs, each of them encoding exactly that range.  One commitment covers them all:
    the members segment by segment (each segment's in sorted order), and the digest of
    the whole mean.  With one segment this is ``streamed_mean``, bit for bit and byte
    for byte (``early``: see there)."""
    numel = math.prod(shape)
    done: set[str] = set()
    if early is not None:
        if len(segments) != 1 or out is not None or early.shape != tuple(shape):
            raise HypertrainError("aggregate: an early sum needs one segment, whole, and no out")
        if not early.begins(segments[0].inputs):
            raise HypertrainError(
                f"aggregate: the early sum of {early.members} does not begin these inputs"
            )
        done = set(early.members)
    opened: list[list[tuple[Any, Any]]] = []
    read_by: list[list[Blob]] = []  # the blob of each of ``opened``'s inputs
    position = 0
    whole = len(segments) == 1  # one segment may also carry the tensor's own shape
    for seg in segments:  # validate every input before anything is written
        if seg.start != position or seg.numel < 0 or not seg.inputs:
            raise HypertrainError(
                f"aggregate: a segment [{seg.start}, {seg.start + seg.numel}) with "
                f"{len(seg.inputs)} inputs does not continue at {position}"
            )
        position += seg.numel
        ops, blobs = [], []
        for member in sorted(seg.inputs):
            if member in done:  # validated when it was added
                continue
            blobs.append(seg.inputs[member])
            header = read_header(seg.inputs[member])
            if (seg.numel,) != header.shape and not (whole and header.shape == tuple(shape)):
                raise CodecError(
                    f"blob has shape {header.shape}, accumulator has "
                    f"{tuple(shape) if whole else (seg.numel,)}"
                )
            ops.append(codec.open(seg.inputs[member]))
            drop_pages(seg.inputs[member])  # read whole by the checksum; read again by range
        opened.append(ops)
        read_by.append(blobs)
    if position != numel:
        raise HypertrainError(f"aggregate: segments cover {position} of {numel} values")
    flat = early.acc if early is not None else None if out is None else out.view(-1)
    if out is not None and flat is not None and flat.numel() != numel:
        raise HypertrainError(f"aggregate: out has {flat.numel()} values, expected {numel}")
    step = _range_length(codec)
    longest = max(seg.numel for seg in segments)
    scratch = torch.empty(min(step, longest), dtype=torch.float32) if flat is None else None
    hasher = TensorHasher(torch.float32, tuple(shape))
    if robust is not None and not robust.plain:
        if len(segments) != 1 or early is not None:
            raise HypertrainError("aggregate: a robust rule needs one segment and no early sum")
        seg = segments[0]
        opens = dict(zip(sorted(seg.inputs), opened[0], strict=True))
        rule = _Rule(robust, codec, opens, seg.inputs)
        rule.decide(seg.numel)
        if prepare is not None:
            prepare()
        for start in range(0, seg.numel, step):
            n = min(step, seg.numel - start)
            acc = flat[start : start + n] if flat is not None else scratch[:n]  # type: ignore[index]
            rule.combine(acc, start)
            for blob in seg.inputs.values():
                drop_pages(blob)
            hasher.update(acc)
            if visit is not None:
                visit(start, acc)
        return Commitment(
            codec=codec.spec.to_dict(),
            members=tuple(rule.kept),
            input_digests=tuple(
                digests[m] if digests is not None and m in digests else blob_digest(seg.inputs[m])
                for m in rule.kept
            ),
            output_digest=hasher.hexdigest(),
            robust=rule.record(),
        )
    ranges = [
        (seg, ops, blobs, start, min(step, seg.numel - start))
        for seg, ops, blobs in zip(segments, opened, read_by, strict=True)
        for start in range(0, seg.numel, step)
    ]
    # In parallel only where every range starts on a digest chunk (segments that start
    # inside one, relay shards of any size, are hashed in order).
    waves = (
        parallel
        and len(ranges) > 1
        and _helper_pool() is not None
        and all(4 * s.start % CHUNK_BYTES == 0 for s in segments)
    )
    scratches = [scratch] if scratch is not None else []
    if waves and scratch is not None:
        scratches += [torch.empty_like(scratch) for _ in range(_WORKERS - 1)]
    if prepare is not None:  # once everything that can fail before a range has been done
        prepare()

    def one_range(k: int, slot: int) -> None:
        seg, ops, blobs, start, n = ranges[k]
        at = seg.start + start
        acc = flat[at : at + n] if flat is not None else scratches[slot][:n]
        if early is None:
            acc.zero_()
        for (header, prepared), blob in zip(ops, blobs, strict=True):
            codec.accumulate_range(header, prepared, acc, start)
            # What the range read of a spooled input goes as soon as it is added, not
            # after the wave: the inputs cost a range of one of them per worker, not a
            # range of each (a relay's final commit adds every input that arrived out
            # of member order).  A worker on another range of the same input may fault
            # a page back from the page cache; the bytes are the same.
            drop_pages(blob)
        acc.div_(len(seg.inputs))
        hasher.put(4 * at, acc)
        if visit is not None:
            visit(at, acc)

    if waves:
        _in_waves(len(ranges), one_range)
    else:
        for k in range(len(ranges)):
            one_range(k, 0)
    members: list[str] = []
    input_digests: list[str] = []
    for seg in segments:
        for key in sorted(seg.inputs):
            member = key if seg.names is None else seg.names[key]
            members.append(member)
            if digests is not None and member in digests:
                input_digests.append(digests[member])
            else:
                input_digests.append(blob_digest(seg.inputs[key]))
                drop_pages(seg.inputs[key])
    return Commitment(
        codec=codec.spec.to_dict(),
        members=tuple(members),
        input_digests=tuple(input_digests),
        output_digest=hasher.hexdigest(),
    )


def delta_norm(codec: Codec, header: Any, prepared: Any, numel: int) -> float:
    """The L2 norm of a validated input (``codec.open``'s ``header`` and ``prepared``),
    decoded one range at a time into scratch (never whole), its squares summed in
    float64 by numpy's pairwise sum, range after range.  Not torch's ``sum``: its
    parallel reduction groups the terms by the process's thread count, and a relay, an
    in-process run and an auditor must get the same bits whatever theirs are."""
    step = _range_length(codec)
    scratch = torch.empty(min(step, numel), dtype=torch.float32)
    total = 0.0
    for start in range(0, numel, step):
        part = scratch[: min(step, numel - start)]
        part.zero_()
        codec.accumulate_range(header, prepared, part, start)
        values = part.numpy().astype(np.float64)
        total += float(np.sum(values * values))
    return math.sqrt(total)


class _Rule:
    """A robust rule at one commit: what it decides from the inputs' norms, and how it
    combines one range of them (``RobustConfig``)."""

    def __init__(
        self,
        cfg: RobustConfig,
        codec: Codec,
        ops: dict[str, tuple[Any, Any]],
        blobs: Mapping[str, Blob],
    ) -> None:
        """``ops``: each input's ``codec.open``; ``blobs``: its bytes (their pages are
        dropped after the norm pass reads them, as after each range of the mean)."""
        self.cfg, self.codec, self.ops, self.blobs = cfg, codec, ops, blobs
        self._rows: torch.Tensor | None = None  # the trimmed mean's range of every input
        self.norms: dict[str, float] = {}
        self.kept: list[str] = sorted(ops)
        self.bound: float | None = None  # norm_median's bound, where it applied
        self.scale: dict[str, float] = dict.fromkeys(self.kept, 1.0)
        self.clip_norm: float | None = None
        self.trim = 0

    def decide(self, numel: int) -> None:
        cfg = self.cfg
        for m in self.kept:
            self.norms[m] = delta_norm(self.codec, *self.ops[m], numel)
            drop_pages(self.blobs[m])
        if cfg.norm_median and len(self.kept) >= 3:
            self.bound = cfg.norm_median * median_low(self.norms.values())
            self.kept = [m for m in self.kept if self.norms[m] <= self.bound]
        if cfg.rule == "clip":
            c = self.clip_norm = cfg.clip * median_low(self.norms[m] for m in self.kept)
            self.scale = {m: c / self.norms[m] if self.norms[m] > c else 1.0 for m in self.kept}
        elif cfg.rule == "trimmed_mean":
            self.trim = min(cfg.trim, (len(self.kept) - 1) // 2)

    def combine(self, acc: torch.Tensor, start: int) -> None:
        """``acc`` = the rule's combination of every kept input's values at
        ``[start, start + acc.numel())``."""
        kept, n = self.kept, acc.numel()
        if self.trim:
            if self._rows is None or self._rows.shape[1] < n:  # one range of each input
                self._rows = torch.empty((len(kept), n), dtype=torch.float32)
            rows = self._rows[:, :n]
            rows.zero_()
            for row, m in zip(rows, kept, strict=True):
                self.codec.accumulate_range(*self.ops[m], row, start)
            ordered = torch.sort(rows, dim=0, stable=True).values
            acc.zero_()
            for row in ordered[self.trim : len(kept) - self.trim]:
                acc.add_(row)
            acc.div_(len(kept) - 2 * self.trim)
            return
        acc.zero_()
        tmp = None
        for m in kept:
            s = self.scale[m]
            if s == 1.0:
                self.codec.accumulate_range(*self.ops[m], acc, start)
                continue
            tmp = torch.zeros(n, dtype=torch.float32) if tmp is None else tmp.zero_()
            self.codec.accumulate_range(*self.ops[m], tmp, start)
            acc.add_(tmp.mul_(s))
        acc.div_(len(kept))

    def record(self) -> dict[str, Any]:
        """What was decided, for the commitment and the tape (figures as exact decimal
        strings: a tape holds no floats)."""
        out: dict[str, Any] = {
            "rule": self.cfg.rule,
            "norms": {m: repr(v) for m, v in sorted(self.norms.items())},
        }
        if self.bound is not None:
            out["bound"] = repr(self.bound)
            out["left_out"] = sorted(set(self.norms) - set(self.kept))
        if self.clip_norm is not None:
            out["clip_norm"] = repr(self.clip_norm)
        if self.cfg.rule == "trimmed_mean":
            out["trim"] = self.trim
        return out


def aggregate(
    inputs: Mapping[str, Blob],
    codec: Codec,
    shape: tuple[int, ...],
    digests: Mapping[str, str] | None = None,
) -> tuple[torch.Tensor, Commitment]:
    """Fixed-order fp32 mean of the decoded ``inputs`` and its commitment (``streamed_mean``
    kept whole).

    ``digests``: each input's blob digest where the caller already verified it (a transport
    checks every transfer's digest as it arrives), so that the bytes are not hashed again;
    computed here for inputs it does not name."""
    mean = torch.empty(shape, dtype=torch.float32)
    return mean, streamed_mean(inputs, codec, shape, out=mean, digests=digests)
