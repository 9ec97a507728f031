"""Model presets, seeded init, flat layout, digests, WSD schedule and LAWA."""

import itertools

import pytest
import torch

from hypertrain.common.digest import state_digest, tensor_digest
from hypertrain.common.errors import ConfigError
from hypertrain.common.flat import ParamLayout
from hypertrain.common.model import PRESETS, ModelConfig, build_model, count_parameters
from hypertrain.common.optim import LAWA, InnerConfig, InnerOptimizer, wsd_factor


def test_presets_have_the_registered_shapes() -> None:
    assert PRESETS["proxy"].n_layer == 4 and PRESETS["proxy"].d_model == 128
    assert PRESETS["proxy"].seq_len == 256
    assert 110e6 < count_parameters(build_model("gpt-125m")) < 135e6


def test_init_is_a_function_of_the_seed() -> None:
    a, b, c = build_model("tiny", seed=3), build_model("tiny", seed=3), build_model("tiny", seed=4)
    la = ParamLayout.of(a)
    assert torch.equal(la.flatten(a), la.flatten(b))
    assert not torch.equal(la.flatten(a), la.flatten(c))


def test_flat_round_trip_and_layout_order() -> None:
    m = build_model("tiny", seed=0)
    layout = ParamLayout.of(m)
    assert list(layout.names) == sorted(layout.names)
    flat = layout.flatten(m)
    other = build_model("tiny", seed=9)
    layout.load(other, flat)
    assert torch.equal(layout.flatten(other), flat)
    views = layout.unflatten(flat)
    assert set(views) == set(layout.names)
    assert views["wte.weight"].shape == (256, 64)


def test_consuming_flatten_releases_memory_as_it_goes_with_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``flatten(consume=True, release=...)`` frees each parameter once copied and calls
    ``release`` after every ``RELEASE_BYTES`` freed and at the end (a daemon gives the heap
    back there), and the vector is the one a plain flatten gives."""
    import hypertrain.common.flat as flat_module

    cfg = ModelConfig(n_layer=2, d_model=64, n_head=4, seq_len=16, vocab_size=256)
    expected = ParamLayout.of(build_model(cfg, seed=3)).flatten(build_model(cfg, seed=3))
    model = build_model(cfg, seed=3)
    layout = ParamLayout.of(model)
    monkeypatch.setattr(flat_module, "RELEASE_BYTES", 64 << 10)
    calls: list[int] = []

    def release() -> None:  # what is still held when release is called
        calls.append(sum(p.numel() for p in model.parameters()))

    got = layout.flatten(model, consume=True, release=release)
    assert torch.equal(got, expected)
    assert len(calls) >= expected.numel() * 4 // (64 << 10)
    assert calls == sorted(calls, reverse=True) and calls[-1] == 0  # all freed at the end
    assert all(p.numel() == 0 for p in model.parameters())


def test_a_bound_model_reads_the_flat_vector_itself() -> None:
    """``bind`` (the aggregator's evaluation): parameters become views of the vector, so
    the model gives the same logits as a loaded copy without holding one."""
    m = build_model("tiny", seed=0).eval()
    layout = ParamLayout.of(m)
    flat = layout.flatten(build_model("tiny", seed=5))
    copy, bound = build_model("tiny", seed=1).eval(), build_model("tiny", seed=2).eval()
    layout.load(copy, flat)
    layout.bind(bound, flat)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(copy(tokens), bound(tokens))
    for p in bound.parameters():
        base = p.untyped_storage().data_ptr()
        assert flat.untyped_storage().data_ptr() == base  # no copy of its own
    with pytest.raises(ConfigError, match="parameters"):
        layout.bind(bound, flat[:-1])


def test_causality_future_tokens_do_not_change_past_logits() -> None:
    m = build_model("tiny", seed=0).eval()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 256
    with torch.no_grad():
        assert torch.equal(m(x)[:, :10], m(y)[:, :10])
        assert not torch.equal(m(x)[:, 10:], m(y)[:, 10:])


def test_bad_model_config_is_named() -> None:
    with pytest.raises(ConfigError, match="n_head"):
        ModelConfig(n_layer=1, d_model=10, n_head=3, seq_len=8)
    with pytest.raises(ConfigError, match="unknown model preset"):
        build_model("huge")


def test_digest_covers_dtype_shape_name_and_bits() -> None:
    t = torch.arange(12, dtype=torch.float32)
    base = state_digest({"a": t})
    assert state_digest({"a": t.clone()}) == base
    assert state_digest({"b": t}) != base
    assert state_digest({"a": t.view(3, 4)}) != base
    assert state_digest({"a": t.double()}) != base
    u = t.clone()
    u.view(torch.int32)[5] ^= 1  # one flipped mantissa bit
    assert state_digest({"a": u}) != base


def test_digest_of_multichunk_tensor_is_thread_independent() -> None:
    t = torch.randn(3 * (1 << 18) + 5)  # > 3 chunks of 1 MiB
    assert tensor_digest(t) == tensor_digest(t, parallel=False)


def test_wsd_schedule_shape() -> None:
    cfg = InnerConfig(warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.1)
    f = [wsd_factor(s, 100, cfg) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == 1.0
    assert all(x == 1.0 for x in f[10:80])
    assert all(a > b for a, b in itertools.pairwise(f[80:]))
    assert f[99] == pytest.approx(0.1)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_inner_optimizers_learn_and_restore_exactly(name: str) -> None:
    torch.manual_seed(0)
    x = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(1))

    def make() -> tuple[torch.nn.Module, InnerOptimizer]:
        m = build_model("tiny", seed=0)
        return m, InnerOptimizer(m, InnerConfig(name=name, lr=3e-3, warmup_steps=0))

    m, opt = make()
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = m.loss(x)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    m2, opt2 = make()
    layout = ParamLayout.of(m)
    layout.load(m2, layout.flatten(m))
    opt2.load_state_dict(opt.state_dict())
    for mm, oo in ((m, opt), (m2, opt2)):
        oo.zero_grad()
        mm.loss(x).backward()
        oo.step()
    assert torch.equal(layout.flatten(m), layout.flatten(m2))


def test_lawa_is_the_mean_of_the_last_k() -> None:
    lawa = LAWA(k=2)
    for v in (1.0, 2.0, 4.0):
        lawa.add(torch.full((3,), v))
    assert torch.equal(lawa.average(), torch.full((3,), 3.0))
