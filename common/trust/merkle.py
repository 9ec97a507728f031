"""RFC 6962 Merkle trees: roots, inclusion and consistency proofs, an incremental log.

The event tape (``hypertrain.common.trust.tape``) commits to its contents with the
Certificate Transparency tree of RFC 6962 sec 2.1 (RFC 9162 sec 2.1), so that
a signed checkpoint (tree size, root) pins every entry before it: an entry
changed, dropped or inserted before a checkpoint changes its root, and two
checkpoints of one tape must be consistent (the older tree a prefix of the
newer), or the tape forked.

Definitions (all SHA-256, 32-byte hashes; hashes are raw ``bytes`` here):

    leaf_hash(d)     = SHA-256(0x00 || d)
    node(l, r)       = SHA-256(0x01 || l || r)
    MTH([])          = SHA-256("")
    MTH([h])         = h                                   (h: a leaf hash)
    MTH(D[0:n])      = node(MTH(D[0:k]), MTH(D[k:n]))      k = largest power of two < n

The 0x00/0x01 prefixes separate leaves from inner nodes (no second preimage by
presenting a node as a leaf).  Functions over a tree take the *leaf hashes*
(``leaf_hash`` of each entry), in order.

Proofs are lists of 32-byte hashes in the RFC's order (from the leaf upwards).
The verifiers implement RFC 9162 sec 2.1.3.2 and 2.1.4.2 exactly and return
``False`` (never raise) for any malformed input: wrong-length hashes, an index
outside the tree, a proof one element too short or too long.  A tree size is
only meaningful together with its root: the tape signs both in one checkpoint.

Conventions outside the RFC, for sizes it leaves undefined:
- the consistency proof from an empty tree, or between equal sizes, is empty;
  it verifies when ``old_root`` is the empty-tree root (resp. the roots are equal).

``MerkleLog`` keeps only the compact range (the roots of the perfect subtrees
that make up the tree, one per set bit of the size), so appending is amortised
O(1) and the current root costs O(log n) without keeping the leaves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from hypertrain.common.errors import HypertrainError

HASH_BYTES = 32
EMPTY_ROOT = hashlib.sha256(b"").digest()
"""MTH of the empty tree: SHA-256 of the empty string."""


def leaf_hash(data: bytes) -> bytes:
    """RFC 6962 leaf hash: SHA-256(0x00 || data)."""
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """RFC 6962 interior node hash: SHA-256(0x01 || left || right)."""
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two strictly smaller than n (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def root(leaf_hashes: Sequence[bytes]) -> bytes:
    """MTH over the leaf hashes (the empty tree's root for none).

    Computed bottom-up, pairing neighbours and promoting an unpaired last node
    unchanged; this builds exactly the largest-power-of-two-split tree.
    """
    level = list(leaf_hashes)
    if not level:
        return EMPTY_ROOT
    while len(level) > 1:
        nxt = [node_hash(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def inclusion_proof(index: int, leaf_hashes: Sequence[bytes]) -> list[bytes]:
    """The audit path PATH(index, D[n]) of RFC 6962 sec 2.1.1, leaf upwards."""
    n = len(leaf_hashes)
    if not 0 <= index < n:
        raise HypertrainError(f"merkle: leaf index {index} is outside a tree of {n} leaves")
    proof: list[bytes] = []
    lo, hi, m = 0, n, index
    # Walk down from the root; each step records the sibling subtree's root.
    while hi - lo > 1:
        k = _split(hi - lo)
        if m < k:
            proof.append(root(leaf_hashes[lo + k : hi]))
            hi = lo + k
        else:
            proof.append(root(leaf_hashes[lo : lo + k]))
            lo, m = lo + k, m - k
    proof.reverse()
    return proof


def verify_inclusion(
    index: int, size: int, leaf: bytes, proof: Sequence[bytes], root_hash: bytes
) -> bool:
    """True iff ``proof`` shows ``leaf`` at ``index`` in the tree (size, root_hash).

    RFC 9162 sec 2.1.3.2.
    """
    if not 0 <= index < size or not _ok_hashes([leaf, root_hash, *proof]):
        return False
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return False  # the proof is longer than the path
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not (fn & 1 or fn == 0):
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == root_hash


def consistency_proof(old_size: int, leaf_hashes: Sequence[bytes]) -> list[bytes]:
    """PROOF(old_size, D[n]) of RFC 6962 sec 2.1.2 (empty for old_size 0 or n)."""
    n = len(leaf_hashes)
    if not 0 <= old_size <= n:
        raise HypertrainError(f"merkle: old size {old_size} is outside 0..{n}")
    if old_size in (0, n):
        return []
    proof: list[bytes] = []
    lo, hi, m, whole = 0, n, old_size, True
    # SUBPROOF(m, D[lo:hi], whole), unrolled; elements are collected top-down.
    while m != hi - lo:
        k = _split(hi - lo)
        if m <= k:
            proof.append(root(leaf_hashes[lo + k : hi]))
            hi = lo + k
        else:
            proof.append(root(leaf_hashes[lo : lo + k]))
            lo, m, whole = lo + k, m - k, False
    if not whole:
        proof.append(root(leaf_hashes[lo:hi]))
    proof.reverse()
    return proof


def verify_consistency(
    old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]
) -> bool:
    """True iff ``proof`` shows the tree (old_size, old_root) is a prefix of (new_size, new_root).

    RFC 9162 sec 2.1.4.2; see the module docstring for sizes 0 and equal sizes.
    """
    if not 0 <= old_size <= new_size or not _ok_hashes([old_root, new_root, *proof]):
        return False
    if old_size == 0:
        return not proof and old_root == EMPTY_ROOT
    if old_size == new_size:
        return not proof and old_root == new_root
    if not proof:
        return False
    path = list(proof)
    if old_size & (old_size - 1) == 0:  # a power of two: the old root is a node of the new tree
        path.insert(0, old_root)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            while not (fn & 1 or fn == 0):
                fn >>= 1
                sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return sn == 0 and fr == old_root and sr == new_root


def _ok_hashes(hashes: Iterable[object]) -> bool:
    return all(isinstance(h, bytes) and len(h) == HASH_BYTES for h in hashes)


class MerkleLog:
    """An append-only Merkle tree that keeps only its compact range.

    ``_range`` holds the roots of the perfect subtrees covering the leaves,
    largest (leftmost) first: one of size 2^b for every set bit b of the size.
    Appending merges equal-sized subtrees like a binary counter increment.
    """

    __slots__ = ("_range", "_size")

    def __init__(self) -> None:
        self._range: list[bytes] = []
        self._size = 0

    @classmethod
    def of(cls, leaf_hashes: Iterable[bytes]) -> MerkleLog:
        """A log holding these leaf hashes, in order."""
        log = cls()
        for h in leaf_hashes:
            log.append(h)
        return log

    @property
    def size(self) -> int:
        """Number of leaves appended."""
        return self._size

    def append(self, leaf: bytes) -> None:
        """Append one leaf hash (``leaf_hash(entry)``, 32 bytes)."""
        if len(leaf) != HASH_BYTES:
            raise HypertrainError(f"merkle: a leaf hash is {HASH_BYTES} bytes, got {len(leaf)}")
        h, n = leaf, self._size
        while n & 1:  # each trailing one bit is a full subtree of the new leaf's height
            h = node_hash(self._range.pop(), h)
            n >>= 1
        self._range.append(h)
        self._size += 1

    def root(self) -> bytes:
        """The current MTH, folding the compact range right to left (O(log n))."""
        if not self._range:
            return EMPTY_ROOT
        r = self._range[-1]
        for h in reversed(self._range[:-1]):
            r = node_hash(h, r)
        return r

    def copy(self) -> MerkleLog:
        """An independent copy (for a root at a point while appending goes on)."""
        other = MerkleLog()
        other._range = list(self._range)
        other._size = self._size
        return other
