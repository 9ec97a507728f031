"""The sans-I/O relay and aggregator machines: membership by step, idempotence, refusals."""

import dataclasses
from pathlib import Path

import pytest
import torch

from hypertrain.common.aggregate import Commitment
from hypertrain.common.codec import make_codec
from hypertrain.common.config import RunConfig
from hypertrain.common.digest import blob_digest
from hypertrain.common.roles import initial_parameters
from hypertrain.common.rounds.machines import (
    CONFLICT,
    INVALID,
    LEAVE,
    MAX_VALUE,
    PRECONDITION,
    AggregatorMachine,
    Committed,
    Decision,
    Delta,
    Forward,
    GlobalArrived,
    MemberRequest,
    Publish,
    RelayMachine,
)
from hypertrain.common.rounds.node import MAX_TAPED_REFUSALS, RelayNode
from hypertrain.common.rounds.store import NodeStore
from hypertrain.common.trust.keys import SigningKey, TrustedKeys
from hypertrain.common.trust.ledger import flat_digest
from hypertrain.common.trust.schema import RejectionEntry
from hypertrain.common.trust.tape import verify_tape

CFG = RunConfig.from_dict(
    {
        "steps": 20,
        "batch_per_island": 8,
        "regional_codec": "int8",
        "topology": {"regions": ["eu", "us"], "islands_per_region": 2, "h_r": 5, "h_g": 10},
    }
)


@pytest.fixture(scope="module")
def theta0() -> torch.Tensor:
    return initial_parameters(CFG)[1]


def _delta(theta0: torch.Tensor, sender: str, step: int, seed: int = 0, **kw: object) -> Delta:
    data = make_codec(CFG.regional_codec).encode(
        torch.randn(theta0.numel(), generator=torch.Generator().manual_seed(seed)) * 1e-3
    )
    fields = dict(
        run_id=CFG.run_id,
        round=(step - 1) // 10,
        sync_step=step,
        sender=sender,
        digest=blob_digest(data),
        codec=str(make_codec(CFG.regional_codec).spec),
        data=data,
    )
    fields.update(kw)
    return Delta(**fields)  # type: ignore[arg-type]


def test_relay_commits_when_the_last_member_arrives_in_any_order(theta0: torch.Tensor) -> None:
    digests = set()
    for order in (["eu-0", "eu-1"], ["eu-1", "eu-0"]):
        relay = RelayMachine(CFG, "eu", theta0)
        effects = []
        for i, sender in enumerate(order):
            decision, eff = relay.on_delta(_delta(theta0, sender, 5, seed=int(sender[-1])))
            assert decision.accepted, decision.reason
            assert isinstance(eff[0], Publish)
            if i == 0:
                assert len(eff) == 1 and relay.merge_for(5) is None
            effects = eff
        committed = [e for e in effects if isinstance(e, Committed)]
        assert committed[0].commitment.members == ("eu-0", "eu-1")
        digests.add(committed[0].commitment.digest)
        assert relay.merge_for(5) is not None and relay.level.open_step == 10
    assert len(digests) == 1


def test_relay_forwards_at_the_global_step_and_waits_for_theta(theta0: torch.Tensor) -> None:
    relay = RelayMachine(CFG, "eu", theta0)
    for step in (5, 10):
        for k, sender in enumerate(("eu-0", "eu-1")):
            _, eff = relay.on_delta(_delta(theta0, sender, step, seed=step + k))
    assert any(isinstance(e, Forward) for e in eff)
    assert relay.merge_for(10) is None  # islands wait for the global merge
    early = relay.on_delta(_delta(theta0, "eu-0", 15))[0]
    assert early.code == PRECONDITION and "pending" in early.reason
    relay.on_global(GlobalArrived(10, theta0.clone(), Commitment({}, (), (), "")))
    assert relay.merge_for(10) is not None and relay.merge_for(10).kind == "global"  # type: ignore[union-attr]
    assert relay.on_delta(_delta(theta0, "eu-0", 15))[0].accepted


