"""hypertrain-aggregator: the global state and the outer optimizer.

    hypertrain-aggregator --listen 127.0.0.1:0 --state-dir agg [--config run.toml]

RPCs (service Aggregator):
- PushRegional: a relay streams its committed regional delta for a global
  round; the ``AggregatorNode`` (common/rounds/node.py) verifies it and keeps it
  under its digest in ``<state-dir>/published/``.  When every region has
  delivered, the fixed-order (sorted region) mean goes through the outer
  optimizer; the round is taped, then written durably (``checkpoints/round-N.pt``
  and ``state.pt``: temp file, fsync, rename) before the push is answered.
- FetchGlobal: blocks until the round of a sync step is applied, streams theta.
- Status.

Held-out loss is evaluated on a background thread after each round (it never
delays the round) and logged as ``event=eval``.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import torch

from hypertrain.common.config import RunConfig
from hypertrain.common.data import HOLDOUT_WINDOWS, holdout_windows
from hypertrain.common.digest import state_digest
from hypertrain.common.flat import ParamLayout
from hypertrain.common.fragments import run_fragments
from hypertrain.common.model import build_model, evaluate
from hypertrain.common.pages import populate
from hypertrain.common.reference import open_dataset
from hypertrain.common.rounds.machines import Committed
from hypertrain.common.rounds.node import AggregatorNode
from hypertrain.common.rounds.store import FRAGMENT_DIR, NodeStore
from hypertrain.common.schedule import Schedule
from hypertrain.common.shards import relay_members
from hypertrain.common.trust.keys import SigningKey, TrustedKeys
from hypertrain.common.trust.ledger import flat_digest, relay_key
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.daemon import (
    fault_point,
    log_event,
    log_pruned,
    log_swept,
    memory_fields,
    starting_parameters,
)
from hypertrain.wire.metrics import Metrics
from hypertrain.wire.options import CHECKPOINT_NICE, lower_priority, trim_heap
from hypertrain.wire.rounds import CHECKPOINT_HOLD_S, Intake, MergeBoard
from hypertrain.wire.server import (
    PartShutdown,
    Shutdown,
    fragment_of,
    maps_errors,
    push_fragment,
)
from hypertrain.wire.tls import PLAINTEXT, Callers, Security

AGGREGATOR_DONE = "run complete: every relay has applied the final state"
#: How long the aggregator keeps serving the final state, once every relay of the last
#: round holds it, to relays absent from that round (``AggregatorService._check_final``).
FINAL_GRACE_S = 10.0


STALE_STATE_BYTES = 64 << 20
"""A state smaller than this is evaluated to the end even after the aggregator let it go
(``Evaluator.release_except``): a quarter of the 256 MiB the aggregator may hold beyond
its 3m, and the demo's initial held-out loss is never skipped for a few hundred KiB."""


_LET_GO = "the aggregator's next outer step let this state go"


def _skipped(round_: int, step: int, reason: str) -> None:
    """A state's held-out evaluation left out (``event=eval_skipped``), and why."""
    log_event("eval_skipped", role="aggregator", round=round_, step=step, reason=reason)


