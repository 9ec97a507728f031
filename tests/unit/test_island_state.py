"""An island's rejoin state: written from the live tensors, without a copy of the model."""

from __future__ import annotations

import pytest
import torch

from hypertrain.common.codec import ErrorFeedback
from hypertrain.common.codec import feedback as feedback_module
from hypertrain.common.config import RunConfig
from hypertrain.common.data import SampleStream
from hypertrain.common.errors import HypertrainError
from hypertrain.common.reference import open_dataset
from hypertrain.common.roles import IslandCore, SegmentNorm, initial_parameters
from hypertrain.common.toy import ToyIsland, toy_parameters


def _toy(cfg: RunConfig) -> ToyIsland:
    return ToyIsland(cfg, "eu-0", toy_parameters(cfg))


def _island(cfg: RunConfig, theta0: torch.Tensor) -> IslandCore:
    """Island eu-0 of the model ``cfg`` names, from ``theta0``."""
    stream = SampleStream(open_dataset(cfg), cfg.model_config().seq_len, cfg.global_batch, 0)
    return IslandCore(cfg, "eu-0", stream, theta0)


def test_live_state_after_a_global_merge_round_trips_without_params() -> None:
    cfg = RunConfig(model="toy").with_overrides(
        **{"steps": 4, "topology.h_r": 2, "topology.h_g": 2}
    )
    island = _toy(cfg)
    for _ in range(2):
        island.train_step()
    island.sync()
    island.apply_merge("global", island.params() * 0.5, 2)
    live = island.state_dict(copy=False)
    assert live["params"] is None  # equal to the base: not written twice
    assert live["base"] is island.base  # the live tensor, no copy
    copied = island.state_dict()
    other = _toy(cfg)
    other.load_state_dict(live)
    assert torch.equal(other.params(), copied["params"])
    assert torch.equal(other.base, copied["base"])
    assert torch.equal(other.feedback.residual, island.feedback.residual)


def test_live_state_keeps_params_that_differ_from_the_base() -> None:
    cfg = RunConfig(model="toy").with_overrides(
        **{"steps": 4, "topology.h_r": 2, "topology.h_g": 2}
    )
    island = _toy(cfg)
    island.train_step()
    live = island.state_dict(copy=False)
    assert live["params"] is not None and torch.equal(live["params"], island.params())


def test_model_island_compares_params_and_base_without_flattening() -> None:
    cfg = RunConfig().with_overrides(**{"steps": 2, "topology.h_r": 2, "topology.h_g": 2})
    _, theta0 = initial_parameters(cfg)
    core = _island(cfg, theta0)
    assert core.params_equal_base()
    called: list[tuple[int, bool]] = []
    core.before_update = lambda: called.append(
        (core.step, all(p.grad is None for p in core.model.parameters()))
    )
    core.train_step()
    # The hook runs before the backward pass (no gradient yet), and so before the first
    # change to the parameters: a rejoin save still running does not overlap it.
    assert called == [(0, True)]
    assert not core.params_equal_base()
    assert all(p.grad is None for p in core.model.parameters())  # freed after the step


def test_live_state_aliases_the_optimizer_moments_and_round_trips() -> None:
    """The rejoin save holds no copy of the inner optimizer's state (two model-sized
    moments for AdamW); what it writes restores the island exactly."""
    cfg = RunConfig().with_overrides(**{"steps": 4, "topology.h_r": 2, "topology.h_g": 2})
    _, theta0 = initial_parameters(cfg)

    core = _island(cfg, theta0)
    core.train_step()
    live = core.state_dict(copy=False)
    moments = [
        t
        for group in live["optimizer"]
        for per_param in group["state"].values()
        for t in per_param.values()
        if isinstance(t, torch.Tensor) and t.numel() > 1
    ]
    owned = {s.untyped_storage().data_ptr() for s in moments}
    in_optimizer = {
        t.untyped_storage().data_ptr()
        for opt in core.optimizer.optimizers
        for per_param in opt.state.values()
        for t in per_param.values()
        if isinstance(t, torch.Tensor) and t.numel() > 1
    }
    assert moments and owned == in_optimizer  # aliases, not copies
    copied = core.state_dict()
    assert not owned & {
        t.untyped_storage().data_ptr()
        for group in copied["optimizer"]
        for per_param in group["state"].values()
        for t in per_param.values()
        if isinstance(t, torch.Tensor) and t.numel() > 1
    }
    other = _island(cfg, theta0)
    other.load_state_dict(live)
    core.train_step()
    other.train_step()
    assert torch.equal(other.params(), core.params())


