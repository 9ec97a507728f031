"""The three roles' numerical work: island, region (relay) and global (aggregator).

These classes hold each role's state and do every computation the algorithm
of docs/design.md §4.1 prescribes; they do no I/O and make no timing decisions.
The daemons and the in-process run reach them through the same round engine
(common/rounds/: the relay and aggregator machines hold a RegionCore /
GlobalCore, IslandRounds drives an island's state), and the simulator calls the
region and global cores directly: one implementation of every number is what
makes the runs bit-identical.

Invariants:
- An island's ``base`` is its relay's ``base``: after a regional merge the island takes
  (``copy_``) the relay's new base, which is bit-identical to applying the committed mean
  to its own copy (the relay computed it with that op from the same old base), so the
  relay never holds the mean whole; after a global merge both take the new global
  parameters.
- Merges are applied at a pinned step (sync_step + tau), never on arrival.
- Error-feedback state lives with the sender (island for the regional codec,
  relay for the global codec).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from hypertrain.common import pages
from hypertrain.common.aggregate import (
    Blob,
    Commitment,
    EarlySum,
    Segment,
    segmented_mean,
    streamed_mean,
)
from hypertrain.common.codec import ErrorFeedback, make_codec
from hypertrain.common.codec.base import alloc_raw, tensor_view
from hypertrain.common.codec.header import CHECKSUM_SEGMENT
from hypertrain.common.config import TOY_MODEL, RunConfig
from hypertrain.common.data import SampleStream
from hypertrain.common.digest import TensorHasher
from hypertrain.common.errors import HypertrainError
from hypertrain.common.flat import ParamLayout
from hypertrain.common.fragments import Fragment
from hypertrain.common.model import GPT, build_model
from hypertrain.common.optim import InnerOptimizer, wsd_factor
from hypertrain.common.outer import make_outer
from hypertrain.common.schedule import Schedule, overlap_merge


def initial_parameters(
    cfg: RunConfig, release: Callable[[], None] | None = None
) -> tuple[ParamLayout, torch.Tensor]:
    """The run's starting global parameters (a pure function of model and seed).
    ``release``: gives freed memory back to the system (``ParamLayout.flatten``)."""
    if cfg.model == TOY_MODEL:
        from hypertrain.common.toy import toy_layout, toy_parameters

        return toy_layout(), toy_parameters(cfg)
    model = build_model(cfg.model_config(), seed=cfg.seed)
    layout = ParamLayout.of(model)
    # never the model and the copy whole
    return layout, layout.flatten(model, consume=True, release=release)


class RankGroup(Protocol):
    """The data-parallel ranks of one island, as its core needs them.

    The island daemon implements it with ``torch.distributed``; the core only asks for
    its rank, the group size and the mean of every rank's gradients.
    """

    rank: int
    size: int

    def average_gradients(self, model: torch.nn.Module, loss: float) -> float:
        """Replace each ``p.grad`` by the mean over ranks; returns the mean of ``loss``."""
        ...


class SegmentNorm:
    """The L2 norm of a vector, taken one checksum segment (``CHECKSUM_SEGMENT``) at a
    time: the square root of the sum of the segments' squared norms.  An island's
    pseudo-gradient norm (a metric): where the delta is framed segment by segment
    (``IslandState._sync_in_base``), each segment's norm is taken while it is in cache
    instead of a pass over the whole delta afterwards; ``of`` gives the same bits for a
    whole vector, so every sync path reports the same value."""

    STEP = CHECKSUM_SEGMENT // 4

    def __init__(self) -> None:
        self._squares: list[float] = []

    def add(self, segment: torch.Tensor) -> None:
        """The next segment's values (``STEP`` of them, the last one fewer)."""
        n = float(torch.linalg.vector_norm(segment))
        self._squares.append(n * n)

    def value(self) -> float:
        return math.sqrt(math.fsum(self._squares))

    @classmethod
    def of(cls, values: torch.Tensor) -> float:
        norm, flat = cls(), values.view(-1)
        for start in range(0, flat.numel(), cls.STEP):
            norm.add(flat[start : start + cls.STEP])
        return norm.value()


