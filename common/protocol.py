"""Sans-I/O round protocol of the relay and the aggregator.

Each machine is fed events (a delta arrived, the new global parameters
arrived) and returns a :class:`Decision` (accepted or not, and why, in words
a daemon can put in a gRPC status) plus the effects the driver must carry out
(publish an input, forward a regional delta, announce a merge).  There are no
sockets, threads or clocks in here; the gRPC servicers only translate.

Round rules (the same for both levels):
- Membership is decided by step, never by wall-clock: the members of a sync
  step are all configured senders (islands of the region; regions of the run),
  and the step commits when the last of them has delivered.  A missing member
  stalls the round; nothing times it out.
- Only the open sync step accepts deltas.  An identical resend of an accepted
  delta (same step, sender and digest) is answered as a duplicate and counted
  once; different bytes for an accepted (step, sender) are refused.
- Every delta is validated against the run's codec and parameter count before
  it is accepted (``Codec.open``), so a corrupt or mismatched input is never
  aggregated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hypertrain.common.aggregate import Blob, Commitment
from hypertrain.common.codec import Codec
from hypertrain.common.config import RunConfig
from hypertrain.common.errors import HypertrainError, UnknownKeyError
from hypertrain.common.roles import GlobalCore, RegionCore
from hypertrain.common.roles import round_of_step as round_of
from hypertrain.common.trust.keys import TrustedKeys
from hypertrain.common.trust.ledger import (
    flat_digest,
    island_key,
    outer_state_digest,
    relay_key,
    transfer_message,
)

# Decision codes: the driver maps them to transport status codes.
OK = "ok"
INVALID = "invalid_argument"  # malformed or not meant for this daemon: never retry
PRECONDITION = "failed_precondition"  # not now (step ahead, round pending): retry later
CONFLICT = "already_exists"  # different bytes for an accepted (step, sender)

KEEP_MERGES = 4  # committed merges kept for late fetchers (tau < h_r needs 1)


@dataclass(frozen=True, slots=True)
class Delta:
    """An encoded delta as the transport received it (its sha256 already verified)."""

    run_id: str
    round: int
    sync_step: int
    sender: str
    digest: str
    codec: str
    data: Blob
    signature: bytes = b""
    """Ed25519 over ``ledger.transfer_message`` of the fields above, by the sender's key."""


@dataclass(frozen=True, slots=True)
class Decision:
    """Whether a delta was taken, and why (one readable line)."""

    code: str
    reason: str
    duplicate: bool = False

    @property
    def accepted(self) -> bool:
        return self.code == OK


@dataclass(frozen=True, slots=True)
class Publish:
    """Effect: keep this accepted input on disk under its digest."""

    delta: Delta


@dataclass(frozen=True, slots=True)
class Committed:
    """Effect: an aggregate was committed (regional mean, or a global outer step)."""

    level: str  # "regional" | "global"
    round: int
    sync_step: int
    merge_step: int
    commitment: Commitment
    payload: torch.Tensor  # regional: the mean; global: theta_{g+1}
    kind: str  # the merge kind islands apply: "regional" | "global"
    input_bytes: int = 0
    pre_digest: str = ""  # flat digest of the base (relay) or theta (aggregator) before
    post_digest: str = ""  # ... and after
    pre_outer: str = ""  # aggregator: digest of the outer optimizer state before / after
    post_outer: str = ""


@dataclass(frozen=True, slots=True)
class Forward:
    """Effect: send this region's delta for the global round to the aggregator."""

    round: int
    sync_step: int
    codec: str
    data: bytes
    pre_residual: str = ""  # flat digest of the relay's global-codec error feedback before
    post_residual: str = ""  # ... and after encoding


Effect = Publish | Committed | Forward


