"""A real 2x2 run audits clean, whole and as a segment; every tampering is caught and named."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hypertrain.common.config import RunConfig
from hypertrain.common.reference import run_reference
from hypertrain.common.rounds.machines import Delta
from hypertrain.common.trust.audit import AuditError, Auditor, RunLayout, audit_run
from hypertrain.common.trust.certs import fingerprint, init_ca
from hypertrain.common.trust.keys import SigningKey, TrustedKeys, load_signing_key
from hypertrain.common.trust.schema import InputEntry, Record, RejectionEntry
from hypertrain.common.trust.tape import TapeWriter, read_tape, verify_tape
from hypertrain.common.trust.tape_format import encode_record
from tests.integration.conftest import Cluster, finished_cluster

CFG = RunConfig.from_dict(
    {
        "steps": 60,  # 3 global rounds
        "batch_per_island": 8,
        "holdout_windows": 64,
        "topology": {"regions": ["eu", "us"], "islands_per_region": 2, "h_r": 10, "h_g": 20},
    }
)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Cluster]:
    cluster = finished_cluster(CFG, tmp_path_factory.mktemp("audit") / "run")
    return cluster.run_dir, cluster


def _trusted(run_dir: Path) -> TrustedKeys:
    return TrustedKeys.load(run_dir / "keys" / "trusted_keys.json")


def test_clean_run_audits_whole_and_as_segment_with_the_reference_digest(run) -> None:  # type: ignore[no-untyped-def]
    run_dir, cluster = run
    whole = audit_run(run_dir, _trusted(run_dir))
    assert (whole.first_round, whole.last_round) == (0, 2)
    segment = audit_run(run_dir, _trusted(run_dir), from_round=1)
    assert (segment.first_round, segment.last_round) == (2, 2)
    daemons = cluster.progress.final_digest
    assert whole.final_digest == segment.final_digest == daemons
    assert run_reference(CFG).final_digest == daemons


def test_checkpoint_files_equal_to_the_replay_are_not_hashed_again(run) -> None:  # type: ignore[no-untyped-def]
    """Every checkpoint file of a clean run is found bit for bit equal to the replay's state
    of its round (so the audit hashes each state once)."""
    auditor = Auditor(RunLayout.of(run[0]), _trusted(run[0]))
    auditor.run()
    assert len(auditor._files) == 3 * 3  # the aggregator and two relays, three rounds
    assert auditor._same_as_replay == set(auditor._files)


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(run_dir, dst)
    return dst


def _rewrite(tape: Path, edit: Callable[[list[bytes]], list[bytes]]) -> None:
    """Rewrite a tape's raw records (header kept) through ``edit``."""
    raw = tape.read_bytes()
    records = read_tape(tape)
    header = raw[
        : len(raw) - sum(len(encode_record(r.key_id, r.data, r.signature)) for r in records)
    ]
    blobs = [encode_record(r.key_id, r.data, r.signature) for r in records]
    tape.write_bytes(header + b"".join(edit(blobs)))


def _resign(
    tape: Path,
    key: SigningKey,
    change: Callable[[str, dict], dict],  # type: ignore[type-arg]
    insert: tuple[int, Record] | None = None,
) -> None:
    """Rebuild a tape entry by entry with ``key`` (valid signatures and chain), changing
    bodies; ``insert``: a record to put in after the entry of that seq."""
    records = verify_tape(tape, _trusted(tape.parents[1])).entries
    tape.unlink()
    with TapeWriter.open(tape, CFG.run_id, key, checkpoint_every=0) as w:
        for e in records:
            if e.kind == "checkpoint":
                w.checkpoint()
            else:
                w.append(e.kind, change(e.kind, dict(e.body)))
            if insert is not None and e.seq == insert[0]:
                w.append(insert[1].KIND, insert[1].to_body())


def _fails(run_dir: Path, words: str) -> str:
    with pytest.raises(AuditError) as err:
        audit_run(run_dir, _trusted(run_dir))
    assert words in str(err.value), str(err.value)
    return str(err.value)


