"""A relay sums deltas as they are accepted (``RegionCore.offer``), and the aggregator
the forwards (``GlobalCore.offer``): in any arrival order, with absences and leaves, the
merges, forwards and outer steps keep the bits of the sum taken at the commit (the path
with ``offer`` switched off)."""

import dataclasses
import itertools

import pytest
import torch

from hypertrain.common import aggregate as agg
from hypertrain.common import pages, roles
from hypertrain.common.aggregate import Commitment
from hypertrain.common.codec import make_codec
from hypertrain.common.config import RunConfig
from hypertrain.common.digest import blob_digest
from hypertrain.common.roles import GlobalCore, RegionCore, initial_parameters
from hypertrain.common.rounds.machines import (
    INVALID,
    LEAVE,
    AggregatorMachine,
    Committed,
    Delta,
    Forward,
    GlobalArrived,
    MemberRequest,
    RelayMachine,
)
from hypertrain.common.trust.ledger import flat_digest

ISLANDS = ("eu-0", "eu-1", "eu-2", "eu-3")


def _cfg(global_codec: str, cutoff: float = 0.0) -> RunConfig:
    return RunConfig.from_dict(
        {
            "steps": 20,
            "batch_per_island": 8,
            "regional_codec": "int8",
            "global_codec": global_codec,
            "topology": {"regions": ["eu"], "islands_per_region": 4, "h_r": 5, "h_g": 10},
            **({"membership": {"regional_cutoff_s": cutoff}} if cutoff else {}),
        }
    )


@pytest.fixture(scope="module")
def theta0() -> torch.Tensor:
    return initial_parameters(_cfg("fp32"))[1]


def _delta(cfg: RunConfig, theta0: torch.Tensor, sender: str, step: int) -> Delta:
    seed = 100 * step + int(sender[-1])
    x = torch.randn(theta0.numel(), generator=torch.Generator().manual_seed(seed)) * 1e-3
    if sender == "eu-2":
        x[::7] = -0.0  # sign-of-zero rules in the sum
    data = make_codec(cfg.regional_codec).encode(x)
    codec = str(make_codec(cfg.regional_codec).spec)
    return Delta(cfg.run_id, 0, step, sender, blob_digest(data), codec, data)


def _round(
    cfg: RunConfig, theta0: torch.Tensor, orders: tuple[tuple[str, ...], ...], **at_five: object
) -> tuple[str, ...]:
    """Steps 5 and 10 (a regional then a global sync) in the given arrival orders: the
    digests of the base after each merge and of the forward's bytes."""
    relay = RelayMachine(cfg, "eu", theta0.clone())
    out: list[str] = []
    for step, order in zip((5, 10), orders, strict=True):
        if at_five.get("warm"):  # as the relay daemon does between rounds
            frame = relay.core.warm()
            if frame is not None:
                assert relay.core.base_view() is relay.core.theta  # still reads as theta
                pages.populate(frame)
        for sender in order:
            decision, effects = relay.on_delta(_delta(cfg, theta0, sender, step))
            assert decision.accepted, decision.reason
        if step == 5 and at_five.get("cutoff"):
            decision, effects = relay.on_cutoff(5)
            assert decision.accepted
        committed = [e for e in effects if isinstance(e, Committed)]
        assert committed, f"step {step} did not commit"
        out.append(committed[0].record.post_base)  # type: ignore[union-attr]
        forward = [e for e in effects if isinstance(e, Forward)]
        if forward:
            out.append(blob_digest(forward[0].data))
    return tuple(out)


