"""Ed25519 signing keys of the daemons and the trusted-key list auditors pin.

Every daemon (the aggregator, each relay, each island) signs what it produces
(tape entries, encoded deltas) with its own Ed25519 key; an auditor verifies
against a list of public keys it pinned beforehand.  These keys are separate
from TLS keys.

Files written by ``init_keys`` (``hypertrain keys init DIR``):

``DIR/<name>.key``
    One private key per daemon: unencrypted PEM PKCS#8 (``-----BEGIN PRIVATE
    KEY-----``, readable by ``openssl pkey``).  Protection is the file mode: it
    is created 0600 from the first byte (``os.open`` with O_CREAT|O_EXCL and
    mode 0600, fsynced, then hard-linked or renamed into place), so it is never
    group/world readable, not even briefly, and a crash never leaves a partial
    key under the final name.
``DIR/trusted_keys.json``
    The public list, mode 0644, safe to copy to auditors::

        {"format": "hypertrain-trusted-keys/1",
         "keys": {"aggregator": {"key_id": "<16 hex>", "public_key": "<64 hex>"}, ...}}

    ``public_key`` is the raw 32-byte Ed25519 public key in hex; ``key_id`` is
    the first 16 hex digits of sha256(public key).  ``TrustedKeys.load`` checks
    that every key id matches its key.

Invariants:
- ``load_signing_key`` refuses, with a message that says what is wrong and how to
  fix it, a key file that is missing, unreadable, not a regular file, has any
  group/other permission bit (a daemon must not start with an exposed key), or
  does not hold an unencrypted Ed25519 PKCS#8 key.
- Existing key files are never replaced unless ``force`` is given.
- Key names are lower-case ``[a-z][a-z0-9._-]*`` and never look like a key id,
  so ``TrustedKeys`` can be indexed by either without ambiguity.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from hypertrain.common.errors import KeyFileError, UnknownKeyError

if TYPE_CHECKING:  # config pulls in torch (via the codecs); keys and the tape do not need it
    from hypertrain.common.config import TopologyConfig

KEY_SUFFIX = ".key"
TRUSTED_KEYS_FILE = "trusted_keys.json"
TRUSTED_FORMAT = "hypertrain-trusted-keys/1"
KEY_ID_HEX = 16
SIGNATURE_BYTES = 64
_MAX_KEY_FILE = 1 << 16
_NAME_RE = re.compile(r"[a-z][a-z0-9._-]{0,63}")
_KEY_ID_RE = re.compile(r"[0-9a-f]{16}")


def key_id_of(public_bytes: bytes) -> str:
    """The key id: first 16 hex digits of sha256 of the raw 32-byte public key."""
    return hashlib.sha256(public_bytes).hexdigest()[:KEY_ID_HEX]


def check_key_name(name: str) -> str:
    """Return ``name`` if it is a valid key name, else raise KeyFileError."""
    if not _NAME_RE.fullmatch(name) or _KEY_ID_RE.fullmatch(name):
        raise KeyFileError(
            f"bad key name {name!r}: use lower-case letters, digits, '.', '_' or '-', "
            "starting with a letter (at most 64 characters, not 16 hex digits)"
        )
    return name


def daemon_key_names(topology: TopologyConfig) -> list[str]:
    """Key names of a run's daemons: aggregator, relay-<region> (with relay shards:
    relay-<region>-<i> for each shard i), island-<island id>."""
    # Imported here: they pull in torch, as the caller's config already has.
    from hypertrain.common.shards import relay_member
    from hypertrain.common.trust.ledger import island_key, relay_key

    names = ["aggregator"]
    s = topology.relay_shards
    names += [relay_key(relay_member(r, i, s)) for r in topology.regions for i in range(s)]
    names += [island_key(i) for i in topology.island_ids()]
    return names


class SigningKey:
    """A daemon's Ed25519 private key with its name and key id.  Never printed."""

    __slots__ = ("_key", "key_id", "name", "public_bytes")

    def __init__(self, name: str, key: Ed25519PrivateKey) -> None:
        self.name = check_key_name(name)
        self._key = key
        self.public_bytes: bytes = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.key_id: str = key_id_of(self.public_bytes)

    @classmethod
    def generate(cls, name: str) -> SigningKey:
        """A fresh random key (in memory; ``init_keys`` writes keys to files)."""
        return cls(name, Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, name: str, seed: bytes) -> SigningKey:
        """The key with this 32-byte private seed (deterministic keys for simulations)."""
        return cls(name, Ed25519PrivateKey.from_private_bytes(seed))

    def sign(self, data: bytes) -> bytes:
        """The 64-byte Ed25519 signature over exactly ``data``."""
        return self._key.sign(data)

    def trusted(self) -> TrustedKey:
        """The public half, as an entry of a trusted list."""
        return TrustedKey(self.name, self.public_bytes)

    def pem(self) -> bytes:
        """The private key as unencrypted PEM PKCS#8 (the key file's content)."""
        return self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def __repr__(self) -> str:
        return f"SigningKey(name={self.name!r}, key_id={self.key_id!r})"


