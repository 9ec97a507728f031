"""The on-disk description of a token dataset: ``manifest.json``.

A prepared dataset is one folder holding raw token shards (``shard-00000.bin``,
...: the token ids back to back, native little-endian ``dtype``, no header) and
this manifest.  The manifest is the only thing that makes the folder a
dataset; ``prepare`` writes it last, inside a temporary folder that is renamed
into place, so a folder with a manifest is always complete.

Invariants:
- ``n_tokens`` is the sum of the shard token counts and is > 0.
- ``fingerprint`` is the sha256 of the canonical JSON (sorted keys, no spaces,
  ASCII) of the *content* fields only: format, version, tokenizer, dtype,
  vocab_size, separator, n_tokens and ``stream_sha256`` (the sha256 of all
  shard bytes in order).  It names the token stream, so it does not change
  with the shard size, the source file names or the folder's location, and
  it changes whenever one token changes.
- Parsing never trusts the file: every malformed field raises ``DataError``
  with one line naming the file and the field.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hypertrain.common.errors import DataError

FORMAT = "hypertrain-tokens"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
# Token dtypes a dataset may use (user shards from a BPE tokenizer are uint16).
DTYPES: dict[str, type[np.unsignedinteger[Any]]] = {
    "uint8": np.uint8,
    "uint16": np.uint16,
    "uint32": np.uint32,
}
_HEX64 = re.compile(r"[0-9a-f]{64}")
# A shard is a plain file beside the manifest: no folders, no "..", no hidden files.
_SHARD_NAME = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]*")


def canonical_json(obj: Any) -> bytes:
    """The one byte encoding hashed for fingerprints: sorted keys, no whitespace, ASCII."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One shard file: its name beside the manifest, its token count, sha256 of its bytes."""

    name: str
    tokens: int
    sha256: str


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """One input file: its relative name (folder basename / relative path) and byte size."""

    name: str
    size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """The parsed ``manifest.json`` of a dataset (see the module docstring)."""

    tokenizer: str
    """How text became tokens; "bytes" = one token per byte (vocab 256)."""
    dtype: str
    """Token dtype in the shards, one of ``DTYPES``."""
    vocab_size: int
    """Every token id is < vocab_size."""
    separator: int | None
    """Token written between documents (None: documents are simply concatenated)."""
    n_tokens: int
    stream_sha256: str
    """sha256 of all shard bytes in shard order."""
    shards: tuple[ShardInfo, ...]
    sources: tuple[SourceInfo, ...]
    fingerprint: str
    version: int = FORMAT_VERSION

    def content_fields(self) -> dict[str, Any]:
        """The fields the fingerprint covers."""
        return content_fields(
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            vocab_size=self.vocab_size,
            separator=self.separator,
            n_tokens=self.n_tokens,
            stream_sha256=self.stream_sha256,
            version=self.version,
        )

    def to_json(self) -> str:
        """Human-readable JSON (indented, sorted keys, trailing newline); deterministic."""
        obj = dict(self.content_fields())
        obj["fingerprint"] = self.fingerprint
        obj["shards"] = [
            {"name": s.name, "tokens": s.tokens, "sha256": s.sha256} for s in self.shards
        ]
        obj["sources"] = [{"name": s.name, "size": s.size} for s in self.sources]
        return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: Path | str) -> Manifest:
        """Parse and check a manifest; ``where`` names the file in error messages."""
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e})") from None
        return _parse(obj, where)


def content_fields(
    *,
    tokenizer: str,
    dtype: str,
    vocab_size: int,
    separator: int | None,
    n_tokens: int,
    stream_sha256: str,
    version: int = FORMAT_VERSION,
) -> dict[str, Any]:
    """The fingerprinted fields as a JSON object."""
    return {
        "format": FORMAT,
        "version": version,
        "tokenizer": tokenizer,
        "dtype": dtype,
        "vocab_size": vocab_size,
        "separator": separator,
        "n_tokens": n_tokens,
        "stream_sha256": stream_sha256,
    }


def fingerprint_of(fields: dict[str, Any]) -> str:
    """sha256 hex of the canonical JSON of ``content_fields``."""
    return hashlib.sha256(canonical_json(fields)).hexdigest()