class IslandState:
    """What every island keeps besides its training: the base it syncs against, the
    regional codec's error feedback, the step, and the overlap snapshots (tau > 0).

    Subclasses train: :class:`IslandCore` (the model) and ``common/toy.py``'s
    ``ToyIsland`` (a small vector with a fixed update, for the fault simulation).  The
    sync and merge rules below are the same for both, so what the fault simulation
    checks is what the daemons run."""

    def __init__(
        self,
        cfg: RunConfig,
        island_id: str,
        theta0: torch.Tensor,
        fragments: Sequence[Fragment] | None = None,
    ) -> None:
        """``fragments``: the run's streaming fragments (``fragments.run_fragments``);
        needed when ``cfg.fragments`` > 1, else the whole vector is one."""
        topo = cfg.topology
        self.cfg = cfg
        self.island_id = island_id
        self.region = topo.region_of(island_id)
        self.data_index = topo.island_ids().index(island_id)
        self.numel = theta0.numel()
        if fragments is None:
            if cfg.fragments != 1:
                raise HypertrainError(
                    f"island {island_id}: a run with {cfg.fragments} fragments needs their ranges"
                )
            fragments = [Fragment.whole(self.numel)]
        self.fragments = tuple(fragments)
        if len(self.fragments) != cfg.fragments or self.fragments[-1].hi != self.numel:
            raise HypertrainError(
                f"island {island_id}: {len(self.fragments)} fragments up to "
                f"{self.fragments[-1].hi} for a run of {cfg.fragments} over {self.numel} values"
            )
        split = cfg.fragments > 1
        self.schedules = [
            Schedule.of(cfg, fragment=f.index if split else None, island=island_id)
            for f in self.fragments
        ]
        """Each fragment's schedule (one, the run's, when it is not split)."""
        self.schedule = self.schedules[0]
        self.base = theta0.clone()  # flat vectors (base, merges, snapshots) stay on the CPU
        self._base_frame: memoryview | None = None
        """The blob the base lies in (``frame_base``), if it does."""
        self._delta_in_base = False
        """Each sync's delta and error-feedback sum are computed over the base
        (``delta_in_base``)."""
        self._base_valid = True
        """False from a sync that wrote its delta over the base (``frame_base``), or a
        download into it (``merge_target``), until a merge or a loaded state is taken: no
        delta or rejoin state is made of it meanwhile (``_check_base``)."""
        self.codec = make_codec(cfg.regional_codec)
        self.feedbacks = [
            ErrorFeedback(self.codec, f.numel, beta=cfg.ef_beta) for f in self.fragments
        ]
        """Each fragment's error feedback of the regional codec."""
        self.feedback = self.feedbacks[0]
        self.shards = cfg.shards(self.numel)
        """The ranges of the region's relay shards; the island sends each its own part."""
        self.step = 0
        self._base_loaded_at: int | None = None
        """The step at which the parameters were last loaded from the base, bit for bit
        (None: not known, or loaded from anything else since)."""
        self.snapshots: list[dict[int, torch.Tensor]] = [{} for _ in self.fragments]
        """Per fragment: sync_step -> its values of theta then (tau > 0)."""
        self.last_delta_norm = 0.0  # L2 norm of the last pseudo-gradient (for metrics)

    # -- what a subclass provides ----------------------------------------------------------
    def train_step(self) -> float:
        """One inner step at ``self.step``; increments it; returns the training loss."""
        raise NotImplementedError

    def params(self) -> torch.Tensor:
        """The current parameters as one flat fp32 vector (a copy)."""
        raise NotImplementedError

    def params_into(self, out: torch.Tensor) -> None:
        """Write the current parameters into ``out`` (a flat fp32 vector of ``numel``)."""
        out.copy_(self.params())

    def subtract_params(self, out: torch.Tensor, start: int = 0) -> None:
        """``out -= `` the current parameters ``[start, start + out.numel())`` (of the flat
        fp32 vector of ``numel``), the bits of that slice of ``out - params()``."""
        out.sub_(self.params()[start : start + out.numel()])

    def load_params(self, flat: torch.Tensor) -> None:
        """Set the current parameters from a flat fp32 vector."""
        raise NotImplementedError

    def _train_state(self, copy: bool = True) -> dict[str, Any]:
        """The training state to save (``copy=False``: the live tensors)."""
        return {}

    def _load_train_state(self, state: dict[str, Any]) -> None:
        pass

    # -- the sync rules (docs/design.md §2, §3) ----------------------------------------------
    def sync(self, encode: bool = True, fragment: int = 0) -> list[Blob]:
        """At a sync step of ``fragment`` (0: the whole model when the run is not split):
        its regional pseudo-gradient ``base - theta`` through the codec with its error
        feedback, one blob per relay shard (one when the region's relay is not sharded).
        With tau > 0 it also snapshots theta's values for the overlap rule.

        ``encode=False`` (ranks other than 0 of a multi-rank island, which send nothing)
        only takes the snapshot and returns no bytes."""
        self._check_base("a sync")
        fr, feedback = self.fragments[fragment], self.feedbacks[fragment]
        split = len(self.fragments) > 1
        in_base = getattr(self, "_base_frame", None)  # (a core pickled before it had one)
        if encode and in_base is not None and feedback.frames_in_place:
            self._sync_in_base(in_base, feedback)
            return [in_base]
        if encode and getattr(self, "_delta_in_base", False) and not split:  # getattr: as above
            return self._sync_over_base(feedback)
        frame: memoryview | None = None
        if encode and self._frames_whole():
            # fp32: the delta is computed behind the header room of the blob that is sent
            # (ErrorFeedback.encode_framed), so a sync holds one copy of the model, not two
            # (the parameters' copy, then the encoded blob).
            frame, theta = self._framed()
            self.params_into(theta)
        elif split:
            theta = self.params()[fr.lo : fr.hi].clone()  # the fragment's values alone
        else:
            theta = self.params()  # a fresh copy: the delta is computed in its memory
        if self.schedules[fragment].tau:
            self.snapshots[fragment][self.step] = theta.clone()
        if not encode:
            return []
        delta = torch.sub(self.base[fr.lo : fr.hi], theta, out=theta)
        self.last_delta_norm = SegmentNorm.of(delta)
        if frame is not None:
            del theta, delta
            feedback.encode_framed(frame, (self.numel,))
            return [frame]
        if not self.shards.sharded:
            blobs = [feedback.encode(delta, consume=True)]
        else:
            blobs = feedback.encode_parts(delta, self.shards.all_bounds(), consume=True)
        # The new residual lives in the delta's memory now; the old one's is let go here,
        # not held beside it until the next sync (a whole model while the island trains).
        feedback.released = None
        return blobs

    def frame_base(self) -> bool:
        """Keep the base behind the header room of a blob (``alloc_raw``), so that each
        sync's delta is computed in the base's own memory and framed and sent from there
        (``_sync_in_base``): no buffer of a model's size per sync.  The base then holds the
        delta from the sync until that sync's merge replaces it, so only for a driver that
        receives every merge into the base (``merge_target``) and reads the base in
        between for nothing else (the island daemon).  Where the delta is framed in place
        (fp32 regional codec, no relay shards, no fragments); False elsewhere."""
        if not self._frames_whole():
            return False
        if self._base_frame is None:
            frame, base = self._framed()
            base.copy_(self.base)
            self.base, self._base_frame = base, frame
        return True

    def delta_in_base(self) -> bool:
        """``frame_base`` for a delta that is not framed in place (a lossy regional codec,
        or fp32 to relay shards): each sync's delta and its error-feedback sum are
        computed over the base (``_sync_over_base``), and where a residual stays, it stays
        in that memory and the previous residual's memory is the base from then on, which
        the sync's merge is received into (``merge_target``).  So a sync takes no
        model-sized buffer of new memory (the parameters' copy the delta was computed in),
        only the encoded blob (and with tau > 0 the overlap's snapshot of the parameters,
        which it is taken from instead of a second copy); the bits are those of ``sync``
        without it.  For the same driver as ``frame_base`` (the island daemon), without
        streaming fragments; False (nothing set) where ``frame_base`` applies or
        fragments are streamed."""
        if self._frames_whole() or len(self.fragments) > 1:
            return False
        self._delta_in_base = True
        return True

    def _sync_over_base(self, feedback: ErrorFeedback) -> list[Blob]:
        """``sync`` of the whole model over the base (``delta_in_base``): the delta
        ``base - theta`` is written over the base one checksum segment at a time (its
        norm taken while in cache), folded into the error feedback there
        (``ErrorFeedback.encode`` with ``consume``) and encoded.  The base then holds
        the new residual, or nothing the island needs (a lossless codec keeps none), and
        the base moves to the old residual's memory (new memory the first time a residual
        is kept): both are read by nothing until the merge is received into the base.
        An encode that fails (a value not finite) leaves the residual as it was and the
        base spent, as ``_sync_in_base`` does."""
        base = self.base.view(-1)
        norm = SegmentNorm()
        fill = self._spend_base(norm)
        for start in range(0, self.numel, SegmentNorm.STEP):
            fill(start, min(self.numel, start + SegmentNorm.STEP))
        self.last_delta_norm = norm.value()
        if not self.shards.sharded:
            blobs = [feedback.encode(base, consume=True)]
        else:
            blobs = feedback.encode_parts(base, self.shards.all_bounds(), consume=True)
        spare, feedback.released = feedback.released, None
        if not feedback.is_zero:  # the new residual is the base's memory now
            shape = self.base.shape
            self.base = torch.empty_like(self.base) if spare is None else spare.view(shape)
        return blobs

    def _frames_whole(self) -> bool:
        """Is a sync's delta one blob of the whole model, framed where its values lie
        (``ErrorFeedback.encode_framed``: fp32, no fragments, no relay shards)?"""
        return (
            len(self.fragments) == 1
            and not self.shards.sharded
            and self.feedbacks[0].frames_in_place
        )

    def _framed(self) -> tuple[memoryview, torch.Tensor]:
        """A blob's memory with the regional codec's header room in front, and the fp32
        vector of the whole model behind it."""
        head = self.codec.header_length((self.numel,))
        frame = alloc_raw(head + 4 * self.numel)
        return frame, tensor_view(frame, torch.float32, head, self.numel)

    def _sync_in_base(self, frame: memoryview, feedback: ErrorFeedback) -> None:
        """``sync`` of the whole model with the base in ``frame`` (``frame_base``): the
        delta ``base - theta`` is written over the base and framed where it lies; the
        same bytes as ``sync`` without it."""
        norm = SegmentNorm()
        feedback.encode_framed(frame, (self.numel,), self._spend_base(norm))
        self.last_delta_norm = norm.value()

    def _spend_base(self, norm: SegmentNorm) -> Callable[[int, int], None]:
        """Mark the base spent (it holds the sync's delta from here until the merge) and
        return ``fill(start, end)``, which writes the delta ``base - theta`` over the
        base's values ``[start, end)`` and adds their norm to ``norm``: the in-base sync
        paths call it one checksum segment at a time, in order, so that each segment is
        written and then encoded while in cache.  With tau > 0 the overlap's snapshot of
        theta is taken here and the whole delta written at once (``fill`` only takes the
        segments' norms)."""
        base = self.base.view(-1)
        self._base_loaded_at = None
        self._base_valid = False
        if self.schedules[0].tau:
            theta = self.params()  # the overlap's snapshot, kept as it is
            self.snapshots[0][self.step] = theta
            base.sub_(theta)
            del theta

            def fill(start: int, end: int) -> None:
                norm.add(base[start:end])

            return fill

        def subtract(start: int, end: int) -> None:
            self.subtract_params(base[start:end], start)
            norm.add(base[start:end])

        return subtract

    def apply_merge(
        self,
        kind: str,
        payload: torch.Tensor,
        sync_step: int,
        fragment: int = 0,
        before_final: bool = False,
    ) -> None:
        """Apply the merge of ``sync_step`` (of ``fragment``: its values); must be called at
        its pinned step (``Schedule.merge_step``), or, ``before_final``, at the run's last
        step before that step's sync when it is pinned there or later (a fragment whose
        last sync is less than tau steps before the end).

        ``kind`` "regional": ``payload`` is the relay's regional base after its merge of
        ``sync_step`` (b_r - mean, the bits this island's ``base - mean`` would give),
        base <- payload.
        ``kind`` "global": ``payload`` is theta_{g+1}, base <- theta_{g+1}.
        The island then takes base, plus (tau > 0) the progress made during the overlap.
        """
        schedule = self.schedules[fragment]
        merge_step = schedule.merge_step(sync_step)
        early = before_final and self.step == schedule.steps <= merge_step
        if self.step != merge_step and not early:
            raise HypertrainError(
                f"island {self.island_id}: merge of sync step {sync_step} is pinned to step "
                f"{merge_step}, island is at step {self.step}"
            )
        if kind not in ("regional", "global"):
            raise HypertrainError(f"island {self.island_id}: unknown merge kind {kind!r}")
        fr = self.fragments[fragment]
        base = self.base[fr.lo : fr.hi]
        take_into(base, payload)
        self._base_valid = True
        snapshot = self.snapshots[fragment].pop(sync_step, None)
        if len(self.fragments) == 1:
            merged = base if snapshot is None else overlap_merge(base, self.params(), snapshot)
        else:
            merged = self.params()
            now = merged[fr.lo : fr.hi]
            now.copy_(base if snapshot is None else overlap_merge(base, now, snapshot))
        self.load_params(merged)
        # The parameters are the base, bit for bit, unless progress from the overlap (or
        # another fragment's values) went into them.
        self._base_loaded_at = self.step if merged is base else None

    def heal(self, theta: torch.Tensor, sync_step: int) -> None:
        """Rejoin from the global merge of ``sync_step`` after being left behind (the steps
        this island was at went ahead without it): parameters and base are ``theta``, the
        step is ``sync_step`` (the steps up to it are skipped, their data unseen), no
        overlap snapshot is pending, and the error-feedback residual is zero (it was the
        part of deltas relative to a base the run no longer has).  The inner optimizer's
        state is kept (docs/design.md §4.10)."""
        if sync_step < self.step:
            raise HypertrainError(
                f"island {self.island_id}: cannot rejoin at step {sync_step}, it is at {self.step}"
            )
        if len(self.fragments) > 1:  # the config refuses what could leave one behind
            raise HypertrainError(f"island {self.island_id}: no rejoin with fragments yet")
        self.finish(theta)  # base and parameters are theta, no overlap snapshot pending
        self.feedback.load_state_dict({"residual": None, "beta": self.feedback.beta})
        self.step = sync_step
        self._base_loaded_at = sync_step

    def finish(self, theta: torch.Tensor) -> None:
        """End of the run: take the final global parameters (no steps follow, no overlap);
        ``heal`` takes a later global merge the same way."""
        take_into(self.base, theta)
        self._base_valid = True
        for snaps in self.snapshots:
            snaps.clear()
        self.load_params(self.base)
        self._base_loaded_at = self.step

    def merge_target(self) -> torch.Tensor:
        """Where a driver may receive a merge of the whole model: the base itself, which
        ``apply_merge``, ``heal`` and ``finish`` then take without a copy, and no buffer
        of a model's size is allocated per merge.  Sound because nothing reads the base
        from a sync's delta (computed from it) until that sync's merge replaces it: the
        next sync comes after (tau < h_r), an overlap reads the base only once it is the
        merge, and a rejoin state is written right after a merge.  A download that fails
        leaves the base undefined; the driver then fetches again or stops (and resumes
        from the rejoin state on disk), and never computes a delta from it (``sync`` and
        ``state_dict`` refuse the base from here until a merge or a state is taken).  Not with
        streaming fragments: one fragment's merge may wait in memory while a rejoin state
        (with the base) is written."""
        if len(self.fragments) > 1:
            raise HypertrainError(f"island {self.island_id}: no merge target with fragments")
        self._base_valid = False
        return self.base

    def _check_base(self, what: str) -> None:
        if not getattr(self, "_base_valid", True):  # (a core pickled before it had one)
            raise HypertrainError(
                f"island {self.island_id}: {what} at step {self.step} from a base that holds "
                "a delta or a merge being received, not a base (a merge was not applied)"
            )

    def _params_are_base(self) -> bool:
        """``params_equal_base``, known without reading them where they were loaded from
        the base at this step and not written since (right after a global merge without
        overlap: the rejoin state saved there)."""
        loaded = getattr(self, "_base_loaded_at", None)  # (a core pickled before it had one)
        return loaded == self.step or self.params_equal_base()

    def params_equal_base(self) -> bool:
        """Are the current parameters bit-identical to the base (as right after a merge
        without overlap)?  A subclass may answer without copying the parameters."""
        return bool(torch.equal(self.params(), self.base))

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """Everything needed to rejoin exactly: parameters, base, training state, error
        feedback, step and overlap snapshots.

        ``copy=False``: the live tensors, no copies (the caller writes them out before the
        island changes them), and ``params`` None when they equal the base."""

        self._check_base("a rejoin state")

        def keep(t: torch.Tensor) -> torch.Tensor:
            return t.clone() if copy else t

        return {
            "island": self.island_id,
            "step": self.step,
            "params": self.params() if copy or not self._params_are_base() else None,
            "base": keep(self.base),
            **self._train_state(copy),
            **self._sync_state(keep, copy),
        }

    def _sync_state(
        self, keep: Callable[[torch.Tensor], torch.Tensor], copy: bool
    ) -> dict[str, Any]:
        """Error feedback and overlap snapshots: as before fragments when the run is not
        split, else one of each per fragment."""
        feedback = [fb.state_dict(copy=copy) for fb in self.feedbacks]
        snapshots = [{k: keep(v) for k, v in snaps.items()} for snaps in self.snapshots]
        if len(self.fragments) == 1:
            return {"feedback": feedback[0], "snapshots": snapshots[0]}
        return {"feedback": feedback, "snapshots": snapshots}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["island"] != self.island_id:
            raise HypertrainError(f"island state of {state['island']!r}, not {self.island_id!r}")
        self.step = int(state["step"])
        params = state["params"]
        self.load_params(state["base"] if params is None else params)
        self._base_loaded_at = self.step if params is None else None
        self.base.copy_(state["base"])
        self._base_valid = True
        self._load_train_state(state)
        split = len(self.fragments) > 1
        feedback, snapshots = state["feedback"], state["snapshots"]
        if split != isinstance(feedback, list) or (split and len(feedback) != len(self.fragments)):
            raise HypertrainError(
                f"island state of {state['island']!r} is not of a run with "
                f"{len(self.fragments)} fragments"
            )
        for fb, fb_state in zip(self.feedbacks, feedback if split else [feedback], strict=True):
            fb.load_state_dict(fb_state)
        self.snapshots = [
            {int(k): v.clone() for k, v in snaps.items()}
            for snaps in (snapshots if split else [snapshots])
        ]


