"""The planner (docs/design.md §5): hand-computed cases, the formulas exactly, the warning,
JSON, bad input."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hypertrain import plan_cmd
from hypertrain.common.codec import parse_codec_spec
from hypertrain.common.errors import ConfigError
from hypertrain.common.model import PRESETS, build_model, count_parameters
from hypertrain.common.planner.plan import (
    LINK_CLASSES,
    PlanInput,
    codec_rho_bits,
    link_class,
    make_plan,
    measurements_from_bench,
    parameter_count,
    parse_count,
)

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "experiments" / "results" / "bench_codecs.json"


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hypertrain")
    plan_cmd.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    return int(args.func(args))


# P = 1M, seq 100, N = 4, R = 2, H_r = 5, H_g = 10, b = 8, D = 32M tokens, t_step = 0.5 s.
SMALL = [
    "--model", "1M", "--seq-len", "100", "--islands", "4", "--regions", "2", "--h-r", "5",
    "--h-g", "10", "--batch", "8", "--tokens", "32M", "--step-time", "0.5",
]  # fmt: skip


def small_input(**kw: object) -> PlanInput:
    base: dict[str, object] = dict(
        params=10**6, seq_len=100, islands=4, regions=2, h_r=5, h_g=10,
        batch_per_island=8, tokens=32 * 10**6, step_seconds=0.5,
    )  # fmt: skip
    base.update(kw)
    return PlanInput(**base)  # type: ignore[arg-type]


def test_parameter_count_matches_the_built_model() -> None:
    for name in ("tiny", "proxy", "small"):
        assert parameter_count(PRESETS[name]) == count_parameters(build_model(name)), name


def test_parameter_count_gpt_125m_by_hand() -> None:
    # V d = 50304 * 768 = 38,633,472; S d = 1024 * 768 = 786,432;
    # per block 4 d + 12 d^2 = 3,072 + 7,077,888 = 7,080,960, times 12 = 84,971,520;
    # final LayerNorm 2 d = 1,536.  Sum: 124,392,960.
    assert parameter_count(PRESETS["gpt-125m"]) == 124_392_960


def test_batch_steps_and_outer_steps_by_hand() -> None:
    plan = make_plan(small_input())
    assert plan.global_batch == 32  # N * b = 4 * 8
    assert plan.tokens_per_step == 3_200  # 32 * 100
    assert plan.total_steps == 10_000  # 32,000,000 / 3,200
    assert plan.outer_steps == 1_000  # 10,000 / 10: exactly at the bound, no warning
    assert plan.warnings == ()
    regional, glob = plan.levels
    assert (regional.syncs, glob.syncs) == (2_000, 1_000)  # T / H_r, T / H_g
    assert (regional.fan_in, glob.fan_in) == (2, 2)  # n_r = 4 / 2, R = 2
    assert (regional.interval_seconds, glob.interval_seconds) == (2.5, 5.0)  # H * t_step


def test_bytes_and_rates_by_hand() -> None:
    plan = make_plan(small_input())
    regional, glob = plan.levels
    costs = {c.codec.split(":")[0]: c for c in regional.codecs}
    # int8, block 256: b_v = 8 + 32/256 = 8.125; bytes = 1e6 * 8.125 / 8 = 1,015,625;
    # rate = 1,015,625 / (5 * 0.5) = 406,250 B/s = 406,250 * 8 / 1e9 = 0.00325 Gbit/s.
    int8 = costs["int8"]
    assert (int8.rho, int8.b_v, int8.bytes_per_sync) == (1.0, 8.125, 1_015_625)
    assert int8.rate_bytes_per_s == 406_250
    assert int8.rate_gbps == pytest.approx(0.00325, rel=1e-12)
    assert int8.receiver_ingress_gbps == pytest.approx(2 * 0.00325, rel=1e-12)  # n_r = 2
    assert int8.total_bytes == 1_015_625 * 2_000
    # SparseLoCo defaults: k = round(0.0156 * 4096) = round(63.8976) = 64, rho = 64/4096
    # = 0.015625; b_v = 2 + 16 + 64/64 = 19; bytes = 1e6 * 0.015625 * 19 / 8 = 37,109.375;
    # rate = 37,109.375 / 2.5 = 14,843.75 B/s.
    sp = costs["sparseloco"]
    assert (sp.rho, sp.b_v, sp.bytes_per_sync) == (0.015625, 19.0, 37_109.375)
    assert sp.rate_bytes_per_s == 14_843.75
    # fp32 at the global level: 4e6 bytes every 10 * 0.5 s = 800,000 B/s = 0.0064 Gbit/s.
    fp32 = next(c for c in glob.codecs if c.codec == "fp32")
    assert (fp32.bytes_per_sync, fp32.rate_bytes_per_s) == (4e6, 800_000)
    assert fp32.rate_gbps == pytest.approx(0.0064, rel=1e-12)
    # merges come back as fp32: 4e6 bytes per island every 2.5 s = 0.0128 Gbit/s.
    assert regional.fetch_bytes_per_sync == 4e6
    assert regional.fetch_rate_gbps == pytest.approx(0.0128, rel=1e-12)


@pytest.mark.parametrize(
    "codec",
    [
        "fp32",
        "int8",
        "int8:block=64+zstd",
        "sparseloco",
        "sparseloco:density=0.05,value_bits=4,chunk=1024",
    ],
)
def test_formula_exactly(codec: str) -> None:
    inp = small_input(params=123_457, h_r=7, h_g=21, step_seconds=0.37, regional_codecs=(codec,))
    cost = make_plan(inp).levels[0].codecs[0]
    rho, b_v = codec_rho_bits(parse_codec_spec(codec))
    assert (cost.rho, cost.b_v) == (rho, b_v)
    assert cost.bytes_per_sync == inp.params * rho * b_v / 8
    assert cost.rate_bytes_per_s == cost.bytes_per_sync / (7 * 0.37)
    assert cost.rate_gbps == cost.rate_bytes_per_s * 8 / 1e9
    assert cost.link == link_class(cost.rate_gbps).label
    assert cost.source.startswith("formula")
    assert ("upper bound" in cost.source) == codec.endswith("+zstd")


def test_formula_matches_the_codec_layout() -> None:
    # The formula's bits per parameter are the codec's raw payload for whole chunks/blocks.
    from hypertrain.common.codec.layout import raw_length

    n = 4096 * 256
    for codec in ("fp32", "int8", "sparseloco", "sparseloco:density=0.05,value_bits=8,chunk=2048"):
        spec = parse_codec_spec(codec)
        rho, b_v = codec_rho_bits(spec)
        assert n * rho * b_v / 8 == pytest.approx(raw_length(spec, n), rel=1e-12), codec


def test_link_classes() -> None:
    # 1B parameters, H_r = 1, t_step = 0.1 s:
    # fp32 4e9 B / 0.1 s = 4e10 B/s = 320 Gbit/s -> none; int8 1.015625e9 / 0.1 -> 81.25 Gbit/s
    # -> metro; sparseloco 1e9 * 0.015625 * 19 / 8 = 37,109,375 B / 0.1 -> 2.96875 Gbit/s.
    plan = make_plan(small_input(params=10**9, h_r=1, h_g=10, step_seconds=0.1))
    got = {c.codec.split(":")[0]: (c.rate_gbps, c.link_class) for c in plan.levels[0].codecs}
    assert got["fp32"] == (pytest.approx(320.0), "none")
    assert got["int8"] == (pytest.approx(81.25), "metro")
    assert got["sparseloco"] == (pytest.approx(2.96875), "interconnect")
    assert link_class(1.0).name == "internet"  # thresholds are inclusive
    assert link_class(1.0000001).name == "interconnect"
    assert [c.max_gbps for c in LINK_CLASSES][:-1] == [1.0, 10.0, 100.0]


def test_warning_when_outer_steps_are_few(capsys: pytest.CaptureFixture[str]) -> None:
    plan = make_plan(small_input(tokens=32 * 10**6 - 3_200))  # T = 9,999, S_g = 999.9
    assert len(plan.warnings) == 1 and "too few outer steps" in plan.warnings[0]
    assert "add tokens rather than islands" in plan.warnings[0]
    assert cli([*SMALL[:-4], "--tokens", "3.2M", "--step-time", "0.5"]) == 0
    out = capsys.readouterr().out
    warn = [line for line in out.splitlines() if line.startswith("WARNING:")]
    assert warn == [f"WARNING: {make_plan(small_input(tokens=3_200_000)).warnings[0]}"]
    assert "S_g = T / H_g = 100.0 <" in warn[0]


def test_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(SMALL) == 0
    out = capsys.readouterr().out
    assert "global batch B_glob = N * b = 4 * 8 = 32 sequences" in out
    assert "total steps T = D / (B_glob * seq_len) = 32,000,000 / 3,200 = 10,000.0" in out
    assert "global outer steps S_g = T / H_g = 1,000.0" in out
    assert "WARNING" not in out
    assert "regional level: every H = 5 steps = 2.5 s" in out
    assert "global level: every H = 10 steps = 5 s" in out
    assert "int8:block=256" in out and "internet (<= 1 Gbit/s)" in out


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        cli([*SMALL, "--json", "--regional-codec", "int8", "--global-codec", "sparseloco+zstd"])
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    expect = make_plan(
        small_input(model="1M", regional_codecs=("int8",), global_codecs=("sparseloco+zstd",))
    ).to_dict()
    doc.pop("bench_json")
    assert doc == json.loads(json.dumps(expect))
    assert doc["total_steps"] == 10_000 and doc["outer_steps"] == 1_000
    regional, glob = doc["levels"]
    assert regional["codecs"][0]["bytes_per_sync"] == 1_015_625
    assert glob["codecs"][0]["codec"] == "sparseloco:density=0.0156,value_bits=2,chunk=4096+zstd"
    assert doc["inputs"]["islands_per_region"] == 2
    assert doc["link_classes"][-1]["max_gbps"] is None


def test_preset_and_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        '[run]\nmodel = "proxy"\nsteps = 100\nbatch_per_island = 4\nregional_codec = "int8"\n'
        'global_codec = "fp32"\n[run.topology]\nregions = ["eu", "us", "ap"]\n'
        "islands_per_region = 2\nh_r = 5\nh_g = 50\n"
    )
    assert cli(["--config", str(cfg), "--step-time", "0.2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    inp = doc["inputs"]
    assert inp["params"] == parameter_count(PRESETS["proxy"])
    assert (inp["islands"], inp["regions"], inp["h_r"], inp["h_g"]) == (6, 3, 5, 50)
    assert inp["seq_len"] == 256  # the preset's
    assert inp["tokens"] == 100 * 6 * 4 * 256  # D = steps * N * b * seq_len
    assert doc["total_steps"] == 100
    assert [c["codec"] for c in doc["levels"][0]["codecs"]] == ["int8:block=256"]
    # flags override the config
    assert cli(["--config", str(cfg), "--step-time", "0.2", "--h-g", "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["outer_steps"] == 10


def write_bench(path: Path) -> None:
    path.write_text(
        json.dumps(
            {
                "config": {"cpu_count": 2},
                "size": {
                    "int8": {"spec": "int8:block=256", "bits_per_param": 8.2},
                    "sparseloco+zstd": {"spec": "sparseloco+zstd", "bits_per_param": 0.16},
                },
                "throughput": {
                    "int8 encode": {"gbps": 2.0},
                    "int8 decode_accumulate": {"gbps": 8.0},
                },
            }
        )
    )


def test_bench_json_replaces_b_v(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = tmp_path / "bench.json"
    write_bench(bench)
    assert cli([*SMALL, "--bench-json", str(bench), "--json", "--regional-codec", "int8",
                "--regional-codec", "sparseloco+zstd", "--regional-codec", "fp32"]) == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert doc["bench_json"] == str(bench)
    int8, sp, fp32 = doc["levels"][0]["codecs"]
    # measured 8.2 bits per parameter: bytes = 1e6 * 8.2 / 8 = 1,025,000
    assert (int8["source"], int8["b_v"]) == ("measured", 8.2)
    assert int8["bytes_per_sync"] == pytest.approx(1_025_000, rel=1e-12)
    # encode: 4e6 fp32 bytes at 2 GB/s = 2 ms; decode: n_r = 2 inputs at 8 GB/s = 1 ms
    assert int8["encode_seconds"] == pytest.approx(0.002)
    assert int8["decode_seconds"] == pytest.approx(0.001)
    # sparseloco+zstd: 0.16 bits per parameter = rho * b_v with rho = 0.015625 -> b_v = 10.24
    assert sp["source"] == "measured" and sp["b_v"] == pytest.approx(10.24)
    assert sp["bytes_per_sync"] == pytest.approx(20_000) and sp["encode_seconds"] is None
    assert fp32["source"] == "formula"  # not in the benchmark
    assert cli([*SMALL, "--bench-json", str(bench)]) == 0
    out = capsys.readouterr().out
    assert f"b_v: measured from {bench}" in out and "[measured]" in out


def test_bench_json_of_the_repository_parses() -> None:
    if not BENCH.exists():
        pytest.skip("no experiments/results/bench_codecs.json")
    measured = measurements_from_bench(json.loads(BENCH.read_text()))
    for codec in ("fp32", "int8", "sparseloco", "sparseloco+zstd"):
        m = measured[str(parse_codec_spec(codec))]
        assert m.bits_per_param > 0 and m.encode_gbps and m.decode_gbps


def test_parse_count() -> None:
    assert parse_count("124392960", "x") == 124_392_960
    assert parse_count("1.5e9", "x") == 1_500_000_000
    assert parse_count("125M", "x") == 125_000_000
    assert parse_count("2.5B", "x") == parse_count("2.5g", "x") == 2_500_000_000
    assert parse_count("1_000k", "x") == 10**6
    for bad in ("0", "-3", "1.5", "abc", "", "nan", "inf", "1e-3"):
        with pytest.raises(ConfigError):
            parse_count(bad, "x")


BAD = [
    (["--islands", "5"], "must split evenly into regions"),  # 5 islands, 2 regions
    (["--h-g", "12"], "must be a multiple of h_r"),
    (["--islands", "0"], "--islands must be positive"),
    (["--batch", "-8"], "--batch must be positive"),
    (["--h-r", "0"], "--h-r must be positive"),
    (["--tokens", "ten"], "--tokens must be a number"),
    (["--step-time", "0"], "--step-time must be positive"),
    (["--step-time", "-1"], "--step-time must be positive"),
    (["--step-time", "fast"], "--step-time must be seconds"),
    (["--model", "gpt-9"], "--model 'gpt-9' is neither a preset (tiny, proxy"),
    (["--model", "0"], "nor a parameter count"),
    (["--regional-codec", "int4"], "unknown codec"),
    (["--regions", "eu,eu"], "--regions: names must be distinct"),
    (["--bench-json", "/nonexistent/bench.json"], "--bench-json /nonexistent/bench.json"),
]


@pytest.mark.parametrize(("extra", "message"), BAD)
def test_bad_input_exits_2_with_one_line(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli([*SMALL, *extra]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    lines = cap.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hypertrain plan: error: "), cap.err
    assert message in lines[0]


def test_missing_inputs_and_bad_bench(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["--islands", "4"]) == 2
    assert capsys.readouterr().err == (
        "hypertrain plan: error: --model is required (a preset name or a parameter count), or --config\n"
    )
    no_step = [a for a in SMALL if a not in ("--step-time", "0.5")]
    assert cli(no_step) == 2
    assert "--step-time SECONDS is required" in capsys.readouterr().err
    bench = tmp_path / "bench.json"
    for text in (
        "{",
        '{"size": 3}',
        '{"size": {"x": {"spec": "int4", "bits_per_param": 1}}}',
        '{"size": {}}',
    ):
        bench.write_text(text)
        assert cli([*SMALL, "--bench-json", str(bench)]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"hypertrain plan: error: --bench-json {bench}")