@dataclass(frozen=True)
class TrustedKey:
    """One pinned public key."""

    name: str
    public_bytes: bytes
    key_id: str = field(init=False)
    _key: Ed25519PublicKey = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_key_name(self.name)
        try:
            key = Ed25519PublicKey.from_public_bytes(self.public_bytes)
        except ValueError:
            raise KeyFileError(
                f"public key of {self.name!r} is not a 32-byte Ed25519 key"
            ) from None
        object.__setattr__(self, "key_id", key_id_of(self.public_bytes))
        object.__setattr__(self, "_key", key)

    def verify(self, data: bytes, signature: bytes) -> bool:
        """True iff ``signature`` is this key's Ed25519 signature over exactly ``data``."""
        try:
            self._key.verify(signature, data)
        except InvalidSignature:
            return False
        return True


class TrustedKeys:
    """The public keys an auditor (or a relay checking islands) trusts, by name and key id."""

    def __init__(self, keys: Iterable[TrustedKey]) -> None:
        self._by_id: dict[str, TrustedKey] = {}
        self._by_name: dict[str, TrustedKey] = {}
        for k in keys:
            if k.name in self._by_name or k.key_id in self._by_id:
                raise KeyFileError(f"trusted keys: duplicate name or key id for {k.name!r}")
            self._by_id[k.key_id] = k
            self._by_name[k.name] = k

    @classmethod
    def of(cls, keys: Iterable[SigningKey | TrustedKey]) -> TrustedKeys:
        """Trust these keys (public halves of signing keys are taken)."""
        return cls(k.trusted() if isinstance(k, SigningKey) else k for k in keys)

    @classmethod
    def load(cls, path: str | Path) -> TrustedKeys:
        """Read a ``trusted_keys.json`` (see the module docstring); KeyFileError if bad."""
        p = Path(path)
        try:
            doc = json.loads(p.read_bytes())
        except FileNotFoundError:
            raise KeyFileError(
                f"trusted key list {p} does not exist; `hypertrain keys init DIR` writes "
                f"DIR/{TRUSTED_KEYS_FILE}"
            ) from None
        except OSError as e:
            raise KeyFileError(f"trusted key list {p}: {e.strerror}") from None
        except ValueError as e:
            raise KeyFileError(f"trusted key list {p} is not valid JSON: {e}") from None
        return cls.from_json(doc, source=str(p))

    @classmethod
    def from_json(cls, doc: object, *, source: str = "trusted key list") -> TrustedKeys:
        """Parse the JSON document form (``to_json`` inverts it)."""
        if not isinstance(doc, dict) or doc.get("format") != TRUSTED_FORMAT:
            raise KeyFileError(f"{source}: not a {TRUSTED_FORMAT} document")
        entries = doc.get("keys")
        if not isinstance(entries, dict):
            raise KeyFileError(f"{source}: 'keys' must be an object of name -> key")
        keys = []
        for name, e in sorted(entries.items()):
            try:
                k = TrustedKey(name, bytes.fromhex(e["public_key"]))
                kid = e["key_id"]
            except (TypeError, KeyError, ValueError) as err:
                raise KeyFileError(f"{source}: key {name!r} is malformed ({err})") from None
            if kid != k.key_id:
                raise KeyFileError(
                    f"{source}: key {name!r} has key_id {kid} but its public key's id is "
                    f"{k.key_id}; the list was edited or corrupted"
                )
            keys.append(k)
        return cls(keys)

    def to_json(self) -> dict[str, object]:
        keys = {
            n: {"key_id": k.key_id, "public_key": k.public_bytes.hex()}
            for n, k in sorted(self._by_name.items())
        }
        return {"format": TRUSTED_FORMAT, "keys": keys}

    def lookup(self, key_id_or_name: str) -> TrustedKey:
        """The pinned key with this key id or name; UnknownKeyError if none."""
        k = self._by_id.get(key_id_or_name) or self._by_name.get(key_id_or_name)
        if k is None:
            raise UnknownKeyError(
                f"unknown key {key_id_or_name!r}: not in the trusted key list "
                f"({len(self._by_id)} keys: {', '.join(sorted(self._by_name)) or 'none'})"
            )
        return k

    def verify(self, key_id_or_name: str, data: bytes, signature: bytes) -> bool:
        """True iff the named key signed exactly ``data``; UnknownKeyError for an unknown key."""
        return self.lookup(key_id_or_name).verify(data, signature)

    def __contains__(self, key_id_or_name: object) -> bool:
        return key_id_or_name in self._by_id or key_id_or_name in self._by_name

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def names(self) -> list[str]:
        return sorted(self._by_name)


