"""Daemon settings (common/settings.py): strict tables and keys, typed values, flags
over the config file, unchanged defaults, and the daemons' one-line refusal of a
mistyped key (exit 2, before anything binds)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from hypertrain.aggregator.__main__ import main as aggregator_main
from hypertrain.common.config import (
    HOLDOUT_TOKENS,
    RunConfig,
    TopologyConfig,
    preset_holdout_windows,
)
from hypertrain.common.errors import ConfigError
from hypertrain.common.model import preset
from hypertrain.common.runflags import add_run_config_flags, run_config_from_args
from hypertrain.common.settings import (
    KNOWN_TABLES,
    AggregatorSettings,
    DaemonSettings,
    IslandSettings,
    RelaySettings,
    load_tables,
)
from hypertrain.island.__main__ import main as island_main
from hypertrain.relay.__main__ import main as relay_main
from hypertrain.wire.daemon import call_guard, daemon_parser, load_settings
from hypertrain.wire.metrics import Metrics

CLASSES: list[type[DaemonSettings]] = [IslandSettings, RelaySettings, AggregatorSettings]
SHARED = {"listen", "state_dir", "metrics_port", "metrics_host", "signing_key", "trusted_keys"} | {
    "tls_cert",
    "tls_key",
    "tls_ca",
    "insecure",
    "calls_per_peer",
    "call_idle_s",
    "call_min_kib_s",
    "pushes_reading",
}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.TABLE)
def test_unknown_key_is_refused_naming_key_and_table(cls: type[DaemonSettings]) -> None:
    with pytest.raises(ConfigError) as e:
        cls.resolve({"listne": "127.0.0.1:7070"}, {}, source="run.toml")
    message = str(e.value)
    assert message.startswith(f"config run.toml: [{cls.TABLE}]: unknown key 'listne' (known: ")
    known = re.search(r"\(known: (.*)\)$", message)
    assert known and known[1].split(", ") == sorted(cls.field_types())


def test_several_unknown_keys_are_all_named() -> None:
    with pytest.raises(ConfigError, match=r"\[relay\]: unknown keys 'indx', 'regoin' \(known: "):
        RelaySettings.resolve({"regoin": "eu", "indx": 1, "region": "eu"}, {})


def test_each_class_knows_exactly_its_keys() -> None:
    assert set(AggregatorSettings.field_types()) == SHARED | {"keep_rounds"}
    assert set(RelaySettings.field_types()) == SHARED | {
        "keep_rounds",
        "region",
        "aggregator",
        "shard",
        "cut_through",
    }
    assert set(IslandSettings.field_types()) == SHARED | {"region", "index", "relay", "device"}
    # the key of one daemon is not a key of another
    with pytest.raises(ConfigError, match=r"\[aggregator\]: unknown key 'region'"):
        AggregatorSettings.resolve({"region": "eu"}, {})
    with pytest.raises(ConfigError, match=r"\[relay\]: unknown key 'relay'"):
        RelaySettings.resolve({"relay": "127.0.0.1:1"}, {})


def test_unknown_table_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text('[run]\nsteps = 20\n[relya]\nlisten = "127.0.0.1:0"\n')
    with pytest.raises(ConfigError) as e:
        load_tables(cfg)
    assert str(e.value) == (
        f"config {cfg}: unknown table [relya] (known tables: aggregator, island, relay, run)"
    )
    cfg.write_text("steps = 20\n")  # a [run] key written above the table
    with pytest.raises(ConfigError, match="unknown top-level key 'steps'"):
        load_tables(cfg)
    cfg.write_text('relay = "127.0.0.1:1"\n')  # a known name that is not a table
    with pytest.raises(ConfigError, match=r"\[relay\] must be a table, got a string"):
        load_tables(cfg)
    cfg.write_text("[run\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_tables(cfg)
    with pytest.raises(ConfigError, match=r"^config .*missing\.toml: "):
        load_tables(tmp_path / "missing.toml")


def test_known_tables_load(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        '[run]\nsteps = 20\n[island]\nindex = 1\n[relay]\nregion = "eu"\n'
        '[aggregator]\nlisten = "0.0.0.0:7070"\n'
    )
    tables = load_tables(cfg)
    assert sorted(tables) == sorted(KNOWN_TABLES)
    assert AggregatorSettings.resolve(tables["aggregator"], {}).listen == "0.0.0.0:7070"


@pytest.mark.parametrize(
    ("cls", "key", "value", "wanted"),
    [
        (RelaySettings, "metrics_port", "9100", "an integer, got a string ('9100')"),
        (IslandSettings, "index", True, "an integer, got a boolean (True)"),
        (IslandSettings, "index", 1.0, "an integer, got a float (1.0)"),
        (AggregatorSettings, "listen", 7070, "a string, got an integer (7070)"),
        (RelaySettings, "state_dir", ["a"], "a path (a string), got an array (['a'])"),
        (IslandSettings, "relay", {"host": "x"}, "a string, got a table"),
    ],
)
def test_wrong_type_is_refused_naming_the_key(
    cls: type[DaemonSettings], key: str, value: object, wanted: str
) -> None:
    with pytest.raises(ConfigError) as e:
        cls.resolve({key: value}, {}, source="run.toml")
    assert str(e.value).startswith(f"config run.toml: [{cls.TABLE}]: key {key!r} must be {wanted}")


@pytest.mark.parametrize(
    ("cls", "fields", "words"),
    [
        (AggregatorSettings, {"listen": "7070"}, "listen '7070' is not an address"),
        (AggregatorSettings, {"listen": "::1:0"}, "listen '::1:0': put an IPv6 host in brackets"),
        (RelaySettings, {"metrics_port": 70000}, "metrics_port must be in [0, 65535], got 70000"),
        (RelaySettings, {"metrics_host": ""}, "metrics_host '' is not a host name"),
        (IslandSettings, {"index": -1}, "index must be >= 0, got -1"),
        (IslandSettings, {"device": "tpu"}, "device must be 'cpu' or 'cuda', got 'tpu'"),
        (IslandSettings, {"state_dir": ""}, "state_dir must not be empty"),
        (IslandSettings, {"metrics_port": "1"}, "metrics_port must be an integer, got a string"),
    ],
)
def test_bad_values_are_refused_naming_the_field(
    cls: type[DaemonSettings], fields: dict[str, object], words: str
) -> None:
    with pytest.raises(ConfigError) as e:
        cls(**fields)
    assert str(e.value).startswith(f"{cls.TABLE}: {words}")


def test_flags_override_the_table() -> None:
    table = {"region": "eu", "aggregator": "agg:7070", "listen": "127.0.0.1:7071"}
    table |= {"state_dir": "from-table", "metrics_port": 9100}
    flags = {"region": "us", "listen": "0.0.0.0:7072", "state_dir": Path("from-flag")}
    flags |= {"metrics_port": None, "aggregator": None}  # None: not given
    s = RelaySettings.resolve(table, flags)
    assert (s.region, s.listen, s.state_dir) == ("us", "0.0.0.0:7072", Path("from-flag"))
    assert (s.aggregator, s.metrics_port) == ("agg:7070", 9100)  # from the table
    assert RelaySettings.resolve(table, {}).state_dir == Path("from-table")  # str -> Path
    with pytest.raises(TypeError, match="not a setting: regoin"):
        RelaySettings.resolve({}, {"regoin": "eu"})


def test_flags_override_the_config_file_through_the_parser(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text('[aggregator]\nlisten = "127.0.0.1:7070"\nmetrics_port = 9100\n')
    p = daemon_parser("aggregator", "test")
    s = load_settings(
        p.parse_args(["--config", str(cfg), "--listen", "0.0.0.0:1"]), AggregatorSettings
    )
    assert (s.listen, s.metrics_port) == ("0.0.0.0:1", 9100)
    s = load_settings(p.parse_args(["--pushes-reading", "3"]), AggregatorSettings)
    assert s.pushes_reading == 3
    guard = call_guard(s, Metrics("aggregator"))
    assert guard.limits.reading == 3 and guard.limits.per_peer == s.calls_per_peer


def test_defaults_are_unchanged() -> None:
    agg = AggregatorSettings.resolve({}, {})
    assert agg.listen == "127.0.0.1:0"
    assert agg.state_dir is None and agg.state_path == Path("aggregator")
    assert agg.metrics_port is None and agg.metrics_host == "127.0.0.1"
    assert agg.signing_key is None and agg.trusted_keys is None and agg.trusted_keys_path is None
    relay = RelaySettings.resolve({"region": "eu"}, {})
    assert relay.state_path == Path("relay-eu") and relay.listen == "127.0.0.1:0"
    assert relay.aggregator is None
    island = IslandSettings.resolve({"region": "us"}, {})
    assert (island.index, island.device, island.relay) == (0, "cpu", None)
    assert island.island_id == "us-0" and island.state_path == Path("island-us-0")
    assert IslandSettings(region="eu", index=1).state_path == Path("island-eu-1")
    # the trusted keys default to the file beside the signing key
    signed = RelaySettings(signing_key=Path("/k/relay-eu.key"))
    assert signed.trusted_keys_path == Path("/k/trusted_keys.json")
    assert RelaySettings(
        signing_key=Path("/k/r.key"), trusted_keys=Path("/t.json")
    ).trusted_keys_path == Path("/t.json")


def test_topology_checks_keep_their_messages() -> None:
    topo = TopologyConfig(regions=("eu", "us"), islands_per_region=2)
    assert RelaySettings(region="eu", aggregator="a:1").check_topology(topo) == ("eu", "a:1")
    with pytest.raises(ConfigError, match=r"^--region must be one of eu, us, got 'ap'$"):
        RelaySettings(region="ap", aggregator="a:1").check_topology(topo)
    with pytest.raises(ConfigError, match=r"^--aggregator HOST:PORT is required$"):
        RelaySettings(region="eu").check_topology(topo)
    assert IslandSettings(region="us", index=1, relay="r:1").check_topology(topo) == ("us", "r:1")
    with pytest.raises(ConfigError, match=r"^--region must be one of eu, us, got None$"):
        IslandSettings(relay="r:1").check_topology(topo)
    with pytest.raises(ConfigError, match=r"^--index must be in \[0, 2\), got 2$"):
        IslandSettings(region="eu", index=2, relay="r:1").check_topology(topo)
    with pytest.raises(ConfigError, match=r"^--relay HOST:PORT is required$"):
        IslandSettings(region="eu").check_topology(topo)


# -- the daemons: a mistyped key is one line on stderr and exit 2 ------------------------------

DAEMONS: list[tuple[str, Callable[[Sequence[str] | None], int], list[str]]] = [
    ("island", island_main, ["--region", "eu", "--index", "0", "--relay", "127.0.0.1:9"]),
    ("relay", relay_main, ["--region", "eu", "--aggregator", "127.0.0.1:9"]),
    ("aggregator", aggregator_main, []),
]


@pytest.mark.parametrize(("role", "main", "args"), DAEMONS, ids=[d[0] for d in DAEMONS])
@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ('[{role}]\nstate_dri = "x"\n', "[{role}]: unknown key 'state_dri' (known: "),
        ("[{role}]\nmetrics_port = true\n", "[{role}]: key 'metrics_port' must be an integer"),
        ('[{role}s]\nlisten = "127.0.0.1:0"\n', "unknown table [{role}s] (known tables: "),
    ],
    ids=["unknown-key", "wrong-type", "unknown-table"],
)
def test_daemon_refuses_a_bad_config_in_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    role: str,
    main: Callable[[Sequence[str] | None], int],
    args: list[str],
    extra: str,
    words: str,
) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text("[run]\nsteps = 20\n\n" + extra.format(role=role))
    state = tmp_path / "state"
    # A missing signing key stops a daemon that wrongly accepts the config (exit 2,
    # with another message) before it binds or waits for a peer: no test hangs.
    guard = ["--signing-key", str(tmp_path / "missing.key")]
    assert main(["--config", str(cfg), "--state-dir", str(state), *guard, *args]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"hypertrain-{role}: error: config {cfg}: {words.format(role=role)}")
    assert out == ""  # refused before anything was logged, signed or bound
    assert not state.exists()


# -- the run config: the same strict tables for every reader of a config file ---------------

REPO = Path(__file__).resolve().parents[2]
BAD_TABLE = "[rnu]\nsteps = 20\n"  # a mistyped [run]: its keys would be silently ignored


def test_run_config_refuses_an_unknown_table(tmp_path: Path) -> None:
    from hypertrain.common.config import RunConfig

    cfg = tmp_path / "run.toml"
    cfg.write_text(BAD_TABLE)
    with pytest.raises(ConfigError) as e:
        RunConfig.from_toml(cfg)
    assert str(e.value) == (
        f"config {cfg}: unknown table [rnu] (known tables: aggregator, island, relay, run)"
    )
    cfg.write_text("[run]\nsteps = 20\n[run.topology]\nh_r = 5\nh_g = 10\n[runn.inner]\nlr = 1\n")
    with pytest.raises(ConfigError, match=r"unknown table \[runn\]"):
        RunConfig.from_toml(cfg)
    cfg.write_text("steps = 20\n")  # a [run] key written above the table
    with pytest.raises(ConfigError, match="unknown top-level key 'steps'"):
        RunConfig.from_toml(cfg)
    cfg.write_text("run = 3\n")
    with pytest.raises(ConfigError, match=r"\[run\] must be a table"):
        RunConfig.from_toml(cfg)


def test_run_config_reads_run_and_leaves_the_daemon_tables(tmp_path: Path) -> None:
    from hypertrain.common.config import RunConfig

    cfg = tmp_path / "run.toml"
    cfg.write_text("")  # [run] stays optional: the defaults
    assert RunConfig.from_toml(cfg) == RunConfig()
    cfg.write_text('[relay]\nregion = "eu"\n[island]\nindex = 1\n[aggregator]\n')
    assert RunConfig.from_toml(cfg) == RunConfig()
    cfg.write_text('[run]\nsteps = 40\n[relay]\nregion = "eu"\n')
    assert RunConfig.from_toml(cfg) == RunConfig(steps=40)
    assert load_tables(cfg)["relay"] == {"region": "eu"}  # both readers take the same file


CLI_COMMANDS = {
    "run": (["run", "--local"], "hypertrain run: error: "),
    "up": (["up", "--quiet"], "hypertrain up: error: "),
    "plan": (["plan", "--step-time", "1"], "hypertrain plan: error: "),
}


@pytest.mark.parametrize("command", sorted(CLI_COMMANDS))
def test_cli_refuses_an_unknown_table_in_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    """``hypertrain run --local|up|plan --config bad.toml`` with a mistyped table: exit 2,
    one stderr line naming the table, nothing started or written."""
    import hypertrain.common.reference as reference
    import hypertrain.up as up
    from hypertrain.cli import main

    def started(*args: object, **kwargs: object) -> None:  # a config wrongly accepted
        pytest.fail(f"hypertrain {command} started with a config it should refuse")

    monkeypatch.setattr(reference, "run_reference", started)
    monkeypatch.setattr(up, "start_cluster", started)
    bad = tmp_path / "bad.toml"
    bad.write_text(BAD_TABLE)
    argv, prefix = CLI_COMMANDS[command]
    run_dir = tmp_path / "run"
    extra = ["--run-dir", str(run_dir)] if command == "up" else []
    assert main([*argv, "--config", str(bad), *extra]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"{prefix}config {bad}: unknown table [rnu] (known tables: aggregator, island, relay, run)"
    ]
    assert out == "" and not run_dir.exists()


def test_every_config_the_repo_ships_or_writes_loads(tmp_path: Path) -> None:
    """deploy/configs/run.toml, its ConfigMap copy and what ``hypertrain up`` writes load
    with both readers (RunConfig.from_toml and load_tables)."""
    import yaml

    from hypertrain.common.config import CUSTOM_MODEL, RunConfig
    from hypertrain.common.model import ModelConfig
    from hypertrain.up import config_toml

    shipped = REPO / "deploy" / "configs" / "run.toml"
    (configmap,) = [d for d in yaml.safe_load_all((REPO / "deploy/k8s/configmap.yaml").read_text())]
    copy = tmp_path / "configmap-run.toml"
    copy.write_text(configmap["data"]["run.toml"])
    example = RunConfig.from_toml(shipped)
    assert example.run_id == "example-3r" and RunConfig.from_toml(copy) == example
    custom = RunConfig(
        model=CUSTOM_MODEL, model_shape=ModelConfig(n_layer=1, d_model=32, n_head=2, seq_len=16)
    )
    for cfg in (RunConfig(), example, custom, RunConfig(model="toy", steps=40)):
        written = tmp_path / f"{cfg.digest[:8]}.toml"
        written.write_text(config_toml(cfg))
        assert RunConfig.from_toml(written) == cfg
        assert sorted(load_tables(written)) == ["run"]
    for path in (shipped, copy):
        assert sorted(load_tables(path)) == ["run"]


def test_transport_settings_are_checked() -> None:
    assert AggregatorSettings.resolve({"insecure": True}).insecure is True
    with pytest.raises(ConfigError, match=r"key 'insecure' must be true or false, got a string"):
        AggregatorSettings.resolve({"insecure": "yes"})
    with pytest.raises(ConfigError, match=r"give tls_cert \(--tls-cert\) or insecure, not both"):
        AggregatorSettings.resolve({"insecure": True, "tls_cert": "a.crt"})
    with pytest.raises(ConfigError, match=r"calls_per_peer must be >= 1, got 0"):
        RelaySettings.resolve({"calls_per_peer": 0})
    assert RelaySettings.resolve({"pushes_reading": 0}).pushes_reading == 0  # no limit
    with pytest.raises(ConfigError, match=r"relay: pushes_reading must be >= 0, got -1"):
        RelaySettings.resolve({"pushes_reading": -1})


# -- a preset's held-out evaluation size on the command line ---------------------------------
def _flags(*argv: str) -> RunConfig:
    p = argparse.ArgumentParser()
    add_run_config_flags(p)
    return run_config_from_args(p.parse_args(list(argv)))


def test_a_preset_on_the_command_line_evaluates_its_own_number_of_held_out_windows() -> None:
    expected = {"tiny": 512, "proxy": 256, "small": 128, "gpt-125m": 64}
    for name, windows in expected.items():
        assert (
            preset_holdout_windows(name)
            == windows
            == min(512, HOLDOUT_TOKENS // preset(name).seq_len)
        )
        assert _flags("--preset", name).holdout_windows == windows
    assert _flags().holdout_windows == 512  # no preset flag: the config's value


def test_an_asked_for_held_out_size_wins_over_the_presets(tmp_path: Path) -> None:
    assert _flags("--preset", "gpt-125m", "--holdout-windows", "8").holdout_windows == 8
    config = tmp_path / "run.toml"
    config.write_text("[run]\nholdout_windows = 16\n")
    assert _flags("--config", str(config), "--preset", "gpt-125m").holdout_windows == 16
    config.write_text("[run]\nseed = 3\n")  # the file says nothing of it: the preset's
    assert _flags("--config", str(config), "--preset", "gpt-125m").holdout_windows == 64


@pytest.mark.parametrize(
    ("name", "value", "line"),
    [
        (
            "HYPERTRAIN_SAVE_COPY_BYTES",
            "16M",
            "hypertrain-island: error: HYPERTRAIN_SAVE_COPY_BYTES must be a byte count, got '16M'",
        ),
        *(
            (
                "HYPERTRAIN_STEP_SECONDS",
                value,
                f"hypertrain-island: error: HYPERTRAIN_STEP_SECONDS must be a number of seconds, "
                f"got {value!r}",
            )
            for value in ("0.2s", "-1", "fast")
        ),
    ],
)
def test_the_island_refuses_an_environment_setting_that_is_not_a_number(
    name: str,
    value: str,
    line: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(name, value)
    cfg = tmp_path / "run.toml"
    cfg.write_text("[run]\nsteps = 20\n")
    args = ["--config", str(cfg), "--state-dir", str(tmp_path / "state"), "--insecure"]
    assert island_main([*args, *DAEMONS[0][2]]) == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_a_relay_of_a_fragmented_run_refuses_a_per_caller_cap_below_an_island_s_calls() -> None:
    RelaySettings(calls_per_peer=1).check_fragments(1)
    RelaySettings(calls_per_peer=2).check_fragments(2)
    RelaySettings(calls_per_peer=4).check_fragments(30)
    with pytest.raises(ConfigError, match=r"^relay: calls_per_peer 3 is below the 4 calls an "
                       r"island of a run with 6 fragments makes at once"):  # fmt: skip
        RelaySettings(calls_per_peer=3).check_fragments(6)
    with pytest.raises(ConfigError, match="below the 2 calls"):
        RelaySettings(calls_per_peer=1).check_fragments(2)