class Evaluator:
    """Held-out loss of each new global state, on its own thread and model.

    At most one state waits: a state submitted while an older one still waits replaces
    it (logged ``event=eval_skipped``), so an evaluation slower than a round (the thread
    runs at the lowest priority on a busy host) never holds a model-sized state per
    round in memory.  The newest state, and so the run's final one, is always evaluated.

    Nor does it hold one the aggregator itself has let go: an outer step holds the old
    and the new parameters and the momentum (3m), and an evaluation of an older state
    still running then would be a fourth model (issue 12: at gpt-125m the evaluation of
    the initial state, slow at the lowest priority while islands train, outlived two
    rounds).  The node calls ``release_except`` before each outer step; an evaluation of
    any other state ends there (at its next batch, logged ``event=eval_skipped``), and
    the model lets go of a state once its evaluation is over.  Models under
    ``STALE_STATE_BYTES`` are exempt: their evaluations always finish."""

    def __init__(self, cfg: RunConfig, metrics: Metrics, layout: ParamLayout) -> None:
        self.cfg = cfg
        self.metrics = metrics
        mcfg = cfg.model_config()
        holdout = holdout_windows(open_dataset(cfg), mcfg.seq_len, n=HOLDOUT_WINDOWS, seed=cfg.seed)
        self.windows = holdout.windows[: cfg.holdout_windows]
        self.model = build_model(mcfg, seed=cfg.seed)
        self.layout = layout
        self.wake: queue.Queue[bool] = queue.Queue()  # True: a state waits; False: stop
        self._waiting: tuple[int, int, torch.Tensor] | None = None  # the one state queued
        self._average: torch.Tensor | None = None  # the LAWA average, after the last state
        self._lock = threading.Lock()
        self._newest = -1  # the step of the newest state handed in
        self._current: torch.Tensor | None = None  # the state being evaluated
        self._abort = threading.Event()  # end the evaluation of _current (release_except)
        self._released = threading.Condition(self._lock)  # _current went back to None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="eval", daemon=True)
        self.thread.start()

    def submit(self, round_: int, step: int, theta: torch.Tensor) -> None:
        with self._lock:
            if step <= self._newest:  # two handlers may hand in their rounds out of order
                older: tuple[int, int, torch.Tensor] | None = (round_, step, theta)
                newer = self._newest
            else:
                older, self._waiting = self._waiting, (round_, step, theta)
                newer, self._newest = step, step
        if older is None:
            self.wake.put(True)
        else:
            _skipped(
                older[0], older[1], f"the state of step {newer} is newer and is evaluated instead"
            )

    def submit_average(self, theta: torch.Tensor) -> None:
        """The LAWA average (RunConfig.lawa): evaluated once no round's state waits, and
        logged as ``event=eval_lawa``."""
        with self._lock:
            self._average = theta
        self.wake.put(True)

    def _take(self) -> tuple[int, int, torch.Tensor] | None:
        """The state to evaluate next (None: stop); round -1 at step -1: the LAWA average."""
        while True:
            if not self.wake.get():
                return None
            with self._lock:
                newest, self._waiting = self._waiting, None
                if newest is None and self._average is not None:
                    newest, self._average = (-1, -1, self._average), None
            if newest is not None:
                return newest

    def _run(self) -> None:
        # Held-out loss is for people, not for the run: at the lowest CPU priority
        # (per thread on Linux) it never steals time from islands on a shared host.
        lower_priority(19)
        while (job := self._take()) is not None:
            round_, step, theta = job
            with self._lock:
                self._current = theta
            # A view, not a copy: a global state is never written while held (each outer
            # step writes a new theta, GlobalCore.recycle), so the model reads it while
            # the next runs.
            self.layout.bind(self.model, theta)
            del job, theta  # held by the model's views and _current, until _let_go
            try:
                trim_heap()  # the first bind frees the model's own parameters into the heap
                loss = evaluate(self.model, self.windows, stop=self._stop_evaluating)
                aborted = math.isnan(loss) and self._abort.is_set()
            finally:  # also when it fails: an outer step may be waiting for the state to go
                self._let_go()
            if self.stopping.is_set():
                return
            if aborted:  # (stopping, handled above, aborts it too)
                _skipped(round_, step, _LET_GO)
                continue
            if step == -1:  # the LAWA average: not a round's state
                log_event("eval_lawa", role="aggregator", heldout_loss=round(loss, 6))
                continue
            self.metrics.heldout_loss.labels("aggregator").set(loss)
            log_event(
                "eval", role="aggregator", round=round_, step=step, heldout_loss=round(loss, 6)
            )

    @property
    def evaluating(self) -> bool:
        """Whether the model holds a state (an evaluation is under way)."""
        return self._current is not None

    def _stop_evaluating(self) -> bool:
        return self.stopping.is_set() or self._abort.is_set()

    def _let_go(self) -> None:
        """The evaluation is over: the model holds no state until the next one."""
        for p in self.model.parameters():
            p.data = torch.empty(0)
        with self._lock:
            self._current = None
            self._abort.clear()
            self._released.notify_all()

    def release_except(self, keep: torch.Tensor) -> None:
        """Hold no state but ``keep`` (the parameters an outer step starts from): an
        evaluation of another one ends at its next batch, and this waits until the model
        has let go of it.  A state waiting to be evaluated is normally ``keep`` itself
        (the node hands each in after its step); an older one still waiting is dropped."""
        if keep.numel() * keep.element_size() < STALE_STATE_BYTES:
            return
        dropped = None
        with self._lock:
            waiting = self._waiting
            if waiting is not None and waiting[2].data_ptr() != keep.data_ptr():
                dropped, self._waiting = waiting, None  # handed in after a newer state was made
            current = self._current
            if current is not None and current.data_ptr() != keep.data_ptr():
                self._abort.set()
                while self._current is current and self.thread.is_alive():
                    self._released.wait(timeout=1.0)
        if dropped is not None:
            _skipped(dropped[0], dropped[1], _LET_GO)

    def holds_only(self, keep: torch.Tensor) -> bool:
        """Does this evaluator hold no state but ``keep`` (being evaluated, or waiting)?"""
        with self._lock:
            held = [w[2] for w in (self._waiting,) if w is not None]
            held += [t for t in (self._current, self._average) if t is not None]
        return all(t.data_ptr() == keep.data_ptr() for t in held)

    def close(self, finish: bool = True) -> None:
        """Stop after the queued evaluations (``finish``: the run's final held-out loss
        is part of its result), or only wait a little for the one in progress (a stop
        mid-run: at the lowest priority on a busy host it may take long, and a held-out
        loss is not worth holding up a stop: it ends at its next batch, so no thread of
        torch's is left running when the process exits)."""
        if not finish:
            self.stopping.set()
        self.wake.put(False)
        self.thread.join(timeout=None if finish else 30)


