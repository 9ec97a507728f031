"""Unit tests of hypertrain.common.data and ``hypertrain data prepare``.

Real files in temporary folders; the stdlib corpus test prepares ~12 MB (~0.3 s).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hypertrain.common.data.build as build_mod
from hypertrain import data_cmd
from hypertrain.common.data import (
    MANIFEST_NAME,
    SampleStream,
    TokenDataset,
    default_data_dir,
    ensure_default_dataset,
    holdout_region_tokens,
    holdout_windows,
    prepare,
    train_end,
    windows_digest,
)
from hypertrain.common.errors import ConfigError, DataError

# ---------------------------------------------------------------- helpers


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def make_tree(root: Path) -> Path:
    """A folder with wanted files, unwanted suffixes, hidden and cache folders."""
    write(root / "b.txt", "bee\n")
    write(root / "a.py", "print('a')\n")
    write(root / "sub" / "c.md", "# see\n")
    write(root / "sub" / "d.rst", "dee\n")
    write(root / "e.bin", b"\x01\x02")
    write(root / ".hidden" / "x.py", "hidden\n")
    write(root / "__pycache__" / "y.py", "cache\n")
    write(root / ".dot.py", "dot\n")
    return root


def text_of_size(n: int, seed: int = 0) -> bytes:
    """n printable bytes, different per seed (never 0x00, the separator)."""
    rng = np.random.default_rng(seed)
    return bytes(rng.integers(32, 127, size=n, dtype=np.uint8).tolist())


def dataset_of(root: Path, data: bytes, shard_tokens: int = 64 * 2**20) -> TokenDataset:
    src = write(root / "src" / "doc.txt", data)
    prepare([src], root / "ds", shard_tokens=shard_tokens)
    return TokenDataset.open(root / "ds")


def one_line(e: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ---------------------------------------------------------------- prepare


def test_prepare_folder_order_filter_and_separator(tmp_path: Path) -> None:
    m = prepare([make_tree(tmp_path / "t")], tmp_path / "ds")
    names = [s.name for s in m.sources]
    assert names == ["t/a.py", "t/b.txt", "t/sub/c.md", "t/sub/d.rst"]
    assert [s.size for s in m.sources] == [11, 4, 6, 4]
    expected = b"print('a')\n" + b"\0bee\n" + b"\0# see\n" + b"\0dee\n"
    ds = TokenDataset.open(tmp_path / "ds")
    assert ds.n_tokens == len(expected) == m.n_tokens
    assert ds.tokens(0, ds.n_tokens).tobytes() == expected
    assert ds.vocab_size == 256 and ds.dtype == np.uint8


def test_manifest_fields(tmp_path: Path) -> None:
    prepare([make_tree(tmp_path / "t")], tmp_path / "ds", shard_tokens=10)
    obj = json.loads((tmp_path / "ds" / MANIFEST_NAME).read_text())
    assert obj["format"] == "hypertrain-tokens" and obj["version"] == 1
    assert (obj["tokenizer"], obj["dtype"], obj["vocab_size"], obj["separator"]) == (
        "bytes",
        "uint8",
        256,
        0,
    )
    assert [s["tokens"] for s in obj["shards"]] == [10, 10, 8]
    assert sum(s["tokens"] for s in obj["shards"]) == obj["n_tokens"] == 28
    stream = b""
    for s in obj["shards"]:
        data = (tmp_path / "ds" / s["name"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == s["sha256"]
        stream += data
    assert hashlib.sha256(stream).hexdigest() == obj["stream_sha256"]
    assert len(obj["fingerprint"]) == 64
    assert sorted(os.listdir(tmp_path)) == ["ds", "t"]  # no temporary folder left


def test_explicit_file_taken_whatever_suffix_and_empty_file_adds_no_separator(
    tmp_path: Path,
) -> None:
    a = write(tmp_path / "a.bin", b"xy")
    empty = write(tmp_path / "empty.txt", b"")
    b = write(tmp_path / "b.dat", b"z")
    m = prepare([a, empty, b], tmp_path / "ds")
    assert [s.name for s in m.sources] == ["a.bin", "empty.txt", "b.dat"]
    assert TokenDataset.open(tmp_path / "ds").tokens(0, m.n_tokens).tobytes() == b"xy\0z"


def test_separator_choice(tmp_path: Path) -> None:
    a, b = write(tmp_path / "a.txt", "a"), write(tmp_path / "b.txt", "b")
    prepare([a, b], tmp_path / "nl", separator=10)
    prepare([a, b], tmp_path / "none", separator=None)
    assert TokenDataset.open(tmp_path / "nl").tokens(0, 3).tobytes() == b"a\nb"
    assert TokenDataset.open(tmp_path / "none").tokens(0, 2).tobytes() == b"ab"
    with pytest.raises(ConfigError):
        prepare([a], tmp_path / "bad", separator=256)


def test_fingerprint_stable_layout_free_and_content_sensitive(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "t")
    m1 = prepare([tree], tmp_path / "one")
    m2 = prepare([tree], tmp_path / "two")
    assert m1.fingerprint == m2.fingerprint
    assert (tmp_path / "one" / MANIFEST_NAME).read_bytes() == (
        tmp_path / "two" / MANIFEST_NAME
    ).read_bytes()
    # The fingerprint names the token stream, not the shard layout.
    assert prepare([tree], tmp_path / "small", shard_tokens=3).fingerprint == m1.fingerprint
    write(tree / "sub" / "d.rst", "deE\n")  # one byte changed
    assert prepare([tree], tmp_path / "three").fingerprint != m1.fingerprint


def test_prepare_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file or folder") as e:
        prepare([tmp_path / "nope"], tmp_path / "ds")
    assert "nope" in one_line(e)
    (tmp_path / "empty").mkdir()
    write(tmp_path / "empty" / "x.bin", b"1")
    with pytest.raises(DataError, match=r"holds no .*py.* files"):
        prepare([tmp_path / "empty"], tmp_path / "ds")
    with pytest.raises(DataError, match="empty input"):
        prepare([write(tmp_path / "e.txt", b"")], tmp_path / "ds")
    with pytest.raises(DataError, match="empty input"):
        prepare([], tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def test_prepare_is_atomic_on_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = write(tmp_path / "src" / "a.txt", "old text")
    prepare([src], tmp_path / "ds")
    before = (tmp_path / "ds" / MANIFEST_NAME).read_bytes()
    write(src, "new text that never lands")
    calls = {"n": 0}
    real_write = build_mod._ShardWriter.write

    def crashing(self: build_mod._ShardWriter, data: bytes | memoryview) -> None:
        calls["n"] += 1
        real_write(self, data)
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(build_mod._ShardWriter, "write", crashing)
    with pytest.raises(OSError, match="simulated"):
        prepare([src], tmp_path / "ds")
    with pytest.raises(OSError, match="simulated"):
        prepare([src], tmp_path / "fresh")
    assert calls["n"] == 2
    assert (tmp_path / "ds" / MANIFEST_NAME).read_bytes() == before  # old dataset intact
    assert not (tmp_path / "fresh").exists()
    assert sorted(os.listdir(tmp_path)) == ["ds", "src"]  # temporaries removed


def test_prepare_refuses_a_folder_that_is_not_a_dataset(tmp_path: Path) -> None:
    write(tmp_path / "out" / "precious.txt", "keep me")
    with pytest.raises(DataError, match=r"not empty and holds no manifest\.json"):
        prepare([write(tmp_path / "a.txt", "a")], tmp_path / "out")
    assert (tmp_path / "out" / "precious.txt").read_text() == "keep me"
    (tmp_path / "blank").mkdir()  # an empty folder is fine
    prepare([tmp_path / "a.txt"], tmp_path / "blank")
    TokenDataset.open(tmp_path / "blank")


def test_prepare_replace_false_keeps_existing(tmp_path: Path) -> None:
    a, b = write(tmp_path / "a.txt", "a"), write(tmp_path / "b.txt", "b")
    first = prepare([a], tmp_path / "ds")
    kept = prepare([b], tmp_path / "ds", replace=False)
    assert kept.fingerprint == first.fingerprint
    assert prepare([b], tmp_path / "ds").fingerprint != first.fingerprint


# ---------------------------------------------------------------- open / verify errors


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    prepare([make_tree(tmp_path / "t")], tmp_path / "ds", shard_tokens=10)
    return tmp_path / "ds"


def edit_manifest(folder: Path, **changes: object) -> None:
    path = folder / MANIFEST_NAME
    obj = json.loads(path.read_text())
    obj.update(changes)
    path.write_text(json.dumps(obj))


def test_open_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="dataset folder not found") as e:
        TokenDataset.open(tmp_path / "nowhere")
    assert "nowhere" in one_line(e)


def test_open_missing_manifest(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match=r"manifest.json: missing") as e:
        TokenDataset.open(tmp_path / "d")
    one_line(e)


def test_open_corrupt_json(prepared: Path) -> None:
    (prepared / MANIFEST_NAME).write_text('{"format": "hypertrain-tokens", ')
    with pytest.raises(DataError, match=r"manifest.json: not valid JSON") as e:
        TokenDataset.open(prepared)
    one_line(e)


def test_open_empty_dataset(prepared: Path) -> None:
    edit_manifest(prepared, n_tokens=0, shards=[])
    with pytest.raises(DataError, match=r"manifest.json: dataset is empty") as e:
        TokenDataset.open(prepared)
    one_line(e)


def test_open_missing_field_and_bad_type(prepared: Path) -> None:
    obj = json.loads((prepared / MANIFEST_NAME).read_text())
    del obj["dtype"]
    (prepared / MANIFEST_NAME).write_text(json.dumps(obj))
    with pytest.raises(DataError, match="field 'dtype' is missing"):
        TokenDataset.open(prepared)
    edit_manifest(prepared, dtype="uint8", n_tokens="25")
    with pytest.raises(DataError, match="field 'n_tokens' should be int"):
        TokenDataset.open(prepared)


def test_open_shard_size_mismatch(prepared: Path) -> None:
    shard = prepared / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(DataError, match=r"shard-00001.bin: shard is 9 bytes, .* 10 uint8") as e:
        TokenDataset.open(prepared)
    one_line(e)


def test_open_missing_shard(prepared: Path) -> None:
    (prepared / "shard-00002.bin").unlink()
    with pytest.raises(
        DataError, match=r"shard-00002.bin: shard listed in manifest.json is missing"
    ):
        TokenDataset.open(prepared)


def test_open_fingerprint_mismatch(prepared: Path) -> None:
    edit_manifest(prepared, separator=10)  # content field edited, fingerprint kept
    with pytest.raises(DataError, match=r"manifest.json: fingerprint mismatch") as e:
        TokenDataset.open(prepared)
    one_line(e)


def test_open_shard_count_mismatch_and_unsafe_name(prepared: Path) -> None:
    obj = json.loads((prepared / MANIFEST_NAME).read_text())
    obj["shards"][0]["tokens"] = 11
    (prepared / MANIFEST_NAME).write_text(json.dumps(obj))
    with pytest.raises(DataError, match="shards hold 29 tokens but n_tokens says 28"):
        TokenDataset.open(prepared)
    obj["shards"][0].update(tokens=10, name="../escape.bin")
    (prepared / MANIFEST_NAME).write_text(json.dumps(obj))
    with pytest.raises(DataError, match="is not a plain file name"):
        TokenDataset.open(prepared)


def test_verify_detects_tampered_shard(prepared: Path) -> None:
    TokenDataset.open(prepared).verify()
    shard = prepared / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0xFF  # same size: open() cannot see it, verify() must
    shard.write_bytes(bytes(data))
    ds = TokenDataset.open(prepared)
    with pytest.raises(DataError, match=r"shard-00000.bin: sha256 mismatch") as e:
        ds.verify()
    one_line(e)


def test_verify_checks_token_ids_against_vocab(tmp_path: Path) -> None:
    """A hand-written uint16 dataset (the format is not bytes-only) with an id >= vocab."""
    from hypertrain.common.data.manifest import content_fields, fingerprint_of

    folder = tmp_path / "u16"
    folder.mkdir()
    ids = np.array([1, 2, 3, 700, 4], dtype="<u2")
    (folder / "s.bin").write_bytes(ids.tobytes())
    digest = hashlib.sha256(ids.tobytes()).hexdigest()
    fields = content_fields(
        tokenizer="custom",
        dtype="uint16",
        vocab_size=500,
        separator=None,
        n_tokens=5,
        stream_sha256=digest,
    )
    obj = dict(fields, fingerprint=fingerprint_of(fields), sources=[])
    obj["shards"] = [{"name": "s.bin", "tokens": 5, "sha256": digest}]
    (folder / MANIFEST_NAME).write_text(json.dumps(obj))
    ds = TokenDataset.open(folder)
    assert ds.tokens(2, 3).tolist() == [3, 700, 4]
    with pytest.raises(DataError, match=r"s.bin: token id 700 >= vocab_size 500"):
        ds.verify()


# ---------------------------------------------------------------- windows across shards


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[TokenDataset, bytes]:
    root = tmp_path_factory.mktemp("sharded")
    data = text_of_size(200, seed=1)
    return dataset_of(root, data, shard_tokens=7), data


@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, 200), n=st.integers(0, 200))
def test_tokens_across_shard_boundaries(
    sharded: tuple[TokenDataset, bytes], start: int, n: int
) -> None:
    ds, data = sharded
    assert len(ds.manifest.shards) == 29
    if start + n > len(data):
        with pytest.raises(IndexError):
            ds.tokens(start, n)
        return
    assert ds.tokens(start, n).tobytes() == data[start : start + n]


@settings(max_examples=100, deadline=None)
@given(starts=st.lists(st.integers(0, 200 - 16), max_size=12))
def test_windows_match_tokens(sharded: tuple[TokenDataset, bytes], starts: list[int]) -> None:
    ds, data = sharded
    got = ds.windows(np.array(starts, dtype=np.int64), 16)
    assert got.dtype == np.int64 and got.shape == (len(starts), 16)
    for row, s in zip(got, starts, strict=True):
        assert bytes(row.tolist()) == data[s : s + 16]


# ---------------------------------------------------------------- sample stream


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> TokenDataset:
    root = tmp_path_factory.mktemp("corpus")
    return dataset_of(root, text_of_size(50_000, seed=2), shard_tokens=4096)


def test_stream_shapes_and_targets(corpus: TokenDataset) -> None:
    s = SampleStream(corpus, seq_len=16, global_batch=8, seed=0, n_holdout=4)
    b = s.global_batch_at(3)
    assert b.dtype == torch.int64 and b.shape == (8, 17)
    data = corpus.tokens(0, corpus.n_tokens)
    for row, start in zip(b, s.starts(3).tolist(), strict=True):
        assert row.tolist() == data[start : start + 17].tolist()


def test_stream_deterministic_and_random_access(corpus: TokenDataset) -> None:
    a = SampleStream(corpus, 16, 8, seed=5, n_holdout=4)
    b = SampleStream(TokenDataset.open(corpus.path), 16, 8, seed=5, n_holdout=4)
    late = b.global_batch_at(1000)  # computed without any earlier step
    for step in range(3):
        assert torch.equal(a.global_batch_at(step), b.global_batch_at(step))
    assert torch.equal(a.global_batch_at(1000), late)
    assert not torch.equal(a.global_batch_at(0), a.global_batch_at(1))
    other = SampleStream(corpus, 16, 8, seed=6, n_holdout=4)
    assert not torch.equal(a.global_batch_at(0), other.global_batch_at(0))


def test_stream_starts_golden() -> None:
    """Pins the (seed, step) -> starts derivation: a change here changes every experiment."""

    class _Fake:
        n_tokens = 1_000_000
        path = Path("fake")

    s = SampleStream(_Fake(), seq_len=256, global_batch=4, seed=0)  # type: ignore[arg-type]
    assert s.starts(0).tolist() == GOLDEN_STARTS_SEED0_STEP0
    assert s.train_tokens == 1_000_000 - 2 * 512 * 257


GOLDEN_STARTS_SEED0_STEP0 = [49215, 158694, 605517, 658002]


def test_stream_same_in_another_process(corpus: TokenDataset) -> None:
    code = (
        "import sys, hashlib; from hypertrain.common.data import TokenDataset, SampleStream;"
        "s = SampleStream(TokenDataset.open(sys.argv[1]), 16, 8, seed=3, n_holdout=4);"
        "print(hashlib.sha256(s.global_batch_at(7).numpy().tobytes()).hexdigest())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(corpus.path)], capture_output=True, text=True, check=True
    )
    here = SampleStream(corpus, 16, 8, seed=3, n_holdout=4).global_batch_at(7)
    assert out.stdout.strip() == hashlib.sha256(here.numpy().tobytes()).hexdigest()


@settings(max_examples=40, deadline=None)
@given(log_m=st.integers(0, 5), step=st.integers(0, 10**9), seed=st.integers(0, 2**32))
def test_replica_batches_concatenate_to_global(
    corpus: TokenDataset, log_m: int, step: int, seed: int
) -> None:
    m = 2**log_m
    s = SampleStream(corpus, 16, 32, seed=seed, n_holdout=4)
    parts = [s.replica_batch(step, r, m) for r in range(m)]
    assert all(p.shape == (32 // m, 17) for p in parts)
    assert torch.equal(torch.cat(parts), s.global_batch_at(step))


def test_replica_batch_rejects_bad_split(corpus: TokenDataset) -> None:
    s = SampleStream(corpus, 16, 12, seed=0, n_holdout=4)
    assert torch.equal(
        torch.cat([s.replica_batch(0, r, 3) for r in range(3)]), s.global_batch_at(0)
    )
    with pytest.raises(ConfigError, match="must divide global_batch 12"):
        s.replica_batch(0, 0, 5)
    with pytest.raises(ConfigError, match="not in"):
        s.replica_batch(0, 3, 3)
    with pytest.raises(ConfigError):
        s.global_batch_at(-1)


def test_batch_is_fast(corpus: TokenDataset) -> None:
    s = SampleStream(corpus, 256, 32, seed=0, n_holdout=16)
    s.global_batch_at(0)
    t0 = time.perf_counter()
    for step in range(200):
        s.global_batch_at(step)
    per_batch = (time.perf_counter() - t0) / 200
    assert per_batch < 5e-3, f"{per_batch * 1e6:.0f} us per 32x257 batch"  # ~0.15 ms measured


# ---------------------------------------------------------------- holdout


def test_holdout_disjoint_from_training(corpus: TokenDataset) -> None:
    seq, n = 16, 64
    h = holdout_windows(corpus, seq, n=n, seed=0)
    s = SampleStream(corpus, seq, 32, seed=0, n_holdout=n)
    boundary = train_end(corpus, seq, n)
    assert boundary == corpus.n_tokens - holdout_region_tokens(seq, n) == s.train_tokens
    assert h.shape == (n, seq + 1) and h.windows.dtype == torch.int64
    starts = list(h.starts)
    assert starts == sorted(starts) and starts[0] >= boundary
    assert all(b - a >= seq + 1 for a, b in itertools.pairwise(starts))  # no overlap
    assert starts[-1] + seq + 1 <= corpus.n_tokens
    train_max = max(int(s.starts(t).max()) for t in range(500))
    assert train_max + seq + 1 <= boundary  # no training token is a holdout token
    for row, a in zip(h.windows, starts, strict=True):
        assert row.tolist() == corpus.tokens(a, seq + 1).tolist()


def test_holdout_digest_stable_and_seeded(corpus: TokenDataset) -> None:
    a = holdout_windows(corpus, 16, n=32, seed=0)
    b = holdout_windows(TokenDataset.open(corpus.path), 16, n=32, seed=0)
    assert a.digest == b.digest == windows_digest(a.windows) and torch.equal(a.windows, b.windows)
    c = holdout_windows(corpus, 16, n=32, seed=1)
    assert c.digest != a.digest and c.starts != a.starts
    assert windows_digest(a.windows[:16]) != a.digest  # the shape is part of the digest


def test_dataset_too_small_says_how_many_tokens(tmp_path: Path) -> None:
    ds = dataset_of(tmp_path, text_of_size(1000))
    need = 2 * 512 * 257 + 257
    with pytest.raises(DataError, match=f"1000 tokens is too few .* needs at least {need}") as e:
        holdout_windows(ds, 256)
    one_line(e)
    with pytest.raises(DataError, match=f"needs at least {need}"):
        SampleStream(ds, 256, 32, seed=0)
    # Exactly enough: the only training window starts at 0.
    exact = dataset_of(tmp_path / "x", text_of_size(2 * 4 * 11 + 11), shard_tokens=5)
    s = SampleStream(exact, 10, 4, seed=0, n_holdout=4)
    assert s.starts(0).tolist() == [0, 0, 0, 0]
    assert holdout_windows(exact, 10, n=4).shape == (4, 11)


# ---------------------------------------------------------------- default corpus


def test_default_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HYPERTRAIN_DATA_DIR", str(tmp_path / "d"))
    assert default_data_dir() == tmp_path / "d"
    monkeypatch.delenv("HYPERTRAIN_DATA_DIR")
    assert default_data_dir() == Path.home() / ".cache" / "hypertrain" / "data" / "stdlib"


def test_ensure_default_dataset_prepares_stdlib_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HYPERTRAIN_DATA_DIR", str(tmp_path / "std"))
    ds = ensure_default_dataset()
    names = [s.name for s in ds.manifest.sources]
    assert names == sorted(names, key=lambda n: n.split("/", 1)[1]) and len(names) > 100
    assert not any("/test/" in n or "site-packages" in n for n in names)
    assert 1_000_000 < ds.n_tokens <= 32 * 2**20 + len(names)
    mtime = (tmp_path / "std" / MANIFEST_NAME).stat().st_mtime_ns
    again = ensure_default_dataset()
    assert again.fingerprint == ds.fingerprint
    assert (tmp_path / "std" / MANIFEST_NAME).stat().st_mtime_ns == mtime  # reused
    h = holdout_windows(ds, 256)
    assert h.shape == (512, 257)
    SampleStream(ds, 256, 32, seed=0).global_batch_at(0)


def test_ensure_default_dataset_never_overwrites_user_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    write(tmp_path / "mine" / "notes.txt", "mine")
    monkeypatch.setenv("HYPERTRAIN_DATA_DIR", str(tmp_path / "mine"))
    with pytest.raises(DataError, match="refusing to overwrite"):
        ensure_default_dataset()


# ---------------------------------------------------------------- CLI


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hypertrain")
    sub = parser.add_subparsers(dest="command", required=True)
    data_cmd.register(sub)
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


def test_cli_prepare_prints_one_summary_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = make_tree(tmp_path / "t")
    assert run_cli(["data", "prepare", str(tree), "--out", str(tmp_path / "ds")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1
    fields = dict(kv.split("=", 1) for kv in out[0].split()[2:])
    ds = TokenDataset.open(tmp_path / "ds")
    assert fields["tokens"] == str(ds.n_tokens) and fields["shards"] == "1"
    assert fields["fingerprint"] == ds.fingerprint and fields["out"] == str(tmp_path / "ds")
    assert float(fields["seconds"]) >= 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{tmp}/missing", "--out", "{tmp}/ds"], "missing: no such file or folder"),
        (["{tmp}/empty", "--out", "{tmp}/ds"], "folder holds no"),
        (["{tmp}/e.txt", "--out", "{tmp}/ds"], "empty input"),
        (["{tmp}/e.txt"], "--out DIR is required"),
    ],
)
def test_cli_errors_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    (tmp_path / "empty").mkdir()
    write(tmp_path / "e.txt", b"")
    rc = run_cli(["data", "prepare", *(a.format(tmp=tmp_path) for a in argv)])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("hypertrain data prepare: error: ") and message in err[0]
    assert not (tmp_path / "ds").exists()


def test_failed_publish_restores_the_old_dataset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = write(tmp_path / "a.txt", "old")
    before = prepare([src], tmp_path / "ds").fingerprint
    real_rename = os.rename

    def rename(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> None:
        if ".ds.tmp-" in str(a):
            raise OSError("rename refused (simulated)")
        real_rename(a, b)

    monkeypatch.setattr(build_mod.os, "rename", rename)
    write(src, "new")
    with pytest.raises(DataError, match="could not move the prepared dataset into place"):
        prepare([src], tmp_path / "ds")
    monkeypatch.undo()
    assert TokenDataset.open(tmp_path / "ds").fingerprint == before
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "ds"]