def test_a_global_update_previewed_while_it_arrives_is_the_merge_on_global_serves(
    theta0: torch.Tensor,
) -> None:
    """``preview_global`` (the relay daemon's cut-through) names the merge ``on_global``
    will serve, field for field, and changes nothing; only for the update the relay
    forwarded and waits for."""
    relay = RelayMachine(CFG, "eu", theta0)
    for step in (5, 10):
        for k, sender in enumerate(("eu-0", "eu-1")):
            relay.on_delta(_delta(theta0, sender, step, seed=step + k))
    theta = theta0 + 1e-3
    commitment = Commitment({"eu": "ab" * 32}, ("eu",), ("fp32",), "cd" * 32)
    digest = flat_digest(theta)
    assert relay.preview_global(5, commitment, theta, digest) is None  # not the one pending
    assert relay.preview_global(10, commitment, theta[:-1], digest) is None  # wrong size
    held = relay.core.theta
    preview = relay.preview_global(10, commitment, theta, digest)
    assert preview is not None
    assert relay.merge_for(10) is None and relay.global_pending == 10  # nothing changed
    assert relay.core.theta is held
    relay.on_global(GlobalArrived(10, theta, commitment, digest))
    served = relay.merge_for(10)
    assert served is not None
    assert dataclasses.replace(preview, receipts=()) == dataclasses.replace(served, receipts=())
    assert served.payload is theta and served.payload_digest == digest
    assert relay.preview_global(10, commitment, theta, digest) is None  # applied: none


def test_identical_resend_is_idempotent_and_different_bytes_refused(theta0: torch.Tensor) -> None:
    relay = RelayMachine(CFG, "eu", theta0)
    d = _delta(theta0, "eu-0", 5)
    assert relay.on_delta(d)[0].accepted
    again, eff = relay.on_delta(d)
    assert again.accepted and again.duplicate and eff == []
    other = _delta(theta0, "eu-0", 5, seed=7)
    assert relay.on_delta(other)[0].code == CONFLICT
    relay.on_delta(_delta(theta0, "eu-1", 5, seed=1))
    after = relay.on_delta(d)[0]  # a resend after the commit is still a duplicate
    assert after.duplicate
    assert len(relay.merge_for(5).commitment.members) == 2  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "changes,code,words",
    [
        ({"run_id": "other"}, INVALID, "wrong run"),
        ({"sender": "us-0"}, INVALID, "not a member"),
        ({"sync_step": 7}, INVALID, "not a sync step"),
        ({"sync_step": 25}, INVALID, "not a sync step"),
        ({"round": 1}, INVALID, "does not match"),
        ({"sync_step": 15, "round": 1}, PRECONDITION, "ahead"),
        ({"codec": "fp32"}, INVALID, "wrong codec"),
        ({"data": b"HTCD" + b"\x00" * 60}, INVALID, "rejected delta"),
    ],
)
def test_bad_deltas_are_refused_with_a_reason(
    theta0: torch.Tensor, changes: dict, code: str, words: str
) -> None:
    relay = RelayMachine(CFG, "eu", theta0)
    fields = {"sender": "eu-0", **changes}
    sender = fields.pop("sender")
    decision, effects = relay.on_delta(_delta(theta0, sender, 5, **fields))
    assert decision.code == code and words in decision.reason, decision.reason
    assert effects == [] and relay.level.inputs == {}


def test_wrong_shape_is_refused(theta0: torch.Tensor) -> None:
    relay = RelayMachine(CFG, "eu", theta0)
    data = make_codec("int8").encode(torch.zeros(100))
    decision, _ = relay.on_delta(_delta(theta0, "eu-0", 5, data=data, digest=blob_digest(data)))
    assert decision.code == INVALID and "shape" in decision.reason


def test_aggregator_applies_one_outer_step_per_round(theta0: torch.Tensor) -> None:
    agg = AggregatorMachine(CFG, theta0)
    g = make_codec(CFG.global_codec)
    deltas = {r: g.encode(torch.full((theta0.numel(),), 1e-3)) for r in ("us", "eu")}
    for region, data in deltas.items():
        decision, _ = agg.on_regional(
            Delta(CFG.run_id, 0, 10, region, blob_digest(data), str(g.spec), data)
        )
        assert decision.accepted
    merge = agg.merge_for(10)
    assert merge is not None and merge.commitment.members == ("eu", "us")
    assert not torch.equal(merge.payload, theta0) and agg.round == 1
    bad = agg.on_regional(Delta(CFG.run_id, 0, 5, "eu", "x", str(g.spec), b""))[0]
    assert bad.code == INVALID and "not a sync step" in bad.reason


