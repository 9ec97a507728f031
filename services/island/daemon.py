"""hypertrain-island: one model replica that trains and syncs through its region's relay.

    hypertrain-island --region eu --index 0 --relay 127.0.0.1:7071 [--config run.toml]

Each step: one inner step (IslandCore.train_step).  At every sync step s
(a multiple of H_r) the island encodes its delta with error feedback and
pushes it to the relay on a background thread, so training can go on; at
step s + tau it fetches the merge of s (regional mean, or new global
parameters at a multiple of H_g; the fetch blocks until the relay has it)
and applies it with IslandCore.apply_merge.  The merge step never depends on
timing.  After the last step the final global parameters are fetched and
loaded (no steps follow, so there is no overlap progress to keep).

SIGTERM / Ctrl-C stop the island between steps, never inside a merge.

Under ``torchrun`` the island is K data-parallel ranks (``ranks.py``): rank 0 does
all the talking (relay, tape signature, rejoin state, metrics, log lines) and
broadcasts each merge to the others; every rank applies it at the same step.
"""

from __future__ import annotations

import io
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import FrameType

import torch

from hypertrain.common.config import RunConfig
from hypertrain.common.data import SampleStream
from hypertrain.common.digest import blob_digest, state_digest
from hypertrain.common.errors import ConfigError
from hypertrain.common.model import preset
from hypertrain.common.reference import open_dataset
from hypertrain.common.roles import IslandCore, initial_parameters, round_of_step
from hypertrain.common.trust.keys import SigningKey
from hypertrain.common.trust.ledger import TRANSFER_FIELDS, transfer_message
from hypertrain.island.ranks import TorchRanks
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.daemon import atomic_write, log_event
from hypertrain.wire.metrics import Metrics
from hypertrain.wire.peers import Peer