def _get(obj: dict[str, Any], key: str, kind: type, where: Path | str) -> Any:
    if key not in obj:
        raise DataError(f"{where}: field {key!r} is missing")
    value = obj[key]
    # bool is an int subclass; a boolean where a count belongs is corruption.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise DataError(f"{where}: field {key!r} should be {kind.__name__}, got {value!r}")
    return value


def _digest(obj: dict[str, Any], key: str, where: Path | str) -> str:
    value = _get(obj, key, str, where)
    if not _HEX64.fullmatch(value):
        raise DataError(f"{where}: field {key!r} is not a sha256 hex digest: {value!r}")
    return str(value)


def _parse(obj: Any, where: Path | str) -> Manifest:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: top level should be a JSON object")
    if obj.get("format") != FORMAT:
        raise DataError(f"{where}: field 'format' should be {FORMAT!r}, got {obj.get('format')!r}")
    version = _get(obj, "version", int, where)
    if version != FORMAT_VERSION:
        raise DataError(
            f"{where}: format version {version} is not supported (this code reads {FORMAT_VERSION})"
        )
    dtype = _get(obj, "dtype", str, where)
    if dtype not in DTYPES:
        raise DataError(f"{where}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    vocab = _get(obj, "vocab_size", int, where)
    if not 1 <= vocab <= int(np.iinfo(DTYPES[dtype]).max) + 1:
        raise DataError(f"{where}: vocab_size {vocab} does not fit dtype {dtype}")
    sep = obj.get("separator")
    if sep is not None and (
        not isinstance(sep, int) or isinstance(sep, bool) or not 0 <= sep < vocab
    ):
        raise DataError(f"{where}: separator {sep!r} is not a token id below vocab_size {vocab}")
    shards = tuple(_parse_shard(s, where) for s in _get(obj, "shards", list, where))
    sources = tuple(_parse_source(s, where) for s in _get(obj, "sources", list, where))
    m = Manifest(
        version=version,
        tokenizer=_get(obj, "tokenizer", str, where),
        dtype=dtype,
        vocab_size=vocab,
        separator=sep,
        n_tokens=_get(obj, "n_tokens", int, where),
        stream_sha256=_digest(obj, "stream_sha256", where),
        shards=shards,
        sources=sources,
        fingerprint=_digest(obj, "fingerprint", where),
    )
    _check_counts(m, where)
    return m


def _parse_shard(obj: Any, where: Path | str) -> ShardInfo:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a 'shards' entry should be an object, got {obj!r}")
    name = _get(obj, "name", str, where)
    if not _SHARD_NAME.fullmatch(name) or name == MANIFEST_NAME:
        raise DataError(f"{where}: shard name {name!r} is not a plain file name")
    tokens = _get(obj, "tokens", int, where)
    if tokens <= 0:
        raise DataError(f"{where}: shard {name} has {tokens} tokens (must be > 0)")
    return ShardInfo(name=name, tokens=tokens, sha256=_digest(obj, "sha256", where))


def _parse_source(obj: Any, where: Path | str) -> SourceInfo:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a 'sources' entry should be an object, got {obj!r}")
    return SourceInfo(name=_get(obj, "name", str, where), size=_get(obj, "size", int, where))


def _check_counts(m: Manifest, where: Path | str) -> None:
    if m.n_tokens <= 0 or not m.shards:
        raise DataError(f"{where}: dataset is empty ({m.n_tokens} tokens, {len(m.shards)} shards)")
    total = sum(s.tokens for s in m.shards)
    if total != m.n_tokens:
        raise DataError(f"{where}: shards hold {total} tokens but n_tokens says {m.n_tokens}")
    if len({s.name for s in m.shards}) != len(m.shards):
        raise DataError(f"{where}: shard names repeat")
    expected = fingerprint_of(m.content_fields())
    if expected != m.fingerprint:
        raise DataError(
            f"{where}: fingerprint mismatch (stored {m.fingerprint[:16]}..., "
            f"content gives {expected[:16]}...): the manifest was edited"
        )


def read_manifest(folder: Path) -> Manifest:
    """Read and check ``folder/manifest.json`` (the shards are not looked at)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: dataset folder not found")
    path = folder / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(
            f"{path}: missing; not a prepared dataset (run `hypertrain data prepare`)"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: unreadable ({e})") from None
    return Manifest.from_json(text, path)
