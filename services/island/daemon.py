"""hypertrain-island: one model replica that trains and syncs through its region's relay.

    hypertrain-island --region eu --index 0 --relay 127.0.0.1:7071 [--config run.toml]

Each step: one inner step (IslandCore.train_step).  At every sync step s
(a multiple of H_r) the island encodes its delta with error feedback and
pushes it to the relay on a background thread, so training can go on; at
step s + tau it applies the merge of s (the relay's base after its regional merge, or
new global parameters at a multiple of H_g) with IslandCore.apply_merge.  With tau > 0
the merge is fetched in the background once the push is done, while the island trains
on (``IslandRounds.ahead``); with tau = 0 it is fetched at s.  Either fetch blocks until
the relay has the merge.  The merge step never depends on timing.  After the last step
the final global parameters are fetched and loaded (no steps follow, so there is no
overlap progress to keep).

SIGTERM / Ctrl-C stop the island between steps, never inside a merge; SIGTERM first
announces a leave to the relay (one try), so the region does not wait for this island
at its next sync step.  At start the island asks its relay to take it in: a member
since the run began is told so and goes on from its own state; an island on standby,
or one that left, joins and first heals to the merge the relay names
(``RelayMachine.on_member``).  (With relay shards, joins and leaves are not supported
yet: the island neither asks nor announces.)

Under ``torchrun`` the island is K data-parallel ranks (``ranks.py``): rank 0 does
all the talking (relay, tape signature, rejoin state, metrics, log lines) and
broadcasts each merge to the others; every rank applies it at the same step.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import torch
from torch import Tensor

from hypertrain.common.config import RunConfig
from hypertrain.common.data import SampleStream
from hypertrain.common.digest import DIGEST_FORMAT, state_digest
from hypertrain.common.errors import ConfigError
from hypertrain.common.fragments import ISLAND_CALLS, run_fragments
from hypertrain.common.reference import open_dataset
from hypertrain.common.roles import IslandCore
from hypertrain.common.rounds.island import IslandRounds
from hypertrain.common.rounds.machines import JOIN, LEAVE, Committed, Delta, MemberRequest
from hypertrain.common.rounds.store import atomic_save, atomic_write, remove_temps
from hypertrain.common.rounds.transport import Unavailable
from hypertrain.common.schedule import PendingMerge
from hypertrain.common.trust.keys import SigningKey, TrustedKeys
from hypertrain.common.trust.ledger import island_key
from hypertrain.common.trust.receipts import Witness
from hypertrain.island.ranks import TorchRanks
from hypertrain.wire.daemon import fault_point, log_event, memory_fields, starting_parameters
from hypertrain.wire.errors import StaleDelta, WireError
from hypertrain.wire.metrics import Metrics
from hypertrain.wire.options import trim_heap
from hypertrain.wire.peers import Peer
from hypertrain.wire.upstream import GrpcUpstream, Patient

T = TypeVar("T")

#: A model of at most this many fp32 bytes is saved from a copy of its rejoin state: the
#: copy takes milliseconds and a few models' bytes, and the next step never waits for the
#: disk (an island with streaming fragments saves after every fragment's global merge, F
#: times a round).  A larger one is written from the live tensors, which the next step's
#: backward pass waits for (issue 12's memory bounds leave no room for a copy).  The
#: environment's ``HYPERTRAIN_SAVE_COPY_BYTES`` overrides it (0: never a copy).
SAVE_COPY_BYTES = 16 << 20
SAVE_COPY_ENV = "HYPERTRAIN_SAVE_COPY_BYTES"

#: The environment's ``HYPERTRAIN_STEP_SECONDS`` (unset or 0: off): the island trains at
#: most one step per that many seconds, sleeping after a step that took less.  Benches
#: use it to give islands that share a machine's cores a steady step rate, as an island
#: of its own accelerators has (bench/bench_streaming.py ``--step-seconds``); it changes
#: no bit of the run, only when its steps start.
STEP_SECONDS_ENV = "HYPERTRAIN_STEP_SECONDS"
FINAL_REPORT_WAIT_S = 60.0
"""How long an island keeps reporting its final state to a relay that is down."""


class Island:
    """The island's driver: training loop, pushes and pinned merges."""

    def __init__(
        self,
        cfg: RunConfig,
        island_id: str,
        relay: Peer | list[Peer] | None,
        metrics: Metrics | None = None,
        key: SigningKey | None = None,
        state_dir: Path | None = None,
        ranks: TorchRanks | None = None,
        stop: threading.Event | None = None,
        device: torch.device | str = "cpu",
        trusted: TrustedKeys | None = None,
    ) -> None:
        """``relay``: the region's relay, or its shards' in shard order (common/shards.py);
        None exactly on ranks other than 0 of a multi-rank island.  ``trusted``: the keys
        it pins; with a ``state_dir`` it checks and keeps the receipts of every merge it
        applies there (``common/trust/receipts.py``)."""
        torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.island_id = island_id
        self.ranks = ranks
        self.stop = stop or threading.Event()
        self.lead = ranks is None or ranks.rank == 0
        if (relay is None) == self.lead:
            raise ValueError("rank 0 (and only rank 0) of an island talks to the relay")
        mcfg = cfg.model_config()
        stream = SampleStream(open_dataset(cfg), mcfg.seq_len, cfg.global_batch, cfg.seed)
        layout, theta0 = starting_parameters(cfg)
        frags = run_fragments(cfg, layout) if cfg.fragments > 1 else None
        if frags is not None and ranks is not None:
            raise ConfigError("an island of several ranks does not sync by fragment yet")
        self.core = IslandCore(cfg, island_id, stream, theta0, ranks, device, frags)
        # Each sync's delta is computed in the base's memory and sent from there (fp32,
        # without shards or fragments), or computed and encoded there (any other codec,
        # the residual then kept there: ``delta_in_base``), the merge then received into
        # the base (``_download``): nothing else reads the base from a sync to its merge.
        if self.lead and not self.core.frame_base():
            self.core.delta_in_base()
        witness = Witness(
            state_dir, island_key(island_id), cfg.run_id, trusted if state_dir else None
        )
        self.rounds = IslandRounds(self.core, cfg.run_id, witness)
        self.numel = theta0.numel()
        self.received = torch.empty(self.numel, dtype=torch.float32)
        shards = self.core.shards
        peers = None if relay is None else relay if isinstance(relay, list) else [relay]
        if peers is not None and len(peers) != shards.count:
            raise ValueError(f"{len(peers)} relay addresses for {shards.count} relay shards")
        self.relays = (
            None
            if peers is None
            else [
                Patient(
                    # No buffer of its own: merges are received into the base
                    # (``_download``), or with fragments into a fresh buffer per merge,
                    # freed once applied.
                    GrpcUpstream(peer, cfg.run_id, end - start, reuse_buffer=False),
                    f"Relay {peer.address}",
                    self.stop.is_set,
                    lambda message: log_event(
                        "waiting", role="island", island=island_id, message=message
                    ),
                )
                for peer, (start, end) in zip(peers, shards.all_bounds(), strict=True)
            ]
        )
        self.peers = peers
        self.fragment_relays = (
            []
            if peers is None or frags is None
            else [
                Patient(
                    GrpcUpstream(
                        peers[0], cfg.run_id, f.numel, reuse_buffer=False, fragment=f.index
                    ),
                    f"Relay {peers[0].address}",
                    self.stop.is_set,
                    lambda message: log_event(
                        "waiting", role="island", island=island_id, message=message
                    ),
                )
                for f in frags
            ]
        )
        """With streaming fragments: the region's relay, for each fragment's deltas and
        merges."""
        # With relay shards every push and fetch goes to all of them at once.
        self.calls = (
            ThreadPoolExecutor(max_workers=shards.count, thread_name_prefix="shard")
            if shards.sharded
            else None
        )
        # With streaming fragments, a step's pushes go to their fragments' relays at once
        # (each fragment has its own rounds and tape; at the last step every one syncs).
        self.fragment_calls = (
            ThreadPoolExecutor(
                max_workers=min(len(frags), ISLAND_CALLS), thread_name_prefix="fragment"
            )
            if self.fragment_relays and frags is not None
            else None
        )
        self.key = key
        self.state_path = state_dir / "island.pt" if state_dir else None
        self.pusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="push")
        # Merges fetched ahead of their pinned step (tau > 0), one per fragment at once up
        # to ISLAND_CALLS (a run's last step syncs every fragment): ``_fetch_ahead``.
        self.fetcher = ThreadPoolExecutor(
            max_workers=min(len(self.core.schedules), ISLAND_CALLS), thread_name_prefix="fetch"
        )
        self.fetching: dict[tuple[int, int], Future[tuple[list[Committed], Tensor | None]]] = {}
        self.saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="save")
        self.saving: Future[None] = _done()
        self.save_wait_s = 0.0
        self.saving_live = False  # the save in flight reads the live tensors
        limit = _environ(SAVE_COPY_ENV, SAVE_COPY_BYTES, r"[0-9]+", "a byte count")
        self.save_copy = 4 * self.numel <= int(limit)
        pace = _environ(STEP_SECONDS_ENV, 0, r"[0-9]+(\.[0-9]+)?", "a number of seconds")
        self.step_seconds = float(pace)
        self.core.before_update = self._saved_live
        self.blocked_s = 0.0
        self.bytes_sent = 0
        self.syncs = 0
        self.stale = 0  # deltas refused as stale (their step closed without this island)
        self.heals = 0  # rejoined from a later global merge after being left behind
        self.leave_on_stop = False  # SIGTERM: announce a leave before stopping
        self.left = False  # ... and the relay took it: a clean end (exit 0)
        self.pushing: Future[None] = _done()  # the push in flight
        self.metrics = metrics or Metrics("island")
        self.tokens_per_step = cfg.batch_per_island * mcfg.seq_len
        self._labels = {"region": self.core.region, "island": island_id}

    def _on_shards(self, fn: Callable[[int], T]) -> list[T]:
        """``fn(i)`` for every relay shard i, at once when there are several."""
        assert self.relays is not None
        if self.calls is None:
            return [fn(0)]
        return list(self.calls.map(fn, range(len(self.relays))))

    def _push(self, deltas: list[Delta]) -> None:
        """Push each relay shard its part (the region's relay: the one delta; with
        streaming fragments, each fragment's delta of the step to its relay), at once."""
        assert self.relays is not None
        relays = (
            [self.fragment_relays[d.fragment or 0] for d in deltas]
            if self.fragment_relays
            else self.relays
        )

        fault_point("island_before_push")

        def push(i: int) -> None:
            delta = deltas[i]
            if self.key is not None:
                delta = delta.signed(self.key.sign(delta.transfer_message()))
            try:
                relays[i].push(delta)
            except StaleDelta as e:
                # The step closed without this island at its cutoff: its delta is not
                # aggregated, and the island takes the step's merge like every member.
                # Its error-feedback residual stays as the encode left it.
                self.stale += 1
                self.metrics.stale_deltas.labels(**self._labels).inc()
                self._log("stale", role="island", island=self.island_id, step=delta.sync_step,
                          message=e.message)  # fmt: skip

        if self.fragment_calls is not None:
            list(self.fragment_calls.map(push, range(len(deltas))))
            return
        self._on_shards(push)

    def _download(
        self, step: int, kind: str, fragment: int
    ) -> tuple[list[Committed], Tensor | None]:
        """Rank 0: the merge of ``step`` (of streaming ``fragment``) from the relay, into
        the base (without fragments); with relay shards every shard's part, into its
        range of the base, which comes with them.  (Joined, and its receipts checked, by
        ``_fetch``.)"""
        if self.fragment_relays:
            return [self.fragment_relays[fragment].fetch(self.island_id, step, kind)], None
        relays = self.relays
        assert relays is not None
        # Received straight into the base (IslandCore.merge_target), which takes it
        # without a copy: no model-sized buffer of fresh memory per merge.
        whole = self.core.merge_target()
        if self.saving_live:  # a rejoin state written from the live base: done first
            self.saving.result()
        if self.calls is None:
            return [relays[0].fetch(self.island_id, step, kind, whole)], None
        bounds = self.core.shards.all_bounds()
        parts = self._on_shards(
            lambda i: relays[i].fetch(self.island_id, step, kind, whole[slice(*bounds[i])])
        )
        return parts, whole

    def _fetch_ahead(self, push: Future[None]) -> None:
        """With tau > 0 (rank 0): start fetching, in the background, each merge this island
        will take at a later step (``IslandRounds.ahead``) once ``push``, the push in
        flight, is done, so its transfer overlaps the steps before it is due instead of
        following them.  ``_fetch`` takes it at the pinned step as before; only when its
        bytes arrive changes.  The merge is received into the base (nothing reads it
        until the merge is applied: ``IslandCore.merge_target``); with fragments, into a
        buffer held from its arrival until then."""
        if not self.lead:
            return
        for p in self.rounds.ahead():
            key = (p.item, p.sync_step)
            if key not in self.fetching:
                self.fetching[key] = self.fetcher.submit(
                    self._download_after, push, p.sync_step, p.kind, p.item
                )

    def _download_after(
        self, push: Future[None], step: int, kind: str, fragment: int
    ) -> tuple[list[Committed], Tensor | None]:
        """``_download`` once ``push`` is done (a fetch ahead's job)."""
        push.result()
        return self._download(step, kind, fragment)

    def _fetch(self, step: int, kind: str, fragment: int = 0) -> tuple[torch.Tensor, int]:
        """The merge of ``step`` (of streaming ``fragment``): on rank 0 from the relay (or
        as fetched ahead, ``_fetch_ahead``), joined and its receipts checked, then on every
        rank; and the sync step it is the merge of (a later global one when this island was
        left behind: ``IslandRounds.heal``)."""
        if self.relays is None:  # a rank other than 0: rank 0 fetches and broadcasts it
            assert self.ranks is not None
            got = int(self.ranks.broadcast(torch.zeros(1, dtype=torch.int64))[0])
            return self.ranks.broadcast(self.received), got
        ahead = self.fetching.pop((fragment, step), None)
        parts, whole = ahead.result() if ahead is not None else self._download(step, kind, fragment)
        del ahead  # the future holds the merge too
        payload, got = self.rounds.join(parts, out=whole, fragment=fragment), parts[0].sync_step
        del parts, whole
        if self.ranks is not None:
            self.ranks.broadcast(torch.tensor([got], dtype=torch.int64))
            self.ranks.broadcast(payload)
        return payload, got

    def _stopping(self) -> bool:
        """Stop before the next step?  On a multi-rank island all ranks agree."""
        return self.stop.is_set() if self.ranks is None else self.ranks.stopping

    def run(self) -> str:
        """Train to the end; returns the final state digest.  Stopped by a signal
        (KeyboardInterrupt, or a wait given up: WireError), after SIGTERM it first
        announces its leave, whatever it was doing (training, pushing, waiting for a
        merge); ``left`` says whether the relay took it."""
        try:
            return self._run()
        except (KeyboardInterrupt, WireError):
            if self.stop.is_set():
                self._leave(self.pushing)
            raise

    def _run(self) -> str:
        done = self._finished_before()
        if done is not None:
            return done
        rounds = self.rounds
        push: Future[None] = _done()
        sent = 0
        t_start = t_interval = time.perf_counter()
        losses: list[float] = []
        m, labels = self.metrics, self._labels
        train_loss = 0.0

        def take(merges: list[PendingMerge[int]], t_trained: float, save: bool = True) -> bool:
            """Fetch and apply ``merges`` in order (each once this island's push in flight
            is done); False when a fetch was answered with a later global merge (left
            behind: healed there).  ``save``: write the rejoin state after a global merge
            (not for the last step's merges taken before its sync: a state saved there
            would resume with the last delta never sent)."""
            nonlocal train_loss
            while merges:
                merge = merges.pop(0)
                t0 = time.perf_counter()
                push.result()
                t1 = time.perf_counter()
                payload, got = self._fetch(merge.sync_step, merge.kind, merge.item)
                t2 = time.perf_counter()
                self.blocked_s += t2 - t0
                if got != merge.sync_step:
                    self._heal(got, payload, merge.sync_step)
                    del payload
                    losses.clear()
                    return False
                rounds.apply(merge, payload)
                del payload  # applied (copied into the model and the base): free it
                trim_heap()  # and the fetch's chunks, freed on gRPC's threads
                self._merged(merge.sync_step, t2 - t0, time.perf_counter() - t1)
                if merge.kind == "global" and save:
                    self._save(merges)
                if losses:
                    train_loss = round(sum(losses) / len(losses), 5)
                self._log(
                    "sync",
                    role="island",
                    island=self.island_id,
                    step=merge.sync_step,
                    kind=merge.kind,
                    **({"fragment": merge.item} if self.fragment_relays else {}),
                    train_loss=train_loss,
                    bytes=sent,
                    blocked_s=round(self.blocked_s, 4),
                    push_wait_s=round(t1 - t0, 4),
                    fetch_s=round(t2 - t1, 4),
                    # from the end of this step's training to the next step's start
                    sync_s=round(time.perf_counter() - t_trained, 4),
                    **memory_fields(),
                )
                losses.clear()
            return True

        if self._resume():
            take(rounds.due(), time.perf_counter())  # (fragments) what it waited for
        self._join()
        while self.core.step < rounds.last_step:  # its own end (an anneal may stop it)
            if self._stopping():
                raise KeyboardInterrupt
            t_step = time.perf_counter()
            losses.append(self.core.train_step())
            step = self.core.step
            if self.step_seconds:  # a steady step rate (STEP_SECONDS_ENV); a stop wakes it
                self.stop.wait(max(0.0, t_step + self.step_seconds - time.perf_counter()))
            t_trained = time.perf_counter()
            m.inner_steps.labels(**labels).inc()
            m.tokens.labels(**labels).inc(self.tokens_per_step)
            # The step's freed pages (activations, gradients) go back to the kernel before
            # anything else: otherwise the next step or the sync's copies of the model
            # come on top of whatever free heap this step left resident.
            trim_heap()
            # At the last step, a fragment's merge still pending is taken before its sync.
            if not take(rounds.before_sync(), t_trained, save=False):
                continue
            t0 = time.perf_counter()
            self._saved_live()  # (done by now: a sync may write over the base)
            deltas = rounds.after_step(encode=self.lead)
            if rounds.last_sync is not None and rounds.last_sync[0] == step:
                if deltas:
                    push = self.pushing = self.pusher.submit(self._push, deltas)
                    self._fetch_ahead(push)  # (none with tau = 0: IslandRounds.ahead)
                    sent = sum(len(d.data) for d in deltas)
                    deltas = []  # the pusher holds them until they are sent, no longer
                    self._sent(sent, time.perf_counter() - t0)
                if losses:  # (none left when the last step's merges came first)
                    m.train_loss.labels(**labels).set(sum(losses) / len(losses))
                    m.tokens_per_second.labels(**labels).set(
                        len(losses) * self.tokens_per_step / (time.perf_counter() - t_interval)
                    )
                t_interval = time.perf_counter()
            take(rounds.due(), t_trained)
        t0 = time.perf_counter()
        push.result()
        # The final global state (fragment by fragment with streaming fragments); none
        # when it rejoined at the last step: the final state is in.
        while (final := rounds.final_due()) is not None:
            theta, _ = self._fetch(final.sync_step, "global", final.item)
            self._saved()
            finished = rounds.finish(theta)
            del theta  # in the base and the model now
            if finished:
                break
        self.blocked_s += time.perf_counter() - t0
        if rounds.stops_early:  # an islands:K anneal: its last delta is in, it stops here
            self._saved()
            rounds.stop()
            digest = state_digest(self.core.layout.unflatten(self.core.params()))
        else:  # finish() loaded the parameters from the base: its digest is theirs, with
            # no copy of the model made to compute it
            digest = state_digest(self.core.layout.unflatten(self.core.base))
            fault_point("island_before_final_mark")
            self._mark_final(digest)
            fault_point("island_before_final_report")
            self._report_final()
        if self.ranks is not None:
            self.ranks.check_equal(digest)
        wall = time.perf_counter() - t_start
        self._log(
            "done",
            role="island",
            island=self.island_id,
            step=self.core.step,
            digest=digest,
            bytes_per_sync=self.bytes_sent // max(self.syncs, 1),
            syncs=self.syncs,
            stale=self.stale,
            heals=self.heals,
            blocked_s=round(self.blocked_s, 4),
            wall_s=round(wall, 3),
            blocked_share=round(self.blocked_s / wall, 5),
            save_wait_s=round(self.save_wait_s, 4),
            ranks=1 if self.ranks is None else self.ranks.size,
        )
        return digest

    @property
    def _final_path(self) -> Path | None:
        """``final``: written once this island holds the run's final state (its digest)."""
        return None if self.state_path is None else self.state_path.parent / "final"

    def _mark_final(self, digest: str) -> None:
        """Keep that this island holds the final state before reporting it: started
        again after its report (its relay may be gone by then), it only reports again."""
        path = self._final_path
        if path is not None and self.lead:
            mark = {"run_id": self.cfg.run_id, "config": self.cfg.digest, "digest": digest,
                    "digest_format": DIGEST_FORMAT}  # fmt: skip
            atomic_write(path, json.dumps(mark, sort_keys=True).encode())

    def _finished_before(self) -> str | None:
        """Started again after it held the final state: report it (again) and end with
        its digest; None when it has not finished yet."""
        path = self._final_path
        if path is None or not path.exists():
            return None
        mark = json.loads(path.read_text())
        if mark.get("run_id") != self.cfg.run_id or mark.get("config") != self.cfg.digest:
            raise ConfigError(f"{path} belongs to another run or config")
        # (a mark without the field was written before digest format 2, with sha256)
        if (written := mark.get("digest_format", 1)) != DIGEST_FORMAT:
            raise ConfigError(
                f"{path} holds a state digest of digest format {written}; this build computes "
                f"format {DIGEST_FORMAT}: the run's end cannot be reported in this --state-dir"
            )
        self._report_final()
        self._log("done", role="island", island=self.island_id, step=self.cfg.steps,
                  digest=mark["digest"], resumed=True)  # fmt: skip
        return str(mark["digest"])

    def _report_final(self) -> None:
        """Report the final state kept to each relay it fetched it from (every shard, or
        every fragment's relay): a relay ends once every member of the last step has
        (``RelayNode.applied``).  Kept trying while a relay is down, for a while: the
        island holds the final state either way."""
        relays = self.fragment_relays or self.relays
        if not relays or not self.lead:
            return
        give_up = time.monotonic() + FINAL_REPORT_WAIT_S
        for relay in relays:
            try:
                relay.report_applied(
                    self.island_id, self.cfg.steps, lambda: time.monotonic() > give_up
                )
            except WireError as e:
                self._log("warning", role="island", island=self.island_id,
                          message=f"report of the final state not taken: {e}")  # fmt: skip

    def _member_request(self, change: str) -> MemberRequest:
        """A signed join or leave, issued now: later than any this island asked before
        (``member-issued`` in its state folder), even if the clock stepped back since."""
        issued = time.time_ns()
        mark = self.state_path.parent / "member-issued" if self.state_path else None
        if mark is not None:
            with contextlib.suppress(FileNotFoundError, ValueError):
                issued = max(issued, int(mark.read_text()) + 1)
            mark.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(mark, str(issued).encode())
        req = MemberRequest(self.cfg.run_id, change, self.island_id, self.core.step, issued)
        return req if self.key is None else req.signed(self.key.sign(req.message()))

    def _join(self) -> None:
        """Ask the relay to take this island in; a new member heals to the merge it names
        first (every rank: rank 0 asks and broadcasts the answer).  (Not with relay shards
        or streaming fragments yet: every island is a member throughout.)"""
        if self.core.shards.sharded or self.fragment_relays:
            return
        start: int | None = None
        if self.relays is not None:
            decision = self.relays[0].member(self._member_request(JOIN))
            start = decision.start
            if not decision.duplicate:
                self._log("joined", role="island", island=self.island_id, start=start,
                          message=decision.reason)  # fmt: skip
        if self.ranks is not None:
            start = int(self.ranks.broadcast(torch.tensor([start or 0], dtype=torch.int64))[0])
        due = self.rounds.join_from(start)
        if due is not None:
            payload, got = self._fetch(*due)
            self._heal(got, payload, due[0])

    def _leave(self, push: Future[None]) -> None:
        """Stopping on SIGTERM: once the push in flight is done (or given up), tell the
        relay this island leaves (one try: the relay may be gone too)."""
        if (
            self.left
            or not (self.leave_on_stop and self.lead and not self.core.shards.sharded)
            or self.fragment_relays
        ):
            return
        assert self.relays is not None
        with contextlib.suppress(WireError):  # given up at the stop: it goes on without it
            push.result()
        try:
            decision = self.relays[0].upstream.member(self._member_request(LEAVE))
        except (Unavailable, WireError) as e:
            self._log("leave", role="island", island=self.island_id, announced=False,
                      message=str(e))  # fmt: skip
            return
        self.left = decision.accepted
        self._log("leave", role="island", island=self.island_id, announced=decision.accepted,
                  message=decision.reason)  # fmt: skip

    def _log(self, event: str, **fields: object) -> None:
        if self.lead:  # one island, one voice
            log_event(event, **fields)

    def _heal(self, sync_step: int, payload: torch.Tensor, wanted: int) -> None:
        """Left behind: the relay answered the fetch of ``wanted`` with the global merge of
        the later ``sync_step``; rejoin there (``IslandRounds.heal``) and save that state."""
        self._saved()
        for ahead in self.fetching.values():  # for steps it no longer waits for
            ahead.cancel()
        self.fetching.clear()
        self.rounds.heal(sync_step, payload)
        self.heals += 1
        self.metrics.heals.labels(**self._labels).inc()
        self._log("healed", role="island", island=self.island_id, wanted=wanted, step=sync_step)
        if not self.rounds.finished:
            self._save()

    def _save(self, taken: list[PendingMerge[int]] | None = None) -> None:
        """After a global merge: the state this island rejoins from after a crash (with
        streaming fragments, and the merges it waits for: ``taken``, handed out and not
        applied yet, and those pending).

        Written on a background thread during the next step's forward pass, from the live
        tensors (no copies); the step's backward pass waits for it (``_saved_live``, the
        core's ``before_update``), so what is written is the state right after the merge.
        A model of at most ``SAVE_COPY_BYTES`` is written from a copy instead, which no
        step waits for; a save waits for the one before it, so one copy at most is held.
        (Waiting at the optimizer update instead let the save overlap the backward pass,
        and an island at gpt-125m peaked 100-200 MiB over its bound in most such runs.)
        The file is replaced atomically: a crash mid-write leaves the previous state, from
        which the island retrains deterministically.  Rank 0 writes it; every rank of a restarted
        island loads it (their states are equal)."""
        if self.state_path is not None and self.lead:
            state: dict[str, Any] = {"run_id": self.cfg.run_id, "config": self.cfg.digest}
            self._saved()
            state |= self.rounds.rejoin_state(taken or [], copy=self.save_copy)
            self.saving = self.saver.submit(atomic_save, self.state_path, state)
            self.saving_live = not self.save_copy

    def _saved_live(self) -> None:
        """Before the optimizer changes the tensors: wait for a save that reads them."""
        if self.saving_live:
            self._saved()

    def _saved(self) -> None:
        """Wait for the rejoin state being written (a failed write is raised here)."""
        if self.saving.done():
            self.saving.result()
            return
        t0 = time.perf_counter()
        self.saving.result()
        self.save_wait_s += time.perf_counter() - t0

    def _resume(self) -> int:
        """Load the rejoin state if there is one; returns the step to continue after.

        Training from it is deterministic, so the island re-sends bit-identical deltas
        for steps its relay already has (answered as duplicates) and catches up."""
        if self.state_path is not None and self.lead:
            # A kill mid-save left its temp file (the size of the rejoin state, several
            # times the model's): nothing reads it, so it goes before the first save.
            files, size = remove_temps(self.state_path.parent, self.state_path.name)
            if files:
                self._log("swept", role="island", island=self.island_id, files=files, bytes=size)
        if self.state_path is None or not self.state_path.exists():
            return 0
        state = torch.load(self.state_path, weights_only=True)
        if state["run_id"] != self.cfg.run_id or state["config"] != self.cfg.digest:
            raise ConfigError(f"{self.state_path} belongs to another run or config")
        self.rounds.load_rejoin_state(state)
        self._log("resumed", role="island", island=self.island_id, step=self.core.step)
        return self.core.step

    def _sent(self, size: int, encode_s: float) -> None:
        m, region = self.metrics, self.core.region
        self.bytes_sent += size
        self.syncs += 1
        m.encode_seconds.labels("island", region).observe(encode_s)
        m.sent_bytes.labels("island", "regional", region).inc(size)
        m.delta_size.labels("island", "regional", region).observe(size)
        m.compression_ratio.labels("island", "regional", region).set(4 * self.numel / size)
        m.pseudo_grad_norm.labels(**self._labels).set(self.core.last_delta_norm)

    def _merged(self, sync_step: int, blocked_s: float, decode_s: float) -> None:
        m, region = self.metrics, self.core.region
        m.blocked_hist.labels(**self._labels).observe(blocked_s)
        m.decode_seconds.labels("island", region).observe(decode_s)
        m.last_step.labels("island", region).set(sync_step)
        m.last_round.labels("island", region).set(self.rounds.schedule.round_of(sync_step))

    def install_signals(self) -> None:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            self.leave_on_stop = self.leave_on_stop or signum == signal.SIGTERM
            self.stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)

    def close(self) -> None:
        self.stop.set()
        self.pusher.shutdown(wait=True, cancel_futures=True)
        self.saver.shutdown(wait=True)  # a rejoin state being written is finished
        self.fetcher.shutdown(wait=False, cancel_futures=True)
        self.fetching.clear()
        for peer in self.peers or []:
            peer.close()  # which ends a fetch ahead still in flight
        self.fetcher.shutdown(wait=True)
        for calls in (self.calls, self.fragment_calls):
            if calls is not None:
                calls.shutdown(wait=True, cancel_futures=True)


def _environ(name: str, default: int, pattern: str, what: str) -> str:
    """The environment's ``name`` (``default`` when unset), which must match ``pattern``
    whole; else a ConfigError naming it as ``what`` it must be."""
    value = os.environ.get(name, str(default))
    if not re.fullmatch(pattern, value):
        raise ConfigError(f"{name} must be {what}, got {value!r}")
    return value


def _done() -> Future[None]:
    """A finished push (before the first sync; ranks other than 0 push nothing)."""
    future: Future[None] = Future()
    future.set_result(None)
    return future