class Island:
    """The island's driver: training loop, pushes and pinned merges."""

    def __init__(
        self,
        cfg: RunConfig,
        island_id: str,
        relay: Peer | None,
        metrics: Metrics | None = None,
        key: SigningKey | None = None,
        state_dir: Path | None = None,
        ranks: TorchRanks | None = None,
        stop: threading.Event | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """``relay`` is None exactly on ranks other than 0 of a multi-rank island."""
        torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.island_id = island_id
        self.ranks = ranks
        self.lead = ranks is None or ranks.rank == 0
        if (relay is None) == self.lead:
            raise ValueError("rank 0 (and only rank 0) of an island talks to the relay")
        self.relay = relay
        mcfg = preset(cfg.model)
        stream = SampleStream(open_dataset(cfg), mcfg.seq_len, cfg.global_batch, cfg.seed)
        _, theta0 = initial_parameters(cfg)
        self.core = IslandCore(cfg, island_id, stream, theta0, ranks, device)
        self.numel = theta0.numel()
        self.received = torch.empty(self.numel, dtype=torch.float32)
        self.codec = str(self.core.codec.spec)
        self.key = key
        self.state_path = state_dir / "island.pt" if state_dir else None
        self.stop = stop or threading.Event()
        self.pusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="push")
        self.blocked_s = 0.0
        self.bytes_sent = 0
        self.syncs = 0
        self.metrics = metrics or Metrics("island")
        self.tokens_per_step = cfg.batch_per_island * mcfg.seq_len
        self._labels = {"region": self.core.region, "island": island_id}

    def _push(self, step: int, blob: bytes) -> pb.PushAck:
        header = pb.TransferHeader(
            run_id=self.cfg.run_id,
            round=round_of_step(self.cfg, step),
            sync_step=step,
            sender=self.island_id,
            digest=blob_digest(blob),
            size=len(blob),
            codec=self.codec,
        )
        if self.key is not None:
            fields = (getattr(header, f) for f in TRANSFER_FIELDS)
            header.signature = self.key.sign(transfer_message(*fields))
        assert self.relay is not None
        return self.relay.push(header, blob, self.stop.is_set)

    def _fetch(self, step: int, kind: str) -> torch.Tensor:
        """The merge of ``step``: from the relay on rank 0, then on every rank."""
        if self.relay is None:  # a rank other than 0: rank 0 fetches and broadcasts it
            assert self.ranks is not None
            return self.ranks.broadcast(self.received)
        request = pb.MergeRequest(
            run_id=self.cfg.run_id, requester=self.island_id, sync_step=step, kind=kind
        )
        # One receive buffer for the whole run: each merge is applied (copied into the
        # model and base) before the next fetch.
        header, payload = self.relay.fetch(request, self.numel, self.stop.is_set, self.received)
        if header.sync_step != step or header.kind != kind:
            raise RuntimeError(f"relay sent the {header.kind} merge of step {header.sync_step}")
        if self.ranks is not None:
            self.ranks.broadcast(payload)
        return payload

    def _stopping(self) -> bool:
        """Stop before the next step?  On a multi-rank island all ranks agree."""
        return self.stop.is_set() if self.ranks is None else self.ranks.stopping

    def run(self) -> str:
        """Train to the end; returns the final state digest."""
        cfg, topo = self.cfg, self.cfg.topology
        pending: tuple[int, str, Future[pb.PushAck]] | None = None
        t_start = t_interval = time.perf_counter()
        losses: list[float] = []
        m, labels = self.metrics, self._labels
        first = self._resume() + 1
        for step in range(first, cfg.steps + 1):
            if self._stopping():
                raise KeyboardInterrupt
            losses.append(self.core.train_step())
            m.inner_steps.labels(**labels).inc()
            m.tokens.labels(**labels).inc(self.tokens_per_step)
            if pending is None and step % topo.h_r == 0:
                t0 = time.perf_counter()
                blob = self.core.sync(encode=self.lead)
                kind = "global" if step % topo.h_g == 0 else "regional"
                push = self.pusher.submit(self._push, step, blob) if self.lead else _done()
                pending = (step, kind, push)
                self._sent(blob, time.perf_counter() - t0)
                m.train_loss.labels(**labels).set(sum(losses) / len(losses))
                m.tokens_per_second.labels(**labels).set(
                    len(losses) * self.tokens_per_step / (time.perf_counter() - t_interval)
                )
                t_interval = time.perf_counter()
            if pending is not None and step == pending[0] + topo.tau and step < cfg.steps:
                sync_step, kind, pushed = pending
                t0 = time.perf_counter()
                pushed.result()
                t1 = time.perf_counter()
                payload = self._fetch(sync_step, kind)
                t2 = time.perf_counter()
                self.blocked_s += t2 - t0
                self.core.apply_merge(kind, payload, sync_step)
                self._merged(sync_step, t2 - t0, time.perf_counter() - t1)
                pending = None
                if kind == "global":
                    self._save()
                self._log(
                    "sync",
                    role="island",
                    island=self.island_id,
                    step=sync_step,
                    kind=kind,
                    train_loss=round(sum(losses) / len(losses), 5),
                    bytes=len(blob),
                    blocked_s=round(self.blocked_s, 4),
                    push_wait_s=round(t1 - t0, 4),
                    fetch_s=round(t2 - t1, 4),
                )
                losses.clear()
        assert pending is not None and pending[0] == cfg.steps
        t0 = time.perf_counter()
        pending[2].result()
        theta = self._fetch(cfg.steps, "global")
        self.blocked_s += time.perf_counter() - t0
        self.core.finish(theta)
        digest = state_digest(self.core.layout.unflatten(self.core.params()))
        if self.ranks is not None:
            self.ranks.check_equal(digest)
        wall = time.perf_counter() - t_start
        self._log(
            "done",
            role="island",
            island=self.island_id,
            digest=digest,
            bytes_per_sync=self.bytes_sent // max(self.syncs, 1),
            syncs=self.syncs,
            blocked_s=round(self.blocked_s, 4),
            wall_s=round(wall, 3),
            blocked_share=round(self.blocked_s / wall, 5),
            ranks=1 if self.ranks is None else self.ranks.size,
        )
        return digest

    def _log(self, event: str, **fields: object) -> None:
        if self.lead:  # one island, one voice
            log_event(event, **fields)

    def _save(self) -> None:
        """After a global merge: the state this island rejoins from after a crash.

        Rank 0 writes it; every rank of a restarted island loads it (their states
        are equal)."""
        if self.state_path is not None and self.lead:
            buf = io.BytesIO()
            torch.save(
                {"run_id": self.cfg.run_id, "config": self.cfg.digest, **self.core.state_dict()},
                buf,
            )
            atomic_write(self.state_path, buf.getvalue())

    def _resume(self) -> int:
        """Load the rejoin state if there is one; returns the step to continue after.

        Training from it is deterministic, so the island re-sends bit-identical deltas
        for steps its relay already has (answered as duplicates) and catches up."""
        if self.state_path is None or not self.state_path.exists():
            return 0
        state = torch.load(self.state_path, weights_only=True)
        if state["run_id"] != self.cfg.run_id or state["config"] != self.cfg.digest:
            raise ConfigError(f"{self.state_path} belongs to another run or config")
        self.core.load_state_dict(state)
        self._log("resumed", role="island", island=self.island_id, step=self.core.step)
        return self.core.step

    def _sent(self, blob: bytes, encode_s: float) -> None:
        if not self.lead:  # ranks other than 0 encode and send nothing
            return
        m, region = self.metrics, self.core.region
        self.bytes_sent += len(blob)
        self.syncs += 1
        m.encode_seconds.labels("island", region).observe(encode_s)
        m.sent_bytes.labels("island", "regional", region).inc(len(blob))
        m.delta_size.labels("island", "regional", region).observe(len(blob))
        m.compression_ratio.labels("island", "regional", region).set(4 * self.numel / len(blob))
        m.pseudo_grad_norm.labels(**self._labels).set(self.core.last_delta_norm)

    def _merged(self, sync_step: int, blocked_s: float, decode_s: float) -> None:
        m, region = self.metrics, self.core.region
        m.blocked_hist.labels(**self._labels).observe(blocked_s)
        m.decode_seconds.labels("island", region).observe(decode_s)
        m.last_step.labels("island", region).set(sync_step)
        m.last_round.labels("island", region).set(round_of_step(self.cfg, sync_step))

    def install_signals(self) -> None:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            self.stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)

    def close(self) -> None:
        self.stop.set()
        self.pusher.shutdown(wait=True, cancel_futures=True)
        if self.relay is not None:
            self.relay.close()


def _done() -> Future[pb.PushAck]:
    """A finished push (ranks other than 0 push nothing)."""
    future: Future[pb.PushAck] = Future()
    future.set_result(pb.PushAck())
    return future
