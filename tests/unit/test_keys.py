"""Ed25519 key files, the trusted list, and ``hypertrain keys init``."""

from __future__ import annotations

import argparse
import json
import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from hypertrain import keys_cmd
from hypertrain.common.errors import KeyFileError, UnknownKeyError
from hypertrain.common.trust.keys import (
    TRUSTED_KEYS_FILE,
    SigningKey,
    TrustedKey,
    TrustedKeys,
    check_key_name,
    init_keys,
    key_id_of,
    load_signing_key,
)

DEFAULT_NAMES = [
    "aggregator",
    "relay-eu",
    "relay-us",
    "island-eu-0",
    "island-eu-1",
    "island-us-0",
    "island-us-1",
]


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hypertrain")
    sub = parser.add_subparsers(dest="command", required=True)
    keys_cmd.register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_init_writes_0600_keys_and_trusted_list(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    trusted_path = init_keys(d, ["aggregator", "relay-eu"])
    assert trusted_path == d / TRUSTED_KEYS_FILE
    assert _mode(d) == 0o700
    for n in ("aggregator", "relay-eu"):
        assert _mode(d / f"{n}.key") == 0o600
        assert (d / f"{n}.key").read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert _mode(trusted_path) == 0o644
    assert sorted(p.name for p in d.iterdir()) == [
        "aggregator.key",
        "relay-eu.key",
        TRUSTED_KEYS_FILE,
    ]
    doc = json.loads(trusted_path.read_text())
    trusted = TrustedKeys.load(trusted_path)
    key = load_signing_key(d / "relay-eu.key")
    assert key.name == "relay-eu"
    assert doc["keys"]["relay-eu"] == {"key_id": key.key_id, "public_key": key.public_bytes.hex()}
    assert key.key_id == key_id_of(key.public_bytes) and len(key.key_id) == 16
    assert trusted.lookup(key.key_id).name == "relay-eu"
    assert "aggregator" in trusted and len(trusted) == 2


def test_mode_is_0600_even_with_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        init_keys(tmp_path, ["aggregator"])
    finally:
        os.umask(old)
    assert _mode(tmp_path / "aggregator.key") == 0o600


def test_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    init_keys(tmp_path, ["aggregator", "relay-eu"])
    before = (tmp_path / "relay-eu.key").read_bytes()
    with pytest.raises(KeyFileError, match=r"relay-eu\.key already exist.*--force"):
        init_keys(tmp_path, ["relay-eu", "relay-us"])
    assert (tmp_path / "relay-eu.key").read_bytes() == before
    assert not (tmp_path / "relay-us.key").exists()
    init_keys(tmp_path, ["relay-eu"], force=True)
    assert (tmp_path / "relay-eu.key").read_bytes() != before
    assert _mode(tmp_path / "relay-eu.key") == 0o600
    # the list keeps the other key and holds the new one
    trusted = TrustedKeys.load(tmp_path / TRUSTED_KEYS_FILE)
    assert trusted.names == ["aggregator", "relay-eu"]
    assert trusted.lookup("relay-eu").key_id == load_signing_key(tmp_path / "relay-eu.key").key_id
    # adding new names later merges into the list
    init_keys(tmp_path, ["island-eu-0"])
    assert TrustedKeys.load(tmp_path / TRUSTED_KEYS_FILE).names == [
        "aggregator",
        "island-eu-0",
        "relay-eu",
    ]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_refuses_group_or_world_readable(tmp_path: Path, mode: int) -> None:
    init_keys(tmp_path, ["relay-eu"])
    p = tmp_path / "relay-eu.key"
    p.chmod(mode)
    with pytest.raises(KeyFileError) as e:
        load_signing_key(p)
    assert str(e.value) == (
        f"key file {p} is readable by group/others (mode {mode:04o}); chmod 600 it"
    )


def test_refuses_group_writable_and_accepts_0400(tmp_path: Path) -> None:
    init_keys(tmp_path, ["relay-eu"])
    p = tmp_path / "relay-eu.key"
    p.chmod(0o620)
    with pytest.raises(KeyFileError, match=r"accessible by group/others \(mode 0620\); chmod 600"):
        load_signing_key(p)
    p.chmod(0o400)
    assert load_signing_key(p).name == "relay-eu"


def test_refuses_missing_unreadable_and_not_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "nope.key"
    with pytest.raises(KeyFileError, match=r"nope\.key does not exist; create keys with"):
        load_signing_key(missing)
    (tmp_path / "dir.key").mkdir(mode=0o700)
    with pytest.raises(KeyFileError, match="not a regular file"):
        load_signing_key(tmp_path / "dir.key")
    init_keys(tmp_path, ["relay-eu"])

    def denied(*args: object, **kwargs: object) -> int:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "open", denied)  # root can read anything: simulate EACCES
    with pytest.raises(KeyFileError, match=r"relay-eu\.key is not readable by this user"):
        load_signing_key(tmp_path / "relay-eu.key")


def _write_0600(p: Path, data: bytes) -> None:
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty"),
        (b"garbage, not a key\n", "is malformed: not a PEM private key"),
        (
            b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
            "is malformed: not a PEM private key",
        ),
        (os.urandom(32), "is malformed"),
    ],
)
def test_refuses_malformed(tmp_path: Path, content: bytes, message: str) -> None:
    p = tmp_path / "relay-eu.key"
    _write_0600(p, content)
    with pytest.raises(KeyFileError, match=message):
        load_signing_key(p)


