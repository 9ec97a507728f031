"""Robust regional rules (RobustConfig): each against a by-hand computation, bit for bit;
the plain mean unchanged byte for byte; a hostile delta's reach on each rule; the
absolute norm bound at acceptance, taped as evidence."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from hypertrain.common.aggregate import MERGE_RANGE, delta_norm, streamed_mean
from hypertrain.common.codec import make_codec
from hypertrain.common.config import RobustConfig, RunConfig
from hypertrain.common.digest import blob_digest
from hypertrain.common.errors import ConfigError
from hypertrain.common.roles import initial_parameters
from hypertrain.common.rounds.machines import INVALID, Delta
from hypertrain.common.rounds.node import MAX_TAPED_REASON, RelayNode
from hypertrain.common.rounds.store import NodeStore
from hypertrain.common.trust.keys import SigningKey, TrustedKeys
from hypertrain.common.trust.schema import RejectionEntry
from hypertrain.common.trust.tape import verify_tape

CODEC = make_codec("fp32")
N = 1000


def _deltas(k: int, outlier: float | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {f"eu-{i}": torch.randn(N, generator=g) * 1e-3 for i in range(k)}
    if outlier is not None:
        out[f"eu-{k - 1}"] = out[f"eu-{k - 1}"] * outlier
    return out


def _mean(
    deltas: dict[str, torch.Tensor], robust: RobustConfig | None
) -> tuple[torch.Tensor, object]:
    inputs = {m: CODEC.encode(x) for m, x in deltas.items()}
    out = torch.empty(N)
    commitment = streamed_mean(inputs, CODEC, (N,), out=out, robust=robust)
    return out, commitment


def test_the_plain_mean_is_unchanged_by_a_default_robust_config() -> None:
    deltas = _deltas(4)
    a, ca = _mean(deltas, None)
    b, cb = _mean(deltas, RobustConfig())
    assert torch.equal(a, b) and ca == cb and cb.robust is None  # type: ignore[attr-defined]
    assert "robust" not in RunConfig().to_dict()


def test_trimmed_mean_leaves_out_each_coordinates_extremes() -> None:
    deltas = _deltas(5, outlier=1e6)
    got, c = _mean(deltas, RobustConfig(rule="trimmed_mean", trim=1))
    rows = torch.sort(torch.stack([deltas[m] for m in sorted(deltas)]), dim=0, stable=True).values
    want = torch.zeros(N)
    for row in rows[1:4]:
        want.add_(row)
    assert torch.equal(got, want.div_(3))
    assert got.abs().max() < 1e-2  # the outlier's 1e3-sized values are gone
    assert c.robust["trim"] == 1 and c.members == tuple(sorted(deltas))  # type: ignore[attr-defined]
    few, c2 = _mean(_deltas(2), RobustConfig(rule="trimmed_mean", trim=3))
    assert c2.robust["trim"] == 0  # type: ignore[attr-defined]  # too few to trim: the mean
    assert torch.equal(few, _mean(_deltas(2), None)[0])


def test_clip_scales_each_delta_to_a_multiple_of_the_median_norm() -> None:
    deltas = _deltas(4, outlier=50.0)
    got, c = _mean(deltas, RobustConfig(rule="clip", clip=2.0))
    norms = {m: math.sqrt(float(x.double().square().sum())) for m, x in deltas.items()}
    bound = 2.0 * sorted(norms.values())[1]  # median_low of 4
    want = torch.zeros(N)
    for m in sorted(deltas):
        x = deltas[m].clone()
        if norms[m] > bound:
            x.mul_(bound / norms[m])
        want.add_(x)
    assert torch.equal(got, want.div_(4))
    rec = c.robust  # type: ignore[attr-defined]
    assert rec["rule"] == "clip" and float(rec["clip_norm"]) == bound
    assert {m: float(v) for m, v in rec["norms"].items()} == pytest.approx(norms, rel=1e-12)


def test_norm_median_leaves_a_far_delta_out_and_names_it() -> None:
    deltas = _deltas(4, outlier=10.0)
    got, c = _mean(deltas, RobustConfig(norm_median=3.0))
    kept = {m: x for m, x in deltas.items() if m != "eu-3"}
    assert torch.equal(got, _mean(kept, None)[0])
    assert c.members == ("eu-0", "eu-1", "eu-2")  # type: ignore[attr-defined]
    assert c.robust["left_out"] == ["eu-3"] and "bound" in c.robust  # type: ignore[attr-defined]
    assert c.digest != _mean(kept, None)[1].digest  # type: ignore[attr-defined]  # the record is bound


def test_delta_norm_is_the_decoded_deltas_l2_norm() -> None:
    x = torch.randn(3 * N)
    for spec in ("fp32", "int8", "sparseloco:density=0.1,value_bits=4,chunk=64"):
        codec = make_codec(spec)
        blob = codec.encode(x)
        header, prepared = codec.open(blob, (3 * N,))
        decoded = codec.decode(blob).double()
        assert delta_norm(codec, header, prepared, 3 * N) == pytest.approx(
            float(decoded.norm()), rel=1e-12
        )


@pytest.mark.parametrize(
    "fields,words",
    [
        ({"rule": "median"}, "rule must be one of mean, clip, trimmed_mean"),
        ({"rule": "clip", "clip": 0.5}, "clip must be >= 1"),
        ({"max_norm": -1.0}, "max_norm must be a finite number >= 0"),
        ({"norm_median": 0.5}, "norm_median must be 0 (off) or >= 1"),
        ({"trim": 0}, "trim must be an integer >= 1"),
    ],
)
def test_bad_robust_configs_are_refused_naming_the_field(fields: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        RunConfig.from_dict({"robust": fields})


def test_robust_rules_refuse_relay_shards() -> None:
    with pytest.raises(ConfigError, match="not with relay_shards > 1"):
        RunConfig.from_dict({"robust": {"rule": "clip"}, "topology": {"relay_shards": 2}})


def test_a_delta_over_max_norm_is_refused_with_its_norm_and_taped_as_evidence(
    tmp_path: Path,
) -> None:
    cfg = MACHINE_CFG.with_overrides(**{"robust.max_norm": 1.0})
    theta0 = initial_parameters(cfg)[1]
    key = SigningKey.generate("relay-eu")
    node = RelayNode(cfg, "eu", theta0, NodeStore(tmp_path, cfg.run_id, key))
    big = _delta_of(cfg, torch.full((theta0.numel(),), 0.5), "eu-1")  # norm 0.5 sqrt(n) > 1
    decision, _ = node.push(big)
    norm = 0.5 * math.sqrt(theta0.numel())
    assert decision.code == INVALID and decision.evidence
    assert "robust.max_norm" in decision.reason and "L2 norm" in decision.reason
    assert float(decision.reason.split("L2 norm ")[1].split()[0]) == pytest.approx(norm, rel=1e-3)
    small = _delta_of(cfg, torch.full((theta0.numel(),), 1e-4), "eu-0")
    assert node.push(small)[0].accepted  # under the bound
    node.close()
    entries = verify_tape(tmp_path / "tape", TrustedKeys.of([key])).entries
    rejections = [RejectionEntry.from_body(e.body) for e in entries if e.kind == "rejection"]
    assert [(r.sender, r.digest) for r in rejections] == [("eu-1", big.digest)]
    assert "robust.max_norm" in rejections[0].reason


def test_a_codec_failing_on_crafted_bytes_refuses_the_delta_and_the_node_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception from a codec's validation that is not a CodecError (a bug crafted
    bytes reach) refuses the delta, changing nothing, instead of escaping ``push``, which
    a daemon takes for a store failure and ends on.  A MemoryError is not a refusal."""
    cfg = MACHINE_CFG
    theta0 = initial_parameters(cfg)[1]
    node = RelayNode(cfg, "eu", theta0, NodeStore(tmp_path, cfg.run_id, SigningKey.generate("r")))
    codec = node.machine.level.codec
    good = _delta_of(cfg, torch.full((theta0.numel(),), 1e-4), "eu-0")

    def buggy(*args: object) -> float:
        raise IndexError("index 7 is out of bounds")

    monkeypatch.setattr(codec, "magnitude", buggy)
    decision, effects = node.push(good)
    assert decision.code == INVALID and not effects
    assert "could not be validated (IndexError: index 7 is out of bounds)" in decision.reason

    def no_memory(*args: object) -> float:
        raise MemoryError

    monkeypatch.setattr(codec, "magnitude", no_memory)
    with pytest.raises(MemoryError):
        node.push(good)
    monkeypatch.undo()
    assert node.push(good)[0].accepted  # nothing was counted before
    node.close()