class IslandCore(IslandState):
    """One island: a model replica with its inner optimizer and its data slice.

    With ``ranks`` (K data-parallel ranks), each rank trains on its K-th of the
    island's batch, rows ``[r*b/K, (r+1)*b/K)`` of the island's rows, and the
    gradients are averaged over ranks before the inner step: the same global batch
    and the same math as one rank, in a different summation order.  Every rank runs
    the same inner steps and merges, so their states stay equal.
    """

    def __init__(
        self,
        cfg: RunConfig,
        island_id: str,
        stream: SampleStream,
        theta0: torch.Tensor,
        ranks: RankGroup | None = None,
        device: torch.device | str = "cpu",
        fragments: Sequence[Fragment] | None = None,
    ) -> None:
        super().__init__(cfg, island_id, theta0, fragments)
        self.stream = stream
        self.ranks = ranks
        k = 1 if ranks is None else ranks.size
        if cfg.batch_per_island % k:
            raise HypertrainError(
                f"island {island_id}: batch_per_island {cfg.batch_per_island} is not divisible "
                f"by its {k} ranks"
            )
        self.device = torch.device(device)
        self.model: GPT = build_model(cfg.model_config(), seed=cfg.seed).to(self.device)
        self.layout = ParamLayout.of(self.model)
        self.layout.load(self.model, theta0)
        self.optimizer = InnerOptimizer(self.model, cfg.inner)
        self.before_update: Callable[[], None] = lambda: None
        """Called after each step's forward pass, before its backward pass (and so before
        the first change to the parameters and the optimizer's state): the island daemon
        waits there for the rejoin state it is writing from them in the background.  Not
        later: a save still running beside the backward pass, where the step holds the
        most, took an island at gpt-125m 100-200 MiB over its bound (issue 12)."""

    def train_step(self) -> float:
        """One inner step on this island's slice of the global batch at ``self.step``."""
        n = self.cfg.topology.n_islands
        if self.ranks is None:
            windows = self.stream.replica_batch(self.step, self.data_index, n)
        else:  # this rank's contiguous share of the island's rows
            k = self.ranks.size
            windows = self.stream.replica_batch(
                self.step, self.data_index * k + self.ranks.rank, n * k
            )
        self.optimizer.set_lr_factor(wsd_factor(self.step, self.cfg.steps, self.cfg.inner))
        self.optimizer.zero_grad()
        loss = self.model.loss(windows.to(self.device))
        self.before_update()
        loss.backward()
        value = float(loss.detach())
        if self.ranks is not None:
            value = self.ranks.average_gradients(self.model, value)
        self.optimizer.step()
        self.optimizer.zero_grad()  # the gradients' memory is free between steps (syncs use it)
        self.step += 1
        return value

    def params(self) -> torch.Tensor:
        return self.layout.flatten(self.model)

    def params_into(self, out: torch.Tensor) -> None:
        self.layout.flatten(self.model, out=out)

    def subtract_params(self, out: torch.Tensor, start: int = 0) -> None:
        self.layout.subtract_from(self.model, out, start)

    def params_equal_base(self) -> bool:
        base = self.layout.unflatten(self.base)
        return all(torch.equal(p.detach(), base[n]) for n, p in self.model.named_parameters())

    def load_params(self, flat: torch.Tensor) -> None:
        self.layout.load(self.model, flat)

    def _train_state(self, copy: bool = True) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(copy)}

    def _load_train_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])


