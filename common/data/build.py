"""Turn text files into a token dataset: byte-level shards plus ``manifest.json``.

    prepare([Path("notes"), Path("README.md")], Path("data/mine"))
    prepare(None, default_data_dir())   # the built-in corpus: this Python's stdlib

Tokenizer "bytes": one token per byte of each file (vocab 256, dtype uint8).
Documents (files) are joined with one separator token, 0x00 by default: a NUL
byte does not occur in text, so it is an unambiguous end-of-document marker
that the model can learn; there is no separator after the last document.
Files are taken as raw bytes (no decoding), so any encoding round-trips.

Invariants:
- Deterministic: the same inputs give byte-identical shards and manifest (no
  timestamps, no absolute paths; files in a fixed order, see ``collect``).
- Atomic: everything is written into a hidden temporary folder beside
  ``out_dir``, fsynced, then renamed onto ``out_dir``; a crash leaves either
  the old dataset, the new one, or a stray temporary folder, never a folder
  whose manifest describes missing or partial shards.
- Never clobbers a folder that is not a dataset (non-empty, no manifest).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from hypertrain.common.data.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    SourceInfo,
    content_fields,
    fingerprint_of,
    read_manifest,
)
from hypertrain.common.errors import ConfigError, DataError
from hypertrain.common.trust.keys import fsync_dir

DEFAULT_SUFFIXES: tuple[str, ...] = (".py", ".txt", ".md", ".rst")
DEFAULT_SHARD_TOKENS = 64 * 2**20
DEFAULT_SEPARATOR = 0
# The built-in corpus is capped so prepare stays a few seconds on 2 cores;
# CPython 3.11's stdlib (no tests) is ~11.6 MiB, under the cap.
DEFAULT_CORPUS_BYTES = 32 * 2**20
# Folders never searched in the stdlib: third-party code and the test suites
# (tests are repetitive and vary most between builds).
STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
_READ_CHUNK = 16 * 2**20


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One input file: relative ``name`` recorded in the manifest, ``path`` read from."""

    name: str
    path: Path
    size: int


def _walk(root: Path, suffixes: Collection[str], excluded: Collection[str]) -> list[SourceFile]:
    """Files under ``root`` with a wanted suffix, sorted by relative POSIX path.

    Hidden files and folders (".git", ".venv") and ``excluded`` folder names are
    skipped; symlinked folders are not followed (os.walk's default), so a link
    loop cannot recurse forever.
    """
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in excluded]
        for fn in filenames:
            p = Path(dirpath) / fn
            if not fn.startswith(".") and p.suffix in suffixes and p.is_file():
                found.append((p.relative_to(root).as_posix(), p))
    found.sort(key=lambda t: t[0])
    return [SourceFile(f"{root.name}/{rel}", p, p.stat().st_size) for rel, p in found]


def collect(
    sources: Sequence[Path], suffixes: Collection[str] = DEFAULT_SUFFIXES
) -> list[SourceFile]:
    """Input files in order: sources as given; a folder's files sorted by relative path.

    A file named explicitly is always taken, whatever its suffix.
    """
    files: list[SourceFile] = []
    for src in sources:
        src = Path(src)
        if src.is_file():
            files.append(SourceFile(src.name, src, src.stat().st_size))
        elif src.is_dir():
            found = _walk(src, suffixes, excluded=("__pycache__",))
            if not found:
                raise DataError(f"{src}: folder holds no {', '.join(sorted(suffixes))} files")
            files.extend(found)
        else:
            raise DataError(f"{src}: no such file or folder")
    return files


