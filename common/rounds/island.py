"""An island's side of the round: when it sends, which merge it needs, when it applies it.

``IslandRounds`` wraps an island's state (``roles.IslandCore``, or the fault
simulation's ``toy.ToyIsland``) and the schedule.  After every inner step the driver
asks it what to do:

- ``after_step()``: at a sync step, the deltas to push, one per relay shard of the
  region (encoded with error feedback, snapshotted for the overlap rule); the merge of
  that step becomes pending;
- ``due()``: the pending merges pinned to the current step: the driver fetches each
  (blocking, or retrying in a simulation) and hands it to ``apply``;
- ``ahead()``: the pending merges pinned to a later step that this island will take: a
  driver may fetch them while it trains on (the island daemon does, with tau > 0), and
  still applies each only when ``due`` hands it out;
- ``final_due()``: after the last step the driver fetches the final global state and
  calls ``finish`` (an island an ``islands:K`` anneal stops, ``stops_early``, fetches
  nothing: once its last push is acknowledged it calls ``stop``).
- streaming fragments (``RunConfig.fragments`` > 1): each fragment syncs on its own
  schedule; deltas and pending merges name their fragment (``Delta.fragment``,
  ``PendingMerge.item``), the driver fetches each from that fragment's relay, and the
  final state comes a fragment at a time (``final_due`` / ``finish`` until it returns
  True).  At the last step, a fragment whose merge is still pending takes it before the
  step's sync (``before_sync``), as the simulator's flush does.
- ``join(parts)``: with relay shards, a merge is fetched from every shard and joined
  here into the whole vector ``apply`` / ``finish`` take; the receipts each part came
  with are checked and kept first (``common/trust/receipts.py``).
- ``heal(sync_step, payload)``: a fetch was answered with a newer global merge than the
  one asked for (the island was left behind): rejoin from it.
- ``join_from(start)``: the relay took this island's join (``RelayMachine.on_member``):
  the merge it must fetch and ``heal`` to before it trains, or None.

The island daemon, the in-process cluster and the fault simulation all drive islands
through this class, so none of them re-derives the schedule.
"""

from __future__ import annotations

from typing import Any

import torch

from hypertrain.common.errors import HypertrainError
from hypertrain.common.roles import IslandState, take_into
from hypertrain.common.rounds.machines import Committed, Delta
from hypertrain.common.schedule import PendingMerge, PendingMerges, Schedule, SyncKind
from hypertrain.common.trust.ledger import relay_key
from hypertrain.common.trust.receipts import Witness


def _order(p: PendingMerge[int]) -> tuple[int, int]:
    return p.item, p.sync_step