def test_refuses_wrong_algorithm_and_encrypted(tmp_path: Path) -> None:
    ec_key = ec.generate_private_key(ec.SECP256R1())
    plain = ec_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write_0600(tmp_path / "a.key", plain)
    with pytest.raises(KeyFileError, match="not Ed25519"):
        load_signing_key(tmp_path / "a.key")
    plain_ed = serialization.load_pem_private_key(SigningKey.generate("b").pem(), None)
    enc = plain_ed.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pw"),
    )
    _write_0600(tmp_path / "b.key", enc)
    with pytest.raises(KeyFileError, match="password-protected"):
        load_signing_key(tmp_path / "b.key")


def test_sign_verify_round_trip_and_tampering(tmp_path: Path) -> None:
    init_keys(tmp_path, ["aggregator", "relay-eu"])
    agg = load_signing_key(tmp_path / "aggregator.key")
    relay = load_signing_key(tmp_path / "relay-eu.key")
    trusted = TrustedKeys.load(tmp_path / TRUSTED_KEYS_FILE)
    data = b"regional merge of round 7"
    sig = agg.sign(data)
    assert len(sig) == 64
    assert trusted.verify(agg.key_id, data, sig)
    assert trusted.verify("aggregator", data, sig)
    assert not trusted.verify(agg.key_id, data + b"!", sig)
    assert not trusted.verify(agg.key_id, data, bytes([sig[0] ^ 1]) + sig[1:])
    assert not trusted.verify(agg.key_id, data, sig[:63])
    assert not trusted.verify(relay.key_id, data, sig)  # another daemon's key
    stranger = SigningKey.generate("stranger")
    with pytest.raises(UnknownKeyError, match=rf"unknown key '{stranger.key_id}'"):
        trusted.verify(stranger.key_id, data, stranger.sign(data))
    with pytest.raises(UnknownKeyError, match="not in the trusted key list"):
        trusted.lookup("relay-us")
    assert "PRIVATE" not in repr(agg) and agg.key_id in repr(agg)


def test_trusted_list_rejects_edited_key_id(tmp_path: Path) -> None:
    path = init_keys(tmp_path, ["aggregator"])
    doc = json.loads(path.read_text())
    doc["keys"]["aggregator"]["key_id"] = "0" * 16
    path.write_text(json.dumps(doc))
    with pytest.raises(KeyFileError, match="has key_id 0000000000000000 but"):
        TrustedKeys.load(path)
    path.write_text("{not json")
    with pytest.raises(KeyFileError, match="not valid JSON"):
        TrustedKeys.load(path)
    with pytest.raises(KeyFileError, match="does not exist"):
        TrustedKeys.load(tmp_path / "none.json")


def test_names_and_seeded_keys() -> None:
    for bad in ["", "Relay", "a/b", "../x", "deadbeefdeadbeef", "1abc"]:
        with pytest.raises(KeyFileError, match="bad key name"):
            check_key_name(bad)
    a = SigningKey.from_seed("a", b"\x01" * 32)
    assert a.key_id == SigningKey.from_seed("a", b"\x01" * 32).key_id
    t = TrustedKeys.of([a, TrustedKey("b", SigningKey.generate("b").public_bytes)])
    assert t.names == ["a", "b"]
    with pytest.raises(KeyFileError, match="duplicate"):
        TrustedKeys.of([a, a])


def test_cli_default_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "k"
    assert _cli(["keys", "init", str(d)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in out[:-1]] == [f"name={n}" for n in DEFAULT_NAMES]
    assert out[-1] == f"keys init: keys=7 dir={d} trusted={d / TRUSTED_KEYS_FILE} ca={d / 'ca.crt'}"
    assert TrustedKeys.load(d / TRUSTED_KEYS_FILE).names == sorted(DEFAULT_NAMES)
    assert all(_mode(d / f"{n}.key") == 0o600 for n in DEFAULT_NAMES)


def test_cli_config_names_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text('[run.topology]\nregions = ["ap"]\nislands_per_region = 3\nh_r = 5\nh_g = 10\n')
    assert _cli(["keys", "init", str(tmp_path / "k"), "--config", str(cfg)]) == 0
    assert TrustedKeys.load(tmp_path / "k" / TRUSTED_KEYS_FILE).names == [
        "aggregator",
        "island-ap-0",
        "island-ap-1",
        "island-ap-2",
        "relay-ap",
    ]
    capsys.readouterr()
    assert _cli(["keys", "init", str(tmp_path / "k"), "--names", "relay-ap"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hypertrain keys init: error: relay-ap.key already exist")
    assert err.count("\n") == 1
    assert _cli(["keys", "init", str(tmp_path / "k"), "--names", "relay-ap", "--force"]) == 0
    capsys.readouterr()
    assert _cli(["keys", "init", str(tmp_path / "j"), "--names", "Bad Name"]) == 2
    assert "bad key name 'Bad Name'" in capsys.readouterr().err
    assert _cli(["keys", "init", str(tmp_path / "j"), "--config", str(tmp_path / "no.toml")]) == 2
    assert capsys.readouterr().err.startswith("hypertrain keys init: error: config ")
