"""The run's TLS certificates: a run CA and one certificate per daemon.

Every daemon talks mutual TLS (``hypertrain.wire.tls``): it presents a certificate
signed by the run's CA whose name is the daemon's (``island-eu-0``, ``relay-eu``,
``relay-eu-1`` for a relay shard, ``aggregator``: the same names as its signing key),
and accepts only peers with such certificates.  The name is the peer's identity.
TLS keys are separate from the Ed25519 signing keys (``keys.py``): TLS authenticates
the channel, signatures make the evidence.

Files (``hypertrain keys init DIR`` makes them beside the signing keys)::

    DIR/ca.crt            the run CA's certificate (public; every daemon pins it)
    DIR/ca.key            the CA's private key, mode 0600: needed only to issue
                          certificates (keep it off the daemons' hosts)
    DIR/<name>.crt        a daemon's certificate (public)
    DIR/<name>.tls.key    its private key, mode 0600

Keys are ECDSA P-256; certificates are X.509 v3, subject CN = the name and a DNS
subjectAltName of the same name (clients check the server's certificate against the
name of the daemon they mean to reach, not its address), usable for both TLS server
and client authentication.  ``issue`` makes a new certificate for one name with the
existing CA (rotation: ``hypertrain keys cert DIR NAME``); a daemon reads its files
at start, so a rotated certificate takes effect when the daemon restarts.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from secrets import token_hex

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hypertrain.common.errors import KeyFileError
from hypertrain.common.trust.keys import check_key_name, init_keys, read_private_file, write_new

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
CERT_SUFFIX = ".crt"
TLS_KEY_SUFFIX = ".tls.key"
CA_DAYS = 3650
CERT_DAYS = 365
_MAX_CERT_FILE = 1 << 16
#: Certificates start being valid this long before they are made: clocks of the hosts
#: of one run are never exactly together.
_BACKDATE = dt.timedelta(minutes=5)


def cert_path(directory: Path, name: str) -> Path:
    return directory / f"{name}{CERT_SUFFIX}"


def tls_key_path(cert: Path) -> Path:
    """The private key beside a certificate: ``<name>.crt`` -> ``<name>.tls.key``."""
    stem = cert.name.removesuffix(CERT_SUFFIX)
    return cert.with_name(f"{stem}{TLS_KEY_SUFFIX}")


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _build(
    name: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    signer: ec.EllipticCurvePrivateKey,
    *,
    ca: bool,
    days: int,
    now: dt.datetime,
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer if not ca else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
    )
    if ca:
        b = b.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), True
        )
    else:
        b = (
            b.add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), False)
            .add_extension(
                x509.KeyUsage(True, False, False, False, False, False, False, False, False), True
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                False,
            )
        )
    return b.sign(signer, hashes.SHA256())


def init_ca(directory: Path, *, force: bool = False, days: int = CA_DAYS) -> Path:
    """Make the run CA (``ca.crt``, ``ca.key`` 0600) in ``directory``; returns ca.crt.
    An existing CA is kept unless ``force`` (every certificate it issued then stops
    being accepted)."""
    crt, key_file = directory / CA_CERT, directory / CA_KEY
    if (crt.exists() or key_file.exists()) and not force:
        raise KeyFileError(
            f"{crt} already exists; `hypertrain keys ca DIR --force` makes a new CA (and "
            "issues every certificate in DIR again: the old CA's are then refused)"
        )
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"hypertrain run CA {token_hex(4)}")])
    cert = _build(name.rfc4514_string(), key, name, key, ca=True, days=days, now=_now())
    write_new(key_file, _pem_key(key), mode=0o600, replace=True)
    write_new(crt, _pem_cert(cert), mode=0o644, replace=True)
    return crt


def issue(
    directory: Path,
    name: str,
    *,
    days: int = CERT_DAYS,
    now: dt.datetime | None = None,
    force: bool = False,
) -> Path:
    """A new key and certificate for daemon ``name``, signed by the CA in ``directory``;
    returns the certificate's path.  ``now``: when it starts being valid (tests make
    expired certificates with it)."""
    check_key_name(name)
    crt = cert_path(directory, name)
    if crt.exists() and not force:
        raise KeyFileError(f"{crt} already exists; pass --force to replace it")
    ca_cert = load_cert(directory / CA_CERT)
    ca_key = _load_ec_key(directory / CA_KEY)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _build(name, key, ca_cert.subject, ca_key, ca=False, days=days, now=now or _now())
    # The key first: a certificate on disk always has its key beside it.
    write_new(tls_key_path(crt), _pem_key(key), mode=0o600, replace=True)
    write_new(crt, _pem_cert(cert), mode=0o644, replace=True)
    return crt


def init_daemons(
    directory: Path, names: Sequence[str], *, force: bool = False, days: int = CERT_DAYS
) -> Path:
    """Everything a run's daemons need in ``directory``: a signing key each and the
    trusted list (``keys.init_keys``), the CA unless there is one, and a certificate
    each.  Returns the trusted list's path."""
    trusted = init_keys(directory, names, force=force)
    ensure_certs(directory, names, force=force, days=days)
    return trusted


