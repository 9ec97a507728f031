"""RFC 6962 Merkle trees: known answers, an independent reference, and proof corruption."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypertrain.common.errors import HypertrainError
from hypertrain.common.trust import merkle
from hypertrain.common.trust.merkle import (
    EMPTY_ROOT,
    MerkleLog,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    root,
    verify_consistency,
    verify_inclusion,
)

# The Certificate Transparency reference test tree (transparency-dev/merkle testonly,
# certificate-transparency merkle_tree_test): leaf inputs and the roots of sizes 0..8.
CT_LEAVES = [
    bytes.fromhex(h)
    for h in [
        "",
        "00",
        "10",
        "2021",
        "3031",
        "40414243",
        "5051525354555657",
        "606162636465666768696a6b6c6d6e6f",
    ]
]
CT_ROOTS = [
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]
# (size, index, proof) and (old, new, proof) from transparency-dev/merkle reference_test.go.
CT_INCLUSION = [
    (1, 0, []),
    (2, 0, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7"]),
    (2, 1, ["6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"]),
    (3, 2, ["fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"]),
    (
        5,
        1,
        [
            "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        ],
    ),
    (
        8,
        0,
        [
            "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
        ],
    ),
    (
        8,
        5,
        [
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        ],
    ),
]
CT_CONSISTENCY = [
    (1, 1, []),
    (
        1,
        8,
        [
            "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
        ],
    ),
    (
        2,
        5,
        [
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        ],
    ),
    (
        6,
        8,
        [
            "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        ],
    ),
]
CT_HASHES = [leaf_hash(d) for d in CT_LEAVES]
MAX_N = 20
LEAVES = [leaf_hash(f"leaf {i}".encode()) for i in range(64)]


# -- an independent reference, written straight from RFC 6962 sec 2.1 (recursive) --
def _k(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def ref_mth(d: list[bytes]) -> bytes:
    if not d:
        return hashlib.sha256(b"").digest()
    if len(d) == 1:
        return d[0]
    k = _k(len(d))
    return hashlib.sha256(b"\x01" + ref_mth(d[:k]) + ref_mth(d[k:])).digest()


def ref_path(m: int, d: list[bytes]) -> list[bytes]:
    if len(d) == 1:
        return []
    k = _k(len(d))
    if m < k:
        return [*ref_path(m, d[:k]), ref_mth(d[k:])]
    return [*ref_path(m - k, d[k:]), ref_mth(d[:k])]


def ref_subproof(m: int, d: list[bytes], b: bool) -> list[bytes]:
    if m == len(d):
        return [] if b else [ref_mth(d)]
    k = _k(len(d))
    if m <= k:
        return [*ref_subproof(m, d[:k], b), ref_mth(d[k:])]
    return [*ref_subproof(m - k, d[k:], False), ref_mth(d[:k])]


# -- known answers ----------------------------------------------------------------
def test_leaf_and_empty_hashes() -> None:
    assert leaf_hash(b"").hex() == CT_ROOTS[1]
    assert EMPTY_ROOT.hex() == CT_ROOTS[0] == root([]).hex()
    assert merkle.node_hash(b"a", b"b") == hashlib.sha256(b"\x01ab").digest()


@pytest.mark.parametrize("n", range(9))
def test_known_roots(n: int) -> None:
    assert root(CT_HASHES[:n]).hex() == CT_ROOTS[n]
    assert MerkleLog.of(CT_HASHES[:n]).root().hex() == CT_ROOTS[n]


@pytest.mark.parametrize(("size", "index", "want"), CT_INCLUSION)
def test_known_inclusion_proofs(size: int, index: int, want: list[str]) -> None:
    proof = inclusion_proof(index, CT_HASHES[:size])
    assert [p.hex() for p in proof] == want
    assert verify_inclusion(index, size, CT_HASHES[index], proof, bytes.fromhex(CT_ROOTS[size]))


@pytest.mark.parametrize(("old", "new", "want"), CT_CONSISTENCY)
def test_known_consistency_proofs(old: int, new: int, want: list[str]) -> None:
    proof = consistency_proof(old, CT_HASHES[:new])
    assert [p.hex() for p in proof] == want
    old_root, new_root = bytes.fromhex(CT_ROOTS[old]), bytes.fromhex(CT_ROOTS[new])
    assert verify_consistency(old, new, old_root, new_root, proof)


# -- agreement with the reference, and every valid proof verifies ----------------------
def test_roots_and_proofs_match_reference() -> None:
    log = MerkleLog()
    for n in range(MAX_N + 1):
        d = LEAVES[:n]
        assert root(d) == ref_mth(d) == log.root()
        assert log.size == n
        for i in range(n):
            assert inclusion_proof(i, d) == ref_path(i, d)
        for m in range(1, n):
            assert consistency_proof(m, d) == ref_subproof(m, d, True)
        log.append(LEAVES[n])


def test_all_valid_proofs_verify() -> None:
    for n in range(1, MAX_N + 1):
        d, r = LEAVES[:n], root(LEAVES[:n])
        for i in range(n):
            assert verify_inclusion(i, n, d[i], inclusion_proof(i, d), r), (i, n)
        for m in range(0, n + 1):
            proof = consistency_proof(m, d)
            assert verify_consistency(m, n, root(d[:m]), r, proof), (m, n)


def test_merkle_log_long_and_copy() -> None:
    leaves = [leaf_hash(i.to_bytes(4, "big")) for i in range(300)]
    log = MerkleLog()
    for i, h in enumerate(leaves):
        log.append(h)
        if i % 37 == 0:
            assert log.root() == root(leaves[: i + 1])
    snap = log.copy()
    log.append(leaves[0])
    assert snap.root() == root(leaves) != log.root()
    with pytest.raises(HypertrainError, match="32 bytes"):
        log.append(b"short")


def test_bad_arguments_to_proof_builders() -> None:
    with pytest.raises(HypertrainError, match="outside"):
        inclusion_proof(3, LEAVES[:3])
    with pytest.raises(HypertrainError, match="outside"):
        consistency_proof(4, LEAVES[:3])
    assert consistency_proof(0, LEAVES[:3]) == []
    assert not verify_inclusion(0, 0, LEAVES[0], [], EMPTY_ROOT)
    assert verify_consistency(0, 0, EMPTY_ROOT, EMPTY_ROOT, [])
    assert not verify_consistency(0, 3, root(LEAVES[:1]), root(LEAVES[:3]), [])
    assert not verify_consistency(0, 3, EMPTY_ROOT, root(LEAVES[:3]), [LEAVES[0]])


# -- every corruption is rejected ------------------------------------------------------
def _flip(h: bytes, bit: int) -> bytes:
    b = bytearray(h)
    b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b)


def test_inclusion_structural_corruptions_rejected() -> None:
    junk = leaf_hash(b"junk")
    for n in range(1, MAX_N + 1):
        d, r = LEAVES[:n], root(LEAVES[:n])
        for i in range(n):
            p = inclusion_proof(i, d)
            for j in range(n):  # wrong index (same leaf, same proof)
                assert j == i or not verify_inclusion(j, n, d[i], p, r)
            for other in range(1, MAX_N + 4):  # wrong size, with that size's true root
                rr = root(LEAVES[:other])
                assert other == n or not verify_inclusion(i, other, d[i], p, rr), (i, n, other)
            for other in (2 * n, n // 2):  # wrong height, same root
                assert not verify_inclusion(i, other, d[i], p, r)
            for k in range(len(p)):  # truncated, an element dropped
                assert not verify_inclusion(i, n, d[i], p[:k], r)
                assert not verify_inclusion(i, n, d[i], p[:k] + p[k + 1 :], r)
            for extra in (junk, EMPTY_ROOT, r, d[i]):  # extended at either end
                assert not verify_inclusion(i, n, d[i], [*p, extra], r)
                assert not verify_inclusion(i, n, d[i], [extra, *p], r)
            assert not verify_inclusion(i, n, junk, p, r)
            assert not verify_inclusion(i, n, d[i], p, junk)
            if len(p) >= 2:
                assert not verify_inclusion(i, n, d[i], p[::-1], r)


def test_consistency_structural_corruptions_rejected() -> None:
    junk = leaf_hash(b"junk")
    for n in range(1, MAX_N + 1):
        d, r = LEAVES[:n], root(LEAVES[:n])
        for m in range(1, n):
            p, r0 = consistency_proof(m, d), root(d[:m])
            assert not verify_consistency(m, n, r, r0, p)  # swapped roots
            assert not verify_consistency(n, m, r, r0, p)  # swapped sizes too
            for other in range(0, n + 1):  # wrong old size, with its true root
                ro = root(d[:other])
                assert other == m or not verify_consistency(other, n, ro, r, p), (m, n, other)
            for other in range(m, MAX_N + 4):  # wrong new size, with its true root
                rn = root(LEAVES[:other])
                assert other == n or not verify_consistency(m, other, r0, rn, p), (m, n, other)
            for k in range(len(p)):  # truncated, an element dropped
                assert not verify_consistency(m, n, r0, r, p[:k])
                assert not verify_consistency(m, n, r0, r, p[:k] + p[k + 1 :])
            for extra in (junk, EMPTY_ROOT, r0, r):  # extended at either end
                assert not verify_consistency(m, n, r0, r, [*p, extra])
                assert not verify_consistency(m, n, r0, r, [extra, *p])
            assert not verify_consistency(m, n, junk, r, p)
            assert not verify_consistency(m, n, r0, junk, p)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_bit_flip_in_any_proof_is_rejected(data: st.DataObject) -> None:
    n = data.draw(st.integers(2, MAX_N), label="n")
    d, r = LEAVES[:n], root(LEAVES[:n])
    if data.draw(st.booleans(), label="inclusion"):
        i = data.draw(st.integers(0, n - 1), label="index")
        p = inclusion_proof(i, d)
        args = [d[i], *p, r]
        k = data.draw(st.integers(0, len(args) - 1), label="which hash")
        args[k] = _flip(args[k], data.draw(st.integers(0, 255), label="bit"))
        assert not verify_inclusion(i, n, args[0], args[1:-1], args[-1])
    else:
        m = data.draw(st.integers(1, n - 1), label="old size")
        p = consistency_proof(m, d)
        args = [root(d[:m]), r, *p]
        k = data.draw(st.integers(0, len(args) - 1), label="which hash")
        args[k] = _flip(args[k], data.draw(st.integers(0, 255), label="bit"))
        assert not verify_consistency(m, n, args[0], args[1], args[2:])


def test_malformed_hash_lengths_return_false() -> None:
    d = LEAVES[:5]
    p = inclusion_proof(2, d)
    assert not verify_inclusion(2, 5, d[2], [*p[:-1], p[-1][:31]], root(d))
    assert not verify_inclusion(2, 5, d[2] + b"\x00", p, root(d))
    q = consistency_proof(3, d)
    assert not verify_consistency(3, 5, root(d[:3]), root(d), [q[0] + b"x", *q[1:]])