def test_a_taped_refusal_quotes_at_most_max_taped_reason_characters(tmp_path: Path) -> None:
    cfg = MACHINE_CFG
    theta0 = initial_parameters(cfg)[1]
    key = SigningKey.generate("relay-eu")
    node = RelayNode(cfg, "eu", theta0, NodeStore(tmp_path, cfg.run_id, key))
    bad = _delta_of(cfg, torch.full((theta0.numel(),), 1e-4), "eu-0")
    bad = dataclasses.replace(bad, run_id="x" * 100_000)
    decision, _ = node.push(bad)
    assert decision.code == INVALID and len(decision.reason) > 100_000 and node.refusal_taped
    node.close()
    entries = verify_tape(tmp_path / "tape", TrustedKeys.of([key])).entries
    (rejection,) = [RejectionEntry.from_body(e.body) for e in entries if e.kind == "rejection"]
    assert (
        rejection.reason
        == f"{decision.reason[:MAX_TAPED_REASON]}... ({len(decision.reason)} characters)"
    )


def _delta_of(cfg: RunConfig, x: torch.Tensor, sender: str, step: int = 5) -> Delta:
    codec = make_codec(cfg.regional_codec)
    data = codec.encode(x)
    return Delta(cfg.run_id, 0, step, sender, blob_digest(data), str(codec.spec), data)