class RegionCore:
    """A relay's numerical state: the global parameters, the regional base, the relay's EF.

    Two ways to take new global parameters: ``set_global`` copies them (the simulator,
    whose global parameters change in place afterwards); ``adopt_global`` keeps the tensor
    itself and never writes to it (the relay machine, which serves it as the global merge),
    and leaves the base equal to it without copying until the first regional merge of
    the round computes ``theta - mean`` straight into the base (the same bits as copying
    and subtracting).  ``base`` always reads as the regional base."""

    def __init__(
        self, cfg: RunConfig, region: str, theta0: torch.Tensor, adopt: bool = False
    ) -> None:
        """``adopt``: keep ``theta0`` itself as the global parameters (see ``adopt_global``)."""
        self.cfg = cfg
        self.region = region
        self.members = cfg.topology.islands_of(region)
        self.codec = make_codec(cfg.regional_codec)
        self.global_codec = make_codec(cfg.global_codec)
        self.theta = theta0 if adopt else theta0.clone()
        self._base: torch.Tensor | None = None  # allocated when first written
        self._base_is_theta = True  # the base equals theta, not yet written into _base
        self.feedback = ErrorFeedback(self.global_codec, theta0.numel(), beta=cfg.ef_beta)
        self._frame: mmap.mmap | None = None  # the base's memory with the forward's header room
        self._in_frame = self.feedback.frames_in_place
        """fp32 forwards: the base lives behind header room, and the forward is framed
        around the delta computed there (``encode_global_delta``), never copied."""
        self._early: EarlySum | None = None
        """The open step's sum so far (``offer``), kept in the base's buffer."""
        self.merged_base: str | None = None
        """``flat_digest`` of the base as the last ``merge`` that completed left it, hashed
        range by range as it was written (None until one has; a refused merge leaves it,
        with the base, as it was)."""

    def __getstate__(self) -> dict[str, Any]:
        """For pickling (the simulator's job checkpoints): the base as a plain tensor, not
        the mapping it lives in.  Only between steps: an open early sum is refused."""
        if self._early is not None:
            raise HypertrainError(f"region {self.region}: no checkpoint while a step is open")
        state = self.__dict__.copy()
        state["_frame"] = None
        if self._base is not None:
            state["_base"] = self._base.clone()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        base = state["_base"]
        self.__dict__.update(state)
        if base is not None and self._in_frame:  # back into a mapping with header room
            self._base = None
            self._buffer().copy_(base)

    def _buffer(self) -> torch.Tensor:
        """The base's own memory, allocated on first use: between a global sync (which
        spends the base) and the next regional merge (or ``warm``) the relay holds no base.
        With an fp32 global codec it is a mapping with room for the forward's header in
        front (pages are given on first write, like ``torch.empty``'s, or by ``warm``)."""
        if self._base is None:
            n = self.theta.numel()
            if self._in_frame:
                head = self.global_codec.header_length((n,))
                self._frame = mmap.mmap(
                    -1, head + 4 * n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                )
                # One fault per 2 MiB, not per 4 KiB, where the kernel allows it.
                self._frame.madvise(mmap.MADV_HUGEPAGE)
                self._base = torch.frombuffer(
                    self._frame, dtype=torch.float32, offset=head, count=n
                )
            else:
                self._base = torch.empty_like(self.theta)
        return self._base

    def warm(self) -> torch.Tensor | None:
        """The memory the next regional merge will write the base into, allocated now if
        it is a mapping (an fp32 global codec, ``_buffer``) not held yet, for the caller to
        fault in (``pages.populate``) while it waits between global rounds, outside any
        lock (populating writes no byte, so a merge that starts meanwhile is not
        disturbed); None when there is nothing to do.  Changes no value: the base still
        reads as theta until a merge writes it.  The relay then holds the base's memory
        between rounds too (theta and the base: the 2m it holds during a round)."""
        if not self._in_frame or self._base is not None:
            return None
        return self._buffer()

    @property
    def base(self) -> torch.Tensor:
        """The regional base b_r (written out of theta when it still equals it)."""
        if self._base_is_theta:
            self._early = None  # its buffer is about to hold the base
            self._buffer().copy_(self.theta)
            self._base_is_theta = False
        return self._buffer()

    def base_view(self) -> torch.Tensor:
        """The regional base, to read only (``theta`` itself while the base equals it)."""
        return self.theta if self._base_is_theta else self._buffer()

    def offer(self, delivered: Mapping[str, Blob], members: tuple[str, ...]) -> None:
        """Add the open step's delivered deltas to its sum now, ahead of its commit, as far
        as the fixed order allows (``EarlySum.next_of``: ``members``, the step's,
        delivered or not).  The commit (``merge``) then adds only the rest, and the
        mean has the same bits as one summed at the commit.

        Only while the base still equals theta (the first regional merge after a global
        one, and every merge where h_r = h_g): the sum is then kept in the base's own
        buffer, which holds nothing yet, so it costs no memory.  After a regional merge
        that buffer holds the base that islands are fetching, and a separate sum would be
        a third model-sized tensor: the commit sums those steps as before.
        A delta that fails to decode here leaves no sum (the commit then validates
        every input and refuses the bad one as it always did).  Never under a robust rule
        (``RobustConfig``): it needs every delta before it adds any."""
        if not self._base_is_theta or not self.cfg.robust.plain:
            return
        self._early = EarlySum.extended(
            self._early,
            lambda: self._buffer().view(-1),
            tuple(self.theta.shape),
            self.codec,
            members,
            delivered,
        )

    def merge(
        self,
        inputs: Mapping[str, Blob],
        digests: Mapping[str, str] | None = None,
        keep: bool = True,
    ) -> tuple[torch.Tensor | None, Commitment]:
        """Fixed-order mean of the islands' deltas; the regional base moves by it.
        ``digests``: the inputs' blob digests, where already known (``aggregate``).

        The mean is computed one range at a time (``streamed_mean``) and each range is
        subtracted from the base while it is in cache; ``keep``: also return the whole
        mean.  Without it (the relay: islands take its base instead of the mean) no
        model-sized tensor is allocated.
        The base moves only once every input is validated (a bad one raises first).
        Where ``offer`` summed the first inputs already, the mean is finished in the
        base's buffer and the base is written over it range by range (same bits)."""
        mean = torch.empty_like(self.theta) if keep else None
        fresh = self._base_is_theta  # base = theta - mean, without copying theta first
        early, self._early = self._early, None
        if early is not None and not (fresh and early.begins(inputs)):
            early = None  # not these inputs (the step closed without some): sum them all
        theta, base = self.theta.view(-1), self._buffer().view(-1)
        flat_mean = None if mean is None else mean.view(-1)
        hasher = TensorHasher(base.dtype, tuple(self.theta.shape))

        def fold(start: int, part: torch.Tensor) -> None:
            end = start + part.numel()
            if flat_mean is not None and early is not None:
                flat_mean[start:end].copy_(part)  # the base is written over it next
            if fresh:
                torch.sub(theta[start:end], part, out=base[start:end])
            else:
                base[start:end].sub_(part)
            hasher.put(4 * start, base[start:end])  # the new base's range, while in cache

        commitment = streamed_mean(
            inputs,
            self.codec,
            tuple(self.theta.shape),
            fold,
            out=mean if early is None else None,
            digests=digests,
            early=early,
            robust=self.cfg.robust,
            parallel=True,
        )
        self._base_is_theta = False
        self.merged_base = hasher.hexdigest()
        return mean, commitment

    def encode_global_delta(self) -> bytes | bytearray | memoryview:
        """``D_r = theta_g - b_r`` through the global codec with the relay's error feedback.

        The difference is computed into the base's buffer (no model-sized allocation per
        round): the base is spent at a global sync and holds nothing until ``set_global``
        / ``adopt_global`` sets it to the new global parameters.  Its memory is let go
        (a lossless codec keeps no residual) or handed the previous residual's buffer,
        and allocated again by the next regional merge: while the relay waits for the
        aggregator it holds theta, the encoded delta and (lossy codecs) the residual."""
        base = self.base
        if self._frame is not None and self.feedback.frames_in_place:  # fp32: framed here
            theta, flat = self.theta.view(-1), base.view(-1)
            del base

            def fill(start: int, end: int) -> None:  # each segment framed while in cache
                torch.sub(theta[start:end], flat[start:end], out=flat[start:end])

            blob: bytes | bytearray | memoryview = self.feedback.encode_framed(
                memoryview(self._frame), (self.theta.numel(),), fill
            )
            del flat
            self._base = self._frame = None  # that memory is the forward's now
            return blob
        torch.sub(self.theta, base, out=base)
        blob = self.feedback.encode(base, consume=True)
        del base
        # Lossy: the base's memory now holds the residual, and the old residual's is free.
        self._base = None if self.feedback.is_zero else self.feedback.released
        self._frame = None
        self.feedback.released = None
        return blob

    def forward_room(self, blob: object) -> torch.Tensor | None:
        """The memory of a forward this core framed in place (``encode_global_delta``,
        fp32: the spent base's mapping) as an fp32 vector of the model's size behind its
        header room, for the driver to download the global merge into once the forward
        needs no more sending (the aggregator acknowledged it): pages that are resident,
        where a new tensor's are fresh memory to fault in during the sync.  None for any
        other blob (a lossy codec's, a read-only one).  The caller must hold the forward's
        bytes nowhere else it still reads them; ``adopt_global`` may then keep the
        download as theta."""
        n = self.theta.numel()
        if not self._in_frame or not isinstance(blob, memoryview) or blob.readonly:
            return None
        head = self.global_codec.header_length((n,))
        if not blob.c_contiguous or blob.nbytes != head + 4 * n:
            return None
        return tensor_view(blob.cast("B"), torch.float32, head, n)

    def set_global(self, theta: torch.Tensor) -> None:
        """The new global parameters, copied (``theta`` may change afterwards)."""
        self._early = None
        self.theta.copy_(theta)
        self._buffer().copy_(theta)
        self._base_is_theta = False

    def adopt_global(self, theta: torch.Tensor) -> None:
        """The new global parameters, kept as they are (no copy): nobody may write to
        ``theta`` afterwards, and this core never writes to its ``theta`` in place."""
        self._early = None
        self.theta = theta
        self._base_is_theta = True