def test_fp32_sync_frames_the_delta_where_it_was_computed_with_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An fp32 island computes its delta behind the blob's header room and sends that
    buffer (one copy of the model per sync, not two); the bytes are those of encoding
    ``base - theta``, and with tau > 0 the parameters are snapshotted first.
    The same island with int8 takes the usual path."""
    from hypertrain.common.codec import make_codec

    for tau in (0, 1):
        cfg = RunConfig().with_overrides(
            **{
                "steps": 4,
                "topology.h_r": 2,
                "topology.h_g": 2,
                "topology.tau": tau,
                "regional_codec": "fp32",
            }
        )
        _, theta0 = initial_parameters(cfg)
        core = _island(cfg, theta0)
        core.train_step()
        core.train_step()
        core.base.view(-1)[:3] = core.params()[:3]  # equal values: deltas of +0.0
        expected = make_codec("fp32").encode(torch.sub(core.base, core.params()))
        with monkeypatch.context() as patch:  # the framed path, not a second encode
            patch.setattr(ErrorFeedback, "encode", None)
            (blob,) = core.sync()
        assert bytes(blob) == bytes(expected)
        assert core.feedback.is_zero
        if tau:
            assert torch.equal(core.snapshots[0][2], core.params())
    int8 = RunConfig().with_overrides(**{"steps": 2, "topology.h_r": 2, "topology.h_g": 2})
    _, theta0 = initial_parameters(int8)
    core = _island(int8, theta0)
    core.train_step()
    expected_int8 = make_codec(int8.regional_codec).encode(torch.sub(core.base, core.params()))
    assert bytes(core.sync()[0]) == bytes(expected_int8)


def test_lossy_sync_lets_the_old_residual_go() -> None:
    """With error feedback the new residual is computed in the delta's memory; the old
    residual's buffer must not stay referenced (a whole model held while training)."""
    import gc
    import weakref

    cfg = RunConfig(model="toy").with_overrides(
        **{"steps": 4, "topology.h_r": 1, "topology.h_g": 2, "regional_codec": "int8"}
    )
    island = _toy(cfg)
    island.train_step()
    island.sync()
    first = island.feedback.residual
    assert first is not None
    gone = weakref.ref(first)
    del first
    island.train_step()
    island.sync()
    assert island.feedback.released is None
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("tau", [0, 1])
def test_a_rejoin_state_after_a_merge_knows_the_parameters_are_the_base(
    tau: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right after a merge without overlap the parameters were loaded from the base: the
    live rejoin state leaves them out without comparing them (a model-sized read on the
    sync's path).  With overlap (tau = 1) they differ and are saved; after a step, or
    after a load of other values, they are compared again; what is saved restores the
    island exactly either way."""
    cfg = RunConfig().with_overrides(
        **{"steps": 6, "topology.h_r": 2, "topology.h_g": 2, "topology.tau": tau}
    )
    _, theta0 = initial_parameters(cfg)

    core = _island(cfg, theta0)
    core.train_step()
    core.train_step()
    core.sync()
    for _ in range(tau):
        core.train_step()
    merge = core.base - 1e-3
    core.apply_merge("global", merge, sync_step=2)
    compared: list[int] = []
    real = IslandCore.params_equal_base

    def counted(self: IslandCore) -> bool:
        compared.append(self.step)
        return real(self)

    monkeypatch.setattr(IslandCore, "params_equal_base", counted)
    live = core.state_dict(copy=False)
    if tau == 0:
        assert live["params"] is None and compared == []
    else:
        assert live["params"] is not None and compared == [3]
    other = _island(cfg, theta0)
    other.load_state_dict(live)
    assert torch.equal(other.params(), core.params())
    other.state_dict(copy=False)  # loaded from the base: known again, no comparison
    assert compared == ([] if tau == 0 else [3, 3])
    core.train_step()
    assert core.state_dict(copy=False)["params"] is not None
    assert compared[-1] == core.step
    core.load_params(core.base)  # loaded, but not by a merge: compared
    assert core.state_dict(copy=False)["params"] is None and compared[-1] == core.step


@pytest.mark.parametrize("tau", [0, 1])
def test_a_merge_received_into_the_base_is_applied_bit_for_bit(tau: int) -> None:
    """The island daemon receives each merge into its base (``merge_target``): applied
    from there, the island's whole state after the merge, a step and the next sync is
    the one a merge in a buffer of its own gives, bit for bit (regional and global)."""
    cfg = RunConfig().with_overrides(
        **{"steps": 8, "topology.h_r": 2, "topology.h_g": 4, "topology.tau": tau}
    )
    _, theta0 = initial_parameters(cfg)
    apart, inplace = _island(cfg, theta0), _island(cfg, theta0)
    for kind, sync_step in (("regional", 2), ("global", 4)):
        blobs = []
        for core in (apart, inplace):
            while core.step < sync_step:
                core.train_step()
            blobs.append(core.sync())
            for _ in range(tau):
                core.train_step()
        assert [bytes(b) for b in blobs[0]] == [bytes(b) for b in blobs[1]]
        merge = apart.base - 1e-3 * sync_step
        target = inplace.merge_target()
        assert target.data_ptr() == inplace.base.data_ptr()
        target.copy_(merge)  # as the download writes it
        apart.apply_merge(kind, merge.clone(), sync_step)
        inplace.apply_merge(kind, target.view(-1), sync_step)
        assert torch.equal(apart.base, inplace.base)
        assert torch.equal(apart.params(), inplace.params())
    left, right = apart.state_dict(), inplace.state_dict()
    assert left.keys() == right.keys()
    for key in ("params", "base"):
        assert torch.equal(left[key], right[key])
    theta = apart.base + 1e-3
    apart.finish(theta.clone())
    target = inplace.merge_target()
    target.copy_(theta)
    inplace.finish(target.view(-1))  # the final state, received into the base too
    assert torch.equal(apart.params(), inplace.params())


def _merge_both(apart: IslandCore, other: IslandCore, kind: str, sync_step: int, tau: int) -> None:
    """The same merge of ``sync_step`` to both islands after their tau steps of overlap:
    ``apart`` takes a copy, ``other`` receives it into its ``merge_target`` (as the
    island daemon does); their base and parameters are then the same."""
    merge = apart.base - 1e-3 * sync_step  # (``other``'s base holds its delta now)
    for core in (apart, other):
        for _ in range(tau):
            core.train_step()
    target = other.merge_target()
    target.copy_(merge)
    apart.apply_merge(kind, merge.clone(), sync_step)
    other.apply_merge(kind, target, sync_step)
    assert torch.equal(apart.base, other.base)
    assert torch.equal(apart.params(), other.params())


@pytest.mark.parametrize("segment", [None, 4096])
@pytest.mark.parametrize("tau", [0, 1])
def test_a_delta_computed_in_the_base_is_the_same_blob_and_state(
    tau: int, segment: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``frame_base`` (the island daemon): each sync's delta is written over the base,
    in the blob that is sent; the blob is byte for byte the one a separate frame gives,
    and after each merge (received into the base) the island's state is the same.
    ``segment``: checksum segments of that many values, so that the toy model spans many
    and the delta's norm, taken segment by segment while framing, is checked against
    the other path's over several (the same bits, and the L2 norm)."""
    if segment is not None:
        monkeypatch.setattr(feedback_module, "CHECKSUM_SEGMENT", 4 * segment)
        monkeypatch.setattr(SegmentNorm, "STEP", segment)
    cfg = RunConfig().with_overrides(
        regional_codec="fp32",
        **{"steps": 8, "topology.h_r": 2, "topology.h_g": 4, "topology.tau": tau},
    )
    _, theta0 = initial_parameters(cfg)
    apart, inplace = _island(cfg, theta0), _island(cfg, theta0)
    assert inplace.frame_base() and torch.equal(inplace.base, apart.base)
    frame_ptr = inplace.base.data_ptr()
    for kind, sync_step in (("regional", 2), ("global", 4), ("regional", 6)):
        blobs = []
        for core in (apart, inplace):
            while core.step < sync_step:
                core.train_step()
            blobs.append([bytes(b) for b in core.sync()])
        assert blobs[0] == blobs[1]
        assert apart.last_delta_norm == inplace.last_delta_norm
        sent = torch.frombuffer(bytearray(blobs[0][0][-4 * apart.numel :]), dtype=torch.float32)
        exact = float(torch.linalg.vector_norm(sent.double()))  # of the values sent
        assert exact > 0 and abs(inplace.last_delta_norm - exact) <= 1e-5 * exact
        assert inplace.base.data_ptr() == frame_ptr  # the delta lies where the base did
        _merge_both(apart, inplace, kind, sync_step, tau)
    left, right = apart.state_dict(), inplace.state_dict()
    for key in ("params", "base"):
        assert torch.equal(left[key], right[key])


def test_frame_base_is_only_for_a_delta_framed_in_place() -> None:
    """int8 (a lossy codec with a residual) keeps the base apart: nothing changes."""
    cfg = RunConfig().with_overrides(regional_codec="int8")
    _, theta0 = initial_parameters(cfg)
    core = _island(cfg, theta0)
    base = core.base
    assert not core.frame_base() and core.base is base


def test_no_delta_or_rejoin_state_is_made_of_a_base_a_merge_is_received_into() -> None:
    """From ``merge_target`` (a download into the base) until the merge is applied, the
    base is not a base: a sync or a rejoin state of it is refused, not made of garbage
    (a download that failed and was not fetched again).  The same after a delta was
    written over it (``frame_base``).  Applying the merge, or loading a state, ends it."""
    cfg = RunConfig().with_overrides(
        regional_codec="fp32", **{"steps": 4, "topology.h_r": 2, "topology.h_g": 2}
    )
    _, theta0 = initial_parameters(cfg)
    core = _island(cfg, theta0)
    saved = core.state_dict()
    core.train_step()
    core.train_step()
    core.merge_target()
    with pytest.raises(HypertrainError, match="not a base"):
        core.sync()
    with pytest.raises(HypertrainError, match="not a base"):
        core.state_dict()
    core.load_state_dict(saved)  # a restart from the rejoin state
    core.state_dict()
    core.train_step()
    core.train_step()
    assert core.frame_base()
    core.sync()  # the delta is written over the base
    with pytest.raises(HypertrainError, match="not a base"):
        core.state_dict()
    target = core.merge_target()
    target.copy_(theta0)
    core.apply_merge("global", target, 2)
    core.state_dict()


@pytest.mark.parametrize("extra", [-1, 0, 1, 777])
def test_a_norm_taken_segment_by_segment_is_the_same_bits_however_it_is_fed(extra: int) -> None:
    """``SegmentNorm``: fed one checksum segment at a time (as an island framing its delta
    in place does), or a whole vector at once (``of``, the other sync paths), the same
    bits; the L2 norm up to fp32 accumulation inside each segment (torch's: ~1e-5 of it
    here, where a whole-vector fp32 norm errs by ~3e-5)."""
    n = 2 * SegmentNorm.STEP + extra
    x = torch.randn(n, generator=torch.Generator().manual_seed(extra + 3)) * 1e-3
    fed = SegmentNorm()
    for start in range(0, n, SegmentNorm.STEP):
        fed.add(x[start : start + SegmentNorm.STEP].clone())
    assert fed.value() == SegmentNorm.of(x)
    exact = float(torch.linalg.vector_norm(x.double()))
    assert abs(SegmentNorm.of(x) - exact) <= 1e-4 * exact
    assert SegmentNorm.of(torch.zeros(0)) == 0.0


@pytest.mark.parametrize(
    "codec,beta,shards,tau",
    [
        ("int8", 1.0, 1, 0),
        ("int8", 0.9, 1, 1),
        ("sparseloco+zstd", 1.0, 1, 0),
        ("fp32", 1.0, 2, 0),  # lossless to relay shards: no residual kept
        ("int8", 1.0, 2, 0),
        ("int8", 0.9, 2, 1),
        ("sparseloco+zstd", 0.9, 2, 0),
    ],
)
def test_a_delta_over_the_base_is_the_same_blobs_and_state(
    codec: str, beta: float, shards: int, tau: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``delta_in_base`` (the island daemon, any codec ``frame_base`` does not frame in
    place): each sync's delta and error-feedback sum are computed over the base, the
    residual kept there and the base moved to the old residual's memory, where the merge
    is received.  The blobs, the residual, the norm and the state after each merge are
    those of ``sync`` without it, over several checksum segments; from the second sync
    on no model-sized buffer is new (the base and the residual trade their memory)."""
    monkeypatch.setattr(feedback_module, "CHECKSUM_SEGMENT", 4 * 4096)
    monkeypatch.setattr(SegmentNorm, "STEP", 4096)
    cfg = RunConfig().with_overrides(
        regional_codec=codec,
        ef_beta=beta,
        **{"steps": 12, "topology.h_r": 2, "topology.h_g": 4, "topology.tau": tau},
        **({"topology.relay_shards": shards} if shards > 1 else {}),
    )
    _, theta0 = initial_parameters(cfg)
    apart, over = _island(cfg, theta0), _island(cfg, theta0)
    assert not over.frame_base() and over.delta_in_base()
    for n, (kind, sync_step) in enumerate(
        (("regional", 2), ("global", 4), ("regional", 6), ("global", 8))
    ):
        blobs = []
        for core in (apart, over):
            while core.step < sync_step:
                core.train_step()
            if core is over:
                base_before = over.base.data_ptr()
                residual_before = None if over.feedback.is_zero else over.feedback.residual
            blobs.append([bytes(b) for b in core.sync()])
        assert blobs[0] == blobs[1]
        assert apart.last_delta_norm == over.last_delta_norm > 0
        assert torch.equal(apart.feedback.residual, over.feedback.residual)
        if over.feedback.is_zero:  # lossless: the base keeps its memory, spent
            assert over.base.data_ptr() == base_before
        else:  # the residual in the base's memory, the base in the old residual's
            assert over.feedback.residual.data_ptr() == base_before
            assert over.base.data_ptr() != base_before
            if residual_before is not None:
                assert over.base.data_ptr() == residual_before.data_ptr()
            else:
                assert n == 0  # new memory once, at the first sync
            del residual_before
        _merge_both(apart, over, kind, sync_step, tau)
    left, right = apart.state_dict(), over.state_dict()
    for key in ("params", "base"):
        assert torch.equal(left[key], right[key])
    assert torch.equal(apart.feedback.residual, over.feedback.residual)
    # A rejoin from that state: the first sync after it trades memory again, same bits.
    back = _island(cfg, theta0)
    assert back.delta_in_base()
    back.load_state_dict(right)
    for core in (apart, back):
        while core.step < 10:
            core.train_step()
    assert [bytes(b) for b in apart.sync()] == [bytes(b) for b in back.sync()]
    assert torch.equal(apart.feedback.residual, back.feedback.residual)


def test_a_delta_over_the_base_that_fails_to_encode_keeps_the_residual() -> None:
    """An encode that refuses the delta (a value not finite) leaves the residual as it
    was and the base spent (no delta or state is made of it until a merge), as the fp32
    path in the base does."""
    cfg = RunConfig().with_overrides(
        regional_codec="int8", **{"steps": 8, "topology.h_r": 2, "topology.h_g": 4}
    )
    _, theta0 = initial_parameters(cfg)
    core = _island(cfg, theta0)
    assert core.delta_in_base()
    while core.step < 2:
        core.train_step()
    core.sync()
    target = core.merge_target()
    target.copy_(core.params())
    core.apply_merge("regional", target, 2)
    residual = core.feedback.residual.clone()
    while core.step < 4:
        core.train_step()
    with torch.no_grad():
        next(core.model.parameters()).view(-1)[3] = float("nan")
    with pytest.raises(HypertrainError, match=r"NaN or inf"):
        core.sync()
    assert torch.equal(core.feedback.residual, residual)
    with pytest.raises(HypertrainError, match="holds a delta"):
        core.state_dict()
    with pytest.raises(HypertrainError, match="holds a delta"):
        core.sync()


def test_delta_in_base_is_not_for_a_delta_framed_in_place() -> None:
    cfg = RunConfig().with_overrides(regional_codec="fp32")
    _, theta0 = initial_parameters(cfg)
    assert not _island(cfg, theta0).delta_in_base()  # frame_base's case