def test_relay_takes_only_deltas_signed_by_the_sender_s_pinned_key(
    theta0: torch.Tensor, tmp_path: Path
) -> None:
    """With pinned keys the relay verifies each delta's signature before accepting:
    unsigned, signed by another island's key, or signed over other fields is refused
    as INVALID naming the sender; the island's own signature is accepted."""
    from hypertrain.common.trust.keys import (
        TrustedKeys,
        daemon_key_names,
        init_keys,
        load_signing_key,
    )
    from hypertrain.common.trust.ledger import transfer_message

    keys = tmp_path / "keys"
    init_keys(keys, daemon_key_names(CFG.topology))
    relay = RelayMachine(CFG, "eu", theta0, TrustedKeys.load(keys / "trusted_keys.json"))
    d = _delta(theta0, "eu-0", 5)

    def signed(delta: Delta, key: str, step: int | None = None) -> Delta:
        message = transfer_message(
            delta.run_id, delta.round, step or delta.sync_step, delta.sender, delta.digest,
            len(delta.data), delta.codec,
        )  # fmt: skip
        sig = load_signing_key(keys / f"{key}.key").sign(message)
        return Delta(
            **{**{f: getattr(delta, f) for f in Delta.__dataclass_fields__}, "signature": sig}
        )

    for bad, words in [
        (d, "unsigned delta from eu-0"),
        (signed(d, "island-eu-1"), "bad signature on the delta from eu-0"),
        (signed(d, "island-eu-0", step=10), "bad signature on the delta from eu-0"),
    ]:
        decision, effects = relay.on_delta(bad)
        assert decision.code == INVALID and words in decision.reason and not effects
    decision, effects = relay.on_delta(signed(d, "island-eu-0"))
    assert decision.accepted and isinstance(effects[0], Publish)


# -- values out of bounds: refused before they reach a sum ------------------------------------
def _huge(theta0: torch.Tensor, sender: str, step: int, value: float) -> Delta:
    data = make_codec(CFG.regional_codec).encode(torch.full((theta0.numel(),), value))
    return _delta(theta0, sender, step, data=data, digest=blob_digest(data))


def test_finite_values_that_could_overflow_the_sum_are_refused_with_evidence(
    theta0: torch.Tensor,
) -> None:
    relay = RelayMachine(CFG, "eu", theta0)
    for sender in ("eu-0", "eu-1"):  # two islands, each alone far from inf, together inf
        decision, effects = relay.on_delta(_huge(theta0, sender, 5, 2.0**127))
        assert decision.code == INVALID and decision.evidence and effects == []
        assert "its values reach 1.701e+38" in decision.reason and "overflow" in decision.reason
    assert relay.level.inputs == {} and relay.level.accepted == {}  # nothing moved
    assert relay.core._early is None and relay.core._base is None
    # honest deltas still commit, to a finite base; 2^64 itself is allowed
    assert MAX_VALUE["regional"] == 2.0**64
    for k, sender in enumerate(("eu-0", "eu-1")):
        decision, effects = relay.on_delta(_delta(theta0, sender, 5, seed=k))
        assert decision.accepted, decision.reason
    merge = relay.merge_for(5)
    assert merge is not None and bool(torch.isfinite(merge.payload).all())


def test_the_aggregator_bounds_forwarded_values_by_its_own_level(theta0: torch.Tensor) -> None:
    agg = AggregatorMachine(CFG, theta0)
    fp32 = make_codec("fp32")

    def forward(value: float) -> Delta:
        data = fp32.encode(torch.full((theta0.numel(),), value))
        return Delta(CFG.run_id, 0, 10, "eu", blob_digest(data), str(fp32.spec), data)

    refused, _ = agg.on_regional(forward(1e30))  # over 2^96
    assert refused.code == INVALID and refused.evidence and "reach 1e+30" in refused.reason
    taken, _ = agg.on_regional(forward(1e20))  # over the regional 2^64, within 2^96
    assert taken.accepted, taken.reason


def test_a_refusal_for_out_of_bounds_values_is_taped_with_the_digest(
    tmp_path: Path, theta0: torch.Tensor
) -> None:
    key = SigningKey.generate("relay-eu")
    node = RelayNode(CFG, "eu", theta0, NodeStore(tmp_path, CFG.run_id, key))
    huge = _huge(theta0, "eu-1", 5, 2.0**127)
    decision, _ = node.push(huge)
    assert decision.code == INVALID
    node.close()
    entries = verify_tape(tmp_path / "tape", TrustedKeys.of([key])).entries
    rejections = [RejectionEntry.from_body(e.body) for e in entries if e.kind == "rejection"]
    assert [(r.sender, r.sync_step, r.digest) for r in rejections] == [("eu-1", 5, huge.digest)]
    assert "its values reach" in rejections[0].reason
    assert not (tmp_path / "published" / huge.digest).exists()