def test_flipped_byte_in_an_input_blob(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = _copy(run[0], tmp_path)
    blob = sorted((d / "relay-us" / "published").iterdir())[0]
    data = bytearray(blob.read_bytes())
    data[len(data) // 3] ^= 0x01
    blob.write_bytes(bytes(data))
    _fails(d, "changed input")


def test_missing_input_blob(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = _copy(run[0], tmp_path)
    sorted((d / "aggregator" / "published").iterdir())[0].unlink()
    _fails(d, "missing input")


@pytest.mark.parametrize(
    "edit,words",
    [
        (lambda b: b[:5] + b[6:], "entry 5"),  # dropped
        (lambda b: [*b[:5], b[6], b[5], *b[7:]], "entry 5"),  # reordered
        (lambda b: [*b[:6], b[5], *b[6:]], "entry 6"),  # duplicated
        (lambda b: [*b[:-1], b[-1][:-20]], "truncated record"),  # cut mid-record
        (lambda b: b[:-2], "truncated tape"),  # cut at a record boundary
    ],
    ids=["dropped", "reordered", "duplicated", "cut-mid-record", "cut-at-boundary"],
)
def test_edited_tape_structure(run, tmp_path: Path, edit: Callable, words: str) -> None:  # type: ignore[no-untyped-def,type-arg]
    d = _copy(run[0], tmp_path)
    _rewrite(d / "relay-eu" / "tape", edit)
    _fails(d, words)


def test_edited_entry_bytes(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = _copy(run[0], tmp_path)
    tape = d / "aggregator" / "tape"
    raw = bytearray(tape.read_bytes())
    at = raw.find(b'"post_state":"') + len(b'"post_state":"')
    raw[at] = ord("0") if raw[at] != ord("0") else ord("1")
    tape.write_bytes(bytes(raw))
    _fails(d, "bad signature")


def test_entry_signed_by_an_unknown_key(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = _copy(run[0], tmp_path)
    _resign(d / "relay-eu" / "tape", SigningKey.generate("relay-eu"), lambda k, b: b)
    _fails(d, "unknown key")


def test_forged_regional_aggregate_with_valid_signatures(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The relay's own key signs a regional merge whose mean is not the mean of its inputs."""
    d = _copy(run[0], tmp_path)
    key = load_signing_key(d / "keys" / "relay-eu.key")
    forged = {"done": False}

    def change(kind: str, body: dict) -> dict:  # type: ignore[type-arg]
        if kind == "regional_merge" and not forged["done"]:
            forged["done"] = True
            body["mean"] = "f" * 64
        return body

    _resign(d / "relay-eu" / "tape", key, change)
    verify_tape(d / "relay-eu" / "tape", _trusted(d))  # the forgery is validly signed and chained
    # ... so only the replay can catch it (checkpoints recorded the old head: relax that check
    # by dropping them, as a forger who also controls the relay's disk would)
    shutil.rmtree(d / "relay-eu" / "checkpoints")
    _fails(d, "recomputed mean differs")


def test_a_fork_against_the_recorded_checkpoint(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = _copy(run[0], tmp_path)
    key = load_signing_key(d / "keys" / "aggregator.key")
    _resign(
        d / "aggregator" / "tape",
        key,
        lambda k, b: b | ({"size": b["size"]} if k == "input" else {}),
    )
    seen = verify_tape(run[0] / "aggregator" / "tape", _trusted(d))
    forked = verify_tape(d / "aggregator" / "tape", _trusted(d))
    assert seen.head == forked.head  # identical bodies re-signed: Ed25519 is deterministic
    # now change one body: a validly signed alternative history
    _resign(
        d / "aggregator" / "tape",
        key,
        lambda k, b: b | ({"size": b["size"] + 1} if k == "input" else {}),
    )
    _fails(d, "fork")


def _cut_to_round(run_dir: Path, round_: int) -> None:
    """Every tape cut back to where its daemon's checkpoint of ``round_`` recorded it, and
    the later checkpoints deleted: a run that looks like it ended at that round."""
    for folder in [run_dir / "aggregator", *sorted(run_dir.glob("relay-*"))]:
        keep = folder / "checkpoints" / f"round-{round_:06d}.pt"
        seq = int(torch.load(keep, weights_only=True, mmap=True)["tape_seq"])
        _rewrite(folder / "tape", lambda b, seq=seq: b[:seq])  # type: ignore[misc]
        for later in (folder / "checkpoints").glob("round-*.pt"):
            if later.name > keep.name:
                later.unlink()


def test_the_verdict_says_a_whole_run_is_complete_and_a_segment_is_a_segment(run) -> None:  # type: ignore[no-untyped-def]
    run_dir, _ = run
    whole = audit_run(run_dir, _trusted(run_dir))
    assert whole.complete and whole.summary().startswith(
        "audit OK: complete, rounds 0..2 of 3 (steps 20..60 of 60)"
    )
    segment = audit_run(run_dir, _trusted(run_dir), from_round=1)
    assert segment.complete and segment.summary().startswith(
        "audit OK: complete, segment rounds 2..2 of 3 (steps 60..60 of 60)"
    )


def test_tapes_cut_back_to_an_earlier_round_are_incomplete(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = _copy(run[0], tmp_path)
    _cut_to_round(d, 1)
    # The islands hold the heads of the longer tapes: with their receipts it is a fork ...
    _fails(d, "fork: relay-eu's tape disagrees with the head island-eu-0 received at step 50")
    for receipts in d.glob("*/receipts"):
        receipts.unlink()
    # ... and without them (an auditor given the daemons' folders only), an incomplete run.
    report = audit_run(d, _trusted(d))  # what is there verifies ...
    assert (report.last_round, report.complete) == (1, False)
    assert report.summary().startswith(
        "audit INCOMPLETE: tapes end at round 1 of 3 (the run's configuration says 60 steps)"
    )
    cli = [sys.executable, "-m", "hypertrain", "audit", str(d)]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and out.stdout.startswith("audit INCOMPLETE: "), out
    out = subprocess.run([*cli, "--partial"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out
    assert out.stdout.startswith("audit OK (partial): rounds 0..1 of 3 (steps 20..40 of 60)")


def test_a_relay_tape_cut_shorter_than_the_aggregators(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The aggregator took relay eu's forward of the last round; eu's tape no longer has it."""
    d = _copy(run[0], tmp_path)
    tape = d / "relay-eu" / "tape"
    entries = verify_tape(tape, _trusted(d)).entries
    last_forward = max(e.seq for e in entries if e.kind == "forward")
    _rewrite(tape, lambda b: b[:last_forward])
    shutil.rmtree(d / "relay-eu" / "checkpoints")  # they recorded the longer tape
    _fails(d, "input from eu for step 60 has no forward on relay eu's tape")


def _other(value: object) -> object:
    """A different value of the same type: a digest with its first hex digit changed, a step
    one later."""
    if isinstance(value, int):
        return value + 1
    assert isinstance(value, str) and value, value
    return ("1" if value[0] == "0" else "0") + value[1:]


FORGED_FIELDS = [
    ("aggregator", "global_merge", field)
    for field in (
        "pre_state",
        "post_state",
        "pre_outer",
        "post_outer",
        "mean",
        "commitment",
        "merge_step",
    )
] + [
    ("relay-eu", kind, field)
    for kind, fields in (
        ("regional_merge", ("pre_base", "post_base", "mean", "commitment", "merge_step")),
        ("forward", ("pre_residual", "post_residual", "digest")),
        ("global_applied", ("theta", "merge_step")),
    )
    for field in fields
]


@pytest.mark.parametrize(
    ("daemon", "kind", "field"), FORGED_FIELDS, ids=[f"{k}.{f}" for _, k, f in FORGED_FIELDS]
)
def test_a_field_forged_under_the_daemons_own_key_is_named(  # type: ignore[no-untyped-def]
    run, tmp_path: Path, daemon: str, kind: str, field: str
) -> None:
    """One field of the first ``kind`` entry changed, the tape re-signed and re-chained with
    the daemon's own key, its checkpoints removed: only the replay can see it, and it names
    the field."""
    d = _copy(run[0], tmp_path)
    key = load_signing_key(d / "keys" / f"{daemon}.key")
    done = []

    def change(k: str, body: dict) -> dict:  # type: ignore[type-arg]
        if k == kind and not done:
            done.append(body[field])
            body[field] = _other(body[field])
        return body

    _resign(d / daemon / "tape", key, change)
    assert done, f"no {kind} entry on {daemon}'s tape"
    verify_tape(d / daemon / "tape", _trusted(d))  # validly signed and chained
    shutil.rmtree(d / daemon / "checkpoints")
    message = _fails(d, f"recomputed {field} differs")
    assert f"({kind}, step " in message


def test_an_input_signed_by_another_pinned_key_is_refused(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Island eu-1's key (pinned: it is a member) signs an input taped as eu-0's, and the
    relay re-signs its tape around it: the replay checks the signature against the
    sender's key, not any pinned key."""
    d = _copy(run[0], tmp_path)
    relay_key, forger = (
        load_signing_key(d / "keys" / f"{n}.key") for n in ("relay-eu", "island-eu-1")
    )
    blobs = d / "relay-eu" / "published"
    done = []

    def change(k: str, body: dict) -> dict:  # type: ignore[type-arg]
        if k == "input" and body["sender"] == "eu-0" and not done:
            rec = InputEntry.from_body(body)
            delta = Delta.from_record(CFG.run_id, rec, (blobs / rec.digest).read_bytes())
            body["signature"] = forger.sign(delta.transfer_message()).hex()
            done.append(rec.sync_step)
        return body

    _resign(d / "relay-eu" / "tape", relay_key, change)
    assert done
    shutil.rmtree(d / "relay-eu" / "checkpoints")
    _fails(d, f"bad signature on the delta from eu-0 for step {done[0]}")


def test_a_deleted_checkpoint_file_is_named(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = _copy(run[0], tmp_path)
    (d / "relay-us" / "checkpoints" / "round-000001.pt").unlink()
    _fails(d, "the checkpoint of round 1 is missing")


def test_a_checkpoint_file_replaced_by_another_rounds(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = _copy(run[0], tmp_path)
    ckpts = d / "aggregator" / "checkpoints"
    shutil.copy(ckpts / "round-000000.pt", ckpts / "round-000001.pt")
    _fails(d, "fork: round-000001.pt recorded the tape's head as entry")


def test_a_checkpoint_file_patched_to_the_tapes_position_is_checked_by_content(
    run,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    """Round 0's state under round 1's name, its tape position patched to round 1's: the
    file is not believed, its parameters are checked against the tape."""
    d = _copy(run[0], tmp_path)
    ckpts = d / "relay-eu" / "checkpoints"
    old, new = (torch.load(ckpts / f"round-00000{r}.pt", weights_only=True) for r in (0, 1))
    old |= {k: new[k] for k in ("tape_seq", "tape_head", "round", "sync_step")}
    torch.save(old, ckpts / "round-000001.pt")
    _fails(d, "checkpoint of round 1: its parameters are not the theta the relay applied")


def _patch_checkpoints(folder: Path) -> None:
    """Make the node's checkpoint files record its (rewritten) tape, as a forger who also
    controls its disk would: each at the position right after its round's entry."""
    entries = verify_tape(folder / "tape", _trusted(folder.parent)).entries
    kind = "global_merge" if folder.name == "aggregator" else "global_applied"
    last = {int(e.body["round"]): e for e in entries if e.kind == kind}
    for path in (folder / "checkpoints").glob("round-*.pt"):
        ck = torch.load(path, weights_only=True)
        e = last[int(path.stem.split("-")[1])]
        ck["tape_seq"], ck["tape_head"] = e.seq + 1, e.hash
        torch.save(ck, path)


@pytest.mark.parametrize(
    ("daemon", "kind", "field", "value"),
    [
        ("relay-eu", "regional_merge", "tau", 1),
        ("aggregator", "global_merge", "outer", {"name": "nesterov", "eta": "0.5", "mu": "0.9"}),
        ("aggregator", "global_merge", "codec", {"name": "int8"}),
    ],
    ids=["relay-tau", "aggregator-outer", "aggregator-codec"],
)
def test_a_configuration_field_rewritten_under_the_daemons_own_key(  # type: ignore[no-untyped-def]
    run, tmp_path: Path, daemon: str, kind: str, field: str, value: object
) -> None:
    """Every ``kind`` entry's ``field`` changed, the tape re-signed and re-chained with the
    daemon's key, its checkpoint files patched to match: the replay, configured by the
    genesis, names the field; and a run.toml edited to agree is refused against the
    genesis."""
    d = _copy(run[0], tmp_path)
    key = load_signing_key(d / "keys" / f"{daemon}.key")
    changed = []

    def change(k: str, body: dict) -> dict:  # type: ignore[type-arg]
        if k == kind:
            changed.append(body[field])
            body[field] = value
        return body

    _resign(d / daemon / "tape", key, change)
    assert changed and all(v != value for v in changed)
    _patch_checkpoints(d / daemon)
    _fails(d, f"recomputed {field} differs")
    if field == "tau":  # the configuration made to agree with the forged entries
        toml = d / "run.toml"
        toml.write_text(toml.read_text().replace("tau = 0", "tau = 1"))
        assert RunConfig.from_toml(toml).topology.tau == 1
        message = _fails(d, "entry 0 (genesis): the configuration the run started with differs")
        assert "run.toml at topology.tau" in message


def test_a_genesis_rewritten_with_another_configuration_disagrees_with_the_relays(  # type: ignore[no-untyped-def]
    run, tmp_path: Path
) -> None:
    """The aggregator's key rewrites its genesis (and run.toml) to another outer eta: the
    relays' genesis entries, under their own keys, still name the old configuration."""
    d = _copy(run[0], tmp_path)
    cfg = RunConfig.from_dict({**CFG.to_dict(), "outer": {"name": "nesterov", "eta": 0.5}})
    key = load_signing_key(d / "keys" / "aggregator.key")

    def change(k: str, body: dict) -> dict:  # type: ignore[type-arg]
        if k == "genesis":
            body |= {"config": cfg.canonical_json(), "config_digest": cfg.digest}
        return body

    _resign(d / "aggregator" / "tape", key, change)
    (d / "run.toml").write_text((d / "run.toml").read_text().replace("eta = 0.7", "eta = 0.5"))
    assert RunConfig.from_toml(d / "run.toml").digest == cfg.digest
    _fails(d, "relay-eu/tape entry 0 (genesis): recomputed config_digest differs")


def _rewrite_entries(
    tape: Path,
    key: SigningKey,
    edit: Callable[[list[tuple[str, dict]]], list[tuple[str, dict]]],  # type: ignore[type-arg]
) -> None:
    """Rebuild a tape from ``edit`` of its (kind, body) list, signed and chained with ``key``."""
    entries = verify_tape(tape, _trusted(tape.parents[1])).entries
    items = edit([(e.kind, dict(e.body)) for e in entries])
    tape.unlink()
    with TapeWriter.open(tape, CFG.run_id, key, checkpoint_every=0) as w:
        for kind, body in items:
            if kind == "checkpoint":
                w.checkpoint()
            else:
                w.append(kind, body)


def _round_of(item: tuple[str, dict]) -> int | None:  # type: ignore[type-arg]
    return item[1].get("round")


def _inputs(items: list[tuple[str, dict]]) -> list[int]:  # type: ignore[type-arg]
    return [i for i, (k, _) in enumerate(items) if k == "input"]


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda items: [*items, items[_inputs(items)[0]]], "(input, step 10): cannot replay"),
        (
            lambda items: [
                *items[: _inputs(items)[-1]],
                items[_inputs(items)[0]],
                *items[_inputs(items)[-1] :],
            ],
            "(input, step 10): cannot replay",
        ),
        (
            lambda items: [
                *items,
                *(it for it in items if _round_of(it) == 0 and it[0] != "checkpoint"),
            ],
            "(input, step 10): cannot replay",
        ),
    ],
    ids=["old-input-appended", "old-input-inserted", "old-round-appended"],
)
def test_an_old_input_or_round_replayed_under_the_relays_own_key(  # type: ignore[no-untyped-def]
    run,
    tmp_path: Path,
    edit: Callable,
    words: str,  # type: ignore[type-arg]
) -> None:
    """Entries the round structure does not explain, validly signed and chained, the
    checkpoint files patched: every entry of every tape is walked, and these are named."""
    d = _copy(run[0], tmp_path)
    _rewrite_entries(d / "relay-eu" / "tape", load_signing_key(d / "keys" / "relay-eu.key"), edit)
    _patch_checkpoints(d / "relay-eu")
    _fails(d, words)


@pytest.mark.parametrize(
    ("daemon", "kind", "accused"),
    [("relay-eu", "regional_merge", "eu-1"), ("aggregator", "global_merge", "eu")],
    ids=["relay", "aggregator"],
)
def test_a_history_rewritten_under_the_daemons_own_key_disagrees_with_its_receipts(  # type: ignore[no-untyped-def]
    run, tmp_path: Path, daemon: str, kind: str, accused: str
) -> None:
    """The daemon slips false evidence against a member (a refusal it never made) into its
    history after its first merge, re-signs and re-chains the rest with its own key and
    patches its checkpoint files.  The tapes alone still audit clean (shown with the
    receipts removed); the signed heads its members received with their merges since
    then disagree with the rewritten tape: a fork."""
    d = _copy(run[0], tmp_path)
    key = load_signing_key(d / "keys" / f"{daemon}.key")
    tape = d / daemon / "tape"
    entries = verify_tape(tape, _trusted(d)).entries
    first = next(e for e in entries if e.kind == kind)
    false = RejectionEntry(
        code="invalid_argument",
        reason="bad signature",
        sender=accused,
        sync_step=int(first.body["sync_step"]),
        round=int(first.body["round"]),
    )
    _resign(tape, key, lambda k, body: body, insert=(first.seq + 1, false))  # after its seal
    _patch_checkpoints(d / daemon)
    message = _fails(d, f"fork: {daemon}'s tape disagrees with the head ")
    assert "are not the ones" in message and "receipts line" in message

    blind = _copy(d, tmp_path / "blind")
    for receipts in blind.glob("*/receipts"):
        receipts.unlink()
    report = audit_run(blind, _trusted(blind))
    assert report.complete and report.receipts == 0, report.summary()


def test_receipts_collected_elsewhere_are_checked_too(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """An island's state folder moved out of the run folder: ``--receipts DIR`` finds its
    receipts; a forged receipt (another signer's record under a relay's name) is named."""
    d = _copy(run[0], tmp_path)
    away = tmp_path / "collected"
    shutil.move(d / "island-us-1", away / "island-us-1")
    whole = audit_run(d, _trusted(d))
    with_away = audit_run(d, _trusted(d), receipts=(away,))
    assert with_away.receipts > whole.receipts > 0
    lines = (away / "island-us-1" / "receipts").read_text().splitlines()
    agg = next(line for line in lines if '"signer":"aggregator"' in line)
    (away / "island-us-1" / "receipts").write_text(
        agg.replace('"signer":"aggregator"', '"signer":"relay-us"') + "\n"
    )
    with pytest.raises(AuditError) as err:
        audit_run(d, _trusted(d), receipts=(away,))
    assert "island-us-1's receipt of relay-us for step" in str(err.value)
    assert "signed by aggregator, not by relay-us" in str(err.value)


def test_every_tape_pins_the_run_ca_and_the_audit_checks_it(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The daemons talked TLS: each genesis pins the run CA's fingerprint.  The audit
    checks it against the CA given (``--ca-cert``), and without one, that every relay
    pinned the aggregator's; a relay genesis re-signed to name another CA is refused."""
    run_dir = run[0]
    ca = fingerprint((run_dir / "keys" / "ca.crt").read_bytes())
    for tape in sorted(run_dir.glob("*/tape")):
        assert verify_tape(tape, _trusted(run_dir)).entries[0].body["ca"] == ca, tape
    assert audit_run(run_dir, _trusted(run_dir), ca_cert=run_dir / "keys" / "ca.crt").complete
    (tmp_path / "other").mkdir()
    other = init_ca(tmp_path / "other")
    with pytest.raises(AuditError, match=r"aggregator/tape entry 0 \(genesis\): the run CA"):
        audit_run(run_dir, _trusted(run_dir), ca_cert=other)
    cli = [sys.executable, "-m", "hypertrain", "audit", str(run_dir), "--ca-cert", str(other)]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "is not the CA given (--ca-cert)" in out.stdout, out

    d = _copy(run_dir, tmp_path)
    key = load_signing_key(d / "keys" / "relay-eu.key")
    forged = fingerprint(other.read_bytes())
    _resign(d / "relay-eu" / "tape", key, lambda k, b: b | {"ca": forged} if k == "genesis" else b)
    _fails(
        d,
        f"relay-eu/tape entry 0 (genesis): the run CA this node pinned ({forged}) is not the aggregator's",
    )
