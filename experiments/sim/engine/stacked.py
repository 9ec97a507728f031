"""``GPT.loss`` for N replicas at once: the batched path's forward (batched matmuls).

``StackedGPT.losses(params, windows)`` computes, for parameters stacked along a
leading replica dimension (``[N, *shape]``, the names of common/model.py) and
windows ``[N, b, T+1]``, the N per-replica losses of ``GPT.loss``.  It follows
``GPT.forward`` line by line, with every per-replica linear layer as one
``torch.bmm`` over N (the kernels that make N small models one large job).

Why not ``torch.vmap`` over ``functional_call``: vmap reduces LayerNorm
parameter gradients in another order than LayerNorm's own backward kernel
(ulp-level differences), and Muon's bf16 Newton-Schulz turns ulps into visible
drift; vmap also has no batching rule for CPU flash attention.  Here the
op-level choices are made so that every gradient is bit-identical to the
per-replica path's (tests/unit/test_sim_engine.py):

- linear layers: ``bmm`` over ``[N, b*T, d]``, which per replica is the ``mm``
  ``F.linear`` runs on ``[b*T, d]`` (for N = 1, ``F.linear`` itself);
- attention: one ``scaled_dot_product_attention`` over ``N*b`` sequences with
  the per-sequence memory layout of ``Block.forward``;
- LayerNorm and the cross-entropy: the native kernels, called per replica (their
  reductions over tokens are what vmap or a fused batch would reorder);
- token embedding: one lookup into the ``[N*V, d]`` table with per-replica offsets.

Invariants (guards against drift from common/model.py): the constructor refuses a
model whose classes or parameter shapes are not the ones mirrored here, and
``check_against`` compares ``losses`` with ``GPT.loss`` on real data (the batched
path calls it once per job).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hypertrain.common.errors import HypertrainError
from hypertrain.common.model import GPT, Block, ModelConfig

_BLOCK = ("ln1", "qkv", "proj", "ln2", "fc", "fc_out")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The parameter names and shapes ``StackedGPT`` mirrors."""
    d, h = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    out: dict[str, tuple[int, ...]] = {
        "wte.weight": (cfg.vocab_size, d),
        "wpe.weight": (cfg.seq_len, d),
        "ln_f.weight": (d,),
        "ln_f.bias": (d,),
    }
    for i in range(cfg.n_layer):
        p = f"blocks.{i}."
        out.update({p + "ln1.weight": (d,), p + "ln1.bias": (d,), p + "ln2.weight": (d,)})
        out.update({p + "ln2.bias": (d,), p + "qkv.weight": (3 * d, d), p + "proj.weight": (d, d)})
        out.update({p + "fc.weight": (h, d), p + "fc_out.weight": (d, h)})
    return out


class StackedGPT:
    """N replicas of one ``GPT`` architecture, computed together (see the module docstring)."""

    def __init__(self, template: GPT) -> None:
        cfg = template.cfg
        shapes = {name: tuple(p.shape) for name, p in template.named_parameters()}
        blocks_ok = all(type(b) is Block for b in template.blocks)
        if type(template) is not GPT or not blocks_ok or shapes != expected_shapes(cfg):
            raise HypertrainError(
                "batched path: the model is not the GPT that sim/engine/stacked.py mirrors "
                "(classes or parameter shapes changed); update StackedGPT"
            )
        self.cfg = cfg
        norms = [m for m in template.modules() if isinstance(m, nn.LayerNorm)]
        self.eps = norms[0].eps
        if any(m.eps != self.eps or not m.elementwise_affine for m in norms):
            raise HypertrainError("batched path: LayerNorms differ from the mirrored ones")

    @staticmethod
    def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x [N, rows, in] @ w [N, out, in]^T`` per replica: one ``bmm``, or for N = 1 the
        very ``F.linear`` of the per-replica path (bmm of one matrix can be a slower kernel)."""
        if x.shape[0] == 1:
            return F.linear(x.squeeze(0), w.squeeze(0))[None]
        return torch.bmm(x, w.transpose(1, 2))

    def _ln(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """LayerNorm per replica with the native kernel (bit-equal parameter gradients)."""
        # unbind, not x[i]: select's backward would zero-fill a full [N, ...] gradient per replica
        d = x.shape[-1]
        if x.shape[0] == 1:  # squeeze's backward is a view: no copy of the gradient
            return F.layer_norm(x.squeeze(0), (d,), w.squeeze(0), b.squeeze(0), self.eps)[None]
        parts = zip(x.unbind(0), w.unbind(0), b.unbind(0), strict=True)
        out = [F.layer_norm(xi, (d,), wi, bi, self.eps) for xi, wi, bi in parts]
        return torch.stack(out)

    def losses(self, params: dict[str, torch.Tensor], windows: torch.Tensor) -> torch.Tensor:
        """Per-replica ``GPT.loss`` for stacked ``params`` and windows ``[N, b, T+1]`` -> ``[N]``."""
        idx, targets = windows[..., :-1], windows[..., 1:]
        n, b, t = idx.shape
        if t > self.cfg.seq_len:
            raise HypertrainError(f"model: sequence of {t} tokens exceeds {self.cfg.seq_len}")
        wte = params["wte.weight"]
        vocab, d = wte.shape[1:]
        nh = self.cfg.n_head
        offsets = (torch.arange(n, device=idx.device) * vocab).view(n, 1, 1)
        x = F.embedding(idx + offsets, wte.reshape(n * vocab, d))
        x = (x + params["wpe.weight"][:, None, :t, :]).reshape(n, b * t, d)
        for i in range(self.cfg.n_layer):
            p = {k: params[f"blocks.{i}.{k}.weight"] for k in _BLOCK}
            h = self._ln(x, p["ln1"], params[f"blocks.{i}.ln1.bias"])
            q, k, v = self._linear(h, p["qkv"]).split(d, dim=2)
            q, k, v = (z.reshape(n * b, t, nh, d // nh).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self._linear(y.transpose(1, 2).reshape(n, b * t, d), p["proj"])
            h = self._ln(x, p["ln2"], params[f"blocks.{i}.ln2.bias"])
            h = F.gelu(self._linear(h, p["fc"]))
            x = x + self._linear(h, p["fc_out"])
        x = self._ln(x, params["ln_f.weight"], params["ln_f.bias"])
        logits = self._linear(x, wte)
        if n == 1:
            return F.cross_entropy(logits.squeeze(0), targets.reshape(b * t))[None]
        pairs = zip(logits.unbind(0), targets.reshape(n, b * t).unbind(0), strict=True)
        return torch.stack([F.cross_entropy(li, ti) for li, ti in pairs])

    @torch.no_grad()
    def check_against(self, template: GPT, windows: torch.Tensor, rel_tol: float = 1e-6) -> None:
        """Refuse to run if ``losses`` no longer equals ``GPT.loss`` on ``windows`` [b, T+1]."""
        params = {name: p.detach().unsqueeze(0) for name, p in template.named_parameters()}
        mine = float(self.losses(params, windows.unsqueeze(0))[0])
        ref = float(template.loss(windows))
        if not abs(mine - ref) <= rel_tol * abs(ref):
            raise HypertrainError(
                f"batched path: StackedGPT gives loss {mine!r} where GPT.loss gives {ref!r}; "
                "common/model.py changed, update sim/engine/stacked.py"
            )