class AggregatorService:
    """The Aggregator servicer: receive and translate; the AggregatorNode decides."""

    def __init__(
        self,
        cfg: RunConfig,
        state_dir: Path,
        shutdown: Shutdown,
        metrics: Metrics | None = None,
        key: SigningKey | None = None,
        trusted: TrustedKeys | None = None,
        security: Security = PLAINTEXT,
        fragment: tuple[int, torch.Tensor] | None = None,
        joint: AggregatorFragments | None = None,
        keep_rounds: int = 0,
    ) -> None:
        """``security``: with TLS, only relays may push, fetch or report, each as
        itself (``tls.Callers``).  ``fragment``: the streaming fragment it serves (its
        index and initial values), in ``<state-dir>/fragment-<index>``, as a part of
        ``joint``, which evaluates and reports the joined model.  ``keep_rounds``: the
        global rounds whose checkpoints and inputs it keeps (``NodeStore.prune``; 0: all)."""
        self.cfg = cfg
        topo = cfg.topology
        self.callers = Callers(
            security,
            {m: relay_key(m) for m in relay_members(topo.regions, topo.relay_shards)},
        )
        self.joint = joint
        self._status_memo: tuple[str, str] | None = None
        self.fragment: int | None = None
        if fragment is None or joint is None:
            self.layout, theta0 = starting_parameters(cfg)
        else:
            self.fragment, theta0 = fragment
            self.layout = joint.layout
            state_dir = state_dir / f"{FRAGMENT_DIR}-{self.fragment}"
        self.numel = theta0.numel()
        state_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir = state_dir
        where: dict[str, object] = {} if self.fragment is None else {"fragment": self.fragment}
        self.node = AggregatorNode(
            cfg,
            theta0,
            # checkpoints written while the islands train on (the tape entry decides a round)
            NodeStore(
                state_dir,
                cfg.run_id,
                key,
                crash=fault_point,
                defer=True,
                hold_s=CHECKPOINT_HOLD_S,
                writer_init=lambda: lower_priority(CHECKPOINT_NICE),
                keep_rounds=keep_rounds,
                on_prune=log_pruned("aggregator", where),
                on_sweep=log_swept("aggregator", where),
            ),
            trusted,
            security.ca_fingerprint,
            fragment=self.fragment,
        )
        self.shutdown = shutdown
        self.board = MergeBoard(cfg, shutdown, self.fragment)
        self.metrics = metrics or Metrics("aggregator")
        self.intake = Intake(self.node, self.board, self.metrics, after_cutoff=self._after)
        self.t_first = 0.0  # first regional arrival of the open round (for the round log)
        # Logs each round (its state digest takes 0.2 s at P = 1e8) after the relay's push
        # is answered, not before: one thread, so rounds are logged in order.
        self.reporter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="round-log")
        # Warms the next outer step's memory and spool files (``_warm``), from when the
        # relays have the merge, while their islands may still be taking it: below the
        # islands' CPU priority, as the checkpoints are.
        self.warmer = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="warm",
            initializer=lambda: lower_priority(CHECKPOINT_NICE),
        )
        if joint is None:
            self.evaluator = Evaluator(cfg, self.metrics, self.layout)
            core = self.node.machine.core
            core.before_step = lambda: self.evaluator.release_except(core.theta)
            core.recycle = True  # its 3m counts the old theta until the next step
        else:
            self.evaluator = joint.evaluator
        self._grace: threading.Timer | None = None  # the end, for relays absent at it
        if not self.node.recover():
            if joint is None:
                self.evaluator.submit(-1, 0, theta0)  # read only: nobody writes theta0 in place
        else:
            self._rounds_done(self._take_done())
            log_event(
                "recovered",
                role="aggregator",
                round=self.node.machine.round,
                open_step=self.node.machine.level.open_step,
                **self.node.recovered,
            )
            self._check_final()
        self.intake.rearm()

    def _check_final(self) -> None:
        """Stop once every relay of the last round holds the final state; relays absent
        from it (a region everyone left, which follows the rounds, or one left behind)
        get up to ``FINAL_GRACE_S`` more to fetch it and report, then the run ends
        without them."""
        with self.board.cond:
            node = self.node
            if not (node.done and node.all_final()):
                return
            everyone = node.finals >= set(node.machine.level.roster)
        if everyone:
            self.board.shutdown.request(AGGREGATOR_DONE)
        elif self._grace is None:
            log_event("final_grace", role="aggregator", waiting_s=FINAL_GRACE_S,
                      message="relays absent from the last round may still fetch it")  # fmt: skip
            self._grace = threading.Timer(
                FINAL_GRACE_S,
                lambda: self.board.shutdown.request(
                    f"{AGGREGATOR_DONE}; relays absent from the last round had {FINAL_GRACE_S:.0f} s"
                ),
            )
            self._grace.daemon = True
            self._grace.start()

    @maps_errors
    def PushRegional(self, chunks: Iterator[Any], context: grpc.ServicerContext) -> pb.PushAck:
        self.t_first = self.t_first or time.perf_counter()
        ack = self.intake.push(
            chunks, lambda header: self.callers.check(context, header.sender, "push")
        )
        self._after()
        return ack

    def _after(self) -> None:
        """After a push or a cutoff: log and evaluate the rounds it completed."""
        done = self._take_done()
        if done:
            t_first, self.t_first = self.t_first, 0.0
            try:
                self.reporter.submit(self._report_rounds, done, t_first)
            except RuntimeError:  # closing: the reporter has stopped, so report here
                self._report_rounds(done, t_first)

    def _report_rounds(self, done: list[Committed], t_first: float) -> None:
        try:
            self._rounds_done(done, t_first)
        except Exception as e:  # a log line must not take the run down; say why it is missing
            log_event("error", role="aggregator", message=f"round report failed: {e!r}")

    @maps_errors
    def FetchGlobal(self, request: pb.MergeRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        self.callers.check(context, request.requester, "fetch")
        node = self.node
        merge = self.board.wait(
            lambda s: node.fetch(request.run_id, request.requester, s), request.sync_step, context
        )
        store = node.store
        # The round's checkpoint, held back while its relays download it, is written once
        # they all have it (CHECKPOINT_HOLD_S).
        yield from self.board.serve(
            merge,
            request.requester,
            merge.commitment.members,
            lambda: self._served_all(store),
        )

    def _served_all(self, store: Any) -> None:
        """Every relay of a round has its merge (under the board's lock): the round's
        checkpoint, held back while they downloaded it, is written, and the next outer
        step's memory is faulted in while the islands train (``_warm``)."""
        if store is not None:
            store.release()
        with contextlib.suppress(RuntimeError):  # closing: nothing to warm for
            self.warmer.submit(self._warm)

    def _warm(self) -> None:
        """Make ready the memory the next outer step writes its theta into
        (``GlobalCore.warm``): the theta the last step replaced when nothing holds it any
        more (resident already), else new memory faulted in (``pages.populate``), which
        the step would otherwise pay for inside the round; and make the spool files of
        the next round's forwards ready (``Intake.warm``).  The memory only while the
        evaluator holds no state but theta (an older one, still evaluated, is let go at the
        step, ``before_step``: warming beside it would make a fourth model-sized tensor),
        and not for a fragment of a split run (its joint evaluates the model)."""
        with self.board.cond:
            m = self.node.machine
            core = m.core
            if m.done:
                return
            ready = self.joint is None and self.evaluator.holds_only(core.theta)
            spare = core.warm() if ready else None
        if spare is not None:
            populate(spare)
        self.intake.warm()

    @maps_errors
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        m = self.node.machine
        if request.requester or request.applied_step:
            self.callers.check(context, request.requester, "report")
            self.intake.report(request.requester, request.applied_step)
            self._check_final()
        with self.board.cond:
            return pb.StatusReply(
                run_id=self.cfg.run_id,
                role="aggregator",
                round=m.round,
                last_step=m.level.open_step - m.schedule.h_g,
                state_digest=self._status_digest(m.state_digest(), m.core.theta)
                if self.joint is None
                else m.state_digest(),
                done=m.done,
                config_digest=self.cfg.digest,
            )

    def _status_digest(self, flat: str, theta: torch.Tensor) -> str:
        """The state digest of the parameters ``theta`` (named, as an island reports its
        own), computed once per state: kept under ``flat``, the digest of record of the
        same bits (``AggregatorMachine.state_digest``, which the round logic keeps as it
        writes theta).  Not under the tensor: an outer step may write a new theta into
        the memory of an old one (``GlobalCore.recycle``).  A caller asking for Status in a
        loop costs no pass over the model, and holds the board's lock for no longer than
        any other call."""
        memo = self._status_memo
        if memo is None or memo[0] != flat:
            memo = (flat, state_digest(self.layout.unflatten(theta)))
            self._status_memo = memo
        return memo[1]

    def _take_done(self) -> list[Committed]:
        """The global rounds made durable since the last call (the tape entry and the
        checkpoint are written by the node)."""
        with self.board.cond:
            done, self.node.committed[:] = list(self.node.committed), []
        return done

    def _rounds_done(self, done: list[Committed], t_first: float = 0.0) -> None:
        """Log each of the rounds ``done`` and queue its held-out evaluation
        (``t_first``: when the round's first regional push arrived)."""
        if done:
            trim_heap()  # the round's transfer buffers, freed on the gRPC threads' heaps
        if self.joint is not None:  # one fragment's rounds: the joint reports the model
            for c in done:
                log_event("round", role="aggregator", fragment=self.fragment, round=c.round,
                          step=c.sync_step, members=",".join(c.commitment.members),
                          bytes=c.input_bytes, state=(c.payload_digest or flat_digest(c.payload))[:16],
                          **memory_fields())  # fmt: skip
            self.joint.rounds_done(self, done)
            return
        for c in done:
            # The round's line names its parameters by the digest its tape entry and the
            # merge's header carry (known: no model-sized hash beside the relays'
            # downloads); the final line by the state digest the islands end on.
            flat = c.payload_digest or flat_digest(c.payload)
            log_event(
                "round",
                seconds=round(time.perf_counter() - t_first, 4) if t_first else 0.0,
                role="aggregator",
                round=c.round,
                step=c.sync_step,
                members=",".join(c.commitment.members),
                **(
                    {"absent": ",".join(absent)}
                    if (absent := getattr(c.record, "absent", None))
                    else {}
                ),
                bytes=c.input_bytes,
                state=flat[:16],
                **memory_fields(),
            )
            if c.sync_step == self.cfg.steps:
                digest = state_digest(self.layout.unflatten(c.payload))
                log_event("final", role="aggregator", step=c.sync_step, digest=digest)
                if (a := self.node.averaged) is not None:  # published with the last round
                    rounds = f"{a.record.first_round}..{a.record.last_round}"
                    lawa = state_digest(self.layout.unflatten(a.payload))
                    log_event("lawa", role="aggregator", rounds=rounds, digest=lawa)
            self.evaluator.submit(c.round, c.sync_step, c.payload)
            if c.sync_step == self.cfg.steps and (a := self.node.averaged) is not None:
                self.evaluator.submit_average(a.payload)  # after the final state's

    def close(self) -> None:
        if self._grace is not None:
            self._grace.cancel()
        self.reporter.shutdown(wait=True)  # every round logged and queued for evaluation
        self.warmer.shutdown(wait=True, cancel_futures=True)
        self.intake.close()
        if self.joint is None:
            self.evaluator.close(finish=self.node.done)
        with self.board.cond:
            self.board.cond.notify_all()


class AggregatorFragments:
    """The Aggregator servicer of a run split into streaming fragments: one
    ``AggregatorService`` per fragment (its own node, folder, tape, rounds and outer
    state), each call handed to the fragment it names.  It evaluates the joined model
    (every fragment's newest global state) after each of fragment 0's rounds, and logs
    the run's final state (``event=final``) once every fragment committed its last
    round.  The aggregator stops when every fragment's run is complete."""

    def __init__(
        self,
        cfg: RunConfig,
        state_dir: Path,
        shutdown: Shutdown,
        metrics: Metrics | None = None,
        key: SigningKey | None = None,
        trusted: TrustedKeys | None = None,
        security: Security = PLAINTEXT,
        keep_rounds: int = 0,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics or Metrics("aggregator")
        self.layout, theta0 = starting_parameters(cfg)
        self.evaluator = Evaluator(cfg, self.metrics, self.layout)
        self._lock = threading.Lock()
        self._finals: dict[int, torch.Tensor] = {}
        self._final_logged = False
        parts: list[PartShutdown] = []
        self.parts: list[AggregatorService] = []
        for f in run_fragments(cfg, self.layout):
            self.parts.append(
                AggregatorService(
                    cfg,
                    state_dir,
                    PartShutdown(shutdown, parts, AGGREGATOR_DONE, cfg.fragments),
                    self.metrics,
                    key,
                    trusted,
                    security,
                    (f.index, theta0[f.lo : f.hi].clone()),
                    self,
                    keep_rounds,
                )
            )
        if not any(p.node.recovered for p in self.parts):
            self.evaluator.submit(-1, 0, theta0)
        del theta0
        self.callers = self.parts[0].callers
        # A restart: a fragment whose last round was durable before it (not redone from
        # its tape, so never handed to ``rounds_done``) has its final state all the same.
        for p in self.parts:
            merge = p.node.machine.merge_for(cfg.steps)
            if merge is not None:
                self._final_part(p, merge.payload)

    def rounds_done(self, part: AggregatorService, done: list[Committed]) -> None:
        """Fragment ``part`` made ``done`` durable: evaluate the joined model after
        fragment 0's rounds, and log the final state once every fragment has its last."""
        if part.fragment == 0 and len(self.parts) == self.cfg.fragments:  # (not while starting)
            for c in done:
                if c.sync_step < self.cfg.steps:
                    joined = torch.cat([p.node.machine.core.theta for p in self.parts])
                    self.evaluator.submit(c.round, c.sync_step, joined)
        for c in done:
            if c.sync_step == self.cfg.steps:
                self._final_part(part, c.payload)

    def _final_part(self, part: AggregatorService, payload: torch.Tensor) -> None:
        """Fragment ``part``'s final state: once every fragment's is in, the run's final
        state is logged (``event=final``, once) and evaluated."""
        final = None
        with self._lock:
            self._finals[part.fragment or 0] = payload
            n = self.cfg.fragments
            # (not while a restart builds the parts: the loop after it logs the final state)
            if len(self._finals) == n == len(self.parts) and not self._final_logged:
                self._final_logged = True
                final = torch.cat([self._finals[i] for i in range(n)])
        if final is not None:
            digest = state_digest(self.layout.unflatten(final))
            log_event("final", role="aggregator", step=self.cfg.steps, digest=digest,
                      fragments=self.cfg.fragments)  # fmt: skip
            rounds = Schedule.of(self.cfg, fragment=0).rounds
            self.evaluator.submit(rounds - 1, self.cfg.steps, final)
            averages = [p.node.averaged for p in self.parts]
            if self.cfg.lawa and all(a is not None for a in averages):
                # each fragment's average over its own last rounds, joined
                spans = ", ".join(
                    f"f{i} {a.record.first_round}..{a.record.last_round}"
                    for i, a in enumerate(averages)
                    if a is not None
                )
                average = torch.cat([a.payload for a in averages if a is not None])
                lawa = state_digest(self.layout.unflatten(average))
                log_event("lawa", role="aggregator", rounds=spans, digest=lawa,
                          fragments=self.cfg.fragments)  # fmt: skip
                self.evaluator.submit_average(average)  # after the final state's

    @maps_errors
    def PushRegional(self, chunks: Iterator[Any], context: grpc.ServicerContext) -> pb.PushAck:
        index, chunks = push_fragment(chunks, len(self.parts))
        return self.parts[index].PushRegional(chunks, context)

    @maps_errors
    def FetchGlobal(self, request: pb.MergeRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        yield from self.parts[fragment_of(request, len(self.parts))].FetchGlobal(request, context)

    @maps_errors
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        return self.parts[fragment_of(request, len(self.parts))].Status(request, context)

    def close(self) -> None:
        for part in self.parts:
            part.close()
        self.evaluator.close(finish=all(p.node.done for p in self.parts))