class StepDigests(NamedTuple):
    """What an outer step (``GlobalCore.step``) left, by digest."""

    theta: str
    """``flat_digest`` of the new theta."""
    outer: dict[str, str]
    """``tensor_digest`` of each parameter-sized tensor of the outer state, by name."""


class GlobalCore:
    """The aggregator's numerical state: global parameters and the outer optimizer."""

    def __init__(self, cfg: RunConfig, theta0: torch.Tensor, adopt: bool = False) -> None:
        """``adopt``: keep ``theta0`` itself (this core never writes a theta anything else
        holds: each outer step writes a new one, into new memory or, with ``recycle``, into
        an old theta's once nothing holds it), so the caller must not write to it either."""
        self.cfg = cfg
        self.codec = make_codec(cfg.global_codec)
        self.theta = theta0 if adopt else theta0.clone()
        self.outer = make_outer(cfg.outer)
        self.shards = cfg.shards(theta0.numel())
        self.members = self.shards.members(cfg.topology.regions)
        """Who sends a delta each global round: the regions' relays, or their shards."""
        self.stepped: StepDigests | None = None
        """The digests of ``theta`` and the outer state's tensors as the last ``step`` that
        completed left them, hashed range by range as they were written (None until one
        has; a refused step leaves it, with theta, as it was)."""
        self.before_step: Callable[[], None] = lambda: None
        """Called before an outer step allocates the new parameters: the aggregator daemon
        lets its evaluator drop any state but ``theta`` there (its memory bound)."""
        self._spare: torch.Tensor | None = None
        """The memory the next outer step writes its new theta into (``warm``), if any."""
        self.recycle = False
        """Keep the theta an outer step replaced (``_retired``) and write a later step's
        theta into it once nothing else holds it (``warm``, ``step``): its pages are
        resident, where a new tensor's are fresh memory to fault in.  Set by a driver whose
        memory bound counts the old theta until the next step (the aggregator daemon)."""
        self._retired: torch.Tensor | None = None
        self._early: EarlySum | None = None
        """The open round's first forwards, summed as they came (``offer``), in ``_spare``."""

    def __getstate__(self) -> dict[str, Any]:
        """For pickling (the simulator's job checkpoints): without the ``before_step`` hook,
        which a restored core starts without."""
        state = self.__dict__.copy()
        del state["before_step"]
        state["_spare"] = state["_retired"] = state["_early"] = None  # memory, not state
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.before_step = lambda: None

    def warm(self) -> torch.Tensor | None:
        """The memory the next outer step will write its new theta into, allocated now
        (None if it already is), for the caller to fault in (``pages.populate``) while it
        waits between rounds, outside any lock (populating writes no byte): the step would
        otherwise pay for it inside the round.  Changes no value.  The caller must hold
        nothing that the step's ``before_step`` would let go (the daemon's evaluator of an
        older state), or the aggregator would hold a fourth model-sized tensor; with it,
        it holds between rounds what it holds during a step (old and new theta, the
        outer state)."""
        if self._spare is not None:
            return None
        self._spare = self._reuse()
        if self._spare is not None:
            return None  # the old theta's memory, resident: nothing to fault in
        self._spare = torch.empty_like(self.theta)
        return self._spare

    def offer(self, delivered: Mapping[str, Blob], members: tuple[str, ...]) -> None:
        """Add the open round's delivered forwards to its sum now, ahead of the outer
        step, as far as the fixed region order allows (``EarlySum.next_of``; ``members``:
        the round's, delivered or not): the step then adds only the rest, with the same
        bits (``RegionCore.offer`` is the relay's twin).

        Only in memory already held for the step (``warm``'s spare, which the step writes
        its new theta into, over the mean range by range): nothing is allocated here, so
        a core that was never warmed (the parity simulator's, the audit's replay) sums at
        the step as before; the daemon and the in-process cluster (``rounds/local.py``,
        which the fault simulation runs) warm theirs between rounds.  Not with relay
        shards (a sum per shard range).  A forward that fails to decode here leaves no
        sum (the step refuses it as it always did)."""
        spare = self._spare
        if spare is None or self.shards.sharded:
            return
        self._early = EarlySum.extended(
            self._early,
            lambda: spare.view(-1),
            tuple(self.theta.shape),
            self.codec,
            members,
            delivered,
        )

    def let_go_retired(self) -> None:
        """No outer step follows (the run's last is done): the theta the last one replaced
        is not kept for one (``recycle``)."""
        self._retired = None

    def _reuse(self) -> torch.Tensor | None:
        """The theta the last step replaced (``recycle``), if nothing else holds it now
        (``pages.unshared``: no merge being served, checkpoint being written or
        evaluation reads it); let go either way."""
        retired, self._retired = self._retired, None
        if retired is None or not pages.unshared(retired, holders=1):
            return None
        return retired

    def step(
        self, inputs: Mapping[str, Blob], digests: Mapping[str, str] | None = None
    ) -> Commitment:
        """Fixed-order mean over regions, then one outer step.
        ``digests``: the inputs' blob digests, where already known (``aggregate``).

        The mean is streamed (``segmented_mean``: with relay shards, each shard's range
        is the mean of the regions' deltas for it, summed in the same region order as
        without shards) and each range goes through the outer step while it is in cache,
        into a new tensor that becomes ``theta``: the previous ``theta`` is not written
        while anything holds it (the merge relays fetch, the checkpoint being written and
        the evaluation may all still read it; ``recycle`` reuses its memory only once
        nothing does), and no whole mean is held.  Where ``offer`` summed the first
        forwards already (in the spare this step writes into), the mean is finished there
        and each range of the new theta is written over its range of the mean, once
        hashed (same bits).  Nothing changes unless every input is valid."""
        if not inputs or set(self.members_of(self.regions_of(inputs))) != set(inputs):
            raise HypertrainError(
                f"global step: inputs from {sorted(inputs)} are not every relay of some "
                f"regions (relays: {sorted(self.members)})"
            )
        self.before_step()
        spare, self._spare = self._spare, None
        early, self._early = self._early, None
        segments = self.segments(inputs)
        if early is not None and not (
            spare is not None
            and early.acc.data_ptr() == spare.data_ptr()
            and len(segments) == 1
            and early.begins(segments[0].inputs)
        ):
            early = None  # not these inputs (the round closed without some): sum them all
        reused = self._reuse()  # let go even when there is a spare: at most 3 models here
        if spare is None:
            spare = reused
        del reused
        old, new = self.theta.view(-1), torch.empty_like(self.theta) if spare is None else spare
        flat = new.view(-1)
        theta_hasher = TensorHasher(new.dtype, tuple(new.shape))
        states: dict[str, tuple[torch.Tensor, TensorHasher]] = {}

        def begin() -> None:
            self.outer.begin(old.numel())
            for name, value in self.outer.state_view().items():
                if isinstance(value, torch.Tensor) and value.numel() == old.numel():
                    states[name] = (value.view(-1), TensorHasher(value.dtype, tuple(value.shape)))

        def outer_step(start: int, grad: torch.Tensor) -> None:
            end = start + grad.numel()
            self.outer.step_range(start, old[start:end], grad, flat[start:end])
            # Hashed while in cache: the ranges of theta and of the state the step wrote.
            theta_hasher.put(4 * start, flat[start:end])
            for value, hasher in states.values():
                hasher.put(start * value.element_size(), value[start:end])

        try:
            commitment = segmented_mean(
                segments,
                self.codec,
                tuple(self.theta.shape),
                outer_step,
                digests=digests,
                prepare=begin,
                early=early,  # in new's memory: each range of theta is written over its mean
                parallel=True,
            )
        except BaseException:
            self._spare = spare  # memory, not state: kept for the next step
            raise
        self.outer.end()
        if self.recycle:
            self._retired = self.theta
        self.theta = new
        self.stepped = StepDigests(
            theta_hasher.hexdigest(), {name: h.hexdigest() for name, (_, h) in states.items()}
        )
        return commitment

    def regions_of(self, inputs: Mapping[str, Blob]) -> tuple[str, ...]:
        """The regions that sent inputs (in the topology's order)."""
        sent = {self.shards.split(m)[0] for m in inputs}
        return tuple(r for r in self.cfg.topology.regions if r in sent)

    def members_of(self, regions: tuple[str, ...]) -> tuple[str, ...]:
        """The relay members (regions, or their shards) of ``regions``."""
        return self.shards.members(regions)

    def segments(self, inputs: Mapping[str, Blob]) -> list[Segment]:
        """The inputs of a round (by member id) as the ranges their mean is summed in: one
        per relay shard, each holding the regions' parts for its range keyed by region, so
        the sum runs in the sorted region order of an unsharded run.  A round that went
        ahead without some regions (after its cutoff) has the others only."""
        segments = []
        regions = self.regions_of(inputs)
        for i, (a, b) in enumerate(self.shards.all_bounds()):
            names = {r: self.shards.member(r, i) for r in regions}
            segments.append(Segment(a, b - a, {r: inputs[m] for r, m in names.items()}, names))
        return segments


def take_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` <- ``src``; nothing to copy when ``src`` was received into ``dst``
    (``IslandCore.merge_target``, a relay shard's part received into its range)."""
    if src.data_ptr() != dst.data_ptr() or src.numel() != dst.numel():
        dst.copy_(src)