@pytest.mark.parametrize("global_codec", ["fp32", "int8"])
def test_every_arrival_order_keeps_the_bits_of_the_sum_at_the_commit(
    global_codec: str, theta0: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(global_codec)
    sorted_order = (ISLANDS, ISLANDS)
    early_sizes: list[int] = []
    real_offer = RegionCore.offer

    def counting_offer(core: RegionCore, delivered, members) -> None:  # type: ignore[no-untyped-def]
        real_offer(core, delivered, members)
        early_sizes.append(0 if core._early is None else len(core._early.members))

    monkeypatch.setattr(RegionCore, "offer", counting_offer)
    want = _round(cfg, theta0, sorted_order)
    # arriving in the order of the sum, the first three are summed before the last arrives
    # (step 5; step 10 follows a regional merge, whose base islands may still fetch)
    assert early_sizes[:3] == [1, 2, 3] and set(early_sizes[3:]) == {0}
    for order in itertools.permutations(ISLANDS):
        assert _round(cfg, theta0, (order, order[::-1])) == want, order
    monkeypatch.setattr(RegionCore, "offer", lambda *a: None)  # today's path
    assert _round(cfg, theta0, sorted_order) == want


def test_an_absent_member_stops_the_early_sum_and_the_commit_goes_on(
    theta0: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg("fp32", cutoff=3.0)
    three = ("eu-3", "eu-0", "eu-2")  # eu-1 never delivers: the sum stops after eu-0
    got = _round(cfg, theta0, (three, ISLANDS), cutoff=True)
    monkeypatch.setattr(RegionCore, "offer", lambda *a: None)
    assert _round(cfg, theta0, (three, ISLANDS), cutoff=True) == got


def test_a_member_that_left_is_passed_over(
    theta0: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg("fp32")
    at_commit: list[list[str]] = []
    real = roles.streamed_mean

    def spy(*args, early=None, **kw):  # type: ignore[no-untyped-def]
        at_commit.append([] if early is None else list(early.members))
        return real(*args, early=early, **kw)

    monkeypatch.setattr(roles, "streamed_mean", spy)
    relay = RelayMachine(cfg, "eu", theta0.clone())
    relay.on_delta(_delta(cfg, theta0, "eu-0", 5))
    relay.on_delta(_delta(cfg, theta0, "eu-2", 5))
    assert relay.core._early is not None and relay.core._early.members == ["eu-0"]
    decision, _ = relay.on_member(MemberRequest(cfg.run_id, LEAVE, "eu-1", 5, 1.0))
    assert decision.accepted, decision.reason
    relay.on_delta(_delta(cfg, theta0, "eu-3", 5))  # eu-1 is gone: eu-2 follows eu-0
    assert at_commit == [["eu-0", "eu-2"]]
    assert relay.merge_for(5) is not None


def test_a_delta_that_does_not_decode_leaves_no_early_sum(theta0: torch.Tensor) -> None:
    cfg = _cfg("fp32")
    core = RegionCore(cfg, "eu", theta0.clone(), adopt=True)
    good = _delta(cfg, theta0, "eu-0", 5).data
    bad = bytearray(good)
    bad[-1] ^= 0xFF
    core.offer({"eu-0": good}, ISLANDS)
    assert core._early is not None
    core.offer({"eu-0": good, "eu-1": bytes(bad)}, ISLANDS)
    assert core._early is None
    assert torch.equal(core.base_view(), core.theta)  # still reads as theta


def test_new_global_parameters_drop_the_early_sum(theta0: torch.Tensor) -> None:
    cfg = _cfg("fp32")
    core = RegionCore(cfg, "eu", theta0.clone(), adopt=True)
    blobs = {m: _delta(cfg, theta0, m, 5).data for m in ISLANDS}
    core.offer({"eu-0": blobs["eu-0"]}, ISLANDS)
    core.adopt_global(theta0.clone() + 1)
    assert core._early is None
    _, com = core.merge(blobs)
    want = agg.aggregate(blobs, core.codec, tuple(theta0.shape))[0]
    assert flat_digest(core.base_view()) == flat_digest(theta0 + 1 - want)
    assert com.members == ISLANDS
    relay = RelayMachine(cfg, "eu", theta0.clone())
    relay.on_delta(_delta(cfg, theta0, "eu-0", 5))
    assert relay.core._early is not None
    assert relay.core.base is not None  # the base, to write: drops the sum in its buffer
    assert relay.core._early is None


def test_nothing_is_allocated_before_one_of_the_first_two_members_delivers(
    theta0: torch.Tensor,
) -> None:
    cfg = _cfg("fp32")
    relay = RelayMachine(cfg, "eu", theta0.clone())
    for sender in ("eu-3", "eu-2"):
        relay.on_delta(_delta(cfg, theta0, sender, 5))
        assert relay.core._early is None and relay.core._base is None  # no model-sized buffer
    relay.on_delta(_delta(cfg, theta0, "eu-1", 5))  # the first two commute: a sum of eu-1
    assert relay.core._early is not None and relay.core._early.members == ["eu-1"]
    relay.on_delta(_delta(cfg, theta0, "eu-0", 5))  # the last: the commit adds eu-0 and on
    assert relay.merge_for(5) is not None


@pytest.mark.parametrize("global_codec", ["fp32", "int8"])
def test_a_base_warmed_between_rounds_keeps_every_bit(
    global_codec: str, theta0: torch.Tensor
) -> None:
    """``RegionCore.warm`` (the relay daemon faults in the next base's memory while it
    waits) changes no merge and no forward, in any arrival order; only an fp32 global
    codec's base is a mapping to warm, and only while no base is held."""
    cfg = _cfg(global_codec)
    want = _round(cfg, theta0, (ISLANDS, ISLANDS))
    for order in (ISLANDS, ISLANDS[::-1]):
        assert _round(cfg, theta0, (order, order), warm=True) == want, order
    core = RegionCore(cfg, "eu", theta0.clone())
    frame = core.warm()
    if global_codec != "fp32":
        assert frame is None
        return
    assert frame is not None and frame.numel() == theta0.numel()
    assert core.warm() is None  # held now: nothing more to allocate
    assert core.base_view() is core.theta


def test_a_base_warmed_after_a_global_round_keeps_every_bit(theta0: torch.Tensor) -> None:
    """After a global round spent the base on the forward, ``warm`` gives the next one's
    memory again (what the relay daemon faults in while its islands train); the merges
    after it are the same bits as without."""
    cfg = _cfg("fp32")

    def rounds(warm: bool) -> list[str]:
        relay = RelayMachine(cfg, "eu", theta0.clone())
        for step in (5, 10):
            for sender in ISLANDS:
                relay.on_delta(_delta(cfg, theta0, sender, step))
        assert relay.global_pending == 10 and relay.core._base is None  # spent
        theta = theta0 + 1e-3
        relay.on_global(GlobalArrived(10, theta, Commitment({}, (), (), ""), flat_digest(theta)))
        if warm:
            frame = relay.core.warm()
            assert frame is not None and frame.numel() == theta0.numel()
            if not pages.populate(frame):
                pytest.skip("this kernel has no MADV_POPULATE_WRITE")
            assert relay.core.base_view() is relay.core.theta
        out = []
        for sender in ISLANDS[::-1]:
            decision, effects = relay.on_delta(
                dataclasses.replace(_delta(cfg, theta0, sender, 15), round=1)
            )
            assert decision.accepted, decision.reason
        committed = [e for e in effects if isinstance(e, Committed)]
        out.append(committed[0].record.post_base)  # type: ignore[union-attr]
        return out

    assert rounds(warm=True) == rounds(warm=False)


@pytest.mark.parametrize("global_codec", ["fp32", "int8"])
def test_a_global_merge_downloaded_into_the_forwards_memory_keeps_every_bit(
    global_codec: str, theta0: torch.Tensor
) -> None:
    """``RegionCore.forward_room`` (the relay daemon downloads the global merge into its
    acknowledged fp32 forward's memory, where a fresh tensor would be faulted in): the
    view is the forward's payload, in the forward's own memory; the merges and forwards of
    two global rounds after it are the same bits as with a fresh tensor.  Nothing for a
    lossy codec's forward or a read-only blob."""
    cfg = _cfg(global_codec)

    def rounds(into_room: bool) -> list[str]:
        relay = RelayMachine(cfg, "eu", theta0.clone())
        out = []
        for g, (regional, global_step) in enumerate(((5, 10), (15, 20))):
            forwards = []
            for step in (regional, global_step):
                for sender in ISLANDS[:: 1 if g else -1]:
                    decision, effects = relay.on_delta(
                        dataclasses.replace(_delta(cfg, theta0, sender, step), round=g)
                    )
                    assert decision.accepted, decision.reason
                    forwards += [e for e in effects if isinstance(e, Forward)]
            (fwd,) = forwards
            out.append(blob_digest(fwd.data))
            room = relay.core.forward_room(fwd.data)
            if global_codec != "fp32":
                assert room is None
            else:
                assert room is not None and room.numel() == theta0.numel()
                data = memoryview(fwd.data).cast("B")
                head = data.nbytes - 4 * theta0.numel()
                assert torch.equal(room, make_codec("fp32").decode(fwd.data))  # its payload
                base_ptr = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
                assert room.data_ptr() == base_ptr + head  # no copy: the forward's memory
                assert relay.core.forward_room(memoryview(bytes(data))) is None  # read-only
                assert relay.core.forward_room(data[:-4]) is None  # not a whole forward
            del fwd, forwards
            theta = theta0 + 1e-3 * (g + 1)
            if into_room and room is not None:
                theta = room.copy_(theta)  # the download, over the forward's bytes
            del room
            relay.on_global(
                GlobalArrived(global_step, theta, Commitment({}, (), (), ""), flat_digest(theta))
            )
            assert flat_digest(relay.core.theta) == flat_digest(theta0 + 1e-3 * (g + 1))
        return out

    assert rounds(into_room=True) == rounds(into_room=False)


# -- the aggregator: forwards summed as they come, in the memory of the step's new theta --
REGIONS = ("ap", "eu", "us")


def _global_cfg(
    global_codec: str,
    shards: int = 1,
    regions: tuple[str, ...] = REGIONS,
    membership: dict[str, float] | None = None,
) -> RunConfig:
    return RunConfig.from_dict(
        {
            "steps": 20,
            "batch_per_island": 8,
            "regional_codec": "int8",
            "global_codec": global_codec,
            "topology": {
                "regions": list(regions),
                "islands_per_region": 1,
                "h_r": 5,
                "h_g": 10,
                "relay_shards": shards,
            },
            **({"membership": membership} if membership else {}),
        }
    )


def _forward(cfg: RunConfig, theta0: torch.Tensor, region: str, step: int) -> Delta:
    seed = 1000 * step + sum(map(ord, region))
    x = torch.randn(theta0.numel(), generator=torch.Generator().manual_seed(seed)) * 1e-3
    if region == "eu":
        x[::5] = -0.0
    codec = make_codec(cfg.global_codec)
    data = codec.encode(x)
    return Delta(cfg.run_id, step // 10 - 1, step, region, blob_digest(data), str(codec.spec), data)


class _StepSpy:
    """``segmented_mean`` as ``GlobalCore.step`` calls it, recording the members of the
    early sum each call was handed (None: none)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.early: list[list[str] | None] = []
        real = roles.segmented_mean

        def spy(*args, early=None, **kw):  # type: ignore[no-untyped-def]
            self.early.append(None if early is None else list(early.members))
            return real(*args, early=early, **kw)

        monkeypatch.setattr(roles, "segmented_mean", spy)


def _global_rounds(
    cfg: RunConfig, theta0: torch.Tensor, order: tuple[str, ...], warm: bool
) -> tuple[list[str], list[list[str]]]:
    """Two global rounds with the forwards in ``order`` (then reversed): each round's
    theta, outer state and record digests, and the early sum's members after each
    forward that did not close the round."""
    agg = AggregatorMachine(cfg, theta0.clone())
    out: list[str] = []
    sums: list[list[str]] = []
    for n, step in enumerate((10, 20)):
        spare = None
        if warm:
            spare = agg.core.warm()
            assert spare is not None
            pages.populate(spare)
        arrivals = order if n == 0 else order[::-1]
        for k, region in enumerate(arrivals):
            decision, effects = agg.on_regional(_forward(cfg, theta0, region, step))
            assert decision.accepted, decision.reason
            if k < len(arrivals) - 1:
                early = agg.core._early
                sums.append([] if early is None else list(early.members))
        committed = [e for e in effects if isinstance(e, Committed)]
        assert committed, f"step {step} did not commit"
        if spare is not None:
            assert agg.core.theta.data_ptr() == spare.data_ptr()  # the step wrote it there
        assert agg.core._early is None
        out += [flat_digest(agg.core.theta), agg.state_digest(), repr(committed[0].record)]
    return out, sums


@pytest.mark.parametrize("global_codec", ["fp32", "int8"])
def test_the_aggregator_sums_forwards_as_they_come_with_the_bits_of_the_step(
    global_codec: str, theta0: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _global_cfg(global_codec)
    theta = initial_parameters(cfg)[1]
    steps = _StepSpy(monkeypatch)
    want, sums = _global_rounds(cfg, theta, REGIONS, warm=False)
    assert sums == [[], []] * 2  # never warmed (the parity simulator's, the audit's core): no sum
    assert steps.early == [None, None]
    for order in itertools.permutations(REGIONS):
        steps.early.clear()
        got, sums = _global_rounds(cfg, theta, order, warm=True)
        assert got == want, order
        # each step went on from the sum that was open when the last forward came
        assert steps.early == [sums[1], sums[3]], order
        # as far as the order allows, the first two in either order
        first = sums[:2]
        if order[0] == "us":
            assert first[0] == []
        else:
            assert first[0] == [order[0]]
        if set(order[:2]) == {"ap", "eu"}:
            assert first[1] == list(order[:2])
    _, sums = _global_rounds(cfg, theta, ("eu", "ap", "us"), warm=True)
    assert sums[:2] == [["eu"], ["eu", "ap"]]


def test_a_round_closed_at_its_cutoff_goes_on_from_the_early_sum_with_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regions absent at the cutoff (a quorum of half): every arrival of one to three
    of four regions, closed by the cutoff, has the bits of the unwarmed aggregator's
    step; an early sum of the second region alone goes on when the first never came."""
    regions = (*REGIONS, "zz")
    cfg = _global_cfg(
        "fp32", regions=regions, membership={"global_cutoff_s": 5.0, "global_quorum": 0.5}
    )
    theta = initial_parameters(cfg)[1]
    steps = _StepSpy(monkeypatch)
    used_second_alone = False
    for k in (1, 2, 3):
        for came in itertools.permutations(regions, k):
            out = {}
            for warm in (False, True):
                agg = AggregatorMachine(cfg, theta.clone())
                if warm:
                    assert agg.core.warm() is not None
                steps.early.clear()
                for region in came:
                    assert agg.on_regional(_forward(cfg, theta, region, 10))[0].accepted
                _, effects = agg.on_cutoff(10)
                committed = [e for e in effects if isinstance(e, Committed)]
                out[warm] = (
                    (flat_digest(agg.core.theta), repr(committed[0].record)) if committed else None
                )
                used_second_alone |= warm and steps.early == [["eu"]] and "ap" not in came
            assert out[True] == out[False], came
    assert used_second_alone


def test_the_aggregator_sums_nothing_early_with_relay_shards() -> None:
    """With relay shards the mean is a sum per shard range: no early sum, even of blobs
    it could add (here of the whole tensor's size, which would sum without the rule)."""
    cfg = _global_cfg("fp32", shards=2)
    theta = initial_parameters(cfg)[1]
    core = GlobalCore(cfg, theta)
    assert core.warm() is not None
    codec = make_codec("fp32")
    blobs = {m: codec.encode(torch.zeros(theta.numel())) for m in core.members}
    core.offer(blobs, core.members)
    assert core._early is None


def test_a_forward_whose_bytes_changed_leaves_no_early_sum_and_fails_the_step() -> None:
    """A forward accepted whole whose bytes then change (as on a failing disk) and that
    an early sum then reads: the sum is dropped, and the step refuses the round as it
    always did (nothing moves; the warmed memory is kept for the next try)."""
    regions = (*REGIONS, "zz")
    cfg = _global_cfg("fp32", regions=regions)
    theta = initial_parameters(cfg)[1]
    agg = AggregatorMachine(cfg, theta.clone())
    assert agg.core.warm() is not None
    spare = agg.core._spare
    late = _forward(cfg, theta, "us", 10)
    changing = bytearray(late.data)
    assert agg.on_regional(dataclasses.replace(late, data=changing))[0].accepted
    assert agg.core._early is None  # us is third in the order: nothing to add yet
    changing[len(changing) // 2] ^= 0xFF
    assert agg.on_regional(_forward(cfg, theta, "ap", 10))[0].accepted
    assert agg.core._early is not None and agg.core._early.members == ["ap"]
    assert agg.on_regional(_forward(cfg, theta, "eu", 10))[0].accepted  # then eu, us: bad
    assert agg.core._early is None
    before = flat_digest(agg.core.theta)
    decision, _ = agg.on_regional(_forward(cfg, theta, "zz", 10))
    assert decision.code == INVALID, decision.reason
    assert flat_digest(agg.core.theta) == before and agg.core._spare is spare