MACHINE_CFG = RunConfig.from_dict(
    {
        "steps": 20,
        "regional_codec": "int8",
        "topology": {"regions": ["eu"], "islands_per_region": 2, "h_r": 5, "h_g": 10},
    }
)


def test_delta_norm_has_the_same_bits_whatever_the_thread_count() -> None:
    codec = make_codec("int8")
    n = 3_000_000  # large enough for torch to split a reduction between threads
    blob = codec.encode(torch.randn(n, generator=torch.Generator().manual_seed(3)))
    header, prepared = codec.open(blob, (n,))
    before = torch.get_num_threads()
    try:
        norms = set()
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            norms.add(delta_norm(codec, header, prepared, n))
    finally:
        torch.set_num_threads(before)
    assert len(norms) == 1


def test_trimmed_mean_over_several_ranges_matches_the_whole_by_hand() -> None:
    n = MERGE_RANGE + 1000  # a whole range, then a short one (the rows buffer is reused)
    g = torch.Generator().manual_seed(11)
    deltas = {f"eu-{i}": torch.randn(n, generator=g) for i in range(3)}
    inputs = {m: CODEC.encode(x) for m, x in deltas.items()}
    out = torch.empty(n)
    streamed_mean(inputs, CODEC, (n,), out=out, robust=RobustConfig(rule="trimmed_mean"))
    rows = torch.sort(torch.stack([deltas[m] for m in sorted(deltas)]), dim=0, stable=True)
    assert torch.equal(out, rows.values[1].clone().div_(1))  # the middle of three
