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
  element (``Codec.decode_accumulate``, bit-identical to ``add_(decode(...))``);
  the mean is one fp32 division by the member count.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hypertrain.common.codec import Codec
from hypertrain.common.digest import blob_digest, tensor_digest
from hypertrain.common.errors import HypertrainError

Blob = bytes | bytearray | memoryview
"""Encoded bytes as received (the transport fills a bytearray)."""


@dataclass(frozen=True, slots=True)
class Commitment:
    """What a relay (or the aggregator) commits to for one aggregate."""

    codec: dict[str, Any]
    """The codec's canonical parameters (``CodecSpec.to_dict()``)."""
    members: tuple[str, ...]
    """Member ids in summation order (sorted)."""
    input_digests: tuple[str, ...]
    """sha256 of each member's encoded bytes, in the same order."""
    output_digest: str
    """tensor digest of the fp32 mean."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "inputs": [[m, d] for m, d in zip(self.members, self.input_digests, strict=True)],
            "output": self.output_digest,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Commitment:
        """The inverse of :meth:`to_dict` (a commitment received on the wire or read from a
        checkpoint); HypertrainError naming what is wrong."""
        try:
            pairs = [(str(m), str(x)) for m, x in d["inputs"]]
            codec, output = d["codec"], d["output"]
        except (KeyError, TypeError, ValueError) as e:
            raise HypertrainError(f"malformed commitment: {e!r}") from None
        if not isinstance(codec, dict) or not isinstance(output, str):
            raise HypertrainError("malformed commitment: codec must be an object, output a string")
        return cls(codec, tuple(m for m, _ in pairs), tuple(x for _, x in pairs), output)

    @property
    def digest(self) -> str:
        """sha256 of the canonical JSON of :meth:`to_dict`."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()


def fixed_order_sum(inputs: Mapping[str, Blob], codec: Codec, out: torch.Tensor) -> None:
    """``out`` (zeroed by the caller) += decoded inputs, in sorted member order."""
    for member in sorted(inputs):
        codec.decode_accumulate(inputs[member], out)


def aggregate(
    inputs: Mapping[str, Blob],
    codec: Codec,
    shape: tuple[int, ...],
    digests: Mapping[str, str] | None = None,
) -> tuple[torch.Tensor, Commitment]:
    """Fixed-order fp32 mean of the decoded ``inputs`` and its commitment.

    ``digests``: each input's sha256 where the caller already verified it (a transport
    checks every transfer's digest as it arrives), so that the bytes are not hashed again;
    computed here for inputs it does not name."""
    if not inputs:
        raise HypertrainError("aggregate: no inputs")
    members = tuple(sorted(inputs))
    acc = torch.zeros(shape, dtype=torch.float32)
    fixed_order_sum(inputs, codec, acc)
    acc.div_(len(members))
    commitment = Commitment(
        codec=codec.spec.to_dict(),
        members=members,
        input_digests=tuple(
            digests[m] if digests is not None and m in digests else blob_digest(inputs[m])
            for m in members
        ),
        output_digest=tensor_digest(acc),
    )
    return acc, commitment