def test_only_authenticated_refusals_are_taped_and_at_most_a_few_per_sender_and_round(
    tmp_path: Path, theta0: torch.Tensor
) -> None:
    relay_key = SigningKey.generate("relay-eu")
    island = {s: SigningKey.generate(f"island-{s}") for s in ("eu-0", "eu-1")}
    trusted = TrustedKeys.of([relay_key, *island.values()])
    node = RelayNode(CFG, "eu", theta0, NodeStore(tmp_path, CFG.run_id, relay_key), trusted)
    ahead = _delta(theta0, "eu-0", 10)  # not open yet: refused
    forged = ahead.signed(island["eu-1"].sign(ahead.transfer_message()))  # eu-1 posing as eu-0
    for d in (ahead, forged):  # unsigned, and signed with another island's key
        decision, _ = node.push(d)
        assert not decision.accepted and not node.refusal_taped
    taped = []
    for k in range(MAX_TAPED_REFUSALS + 3):
        claim = _delta(theta0, "eu-0", 10, round=k)  # a round of its choosing each time
        signed = claim.signed(island["eu-0"].sign(claim.transfer_message()))
        decision, _ = node.push(signed)
        assert not decision.accepted
        taped.append(node.refusal_taped)
    assert taped == [True] * MAX_TAPED_REFUSALS + [False] * 3  # counted by the open round
    node.close()
    entries = verify_tape(tmp_path / "tape", trusted).entries
    rejections = [RejectionEntry.from_body(e.body) for e in entries if e.kind == "rejection"]
    assert len(rejections) == MAX_TAPED_REFUSALS
    assert {r.sender for r in rejections} == {"eu-0"}


@pytest.mark.parametrize("value", [2**63, 2**64 - 1])
def test_a_round_step_or_time_beyond_the_tape_s_integers_is_refused_by_name(
    tmp_path: Path, theta0: torch.Tensor, value: int
) -> None:
    """uint64 on the wire, signed 64-bit on the tape: a value the tape cannot hold is
    refused naming its field, is not taped, and changes nothing (a leave with such a
    ``step`` used to change the members, then fail to tape)."""
    key = SigningKey.generate("relay-eu")
    node = RelayNode(CFG, "eu", theta0, NodeStore(tmp_path, CFG.run_id, key))  # tapes refusals
    refusals = [
        node.push(_delta(theta0, "eu-0", 5, round=value))[0],
        node.push(_delta(theta0, "eu-0", 5, sync_step=value))[0],
        node.on_member(MemberRequest(CFG.run_id, LEAVE, "eu-1", value, 1))[0],
        node.on_member(MemberRequest(CFG.run_id, LEAVE, "eu-1", 3, value))[0],
        node.fetch(CFG.run_id, "eu-0", value, "regional"),
    ]
    fields = ["round", "sync_step", "step", "issued", "sync_step"]
    for decision, field in zip(refusals, fields, strict=True):
        assert isinstance(decision, Decision) and decision.code == INVALID
        assert decision.reason == f"{field} {value} is out of range: at most 2^63 - 1"
    assert node.machine.members == ("eu-0", "eu-1") and node.machine.level.inputs == {}
    assert node.push(_delta(theta0, "eu-0", 5))[0].accepted
    node.close()
    kinds = [e.kind for e in verify_tape(tmp_path / "tape", TrustedKeys.of([key])).entries]
    assert "rejection" not in kinds and "member" not in kinds and "input" in kinds


