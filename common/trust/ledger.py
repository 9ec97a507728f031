"""What goes on the tape, and what is signed on the wire: one schema for all.

The daemons build tape entry bodies with these functions and the auditor
reads them back with the same field names, so the two can never disagree on
what a merge record means.

Signed transfers: an island signs the canonical JSON of its delta's transfer
fields (run, round, sync step, sender, sha256, size, codec) with its key
(``island-<id>``); a relay signs its forwarded regional delta with
``relay-<region>``.  The receiver verifies before accepting; the signature
goes on the tape beside the input's digest so the auditor can check it too.

Tape entry kinds (body fields; all digests hex, numbers ints, floats as strings):
- ``input``: an accepted delta (membership of its round):
  round, sync_step, sender, digest, size, codec, signature
- ``rejection``: sender, sync_step, round, code, reason
- ``regional_merge`` (relay): round, sync_step, tau, merge_step, codec,
  members [[sender, digest], ...], mean (output digest), commitment,
  pre_base, post_base
- ``forward`` (relay, at a global step): round, sync_step, codec, digest, size,
  pre_residual, post_residual (the relay's global-codec error feedback)
- ``global_applied`` (relay): round, sync_step, merge_step, theta
- ``global_merge`` (aggregator): round, sync_step, tau, merge_step, codec,
  outer (config), members [[region, digest], ...], mean, commitment,
  pre_state, post_state (state digests of theta), pre_outer, post_outer
  (digests of the outer optimizer's state)
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch

from hypertrain.common.aggregate import Commitment
from hypertrain.common.config import RunConfig
from hypertrain.common.digest import state_digest, tensor_digest

if TYPE_CHECKING:
    from hypertrain.common.protocol import Committed, Forward

TRANSFER_FIELDS = ("run_id", "round", "sync_step", "sender", "digest", "size", "codec")


def transfer_message(
    run_id: str, round: int, sync_step: int, sender: str, digest: str, size: int, codec: str
) -> bytes:
    """The canonical bytes a sender signs for one delta transfer."""
    fields = dict(
        zip(TRANSFER_FIELDS, (run_id, round, sync_step, sender, digest, size, codec), strict=True)
    )
    return json.dumps(
        {"hypertrain-transfer": 1, **fields}, sort_keys=True, separators=(",", ":")
    ).encode()


def island_key(island: str) -> str:
    return f"island-{island}"


def relay_key(region: str) -> str:
    return f"relay-{region}"


AGGREGATOR_KEY = "aggregator"


def outer_state_digest(state: dict[str, Any]) -> str:
    """Digest of an outer optimizer's state (tensors by digest, scalars by value)."""
    canon = {
        k: (tensor_digest(v) if isinstance(v, torch.Tensor) else v)
        for k, v in sorted(state.items())
    }
    return hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()


def flat_digest(flat: torch.Tensor) -> str:
    """Digest of a flat parameter-sized vector (the regional base, a residual)."""
    return tensor_digest(flat)


def params_digest(names_views: dict[str, torch.Tensor]) -> str:
    """State digest of parameters given as name -> tensor views (ParamLayout.unflatten)."""
    return state_digest(names_views)


def tape_safe(obj: Any) -> Any:
    """``obj`` with every float replaced by its repr string (tape entries hold no floats:
    a float's text could re-serialize differently; see common/trust/tape_format.py)."""
    if isinstance(obj, float):
        return repr(obj)
    if isinstance(obj, dict):
        return {k: tape_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [tape_safe(v) for v in obj]
    return obj


def merge_members(commitment: Commitment) -> list[list[str]]:
    return [[m, d] for m, d in zip(commitment.members, commitment.input_digests, strict=True)]


def regional_merge_body(cfg: RunConfig, c: Committed) -> dict[str, Any]:
    return {
        "round": c.round,
        "sync_step": c.sync_step,
        "tau": cfg.topology.tau,
        "merge_step": c.merge_step,
        "codec": tape_safe(c.commitment.codec),
        "members": merge_members(c.commitment),
        "mean": c.commitment.output_digest,
        "commitment": c.commitment.digest,
        "pre_base": c.pre_digest,
        "post_base": c.post_digest,
    }


def forward_body(f: Forward) -> dict[str, Any]:
    return {
        "round": f.round,
        "sync_step": f.sync_step,
        "codec": f.codec,
        "digest": hashlib.sha256(f.data).hexdigest(),
        "size": len(f.data),
        "pre_residual": f.pre_residual,
        "post_residual": f.post_residual,
    }


def global_merge_body(cfg: RunConfig, c: Committed) -> dict[str, Any]:
    return {
        "round": c.round,
        "sync_step": c.sync_step,
        "tau": cfg.topology.tau,
        "merge_step": c.merge_step,
        "codec": tape_safe(c.commitment.codec),
        "outer": tape_safe(cfg.outer.to_dict()),
        "members": merge_members(c.commitment),
        "mean": c.commitment.output_digest,
        "commitment": c.commitment.digest,
        "pre_state": c.pre_digest,
        "post_state": c.post_digest,
        "pre_outer": c.pre_outer,
        "post_outer": c.post_outer,
    }
