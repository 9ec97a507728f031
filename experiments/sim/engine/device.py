"""The device switch check of docs/design.md §7.11: the same short jobs on CPU and on the device.

    python -m hypertrain.sim.engine.device --device cuda [--steps 60] [--json PATH]

The device (``SimJob.device`` or ``$HYPERTRAIN_SIM_DEVICE``) is outside the
design hash, which is only honest if the device computes the same function.
``device_equivalence_check`` runs a few real grid jobs, shortened, once on CPU
and once on the device, and compares their final held-out losses; if any pair
differs by more than ``rel_tol`` (default 5e-4 = 0.05%, a tenth of the 0.5%
equivalence margin), or one side diverges and the other does not, it raises
``DeviceMismatch`` naming every offending job, and the device must not be used.

Invariants: the CPU side always runs on ``cpu`` whatever the environment says;
both sides run the identical ``SimJob`` apart from ``device``; the report keeps
every compared pair, passing or not.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hypertrain.common.errors import HypertrainError
from hypertrain.common.optim import InnerConfig
from hypertrain.common.outer import OuterConfig
from hypertrain.sim.engine.job import SimJob, dp_job, flat_job
from hypertrain.sim.engine.run import run_job

DEFAULT_REL_TOL = 5e-4


class DeviceMismatch(HypertrainError):
    """The device's held-out losses disagree with the CPU's beyond the tolerance."""


@dataclass(slots=True)
class DeviceCheck:
    """Every compared pair and the verdict."""

    device: str
    rel_tol: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    ok: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def shorten(job: SimJob, steps: int) -> SimJob:
    """``job`` cut to about ``steps`` steps (a multiple of h_g, at least one round)."""
    n = max(job.h_g, steps // job.h_g * job.h_g) if not job.dp else max(1, steps)
    warmup = min(job.inner.warmup_steps, max(0, n // 5))
    inner = InnerConfig(**{**asdict(job.inner), "warmup_steps": warmup})
    return job.replace(steps=n, inner=inner, eval_points=1)


def _rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(b - a) / abs(a) if a else abs(b - a)


def device_equivalence_check(
    jobs: Sequence[SimJob],
    device: str,
    rel_tol: float = DEFAULT_REL_TOL,
    steps: int | None = None,
) -> DeviceCheck:
    """Run each job on CPU and on ``device``; raise ``DeviceMismatch`` if any disagree."""
    report = DeviceCheck(device=device, rel_tol=rel_tol)
    for job in jobs:
        job = shorten(job, steps) if steps else job
        cpu = run_job(job.replace(device="cpu"))
        dev = run_job(job.replace(device=device))
        rel = _rel(cpu.final_loss, dev.final_loss)
        same_fate = cpu.diverged == dev.diverged
        ok = same_fate and (cpu.diverged or rel <= rel_tol)
        report.rows.append(
            {
                "key": job.key(),
                "job": job.design_dict(),
                "cpu_loss": cpu.to_dict()["final_loss"],
                "device_loss": dev.to_dict()["final_loss"],
                "rel_diff": rel if math.isfinite(rel) else None,
                "cpu_diverged": cpu.diverged,
                "device_diverged": dev.diverged,
                "ok": ok,
            }
        )
        report.ok = report.ok and ok
    if not report.ok:
        bad = [r for r in report.rows if not r["ok"]]
        detail = "; ".join(
            f"job {r['key']}: cpu {r['cpu_loss']} vs {device} {r['device_loss']} "
            f"(rel {r['rel_diff']}, diverged {r['cpu_diverged']}/{r['device_diverged']})"
            for r in bad
        )
        raise DeviceMismatch(
            f"device {device!r} disagrees with CPU beyond {rel_tol:.4%} relative held-out loss "
            f"on {len(bad)} of {len(report.rows)} jobs; refusing the device: {detail}"
        )
    return report


def default_check_jobs(model: str = "tiny", steps: int = 60, seed: int = 0) -> list[SimJob]:
    """A few real grid arms, short: the DP control, flat DiLoCo, Muon, streaming with overlap."""
    inner = InnerConfig(warmup_steps=5)
    kw: dict[str, Any] = dict(model=model, steps=steps, global_batch=8, seed=seed, holdout=64)
    outer = OuterConfig(name="nesterov", eta=0.7, mu=0.9)
    return [
        dp_job(h=10, inner=inner, **kw),
        flat_job(4, 10, inner=inner, outer=outer, **kw),
        flat_job(4, 10, inner=InnerConfig(name="muon", warmup_steps=5), outer=outer, **kw),
        flat_job(4, 10, inner=inner, outer=outer, fragments=3, tau=1, **kw),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hypertrain.sim.engine.device", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--device", default="cuda", help="device to check against the CPU")
    ap.add_argument("--model", default="tiny", help="model preset of the check jobs")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rel-tol", type=float, default=DEFAULT_REL_TOL)
    ap.add_argument("--json", metavar="PATH", help="write the report here")
    args = ap.parse_args(argv)
    jobs = default_check_jobs(args.model, args.steps)
    try:
        report = device_equivalence_check(jobs, args.device, args.rel_tol)
    except DeviceMismatch as e:
        print(f"device check FAILED: {e}")
        return 1
    except HypertrainError as e:  # e.g. CUDA requested where there is none
        print(f"device check: error: {e}")
        return 2
    for row in report.rows:
        print(f"  {row['key']}: cpu {row['cpu_loss']} {args.device} {row['device_loss']}")
    print(f"device check ok: {args.device} within {args.rel_tol:.4%} on {len(report.rows)} jobs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
