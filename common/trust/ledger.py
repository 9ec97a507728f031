"""What is signed on the wire, and the names and digests both sides agree on.

Signed transfers: an island signs the canonical JSON of its delta's transfer
fields (run, round, sync step, sender, digest, size, codec, and the relay shard
"i/S" its part is for when the region's relay is sharded) with its key
(``island-<id>``); a relay signs its forwarded regional delta with
``relay-<region>`` (a shard: ``relay-<region>-<i>``).  The receiver verifies before accepting; the signature
goes on the tape beside the input's digest so the auditor can check it too.

What goes on the tape is defined in common/trust/schema.py (one typed record per
entry kind); the digests recorded there are computed by the functions here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch

from hypertrain.common.digest import state_digest, tensor_digest

TRANSFER_FIELDS = ("run_id", "round", "sync_step", "sender", "digest", "size", "codec")


def transfer_message(
    run_id: str,
    round: int,
    sync_step: int,
    sender: str,
    digest: str,
    size: int,
    codec: str,
    shard: str = "",
    fragment: int | None = None,
) -> bytes:
    """The canonical bytes a sender signs for one delta transfer; ``shard`` ("i/S", an
    island's part for one relay shard) and ``fragment`` (a streaming fragment's index)
    are bound in when set, so a part cannot be replayed to another shard or fragment."""
    fields: dict[str, Any] = dict(
        zip(TRANSFER_FIELDS, (run_id, round, sync_step, sender, digest, size, codec), strict=True)
    )
    if shard:
        fields["shard"] = shard
    if fragment is not None:
        fields["fragment"] = fragment
    return json.dumps(
        {"hypertrain-transfer": 1, **fields}, sort_keys=True, separators=(",", ":")
    ).encode()


def member_message(run_id: str, change: str, member: str, step: int, issued: int) -> bytes:
    """The canonical bytes an island signs to join (``change`` "join") or leave ("leave")
    its region; ``step``: its own step when it asks; ``issued``: when it asked (ns; a
    request issued before the member's last taped change is refused, so an old signed
    request replayed later changes nothing: see ``RelayMachine.on_member``)."""
    return json.dumps(
        {"hypertrain-member": 1, "run_id": run_id, "change": change, "member": member,
         "step": step, "issued": issued},
        sort_keys=True,
        separators=(",", ":"),
    ).encode()  # fmt: skip


def island_key(island: str) -> str:
    """The key (and certificate) name of an island: ``eu-0`` signs as ``island-eu-0``."""
    return f"island-{island}"


def relay_key(member: str) -> str:
    """The key a relay signs with: ``relay-eu``; a relay shard ``eu/1``: ``relay-eu-1``."""
    return f"relay-{member.replace('/', '-')}"


AGGREGATOR_KEY = "aggregator"


def outer_state_digest(state: dict[str, Any], known: Mapping[str, str] | None = None) -> str:
    """Digest of an outer optimizer's state (tensors by digest, scalars by value).
    ``known``: the digests of some of its tensors, by name, already taken."""
    known = known or {}
    canon = {
        k: ((known.get(k) or tensor_digest(v)) if isinstance(v, torch.Tensor) else v)
        for k, v in sorted(state.items())
    }
    return hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()


def flat_digest(flat: torch.Tensor) -> str:
    """Digest of a flat parameter-sized vector (the regional base, a residual)."""
    return tensor_digest(flat)


def params_digest(names_views: dict[str, torch.Tensor]) -> str:
    """State digest of parameters given as name -> tensor views (ParamLayout.unflatten)."""
    return state_digest(names_views)
