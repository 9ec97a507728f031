"""The training step holds less working memory than before and changes no bit.

``PiecewiseAdamW`` is torch's AdamW to the bit (last test).

The plain formulation is ``F.cross_entropy(model(inputs), targets)`` with every block's
activations kept: what the training step computed before (and what any other
implementation of the model computes).  The loss value and every parameter's gradient
must be equal to it bit for bit, with and without block recomputation, at shapes whose
rows fill no whole piece of ``MeanCrossEntropy``'s work and at the gpt-125m head."""

import pytest
import torch
import torch.nn.functional as F

from hypertrain.common import model as model_mod
from hypertrain.common import optim as optim_mod
from hypertrain.common.model import (
    GPT,
    PRESETS,
    MeanCrossEntropy,
    ModelConfig,
    TiedLookup,
    activation_bytes,
    recomputes,
)
from hypertrain.common.optim import InnerConfig, InnerOptimizer, PiecewiseAdamW, wsd_factor


def plain_loss(m: GPT, windows: torch.Tensor) -> torch.Tensor:
    logits = m(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


def grads(m: GPT) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    return out


def windows_for(cfg: ModelConfig, batch: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)


CASES = [
    ("tiny x 8", PRESETS["tiny"], 8),
    ("tiny x 1", PRESETS["tiny"], 1),
    ("odd rows", ModelConfig(n_layer=2, d_model=64, n_head=4, seq_len=77, vocab_size=1000), 3),
]


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
@pytest.mark.parametrize(("name", "cfg", "batch"), CASES, ids=[c[0] for c in CASES])
def test_the_loss_and_every_gradient_are_the_plain_formulations_to_the_bit(
    monkeypatch: pytest.MonkeyPatch, name: str, cfg: ModelConfig, batch: int, recompute: bool
) -> None:
    m = GPT(cfg, seed=1)
    x = windows_for(cfg, batch, seed=3)
    ref = plain_loss(m, x)
    ref.backward()
    want = grads(m)
    monkeypatch.setattr(model_mod, "ACTIVATION_BUDGET_BYTES", 0 if recompute else 1 << 40)
    monkeypatch.setattr(model_mod, "LOGITS_BUDGET_BYTES", 0)  # MeanCrossEntropy, always
    monkeypatch.setattr(model_mod, "TIED_BUDGET_BYTES", 0)  # TiedLookup, always
    assert recomputes(cfg, batch) is recompute
    got = m.loss(x)
    got.backward()
    have = grads(m)
    assert got.item() == ref.item() and got.dtype == ref.dtype
    assert set(have) == set(want)
    for n in want:
        assert torch.equal(have[n], want[n]), n


def test_the_gpt_125m_head_is_the_plain_cross_entropy_to_the_bit() -> None:
    """The head alone at gpt-125m's size (1024 positions x 50,304 logits): the vocabulary
    where the pieces matter, without the trunk's seconds of compute."""
    gen = torch.Generator().manual_seed(5)
    v = PRESETS["gpt-125m"].vocab_size
    logits = (torch.randn(1024, v, generator=gen) * 3).requires_grad_()
    targets = torch.randint(0, v, (1024,), generator=gen)
    ref = F.cross_entropy(logits, targets)
    (want,) = torch.autograd.grad(ref, logits)
    lean = logits.detach().clone().requires_grad_()
    got = MeanCrossEntropy.apply(lean * 1, targets)  # an intermediate, as in GPT.loss
    (have,) = torch.autograd.grad(got, lean)
    assert got.item() == ref.item()
    assert torch.equal(have, want)


@pytest.mark.parametrize(
    ("vocab", "dim", "tokens", "distinct"),
    [(50_304, 768, 1024, 50_304), (50_304, 16, 4096, 300), (70, 8, 3, 70)],
    ids=["gpt-125m", "repeats", "few"],
)
def test_the_tied_sum_is_autograds_to_the_bit(
    vocab: int, dim: int, tokens: int, distinct: int
) -> None:
    """The head's gradient (signed zeros included) plus the embedding's, with tokens
    repeated many times: autograd's own sum of a tied weight's two gradients, to the bit
    (compared as integers, so that -0.0 and +0.0 differ)."""
    gen = torch.Generator().manual_seed(7)
    idx = torch.randint(0, distinct, (tokens,), generator=gen)
    rows_grad = torch.randn(tokens, dim, generator=gen)
    rows_grad[::7] = -0.0
    head_grad = torch.randn(vocab, dim, generator=gen)
    head_grad[1::5], head_grad[2::11] = -0.0, 0.0
    weight = torch.zeros(vocab, dim, requires_grad=True)
    (F.embedding(idx, weight) * rows_grad).sum().add((weight * head_grad).sum()).backward()
    want = weight.grad
    weight.grad = None
    head = weight.detach().requires_grad_()
    x = TiedLookup.apply(idx, weight, (head,))
    (x * rows_grad).sum().add((head * head_grad).sum()).backward()
    assert weight.grad is not None and head.grad is None
    assert torch.equal(weight.grad.view(torch.int32), want.view(torch.int32))


def test_the_tied_sum_adds_into_a_gradient_already_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two backward passes without zeroing (gradients accumulated over micro-batches):
    the same bits as autograd's own sums."""
    cfg = PRESETS["tiny"]
    x, y = windows_for(cfg, 2, seed=3), windows_for(cfg, 2, seed=4)
    m = GPT(cfg, seed=1)
    for w in (x, y):
        m.loss(w).backward()
    want = grads(m)
    monkeypatch.setattr(model_mod, "TIED_BUDGET_BYTES", 0)
    for w in (x, y):
        m.loss(w).backward()
    have = grads(m)
    for n in want:
        assert torch.equal(have[n], want[n]), n


def test_a_gradient_that_skips_the_tied_head_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.autograd.grad`` does not store the head's gradient: rather than a wrong
    embedding gradient without the head's part, the backward pass refuses."""
    monkeypatch.setattr(model_mod, "TIED_BUDGET_BYTES", 0)
    m = GPT(PRESETS["tiny"], seed=1)
    loss = m.loss(windows_for(PRESETS["tiny"], 2, seed=3))
    with pytest.raises(RuntimeError, match=r"not torch\.autograd\.grad"):
        torch.autograd.grad(loss, [m.wte.weight])


def test_a_second_backward_through_the_overwritten_logits_is_refused() -> None:
    logits = torch.randn(5, 7).requires_grad_()
    loss = MeanCrossEntropy.apply(logits * 2, torch.tensor([0, 1, 2, 3, 4]))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_recomputation_starts_where_the_activations_pass_the_budget() -> None:
    gpt = PRESETS["gpt-125m"]
    assert activation_bytes(gpt, 1) == 4 * 16 * 1024 * 768 * 12
    assert recomputes(gpt, 1)
    assert not recomputes(PRESETS["proxy"], 32) and recomputes(PRESETS["proxy"], 33)
    assert not recomputes(PRESETS["tiny"], 512) and recomputes(PRESETS["tiny"], 513)


def test_evaluation_does_not_recompute_or_keep_anything() -> None:
    m = GPT(PRESETS["tiny"], seed=0)
    x = windows_for(PRESETS["tiny"], 2, seed=1)
    with torch.no_grad():
        value = m.loss(x)
    assert not value.requires_grad
    assert value.item() == plain_loss(m, x).item()


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_the_piecewise_adamw_step_is_torch_adamws_to_the_bit(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Pieces of 1000 elements (the tiny model's embeddings and matrices are split, some
    with a short last piece; its gains are not), weight decay on the matrices, warmup and
    clipping: six steps of the island's optimizer against torch's AdamW on a copy, every
    parameter and every moment equal, and the state dicts interchangeable."""
    monkeypatch.setattr(optim_mod, "ADAM_PIECE", 1000)
    cfg = InnerConfig(name=name, lr=3e-3, warmup_steps=3, grad_clip=0.5)
    x = windows_for(PRESETS["tiny"], 4, seed=2)
    ours_m, theirs_m = GPT(PRESETS["tiny"], seed=0), GPT(PRESETS["tiny"], seed=0)
    ours = InnerOptimizer(ours_m, cfg)
    theirs = InnerOptimizer(theirs_m, cfg)
    adamw = theirs.optimizers[-1]
    theirs.optimizers[-1] = torch.optim.AdamW(adamw.param_groups, foreach=False)
    assert type(ours.optimizers[-1]) is PiecewiseAdamW
    for step in range(6):
        for m, opt in ((ours_m, ours), (theirs_m, theirs)):
            opt.set_lr_factor(wsd_factor(step, 6, cfg))
            opt.zero_grad()
            m.loss(x).backward()
            opt.step()
    for (n, a), (_, b) in zip(
        sorted(ours_m.named_parameters()), sorted(theirs_m.named_parameters()), strict=True
    ):
        assert torch.equal(a, b), n
    mine, torchs = ours.state_dict(), theirs.state_dict()
    for sa, sb in zip(mine[-1]["state"].values(), torchs[-1]["state"].values(), strict=True):
        assert set(sa) == set(sb) == {"step", "exp_avg", "exp_avg_sq"}
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
    ours.load_state_dict(torchs)  # AdamW's state dict is the piecewise optimizer's