class IslandRounds:
    """The schedule-driven sync loop of one island (see the module docstring)."""

    def __init__(self, core: IslandState, run_id: str, witness: Witness | None = None) -> None:
        """``witness``: checks and keeps the receipts of every merge joined (None: none)."""
        self.core = core
        self.run_id = run_id
        self.witness = witness
        self.schedule: Schedule = core.schedule
        """The run's schedule (fragment 0's when the run is split)."""
        self.last_step = max(s.steps for s in core.schedules)
        """This island's last step: the run's, or, when an ``islands:K`` anneal stops it,
        the anneal's first step (with streaming fragments, the last fragment's: it leaves
        each fragment at that fragment's own start, and trains on to the last)."""
        self.pendings: list[PendingMerges[int]] = [PendingMerges(s) for s in core.schedules]
        """Per fragment, the merges it waits for (the item: the fragment's index)."""
        self.codec = str(core.codec.spec)
        self.last_sync: tuple[int, SyncKind] | None = None
        self._final: torch.Tensor | None = None  # fragments' final values, as they come

    @property
    def step(self) -> int:
        return self.core.step

    @property
    def finished(self) -> bool:
        """Trained every step (the final merge may still be outstanding)."""
        return self.core.step >= self.last_step

    @property
    def stops_early(self) -> bool:
        """An ``islands:K`` anneal does not keep this island: its schedule ends at the
        anneal's first step, whose delta it pushes (it is merged in) and then stops, without
        waiting for that merge (its relay may follow the run past it meanwhile)."""
        return self.last_step < self.core.cfg.steps

    def stop(self) -> None:
        """An island that ``stops_early``: its last push was acknowledged; nothing more."""
        if not (self.finished and self.stops_early):
            raise HypertrainError(f"island {self.core.island_id}: stop before its last step")
        self._flush()

    def _flush(self) -> list[PendingMerge[int]]:
        return [p for q in self.pendings for p in q.flush()]

    def before_sync(self) -> list[PendingMerge[int]]:
        """At the run's last step, before its sync: the merges still pending (pinned to
        that step, or later with tau > 0), to fetch and ``apply`` first, so the final delta
        is taken from the state they give (the simulator's flush).  Only a fragment whose
        last sync before the end lies less than tau steps back has one."""
        if self.core.step != self.last_step or self.stops_early:
            return []
        return [p for q in self.pendings if len(q) for p in q.flush()]

    def after_step(self, encode: bool = True) -> list[Delta]:
        """After an inner step: at a sync step, the deltas to push, the i-th for relay shard
        i (one when the region's relay is not sharded), fragment by fragment when the run
        is split; none on other steps, and none with ``encode=False``, for ranks that send
        nothing but must snapshot."""
        step = self.core.step
        shards = self.core.shards
        out: list[Delta] = []
        for f, schedule in enumerate(self.core.schedules):
            kind = schedule.sync_kind(step) if step <= schedule.steps else None
            if kind is None:  # not a sync step (or past this island's end of the fragment)
                continue
            blobs = self.core.sync(encode=encode, fragment=f)
            self.pendings[f].add(step, kind, f)
            self.last_sync = (step, kind)
            out.extend(
                Delta.of(
                    self.run_id,
                    step,
                    self.core.island_id,
                    self.codec,
                    blob,
                    schedule,
                    shard=shards.label(i),
                )
                for i, blob in enumerate(blobs)
            )
        return out

    def join(
        self, parts: list[Committed], out: torch.Tensor | None = None, fragment: int = 0
    ) -> torch.Tensor:
        """The payload of a merge fetched from each relay shard, in shard order, as one
        vector (the part itself when the relay is not sharded).  HypertrainError unless
        the parts are one merge: same step and kind, each the size of its shard (a
        regional merge at a global sync step is empty everywhere), each with valid
        receipts (``ReceiptError``).  ``out``: the whole vector, into whose ranges the
        parts were received (nothing is copied then)."""
        shards = self.core.shards
        if len(parts) != shards.count:
            raise HypertrainError(
                f"a merge from {len(parts)} relay shards, expected {shards.count}"
            )
        if len({(p.sync_step, p.kind) for p in parts}) != 1:
            raise HypertrainError("merge parts of different steps or kinds")
        if self.witness is not None:
            for i, p in enumerate(parts):
                source = relay_key(shards.member(self.core.region, i))
                self.witness.take(
                    p.sync_step, p.kind, p.receipts, source, self.core.schedules[fragment].fragment
                )
        if shards.count == 1:
            return parts[0].payload
        empty = all(p.payload.numel() == 0 for p in parts)
        for i, p in enumerate(parts):
            a, b = shards.bounds(i)
            if not empty and p.payload.numel() != b - a:
                raise HypertrainError(
                    f"merge part of relay shard {i} has {p.payload.numel()} values, "
                    f"the shard owns {b - a}"
                )
        if out is None or empty:
            return torch.cat([p.payload.view(-1) for p in parts])
        for i, p in enumerate(parts):
            a, b = shards.bounds(i)
            take_into(out[a:b], p.payload.view(-1))  # (nothing to copy where received in place)
        return out

    def due(self) -> list[PendingMerge[int]]:
        """The merges to fetch and apply now (pinned to the current step, within the run),
        in fragment order."""
        step = self.core.step
        out: list[PendingMerge[int]] = []
        for q in self.pendings:
            head = q.peek()
            if head is not None and not self._applies(q, head.sync_step):
                continue  # the last step's merge: taken by ``finish`` (or by no one)
            out.extend(q.due(step))
        return out

    def ahead(self) -> list[PendingMerge[int]]:
        """The pending merges pinned to a later step than the current one that this island
        will take (handed out by ``due`` or ``before_sync``, or its final state through
        ``final_due``), in fragment and step order: with tau > 0 a driver may fetch them
        while it trains on, and applies each only when it is handed out.  Fetching ahead
        changes when the bytes arrive, never the step a merge is applied at.  Not the last
        merge of an island an ``islands:K`` anneal stops: it never takes that one."""
        step = self.core.step
        return [
            p
            for q in self.pendings
            for p in q
            if p.merge_step > step and (not self.stops_early or self._applies(q, p.sync_step))
        ]

    def _applies(self, q: PendingMerges[int], sync_step: int) -> bool:
        """Is the merge of ``sync_step`` applied at a step this island trains?  Not its last
        step's.  An island an ``islands:K`` anneal stops takes the merge of a fragment it
        leaves before its own last step, as every island takes one in the run: it trains
        on from the merged state (the fragment's schedule ends there, and its last merge
        is not its final state)."""
        if not self.stops_early:
            return q.schedule.applies_in_run(sync_step)
        return q.schedule.merge_step(sync_step) < self.last_step  # (its last step's: no)

    def apply(self, merge: PendingMerge[int], payload: torch.Tensor) -> None:
        """Apply ``merge`` (from ``due``, or ``before_sync`` at the last step)."""
        self.core.apply_merge(
            merge.kind, payload, merge.sync_step, fragment=merge.item, before_final=True
        )

    def final_due(self) -> PendingMerge[int] | None:
        """After the last step: the merge whose global state ends the run (the next
        fragment's, when the run is split), or None."""
        if not self.finished or self.stops_early:
            return None
        return next((q.peek() for q in self.pendings if len(q)), None)

    def finish(self, theta: torch.Tensor) -> bool:
        """Take the final global state of ``final_due``'s merge (the whole model, or its
        fragment's values); True once the island holds the run's final state."""
        head = self.final_due()
        if head is None:
            raise HypertrainError(f"island {self.core.island_id}: no final merge to take")
        left = self.pendings[head.item].flush()
        if len(left) != 1 or not self.pendings[head.item].schedule.is_final(left[0].sync_step):
            raise HypertrainError(
                f"island {self.core.island_id}: the run ends with merges of steps "
                f"{[p.sync_step for p in left]} pending"
            )
        if len(self.pendings) == 1:
            self.core.finish(theta)
            return True
        if self._final is None:
            self._final = torch.empty(self.core.numel)
        fr = self.core.fragments[head.item]
        self._final[fr.lo : fr.hi].copy_(theta.view(-1))
        if self.final_due() is not None:
            return False
        self.core.finish(self._final)
        self._final = None
        return True

    def join_from(self, start: int | None) -> tuple[int, SyncKind] | None:
        """After a join was taken with ``start`` (``Decision.start``): the merge (sync step
        and kind) to fetch and ``heal`` to before training, or None when this island
        already stands there or later (or ``start`` is None or 0: a member since the run
        began continues from its own state; 0 is the initial parameters, which a new
        island has)."""
        if not start or start <= self.core.step:
            return None
        kind = self.schedule.sync_kind(start)
        assert kind is not None
        return start, kind

    def heal(self, sync_step: int, payload: torch.Tensor) -> None:
        """The relay answered a fetch with the global merge of a later ``sync_step`` than the
        one asked for: this island was left behind; it rejoins there
        (``IslandState.heal``), with nothing pending, and is a member again from the next
        sync step (at the run's last step, ``payload`` is the final state).  A joining
        island takes the merge its join names the same way (a regional one when it joins
        a region that no member holds).  An island an ``islands:K`` anneal stops, left
        behind past its own last step (the run went on to a later global merge while its
        last delta was refused as stale), takes that merge and is finished: it has nothing
        left to push, and nothing it trains counts."""
        past_end = self.stops_early and sync_step >= self.last_step
        if (
            not (past_end or self.schedule.is_sync_step(sync_step, "regional"))
            or sync_step < self.core.step
        ):
            raise HypertrainError(
                f"island {self.core.island_id}: cannot rejoin at step {sync_step} from step "
                f"{self.core.step}"
            )
        self._flush()
        self.core.heal(payload, sync_step)
        self.last_sync = None

    def rejoin_state(self, taken: list[PendingMerge[int]], copy: bool = True) -> dict[str, Any]:
        """The state this island rejoins from after a crash (saved right after a global
        merge): its core's (``copy=False``: the live tensors), and when the run is split,
        every merge it still waits for (a merge of one fragment's global round may be
        applied while another fragment's are pending): ``taken`` (handed out by ``due``,
        not applied yet) and those pending, as ``[fragment, sync_step, kind]`` in fragment
        and step order."""
        state = self.core.state_dict(copy=copy)
        if len(self.pendings) > 1:
            waiting = sorted([*taken, *(p for q in self.pendings for p in q)], key=_order)
            state["pending"] = [[p.item, p.sync_step, p.kind] for p in waiting]
        return state

    def load_rejoin_state(self, state: dict[str, Any]) -> None:
        """Take a ``rejoin_state``: the core's state, and the merges it waited for (none
        when the run is not split), which the driver fetches from ``due`` on."""
        self.core.load_state_dict(state)
        self.resume()
        for fragment, sync_step, kind in state.get("pending", []):
            self.pendings[int(fragment)].add(int(sync_step), kind, int(fragment))

    def resume(self) -> None:
        """After loading a rejoin state (saved right after a global merge): nothing pending."""
        self._flush()