def stdlib_root() -> Path:
    """The standard library folder of the running Python."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[SourceFile]:
    """The built-in corpus: stdlib ``*.py`` (no tests, no site-packages), sorted.

    Files are taken in order while the total stays <= ``max_bytes`` (a prefix of
    the sorted list, so the choice is deterministic on a given Python build).
    """
    files = _walk(stdlib_root(), (".py",), STDLIB_EXCLUDED_DIRS)
    taken: list[SourceFile] = []
    total = 0
    for f in files:
        if total + f.size > max_bytes:
            break
        taken.append(f)
        total += f.size
    if not taken:
        raise DataError(f"{stdlib_root()}: no standard-library source files found")
    return taken


class _ShardWriter:
    """Appends token bytes into fixed-size shard files, hashing as it goes."""

    def __init__(self, folder: Path, shard_tokens: int) -> None:
        self._folder = folder
        self._cap = shard_tokens
        self._shards: list[ShardInfo] = []
        self._stream = hashlib.sha256()
        self._fh: BinaryIO | None = None  # the shard being filled
        self._name = ""
        self._hash = hashlib.sha256()
        self._count = 0

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            if self._fh is None:
                name = f"shard-{len(self._shards):05d}.bin"
                self._fh = open(self._folder / name, "wb")  # noqa: SIM115 (closed in _finish)
                self._name, self._hash, self._count = name, hashlib.sha256(), 0
            piece = view[: self._cap - self._count]
            self._fh.write(piece)
            self._hash.update(piece)
            self._stream.update(piece)
            self._count += len(piece)
            view = view[len(piece) :]
            if self._count == self._cap:
                self._finish()

    def _finish(self) -> None:
        assert self._fh is not None
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        self._shards.append(ShardInfo(self._name, self._count, self._hash.hexdigest()))

    def close(self) -> tuple[list[ShardInfo], str]:
        """Finish the open shard; return the shards and the whole-stream sha256."""
        if self._fh is not None:
            self._finish()
        return self._shards, self._stream.hexdigest()

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _chunks(path: Path) -> Iterator[bytes]:
    # Chunked so a multi-GB text file never sits in memory whole.
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(_READ_CHUNK):
                yield chunk
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


def _write_tokens(
    files: Sequence[SourceFile], folder: Path, shard_tokens: int, separator: int | None
) -> Manifest:
    writer = _ShardWriter(folder, shard_tokens)
    sources: list[SourceInfo] = []
    n_tokens = 0
    sep = b"" if separator is None else bytes([separator])
    try:
        for f in files:
            size = 0
            for chunk in _chunks(f.path):
                if size == 0 and n_tokens:  # between non-empty documents only
                    writer.write(sep)
                    n_tokens += len(sep)
                writer.write(chunk)
                size += len(chunk)
                n_tokens += len(chunk)
            sources.append(SourceInfo(f.name, size))  # bytes actually read
        shards, stream = writer.close()
    finally:
        writer.abort()
    if n_tokens == 0:
        raise DataError(f"empty input: the {len(files)} source files hold no bytes")
    fields = content_fields(
        tokenizer="bytes", dtype="uint8", vocab_size=256, separator=separator,
        n_tokens=n_tokens, stream_sha256=stream,
    )  # fmt: skip
    return Manifest(
        tokenizer="bytes", dtype="uint8", vocab_size=256, separator=separator,
        n_tokens=n_tokens, stream_sha256=stream, shards=tuple(shards),
        sources=tuple(sources), fingerprint=fingerprint_of(fields),
    )  # fmt: skip


def _check_target(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"{out_dir}: exists and is not a folder")
    if out_dir.is_dir() and not (out_dir / MANIFEST_NAME).exists() and any(out_dir.iterdir()):
        raise DataError(
            f"{out_dir}: folder is not empty and holds no {MANIFEST_NAME}; refusing to overwrite it"
        )


def _publish(tmp: Path, out_dir: Path, replace: bool) -> bool:
    """Rename the finished ``tmp`` onto ``out_dir``.

    Returns False (and publishes nothing) when ``replace`` is off and a dataset
    is already there, e.g. a concurrent ``prepare`` won the race.  Replacing
    moves the old dataset aside first: a directory cannot be swapped in one
    rename, and a reader that already memory-mapped the old shards keeps them.
    """
    _check_target(out_dir)
    aside: Path | None = None
    if out_dir.is_dir():
        if not any(out_dir.iterdir()):
            out_dir.rmdir()
        elif not replace:
            return False
        else:
            aside = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.rename(out_dir, aside / "dataset")
    try:
        os.rename(tmp, out_dir)
    except OSError as e:
        if aside is not None:  # put the old dataset back before reporting
            os.rename(aside / "dataset", out_dir)
            aside.rmdir()
        if not replace and (out_dir / MANIFEST_NAME).exists():
            return False  # lost the race to another process; its dataset stands
        raise DataError(
            f"{out_dir}: could not move the prepared dataset into place ({e})"
        ) from None
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    fsync_dir(out_dir.parent)
    return True


def prepare(
    sources: Sequence[Path] | None,
    out_dir: Path,
    *,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    separator: int | None = DEFAULT_SEPARATOR,
    suffixes: Collection[str] = DEFAULT_SUFFIXES,
    replace: bool = True,
) -> Manifest:
    """Write a byte-level token dataset for ``sources`` into ``out_dir``; return its manifest.

    ``sources=None`` takes the built-in stdlib corpus (``stdlib_corpus``).
    ``suffixes`` filters files found in folders.  With ``replace=False`` an
    existing dataset in ``out_dir`` is kept and its manifest returned.
    Raises DataError for missing or empty input, ConfigError for bad settings.
    """
    if shard_tokens < 1:
        raise ConfigError(f"shard_tokens must be >= 1, got {shard_tokens}")
    if separator is not None and not 0 <= separator < 256:
        raise ConfigError(f"separator must be a byte 0..255 or None, got {separator}")
    if sources is not None and not sources:
        raise DataError("empty input: no source files or folders given")
    out_dir = Path(out_dir)
    files = stdlib_corpus() if sources is None else collect(sources, suffixes)
    _check_target(out_dir)  # fail before the work, not after
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        # Beside out_dir so the final rename stays on one filesystem (atomic).
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    except OSError as e:
        raise DataError(
            f"{out_dir}: cannot create the dataset folder ({e.strerror or e})"
        ) from None
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; a dataset is meant to be shared
        manifest = _write_tokens(files, tmp, shard_tokens, separator)
        with open(tmp / MANIFEST_NAME, "w", encoding="ascii") as fh:
            fh.write(manifest.to_json())
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(tmp)
        if not _publish(tmp, out_dir, replace):
            return read_manifest(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when published
    return manifest
