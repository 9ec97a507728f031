"""Outer optimizers: torch SGD(nesterov) parity bit for bit, exact state round trip."""

import io

import pytest
import torch

from hypertrain.common.errors import ConfigError
from hypertrain.common.outer import NesterovOuter, OuterConfig, make_outer


def _pseudo_grads(n: int, numel: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) * 10 ** (-i % 4) for i in range(n)]


@pytest.mark.parametrize("eta,mu", [(0.7, 0.9), (1.0, 0.0), (0.4, 0.5), (0.123, 0.99)])
@pytest.mark.parametrize("foreach", [False, True])
def test_nesterov_equals_torch_sgd_bit_for_bit(eta: float, mu: float, foreach: bool) -> None:
    theta0 = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    ours = theta0.clone()
    outer = NesterovOuter(OuterConfig(eta=eta, mu=mu))
    ref = torch.nn.Parameter(theta0.clone())
    sgd = torch.optim.SGD([ref], lr=eta, momentum=mu, nesterov=mu > 0, foreach=foreach)
    for g in _pseudo_grads(6, 1000, seed=2):
        outer.step(ours, g)
        ref.grad = g.clone()
        sgd.step()
        assert torch.equal(ours, ref.detach()), "diverged from torch.optim.SGD"


def test_state_round_trip_is_exact() -> None:
    cfg = OuterConfig(eta=0.7, mu=0.9)
    grads = _pseudo_grads(8, 257, seed=3)
    a_theta, b_theta = torch.zeros(257), torch.zeros(257)
    a = make_outer(cfg)
    for g in grads[:4]:
        a.step(a_theta, g)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b = make_outer(cfg)
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    b_theta.copy_(a_theta)
    for g in grads[4:]:
        a.step(a_theta, g)
        b.step(b_theta, g)
    assert torch.equal(a_theta, b_theta)
    assert a.state_dict()["steps"] == b.state_dict()["steps"] == 8


def test_average_is_plain_mean_step() -> None:
    theta = torch.tensor([1.0, 2.0, 3.0])
    make_outer(OuterConfig(name="average", eta=0.3)).step(theta, torch.tensor([0.5, 0.5, -1.0]))
    assert torch.equal(theta, torch.tensor([0.5, 1.5, 4.0]))
    assert OuterConfig(name="average").to_dict()["eta"] == 1.0


def test_sparseloco_outer_has_no_momentum() -> None:
    theta = torch.zeros(3)
    opt = make_outer(OuterConfig(name="sparseloco", eta=0.5))
    for _ in range(2):
        opt.step(theta, torch.tensor([1.0, 0.0, -2.0]))
    assert torch.equal(theta, torch.tensor([-1.0, 0.0, 2.0]))


@pytest.mark.parametrize(
    "kwargs,msg",
    [({"name": "adam"}, "unknown optimizer"), ({"eta": 0.0}, "eta"), ({"mu": 1.0}, "mu")],
)
def test_bad_config_is_named(kwargs: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        OuterConfig(**kwargs)


@pytest.mark.parametrize("name", ["nesterov", "average", "sparseloco"])
@pytest.mark.parametrize("numel,width", [(1000, 96), (300_007, 65_536), (70_001, 70_001)])
def test_a_step_taken_range_by_range_has_the_bits_of_the_whole_step(
    name: str, numel: int, width: int
) -> None:
    """The aggregator streams its mean through the outer step one range at a time, into
    a new tensor: every range boundary, odd tails included, gives the whole step's bits."""
    cfg = OuterConfig(name=name, eta=0.7, mu=0.9)
    theta0 = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    whole, ranged = make_outer(cfg), make_outer(cfg)
    a, b = theta0.clone(), theta0.clone()
    for g in _pseudo_grads(4, numel, seed=4):
        whole.step(a, g)
        ranged.begin(numel)
        new = torch.empty_like(b)
        for start in range(0, numel, width):
            end = min(numel, start + width)
            ranged.step_range(start, b[start:end], g[start:end], new[start:end])
        ranged.end()
        b = new
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for key, value in whole.state_dict().items():
        other = ranged.state_dict()[key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