def read_private_file(path: str | Path, what: str = "key file") -> bytes:
    """The bytes of a private key file, refused (KeyFileError naming the problem and
    the fix) if missing, unreadable, not a regular file or group/world-accessible;
    at most 64 KiB + 1 bytes are read (more is no key).  The mode is checked on the opened descriptor, so the file checked
    is the file read."""
    p = Path(path)
    fix = "create keys with `hypertrain keys init DIR`"
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise KeyFileError(f"{what} {p} does not exist; {fix}") from None
    except PermissionError:
        raise KeyFileError(
            f"{what} {p} is not readable by this user (uid {os.geteuid()}); it must be "
            "owned by the daemon's user with mode 0600"
        ) from None
    except OSError as e:
        raise KeyFileError(f"{what} {p} cannot be opened: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"{what} {p} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            how = "readable" if mode & 0o044 else "accessible"
            raise KeyFileError(
                f"{what} {p} is {how} by group/others (mode {mode:04o}); chmod 600 it"
            )
        try:
            return os.read(fd, _MAX_KEY_FILE + 1)
        except OSError as e:
            raise KeyFileError(f"{what} {p} cannot be read: {e.strerror}") from None
    finally:
        os.close(fd)


def load_signing_key(path: str | Path, name: str | None = None) -> SigningKey:
    """Load a daemon's private key file (name defaults to the file's stem).

    Refuses with KeyFileError, naming the problem and the fix, a missing,
    unreadable, non-regular, group/world-accessible or malformed file.  The
    mode is checked on the opened descriptor, so the file checked is the file read.
    """
    p = Path(path)
    data = read_private_file(p)
    return SigningKey(name or _name_of(p), _parse_private(p, data))


def _name_of(p: Path) -> str:
    stem = p.name[: -len(KEY_SUFFIX)] if p.name.endswith(KEY_SUFFIX) else p.name
    return check_key_name(stem)


def _parse_private(p: Path, data: bytes) -> Ed25519PrivateKey:
    expect = "hypertrain key files hold an unencrypted Ed25519 key in PEM PKCS#8 form"
    if not data.strip():
        raise KeyFileError(f"key file {p} is empty; {expect}; regenerate it")
    if len(data) > _MAX_KEY_FILE:
        raise KeyFileError(f"key file {p} is too large to be a key; {expect}")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise KeyFileError(
            f"key file {p} is password-protected; {expect} (protected by mode 0600)"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise KeyFileError(
            f"key file {p} is malformed: not a PEM private key; {expect}; regenerate it"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"key file {p} holds a {type(key).__name__}, not Ed25519; {expect}")
    return key


def init_keys(directory: str | Path, names: Sequence[str], *, force: bool = False) -> Path:
    """Make one private key per name in ``directory`` and add them to its trusted list.

    Returns the path of ``trusted_keys.json``, which keeps keys of other names
    already listed there.  Refuses (KeyFileError) if a key file of one of these
    names exists, unless ``force``; then the old key is replaced atomically.
    """
    d = Path(directory)
    for n in names:
        check_key_name(n)
    if not names:
        raise KeyFileError("no key names given")
    if len(set(names)) != len(names):
        raise KeyFileError(f"duplicate key names in {', '.join(names)}")
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise KeyFileError(f"cannot create key folder {d}: {e.strerror}") from None
    existing = [f"{n}{KEY_SUFFIX}" for n in names if (d / f"{n}{KEY_SUFFIX}").exists()]
    if existing and not force:
        raise KeyFileError(
            f"{', '.join(existing)} already exist in {d}; pass --force to replace them "
            "(entries signed with the old keys will no longer verify against the new list)"
        )
    trusted_path = d / TRUSTED_KEYS_FILE
    old: dict[str, TrustedKey] = {}
    if trusted_path.exists():
        try:
            prior = TrustedKeys.load(trusted_path)
            old = {n: prior.lookup(n) for n in prior.names}
        except KeyFileError:
            if not force:  # a damaged list is only replaced on request
                raise
    new = [SigningKey.generate(n) for n in names]
    for k in new:
        write_new(d / f"{k.name}{KEY_SUFFIX}", k.pem(), mode=0o600, replace=force)
    old.update({k.name: k.trusted() for k in new})
    doc = json.dumps(TrustedKeys(old.values()).to_json(), indent=2, sort_keys=True) + "\n"
    write_new(trusted_path, doc.encode(), mode=0o644, replace=True)
    return trusted_path


def write_new(path: Path, data: bytes, *, mode: int, replace: bool) -> None:
    """Write ``data`` at ``path`` atomically with ``mode`` from creation on.

    A temporary file in the same folder is created with O_EXCL and the final
    mode, written and fsynced, then renamed over ``path`` (``replace``) or
    hard-linked to it (which fails if ``path`` exists); the folder is fsynced.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)  # exactly this mode, whatever the umask
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise KeyFileError(f"{path} already exists; pass --force to replace it") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_dir(path.parent)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write all of ``data`` at ``fd``'s position: ``os.write`` may take fewer bytes than
    asked (a disk nearly full, a signal), so it is called until none are left (an
    OSError is raised as it comes, with what was written so far left in the file)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def fsync_dir(directory: Path) -> None:
    """fsync a folder so a file created or renamed in it survives a crash."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