@dataclass
class _Level:
    """Bookkeeping shared by both machines: the open step and who delivered what."""

    cfg: RunConfig
    role: str
    members: tuple[str, ...]
    interval: int
    codec: Codec
    numel: int
    open_step: int
    inputs: dict[str, Delta] = field(default_factory=dict)
    accepted: dict[tuple[int, str], str] = field(default_factory=dict)  # (step, sender) -> digest
    trusted: TrustedKeys | None = None  # None: signatures are not required
    signer_of: Callable[[str], str] = str  # sender id -> key name

    def check(self, d: Delta) -> Decision | None:
        """None if ``d`` may be taken into the open step; otherwise the refusal."""
        cfg = self.cfg
        if d.run_id != cfg.run_id:
            return Decision(
                INVALID, f"wrong run: {d.run_id!r}, this {self.role} serves {cfg.run_id!r}"
            )
        if d.sender not in self.members:
            return Decision(
                INVALID, f"{d.sender!r} is not a member here (members: {', '.join(self.members)})"
            )
        s = d.sync_step
        if s < 1 or s > cfg.steps or s % self.interval:
            return Decision(
                INVALID,
                f"step {s} is not a sync step (every {self.interval} steps up to {cfg.steps})",
            )
        if d.round != round_of(cfg, s):
            return Decision(
                INVALID, f"round {d.round} does not match sync step {s} (round {round_of(cfg, s)})"
            )
        known = self.accepted.get((s, d.sender))
        if known is not None:
            if known == d.digest:
                return Decision(
                    OK,
                    f"duplicate of the accepted delta from {d.sender} for step {s}",
                    duplicate=True,
                )
            return Decision(CONFLICT, f"{d.sender} already delivered different bytes for step {s}")
        if s < self.open_step:
            return Decision(PRECONDITION, f"step {s} is closed (open step is {self.open_step})")
        if s > self.open_step:
            return Decision(PRECONDITION, f"step {s} is ahead of the open step {self.open_step}")
        if self.trusted is not None:
            refusal = self._check_signature(d)
            if refusal is not None:
                return refusal
        if d.codec != str(self.codec.spec):
            return Decision(INVALID, f"wrong codec {d.codec!r}, this run uses {self.codec.spec}")
        try:  # full validation (header, checksum, payload) without decoding to fp32
            self.codec.open(d.data, (self.numel,))
        except HypertrainError as e:
            return Decision(INVALID, f"rejected delta from {d.sender} for step {s}: {e}")
        return None

    def _check_signature(self, d: Delta) -> Decision | None:
        assert self.trusted is not None
        if not d.signature:
            return Decision(INVALID, f"unsigned delta from {d.sender} for step {d.sync_step}")
        message = transfer_message(
            d.run_id, d.round, d.sync_step, d.sender, d.digest, len(d.data), d.codec
        )
        key = self.signer_of(d.sender)
        try:
            good = self.trusted.verify(key, message, d.signature)
        except UnknownKeyError:
            return Decision(INVALID, f"no trusted key {key!r} for {d.sender}")
        if not good:
            return Decision(
                INVALID, f"bad signature on the delta from {d.sender} for step {d.sync_step}"
            )
        return None

    def take(self, d: Delta) -> bool:
        """Record an accepted delta; True when the open step is complete."""
        self.inputs[d.sender] = d
        self.accepted[(d.sync_step, d.sender)] = d.digest
        return len(self.inputs) == len(self.members)

    def close(self) -> dict[str, Blob]:
        blobs = {m: d.data for m, d in self.inputs.items()}
        self.inputs = {}
        self.open_step += self.interval
        return blobs