def ensure_certs(
    directory: Path, names: Sequence[str], *, force: bool = False, days: int = CERT_DAYS
) -> None:
    """The CA in ``directory`` unless there is one, and a certificate for each name that
    has none (every name with ``force``)."""
    if not (directory / CA_CERT).exists():
        init_ca(directory)
    for n in names:
        if force or not cert_path(directory, n).exists():
            issue(directory, n, days=days, force=True)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def load_cert(path: Path) -> x509.Certificate:
    """A PEM certificate; KeyFileError naming the file if missing or malformed."""
    try:
        data = path.read_bytes()[: _MAX_CERT_FILE + 1]
    except FileNotFoundError:
        raise KeyFileError(
            f"certificate {path} does not exist; create it with `hypertrain keys init DIR`"
        ) from None
    except OSError as e:
        raise KeyFileError(f"certificate {path} cannot be read: {e.strerror}") from None
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError:
        raise KeyFileError(f"certificate {path} is not a PEM X.509 certificate") from None


def _load_ec_key(path: Path) -> ec.EllipticCurvePrivateKey:
    data = read_private_file(path, "TLS key file")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (TypeError, ValueError, UnsupportedAlgorithm):
        raise KeyFileError(f"TLS key file {path} is not an unencrypted PEM private key") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise KeyFileError(f"TLS key file {path} holds a {type(key).__name__}, not ECDSA")
    return key


def fingerprint(pem: bytes) -> str:
    """The sha256 (hex) of a PEM certificate's DER bytes: how a tape pins the run CA."""
    cert = x509.load_pem_x509_certificate(pem)
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def common_name(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


@dataclass(frozen=True)
class TlsFiles:
    """A daemon's TLS material, checked: its name, PEM key, certificate and CA."""

    name: str
    key_pem: bytes
    cert_pem: bytes
    ca_pem: bytes
    not_after: dt.datetime

    @property
    def ca_fingerprint(self) -> str:
        """The run CA's fingerprint (``fingerprint``), which the node's tape pins."""
        return fingerprint(self.ca_pem)

    @classmethod
    def load(
        cls,
        cert: Path,
        key: Path | None = None,
        ca: Path | None = None,
        *,
        now: dt.datetime | None = None,
    ) -> TlsFiles:
        """Load and check (KeyFileError naming the problem): the key is private (0600)
        and belongs to the certificate, the certificate is signed by the CA and valid
        now.  ``key`` defaults to ``<name>.tls.key`` beside the certificate, ``ca`` to
        ``ca.crt`` beside it."""
        key = key or tls_key_path(cert)
        ca = ca or cert.with_name(CA_CERT)
        c, authority, k = load_cert(cert), load_cert(ca), _load_ec_key(key)
        if c.public_key() != k.public_key():
            raise KeyFileError(f"TLS key {key} does not belong to certificate {cert}")
        try:
            c.verify_directly_issued_by(authority)
        except (ValueError, TypeError, InvalidSignature):
            raise KeyFileError(f"certificate {cert} was not issued by the CA in {ca}") from None
        at = now or _now()
        if not c.not_valid_before_utc <= at <= c.not_valid_after_utc:
            raise KeyFileError(
                f"certificate {cert} is valid from {c.not_valid_before_utc:%Y-%m-%d %H:%M} to "
                f"{c.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now; issue a new one with "
                "`hypertrain keys cert DIR NAME`"
            )
        return cls(
            common_name(c),
            _pem_key(k),
            _pem_cert(c),
            _pem_cert(authority),
            c.not_valid_after_utc,
        )