def test_a_step_whose_aggregate_fails_refuses_the_last_delta_and_changes_nothing(
    theta0: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """eu-1's accepted bytes change afterwards (as a spool file's could on disk; no early
    sum here, which would have summed them before they changed: ``RegionCore.offer``
    off); eu-0's delta completes the step, and the aggregate cannot decode eu-1's: eu-0
    is refused and the machine is exactly as before it, then commits once the bytes are
    whole again."""
    from hypertrain.common.roles import RegionCore

    monkeypatch.setattr(RegionCore, "offer", lambda *a: None)
    relay = RelayMachine(CFG, "eu", theta0)
    second = _delta(theta0, "eu-1", 5, seed=1)
    second = dataclasses.replace(second, data=bytearray(second.data))
    assert relay.on_delta(second)[0].accepted
    assert isinstance(second.data, bytearray)
    whole = bytes(second.data)
    second.data[len(whole) // 2] ^= 0xFF
    before = (dict(relay.level.inputs), dict(relay.level.accepted), relay.level.open_step)
    base = flat_digest(relay.core.base_view())
    decision, effects = relay.on_delta(_delta(theta0, "eu-0", 5, seed=0))
    assert decision.code == INVALID and effects == [], decision.reason
    assert "completed step 5, whose aggregate failed" in decision.reason
    assert "checksum" in decision.reason and "nothing changed" in decision.reason
    after = (dict(relay.level.inputs), dict(relay.level.accepted), relay.level.open_step)
    assert after == before and flat_digest(relay.core.base_view()) == base
    second.data[:] = whole
    decision, effects = relay.on_delta(_delta(theta0, "eu-0", 5, seed=0))
    assert decision.accepted and any(isinstance(e, Committed) for e in effects)
    assert relay.level.open_step == 10


class _CountingDigest:
    """``flat_digest`` as the machines module calls it, counting the passes it makes."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, flat: torch.Tensor) -> str:
        self.calls += 1
        return flat_digest(flat)


def test_the_relay_s_state_digest_follows_its_state_and_hashes_it_once_per_change(
    theta0: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``state_digest`` (what a relay's Status reports) is the digest of the base, or of
    the last global parameters while a global round is pending, at every point of a
    round and after a restore, and asking again (a caller looping Status) hashes nothing."""
    import hypertrain.common.rounds.machines as machines

    counting = _CountingDigest()
    monkeypatch.setattr(machines, "flat_digest", counting)
    relay = RelayMachine(CFG, "eu", theta0)

    def held() -> torch.Tensor:
        return relay.core.theta if relay.global_pending is not None else relay.core.base_view()

    def check(hashed_at_most: int) -> None:
        before = counting.calls
        assert relay.state_digest() == flat_digest(held())
        for _ in range(5):
            assert relay.state_digest() == flat_digest(held())
        assert counting.calls - before <= hashed_at_most

    check(1)  # the initial parameters: hashed once, then kept
    for k, sender in enumerate(("eu-0", "eu-1")):
        relay.on_delta(_delta(theta0, sender, 5, seed=5 + k))
    check(0)  # the commit recorded the new base's digest as it wrote it
    for k, sender in enumerate(("eu-0", "eu-1")):
        relay.on_delta(_delta(theta0, sender, 10, seed=10 + k))
    assert relay.global_pending == 10
    check(1)  # pending: the global parameters it still holds
    theta = theta0 + 1e-3
    relay.on_global(GlobalArrived(10, theta, Commitment({}, (), (), ""), flat_digest(theta)))
    check(0)  # the update's verified digest
    snap = relay.snapshot()
    fresh = RelayMachine(CFG, "eu", theta0)
    fresh.restore(snap, [])
    relay = fresh
    check(1)
    assert relay.state_digest() == flat_digest(theta)


def test_the_aggregator_s_state_digest_is_its_theta_s_hashed_once_per_step(
    theta0: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hypertrain.common.rounds.machines as machines

    counting = _CountingDigest()
    monkeypatch.setattr(machines, "flat_digest", counting)
    agg = AggregatorMachine(CFG, theta0)
    assert [agg.state_digest() for _ in range(4)] == [flat_digest(theta0)] * 4
    assert counting.calls == 1
    g = make_codec(CFG.global_codec)
    for region in ("eu", "us"):
        data = g.encode(torch.full((theta0.numel(),), 1e-3))
        agg.on_regional(Delta(CFG.run_id, 0, 10, region, blob_digest(data), str(g.spec), data))
    assert agg.round == 1
    before = counting.calls
    assert [agg.state_digest() for _ in range(4)] == [flat_digest(agg.core.theta)] * 4
    assert agg.state_digest() != flat_digest(theta0)
    assert counting.calls == before  # the step's own record: no pass at all


def test_an_outer_step_into_warmed_memory_keeps_every_bit(
    theta0: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``GlobalCore.warm`` (the aggregator daemon faults in the next step's memory while
    it waits) changes no value: the same thetas and outer state, step after step, as
    without it; the step writes its theta there; a step whose aggregate fails keeps it
    for the next; a pickled core (the simulator's checkpoints) carries no spare.  (No
    early sum here, ``GlobalCore.offer``: it would have summed the first forward before
    its bytes changed; tests/unit/test_early_sum.py has the early sums in warmed memory.)"""
    import pickle

    from hypertrain.common import pages
    from hypertrain.common.roles import GlobalCore

    monkeypatch.setattr(GlobalCore, "offer", lambda *a: None)
    g = make_codec(CFG.global_codec)

    def run(warm: bool) -> list[str]:
        agg = AggregatorMachine(CFG, theta0.clone())
        out = []
        for step in (10, 20):
            spare = None
            if warm:
                spare = agg.core.warm()
                assert spare is not None and agg.core.warm() is None
                pages.populate(spare)
                assert pickle.loads(pickle.dumps(agg.core))._spare is None
            blobs = {r: g.encode(torch.full((theta0.numel(),), 1e-3 * step)) for r in ("eu", "us")}
            first = bytearray(blobs["eu"])  # accepted, then its bytes change (as on disk)
            whole = bytes(first)
            d = Delta(
                CFG.run_id, step // 10 - 1, step, "eu", blob_digest(whole), str(g.spec), first
            )
            assert agg.on_regional(d)[0].accepted
            first[len(whole) // 2] ^= 0xFF
            last = Delta(
                CFG.run_id, step // 10 - 1, step, "us", blob_digest(blobs["us"]), str(g.spec),
                blobs["us"],
            )  # fmt: skip
            assert agg.on_regional(last)[0].code == INVALID  # the step failed: nothing moved
            assert agg.core._spare is spare
            first[:] = whole
            assert agg.on_regional(last)[0].accepted
            if warm:
                assert agg.core.theta is spare and agg.core._spare is None
            out += [flat_digest(agg.core.theta), agg.state_digest()]
        return out

    assert run(warm=True) == run(warm=False)


@pytest.mark.parametrize("warm", [False, True])
def test_an_outer_step_reuses_the_theta_it_replaced_only_when_nothing_holds_it(
    theta0: torch.Tensor, warm: bool
) -> None:
    """With ``recycle`` (the aggregator daemon) the theta an outer step replaced becomes
    the memory of a later step's theta (at ``warm``, or at the step) once nothing else
    holds it, and every theta and digest is the one a core without it makes.  A theta
    still held (here, a view of it that a merge being served would hold) is never
    written: it keeps its values, and fresh memory is taken instead."""
    g = make_codec(CFG.global_codec)
    cfg = CFG.with_overrides(steps=50)

    def run(recycle: bool) -> list[str]:
        agg = AggregatorMachine(cfg, theta0.clone())
        agg.core.recycle = recycle
        out, held, kept, two_back = [], None, None, 0
        for n, step in enumerate((10, 20, 30, 40, 50)):
            replaced = agg.core.theta
            before = replaced.data_ptr()
            if n == 2:  # something reads the theta about to be replaced, through the next step
                held, kept = replaced.view(-1), replaced.clone()
            del replaced
            if warm:
                spare = agg.core.warm()
                assert agg.core.warm() is None
                # the old theta's memory is already resident: nothing to fault in
                assert (spare is None) == (recycle and n in (1, 2, 4))
                del spare
            for r in ("eu", "us"):
                data = g.encode(
                    torch.full((theta0.numel(),), 1e-3 * step * (2 if r == "eu" else 1))
                )
                d = Delta(cfg.run_id, n, step, r, blob_digest(data), str(g.spec), data)
                assert agg.on_regional(d)[0].accepted
            if recycle and n == 4:  # the run's last step: nothing kept for a next one
                assert agg.done and agg.core._retired is None
            elif recycle:
                assert agg.core._retired is not None and agg.core._retired.data_ptr() == before
            if recycle and n >= 1:
                reused = agg.core.theta.data_ptr() == two_back
                assert reused == (n != 3), n  # the theta step 3 retired was still held
            two_back = before
            out += [flat_digest(agg.core.theta), agg.state_digest()]
            if n == 3:
                assert held is not None and kept is not None and torch.equal(held, kept)
                del held  # let go: a later step may write it again
        return out

    assert run(recycle=True) == run(recycle=False)
