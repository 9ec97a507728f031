"""hypertrain.common.trust: what makes a run verifiable by someone who does not trust it.

- ``keys``: Ed25519 signing keys (0600 files) and the pinned public keys a verifier trusts.
- ``merkle``: RFC 6962 Merkle trees, inclusion and consistency proofs.
- ``tape_format``, ``tape_verify``, ``tape``: the signed, hash-chained, append-only event
  tape (bytes on disk, verification, the durable writer).
- ``schema``: one typed record per tape entry kind, the only way bodies are built and read.
- ``ledger``: what a sender signs for a transfer, key names, state digests.
- ``audit``: verify a run's tapes and replay every merge through the round machines.

Nothing here decides a round; the round machines (``hypertrain.common.rounds``) do, and
the auditor replays them.
"""
