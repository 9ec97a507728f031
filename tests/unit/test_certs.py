"""The run CA and the daemons' certificates: files, modes, names, and every refusal of
``TlsFiles.load`` (the check a daemon runs on its own material at start)."""

from __future__ import annotations

import datetime as dt
import stat
from pathlib import Path

import pytest
from cryptography import x509

from hypertrain.cli import main as cli
from hypertrain.common.errors import KeyFileError
from hypertrain.common.trust.certs import (
    TlsFiles,
    cert_path,
    ensure_certs,
    init_ca,
    init_daemons,
    issue,
    load_cert,
)

NOW = dt.datetime.now(dt.UTC)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_init_makes_a_ca_and_a_certificate_per_daemon_naming_it(tmp_path: Path) -> None:
    init_daemons(tmp_path, ["aggregator", "island-eu-0"])
    assert _mode(tmp_path / "ca.key") == 0o600 and _mode(tmp_path / "ca.crt") == 0o644
    for name in ["aggregator", "island-eu-0"]:
        files = TlsFiles.load(cert_path(tmp_path, name))
        assert files.name == name
        assert _mode(tmp_path / f"{name}.tls.key") == 0o600
        cert = load_cert(cert_path(tmp_path, name))
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.DNSName) == [name]
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_ensure_keeps_the_ca_and_adds_only_missing_certificates(tmp_path: Path) -> None:
    init_daemons(tmp_path, ["aggregator"])
    ca, agg = (tmp_path / "ca.crt").read_bytes(), cert_path(tmp_path, "aggregator").read_bytes()
    (tmp_path / "relay-eu.key").write_bytes(b"")  # not read: only certificates are made
    ensure_certs(tmp_path, ["aggregator", "relay-eu"])
    assert (tmp_path / "ca.crt").read_bytes() == ca
    assert cert_path(tmp_path, "aggregator").read_bytes() == agg
    assert TlsFiles.load(cert_path(tmp_path, "relay-eu")).name == "relay-eu"
    with pytest.raises(KeyFileError, match="already exists; `hypertrain keys ca DIR --force`"):
        init_ca(tmp_path)
    with pytest.raises(KeyFileError, match="already exists; pass --force"):
        issue(tmp_path, "relay-eu")


def test_load_refuses_what_a_daemon_must_not_start_with(tmp_path: Path) -> None:
    init_daemons(tmp_path, ["aggregator", "relay-eu"])
    other = tmp_path / "other"
    other.mkdir()
    init_ca(other)
    stranger = issue(other, "aggregator")
    old = issue(tmp_path, "old", now=NOW - dt.timedelta(days=40), days=30)
    early = issue(tmp_path, "early", now=NOW + dt.timedelta(days=2))
    agg = cert_path(tmp_path, "aggregator")
    cases = [
        (lambda: TlsFiles.load(stranger, ca=tmp_path / "ca.crt"), "was not issued by the CA"),
        (lambda: TlsFiles.load(old), "not now; issue a new one"),
        (lambda: TlsFiles.load(early), "not now; issue a new one"),
        (lambda: TlsFiles.load(agg, tmp_path / "relay-eu.tls.key"), "does not belong"),
        (lambda: TlsFiles.load(tmp_path / "nope.crt"), "does not exist"),
        (lambda: TlsFiles.load(agg, tmp_path / "aggregator.key"), "holds a Ed25519PrivateKey"),
    ]
    for load, words in cases:
        with pytest.raises(KeyFileError, match=words):
            load()
    (tmp_path / "aggregator.tls.key").chmod(0o640)
    with pytest.raises(KeyFileError, match=r"readable by group/others \(mode 0640\); chmod 600"):
        TlsFiles.load(agg)
    (tmp_path / "garbage.crt").write_text("not a certificate")
    with pytest.raises(KeyFileError, match=r"is not a PEM X\.509 certificate"):
        load_cert(tmp_path / "garbage.crt")


def test_keys_cert_rotates_a_certificate_under_the_same_ca(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "k"
    assert cli(["keys", "init", str(d), "--names", "relay-eu"]) == 0
    before = cert_path(d, "relay-eu").read_bytes()
    ca = (d / "ca.crt").read_bytes()
    capsys.readouterr()
    # the day is read before and after the command, so a run across midnight UTC passes
    days = {(dt.datetime.now(dt.UTC) + dt.timedelta(days=7)).strftime("%Y-%m-%d")}
    assert cli(["keys", "cert", str(d), "relay-eu", "--days", "7"]) == 0
    days.add((dt.datetime.now(dt.UTC) + dt.timedelta(days=7)).strftime("%Y-%m-%d"))
    out = capsys.readouterr().out.split()
    assert out[:3] == ["cert", "name=relay-eu", f"file={cert_path(d, 'relay-eu')}"]
    assert len(out) == 4 and out[3].removeprefix("expires=") in days
    assert cert_path(d, "relay-eu").read_bytes() != before and (d / "ca.crt").read_bytes() == ca
    assert TlsFiles.load(cert_path(d, "relay-eu")).name == "relay-eu"
    assert cli(["keys", "cert", str(d), "Bad Name"]) == 2
    assert "bad key name 'Bad Name'" in capsys.readouterr().err
    assert cli(["keys", "cert", str(tmp_path / "none"), "relay-eu"]) == 2
    assert "ca.crt does not exist" in capsys.readouterr().err


def test_a_daemon_says_when_its_certificate_expires_and_warns_when_soon(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hypertrain.common.settings import AggregatorSettings
    from hypertrain.wire.daemon import load_security
    from hypertrain.wire.metrics import Metrics

    init_daemons(tmp_path, ["aggregator"])
    metrics = Metrics("aggregator")
    settings = AggregatorSettings(tls_cert=cert_path(tmp_path, "aggregator"))
    assert load_security(settings, "aggregator", metrics).name == "aggregator"
    line = capsys.readouterr().out.strip()
    assert line.startswith("event=tls role=aggregator name=aggregator expires=")
    expiry = metrics.cert_expiry.labels("aggregator")._value.get()
    now = dt.datetime.now(dt.UTC)
    assert expiry == pytest.approx((now + dt.timedelta(days=365)).timestamp(), abs=600)
    issue(tmp_path, "aggregator", days=10, force=True)
    load_security(settings, "aggregator", metrics)
    line = capsys.readouterr().out.strip()
    assert line.startswith("event=warning") and "days_left=9" in line and "keys cert" in line


def test_keys_ca_makes_a_new_ca_and_reissues_every_certificate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "k"
    assert cli(["keys", "init", str(d), "--names", "aggregator,relay-eu"]) == 0
    signing = (d / "relay-eu.key").read_bytes()
    old_ca = (d / "ca.crt").read_bytes()
    capsys.readouterr()
    assert cli(["keys", "ca", str(d)]) == 2  # an existing CA is replaced only with --force
    assert "keys ca DIR --force" in capsys.readouterr().err
    assert cli(["keys", "ca", str(d), "--force"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"ca file={d / 'ca.crt'}"
    assert [line.split()[1] for line in out[1:]] == ["name=aggregator", "name=relay-eu"]
    assert (d / "ca.crt").read_bytes() != old_ca and (d / "relay-eu.key").read_bytes() == signing
    for name in ("aggregator", "relay-eu"):
        assert TlsFiles.load(cert_path(d, name)).name == name  # issued by the new CA
