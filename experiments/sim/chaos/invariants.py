"""The invariants checked while a fault schedule runs (and at its end).

After every event (a message delivered, a step trained, a node crashed or restarted):

1. No accepted delta is lost: every push a node answered "accepted" is known to that
   node, with the same digest, for as long as it is up, restarts included.
2. None is counted twice: every committed aggregate has each member of its step exactly
   once, present or named absent (the configured members, less those on standby, changed
   by the joins and leaves the node taped); members are absent only from a step whose cutoff the
   node took first; a sync step of a level is committed once (a replay may commit it
   again only identically).
3. Every committed aggregate is recomputable from its committed inputs: the published
   blobs of its members give the same fixed-order mean and commitment.
4. Every island that applies the merge of sync step s holds the same base as every
   other island that applied it, and as the node that committed it (with streaming
   fragments: the same range of it, the merge's fragment's).
5. Every island ends on the same final parameters.

At the end of the schedule (runner.py): the run completed; the final digest equals the
fault-free run's when no step went ahead without a member (else every island still ends
on one digest, invariant 5); no node's folder holds what a crash left
(``NodeStore.leftovers``, swept when a node's recovery resumes it); and the run's tapes
pass the audit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hypertrain.common.aggregate import segmented_mean, streamed_mean
from hypertrain.common.roles import GlobalCore
from hypertrain.common.rounds.local import Cluster, Observer
from hypertrain.common.rounds.machines import (
    Committed,
    Cut,
    Decision,
    Delta,
    Effect,
    Membership,
)
from hypertrain.common.shards import Shards
from hypertrain.common.trust.ledger import flat_digest
from hypertrain.common.trust.schema import MemberEntry, records


class Violation(Exception):
    """An invariant broke; the message says which and where."""


class Checker(Observer):
    """Watches one cluster (see the module docstring)."""

    def __init__(
        self,
        cluster_members: dict[str, tuple[str, ...]],
        on_crash: Callable[[str], None] = lambda name: None,
        shards: Shards | None = None,
        standby: tuple[str, ...] = (),
        anneal: tuple[tuple[int, ...], tuple[str, ...]] | None = None,
    ) -> None:
        """``anneal``: an ``islands:K`` anneal's first step (each streaming fragment's, in
        fragment order: one when the run is not split) and the islands it keeps."""
        self.members = cluster_members  # node name -> its configured members
        self.anneal = anneal
        self.standby = standby  # islands that are not members when the run starts
        self.changes: dict[str, list[MemberEntry]] = {n: [] for n in cluster_members}
        """Node -> the joins and leaves it took, as observed (and, after a restart, as its
        tape records them): the checker folds them itself (``_members_of``)."""
        self.shards = shards  # the relay shards of each region (None: one relay)
        self.on_crash = on_crash  # the runner restarts a crashed process after a while
        self.cluster: Cluster | None = None
        self.acked: dict[str, dict[tuple[int, str], str]] = {n: {} for n in cluster_members}
        self.commits: dict[tuple[str, int], str] = {}  # (node, sync step) -> commitment digest
        self.bases: dict[tuple[str, int], str] = {}  # (region or "*", step) -> base digest
        self.finals: dict[str, str] = {}
        self.dirty: set[str] = set()  # nodes to check in full after this event
        self.cuts: set[tuple[str, int]] = set()  # (node, sync step) whose cutoff was taken
        self.absences = 0  # commits that went ahead without some member

    def attach(self, cluster: Cluster) -> None:
        self.cluster = cluster

    # -- observations ------------------------------------------------------------------------
    def pushed(self, node: str, delta: Delta, decision: Decision) -> None:
        if not decision.accepted:
            return
        key = (delta.sync_step, delta.sender)
        known = self.acked[node].setdefault(key, delta.digest)
        if known != delta.digest:
            raise Violation(
                f"{node} accepted two different deltas from {delta.sender} for step "
                f"{delta.sync_step}"
            )
        self._check_known(node, key)

    def committed(self, node: str, effect: Effect) -> None:
        if isinstance(effect, Cut):
            self.cuts.add((node, effect.record.sync_step))
            return
        if isinstance(effect, Membership):
            self.changes[node].append(effect.record)
            return
        if not isinstance(effect, Committed) or effect.record is None:
            return
        c = effect.commitment
        absent = tuple(getattr(effect.record, "absent", None) or ())
        want = tuple(sorted(self._members_of(node, effect.sync_step)))
        counted = [*c.members, *absent]
        if tuple(sorted(counted)) != want or len(counted) != len(want):
            raise Violation(
                f"{node} committed step {effect.sync_step} with members {list(c.members)} "
                f"and absent {list(absent)}, not each of {list(want)} once"
            )
        if absent:
            self.absences += 1
            if (node, effect.sync_step) not in self.cuts:
                raise Violation(
                    f"{node} went ahead without {list(absent)} at step {effect.sync_step} "
                    "before its cutoff"
                )
        key = (node, effect.sync_step)
        seen = self.commits.setdefault(key, c.digest)
        if seen != c.digest:
            raise Violation(f"{node} committed step {effect.sync_step} twice, differently")
        self._recompute(node, effect)
        group = "*" if effect.level == "global" else self._group_of(node)
        group += self._part_of(node)
        post = getattr(effect.record, "post_base", None) or getattr(
            effect.record, "post_state", None
        )
        if post is not None:
            self._same_base(group, effect.sync_step, str(post), node)

    def _members_of(self, node: str, step: int) -> tuple[str, ...]:
        """The members of ``step`` at ``node``: its configured members, less those on
        standby, changed by the joins and leaves it took before, each from its sync step
        (folded here, not asked of the machine under test)."""
        members = {m for m in self.members[node] if m not in self.standby}
        for c in self.changes[node]:
            if c.sync_step <= step:
                if c.change == "join":
                    members.add(c.member)
                else:
                    members.discard(c.member)
        if self.anneal is not None and step > self.anneal[0][self._fragment_of(node)]:
            # after an islands:K anneal starts: its islands, and the regions they are in
            kept = set(self.anneal[1]) | {i.rpartition("-")[0] for i in self.anneal[1]}
            members &= kept
        return tuple(sorted(members))

    def applied(
        self, island: str, kind: str, sync_step: int, base: torch.Tensor, fragment: int = 0
    ) -> None:
        assert self.cluster is not None
        frags = self.cluster.fragments
        if frags is not None:  # streaming fragments: each one's base is its range
            group = "*" if kind == "global" else island.rpartition("-")[0]
            part = base.view(-1)[frags[fragment].lo : frags[fragment].hi]
            self._same_base(f"{group}.f{fragment}", sync_step, flat_digest(part), island)
            return
        if kind == "global" or self.shards is None or not self.shards.sharded:
            group = "*" if kind == "global" else island.rpartition("-")[0]
            self._same_base(group, sync_step, flat_digest(base), island)
            return
        region = island.rpartition("-")[0]  # each relay shard's base is its range
        for i, (a, b) in enumerate(self.shards.all_bounds()):
            group = self.shards.member(region, i)
            self._same_base(group, sync_step, flat_digest(base.view(-1)[a:b]), island)

    def _part_of(self, node: str) -> str:
        """What a node's base groups add when the run is split into streaming fragments:
        its fragment (``.f1``; "" when not split)."""
        assert self.cluster is not None
        return "" if self.cluster.fragments is None else f".f{self._fragment_of(node)}"

    def _fragment_of(self, node: str) -> int:
        """The streaming fragment a node serves (0 when the run is not split)."""
        assert self.cluster is not None
        fragment = getattr(self.cluster.actors[node], "fragment", None)
        return 0 if fragment is None else int(fragment.index)

    def _group_of(self, node: str) -> str:
        """Who shares the base a relay commits: its region's islands (a relay shard: the
        range of their bases it owns, grouped under its member id)."""
        assert self.cluster is not None
        actor = self.cluster.relays[node]
        return actor.member

    def finished(self, island: str, theta: torch.Tensor) -> None:
        if self.anneal is not None and island not in self.anneal[1]:
            return  # an islands:K anneal stopped it on its own last step's parameters
        self.finals[island] = flat_digest(theta)
        if len(set(self.finals.values())) > 1:
            raise Violation(f"islands end on different parameters: {self.finals}")

    def crashed(self, name: str) -> None:
        self.dirty.add(name)
        self.on_crash(name)

    # -- checks ------------------------------------------------------------------------------
    def _same_base(self, group: str, step: int, digest: str, who: str) -> None:
        seen = self.bases.setdefault((group, step), digest)
        if seen != digest:
            raise Violation(
                f"{who} holds base {digest[:12]} after the merge of step {step}, others {seen[:12]}"
            )

    def _node(self, name: str) -> object | None:
        assert self.cluster is not None
        actor = self.cluster.actors[name]
        return getattr(actor, "node", None) if actor.alive else None

    def _check_known(self, node: str, key: tuple[int, str]) -> None:
        n = self._node(node)
        if n is None:
            return
        have = n.machine.level.accepted.get(key)  # type: ignore[attr-defined]
        if have != self.acked[node][key]:
            raise Violation(
                f"{node} lost the accepted delta from {key[1]} for step {key[0]} (it knows {have})"
            )

    def after_event(self) -> None:
        """Full checks of the nodes that restarted since the last event."""
        if not self.dirty:
            return
        assert self.cluster is not None
        for name in list(self.dirty):
            actor = self.cluster.actors[name]
            if not actor.alive:
                continue
            self.dirty.discard(name)
            for key in self.acked.get(name, {}):
                self._check_known(name, key)
            self._reload_changes(name)

    def _reload_changes(self, name: str) -> None:
        """After a restart: the joins and leaves a node took are those on its tape (a
        crash may come after a change was taped and before it was observed)."""
        store = getattr(self._node(name), "store", None)
        if store is None or name not in self.changes:
            return
        taped = [r for r in records(store.entries()) if isinstance(r, MemberEntry)]
        seen = self.changes[name]
        if taped[: len(seen)] != seen[: len(taped)]:
            raise Violation(f"{name}: its tape's joins and leaves are not those it took")
        self.changes[name] = taped if len(taped) >= len(seen) else seen

    def _recompute(self, node: str, c: Committed) -> None:
        n = self._node(node)
        store = getattr(n, "store", None)
        if store is None:
            return
        blobs = {
            m: (store.published / d).read_bytes()
            for m, d in zip(c.commitment.members, c.commitment.input_digests, strict=True)
        }
        machine = n.machine  # type: ignore[attr-defined]
        core = machine.core
        shape = (core.theta.numel(),)
        if isinstance(core, GlobalCore):  # with relay shards: range by range
            commitment = segmented_mean(core.segments(blobs), core.codec, shape)
        else:
            commitment = streamed_mean(blobs, core.codec, shape)
        if commitment.digest != c.commitment.digest:
            raise Violation(
                f"{node}: the aggregate of step {c.sync_step} does not recompute from its "
                "published inputs"
            )