class RelayMachine:
    """One region's round logic: collect island deltas, commit, forward, hand out merges."""

    def __init__(
        self, cfg: RunConfig, region: str, theta0: torch.Tensor, trusted: TrustedKeys | None = None
    ) -> None:
        self.cfg = cfg
        self.region = region
        self.core = RegionCore(cfg, region, theta0)
        self.level = _Level(
            cfg,
            f"relay of {region}",
            cfg.topology.islands_of(region),
            cfg.topology.h_r,
            self.core.codec,
            theta0.numel(),
            open_step=cfg.topology.h_r,
            trusted=trusted,
            signer_of=island_key,
        )
        self.global_pending: int | None = None  # sync step forwarded, theta not yet back
        self.merges: dict[int, Committed] = {}  # sync_step -> what islands apply
        self.done = False

    def on_delta(self, d: Delta) -> tuple[Decision, list[Effect]]:
        refusal = self.level.check(d)
        if refusal is not None:
            return refusal, []
        if self.global_pending is not None:
            return Decision(
                PRECONDITION, f"global round of step {self.global_pending} is pending"
            ), []
        effects: list[Effect] = [Publish(d)]
        if self.level.take(d):
            effects.extend(self._commit(d.sync_step))
        return Decision(OK, f"accepted delta from {d.sender} for step {d.sync_step}"), effects

    def _commit(self, step: int) -> list[Effect]:
        blobs = self.level.close()
        pre = flat_digest(self.core.base)
        mean, commitment = self.core.merge(blobs)
        post = flat_digest(self.core.base)
        tau = self.cfg.topology.tau
        g = round_of(self.cfg, step)
        regional = Committed(
            "regional",
            g,
            step,
            step + tau,
            commitment,
            mean,
            "regional",
            sum(len(b) for b in blobs.values()),
            pre_digest=pre,
            post_digest=post,
        )
        if step % self.cfg.topology.h_g:
            self._keep(step, regional)
            return [regional]
        self.global_pending = step
        pre_res = flat_digest(self.core.feedback.residual)
        blob = self.core.encode_global_delta()
        post_res = flat_digest(self.core.feedback.residual)
        forward = Forward(g, step, str(self.core.global_codec.spec), blob, pre_res, post_res)
        return [regional, forward]

    def on_global(self, sync_step: int, theta: torch.Tensor) -> Committed:
        """The aggregator's theta_{g+1} for the global round of ``sync_step`` arrived."""
        if sync_step != self.global_pending:
            raise HypertrainError(
                f"relay {self.region}: unexpected global update for step {sync_step}"
            )
        self.core.set_global(theta)
        self.global_pending = None
        tau = self.cfg.topology.tau
        merge = Committed(
            "global",
            round_of(self.cfg, sync_step),
            sync_step,
            sync_step + tau,
            Commitment({}, (), (), ""),
            theta,
            "global",
            post_digest=flat_digest(self.core.theta),
        )
        self._keep(sync_step, merge)
        self.done = sync_step == self.cfg.steps
        return merge

    def _keep(self, step: int, merge: Committed) -> None:
        self.merges[step] = merge
        for old in sorted(self.merges)[:-KEEP_MERGES]:
            del self.merges[old]

    def merge_for(self, sync_step: int) -> Committed | None:
        """The merge islands apply for ``sync_step``, once it exists."""
        return self.merges.get(sync_step)

    def restore(
        self,
        theta: torch.Tensor,
        residual: torch.Tensor,
        sync_step: int,
        accepted: dict[tuple[int, str], str],
    ) -> None:
        """Resume after the global round of ``sync_step`` (a durable relay checkpoint):
        theta_{g+1} (the base too), the global codec's error-feedback residual, and
        every (step, island) -> digest ever accepted, so that islands re-sending what
        the relay already took are answered as duplicates.  Islands that had not yet
        fetched that global merge can."""
        self.global_pending = sync_step
        self.on_global(sync_step, theta.clone())
        self.core.feedback.residual.copy_(residual)
        self.level.open_step = sync_step + self.cfg.topology.h_r
        self.level.inputs = {}
        self.level.accepted = dict(accepted)


class AggregatorMachine:
    """The global round logic: one delta per region per round, then the outer step."""

    def __init__(
        self, cfg: RunConfig, theta0: torch.Tensor, trusted: TrustedKeys | None = None
    ) -> None:
        self.cfg = cfg
        self.core = GlobalCore(cfg, theta0)
        self.level = _Level(
            cfg,
            "aggregator",
            tuple(sorted(cfg.topology.regions)),
            cfg.topology.h_g,
            self.core.codec,
            theta0.numel(),
            open_step=cfg.topology.h_g,
            trusted=trusted,
            signer_of=relay_key,
        )
        self.merges: dict[int, Committed] = {}
        self.done = False

    @property
    def round(self) -> int:
        """The open global round."""
        return round_of(self.cfg, self.level.open_step)

    def restore(self, theta: torch.Tensor, outer_state: dict[str, Any], sync_step: int) -> None:
        """Resume after the global round of ``sync_step`` (from a durable checkpoint)."""
        self.core.theta.copy_(theta)
        self.core.outer.load_state_dict(outer_state)
        self.level.open_step = sync_step + self.cfg.topology.h_g
        self.level.inputs = {}
        self.done = sync_step >= self.cfg.steps

    def on_regional(self, d: Delta) -> tuple[Decision, list[Effect]]:
        refusal = self.level.check(d)
        if refusal is not None:
            return refusal, []
        effects: list[Effect] = [Publish(d)]
        if self.level.take(d):
            step = d.sync_step
            blobs = self.level.close()
            pre, pre_outer = (
                flat_digest(self.core.theta),
                outer_state_digest(self.core.outer.state_dict()),
            )
            commitment = self.core.step(blobs)
            merge = Committed(
                "global",
                round_of(self.cfg, step),
                step,
                step + self.cfg.topology.tau,
                commitment,
                self.core.theta.clone(),
                "global",
                sum(len(b) for b in blobs.values()),
                pre_digest=pre,
                post_digest=flat_digest(self.core.theta),
                pre_outer=pre_outer,
                post_outer=outer_state_digest(self.core.outer.state_dict()),
            )
            self.merges[step] = merge
            for old in sorted(self.merges)[:-KEEP_MERGES]:
                del self.merges[old]
            self.done = step == self.cfg.steps
            effects.append(merge)
        return Decision(
            OK, f"accepted regional delta from {d.sender} for step {d.sync_step}"
        ), effects

    def merge_for(self, sync_step: int) -> Committed | None:
        return self.merges.get(sync_step)
