"""bench/bench_sync_scale.py's floors: the work every sync must do, over the machine's cores.

The bench calls a missed speed target FLOOR, not FAIL, when even this floor is above it;
so the floor's arithmetic is checked here against sums written out by hand, piece by piece,
and the measurement is run on a small sample to see that it gives a cost for every piece."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_sync_scale as bench  # bench/ is a folder of scripts, put on the path above

P = 1000
ZERO = {"fp32": 0.0, "int8": 0.0}


def only(**costs: float) -> bench.CoreCosts:
    """Costs with every piece 0 but those named (per byte or per parameter), on 2 cores."""
    return bench.CoreCosts(
        tcp=costs.get("tcp", 0.0),
        grpc_push=costs.get("grpc_push", 0.0),
        grpc_fetch=costs.get("grpc_fetch", 0.0),
        digest=costs.get("digest", 0.0),
        copy=costs.get("copy", 0.0),
        outer=costs.get("outer", 0.0),
        encode={**ZERO, "int8": costs.get("encode", 0.0)},
        decode_acc={"fp32": costs.get("fp32_add", 0.0), "int8": costs.get("int8_add", 0.0)},
        cores=2,
    )


def test_part_a_counts_each_transfer_each_digest_and_each_sum_once() -> None:
    n_r, delta, fwd = 4, 250, 4 * P + 64
    path = n_r * delta + fwd + 4 * P + n_r * 4 * P
    # TCP: every byte on the path once, both ends in the measured cost.
    assert only(tcp=1.0).relay_e2e("int8", n_r, P, path, fwd) == path / 2
    # gRPC's own cost where it is more: the deltas and the forward pushed, the merge
    # fetched by the relay and then by each island
    fetched = (n_r + 1) * 4 * P
    pushed = n_r * delta + fwd
    assert only(grpc_push=1.0).relay_e2e("int8", n_r, P, path, fwd) == pushed / 2
    assert only(grpc_fetch=1.0).relay_e2e("int8", n_r, P, path, fwd) == fetched / 2
    both = only(tcp=2.0, grpc_push=1.0, grpc_fetch=3.0)  # the larger, byte by byte
    assert both.relay_e2e("int8", n_r, P, path, fwd) == (2 * pushed + 3 * fetched) / 2
    # digest: every receiver, plus the relay's forward and the aggregator's merge (the
    # islands signed their deltas before the clock started).
    assert only(digest=1.0).relay_e2e("int8", n_r, P, path, fwd) == (path + fwd + 4 * P) / 2
    # the relay adds n_r int8 deltas, the aggregator one fp32 forward, and steps once
    assert only(int8_add=1.0).relay_e2e("int8", n_r, P, path, fwd) == n_r * P / 2
    assert only(fp32_add=1.0).relay_e2e("int8", n_r, P, path, fwd) == P / 2
    assert only(outer=1.0).relay_e2e("int8", n_r, P, path, fwd) == P / 2
    # nothing is encoded or applied in part A's window
    assert only(encode=1.0, copy=1.0).relay_e2e("int8", n_r, P, path, fwd) == 0.0


@pytest.mark.parametrize(("regions", "per"), [(1, 1), (1, 2), (2, 1)])
def test_part_b_floor_is_everything_before_the_first_island_has_the_merge(
    regions: int, per: int
) -> None:
    """The islands sync at the same step: every delta and every forward is made, sent and
    summed and the outer step taken before any island's window can close; only the other
    relays' and the other islands' copies of the merge may come after it."""
    delta, fwd = 250, 4 * P + 64
    n = regions * per
    pushed = n * delta + regions * fwd  # every delta to its relay, every forward up
    fetched = 2 * 4 * P  # the merge to this island's relay, then to this island
    signed = n * delta + regions * fwd + 4 * P  # each payload digested by its sender
    assert only(tcp=1.0).sync("int8", regions, per, P, delta, fwd) == (pushed + fetched) / 2
    assert only(grpc_push=1.0).sync("int8", regions, per, P, delta, fwd) == pushed / 2
    assert only(grpc_fetch=1.0).sync("int8", regions, per, P, delta, fwd) == fetched / 2
    digested = pushed + fetched + signed
    assert only(digest=1.0).sync("int8", regions, per, P, delta, fwd) == digested / 2
    assert only(encode=1.0).sync("int8", regions, per, P, delta, fwd) == n * P / 2
    assert only(int8_add=1.0).sync("int8", regions, per, P, delta, fwd) == n * P / 2
    assert only(fp32_add=1.0).sync("int8", regions, per, P, delta, fwd) == regions * P / 2
    assert only(outer=1.0).sync("int8", regions, per, P, delta, fwd) == P / 2
    assert only(copy=1.0).sync("int8", regions, per, P, delta, fwd) == 4 * P / 2


@pytest.mark.parametrize(("regions", "per"), [(1, 2), (2, 1)])
def test_part_b_all_at_once_counts_every_island_of_the_case(regions: int, per: int) -> None:
    delta, fwd = 250, 4 * P + 64
    n = regions * per
    moved = n * delta + regions * fwd + regions * 4 * P + n * 4 * P
    signed = n * delta + regions * fwd + 4 * P  # each payload digested by its sender
    every = only(tcp=1.0, digest=1.0)
    assert only(tcp=1.0).sync_all("int8", regions, per, P, delta, fwd) == moved / 2
    pushed = n * delta + regions * fwd
    assert only(grpc_push=1.0).sync_all("int8", regions, per, P, delta, fwd) == pushed / 2
    assert (
        only(grpc_fetch=1.0).sync_all("int8", regions, per, P, delta, fwd) == (moved - pushed) / 2
    )
    assert only(digest=1.0).sync_all("int8", regions, per, P, delta, fwd) == (moved + signed) / 2
    assert only(encode=1.0).sync_all("int8", regions, per, P, delta, fwd) == n * P / 2
    assert only(int8_add=1.0).sync_all("int8", regions, per, P, delta, fwd) == n * P / 2
    assert only(fp32_add=1.0).sync_all("int8", regions, per, P, delta, fwd) == regions * P / 2
    assert only(outer=1.0).sync_all("int8", regions, per, P, delta, fwd) == P / 2
    assert only(copy=1.0).sync_all("int8", regions, per, P, delta, fwd) == n * 4 * P / 2
    # more than the first island's floor by the other copies of the merge alone
    first = every.sync("int8", regions, per, P, delta, fwd)
    copies = (regions - 1) + (n - 1)  # the other relays' and the other islands'
    assert every.sync_all("int8", regions, per, P, delta, fwd) - first == copies * 2 * 4 * P / 2


def test_a_missed_target_is_called_floor_only_when_the_floor_is_above_it() -> None:
    assert bench.verdict(None) == ""
    assert bench.verdict(True, 9.0, 4.0) == "PASS"
    assert bench.verdict(False, 4.5, 4.0) == "FLOOR"
    assert bench.verdict(False, 3.9, 4.0) == "FAIL"
    assert bench.verdict(False) == "FAIL"


def test_the_costs_are_measured_for_every_piece_and_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "FLOOR_SAMPLE", 1 << 16)
    costs = bench.core_costs(1e-9, (2e-9, 3e-9), ["int8", "sparseloco+zstd"])
    assert set(costs.encode) == set(costs.decode_acc) == {"fp32", "int8", "sparseloco+zstd"}
    pieces = [costs.digest, costs.copy, costs.outer, *costs.decode_acc.values()]
    assert all(math.isfinite(c) and c > 0 for c in pieces), costs
    assert all(math.isfinite(c) and c >= 0 for c in costs.encode.values()), costs
    assert costs.tcp == 1e-9 and costs.cores >= 1
    assert (costs.grpc_push, costs.grpc_fetch) == (2e-9, 3e-9)


def test_a_rows_floor_is_the_larger_of_disk_and_work_over_its_tcp_time() -> None:
    row: dict[str, object] = {"tcp_s": 2.0}
    bench.put_floors(row, 3.0, 5.0, 11.0)
    assert row["floor_over_tcp"] == 2.5 and row["disk_floor_over_tcp"] == 1.5
    assert row["cpu_floor_over_tcp"] == 2.5 and row["serial_over_tcp"] == 5.5
    bench.put_floors(row, 6.0, 5.0, 11.0)
    assert row["floor_over_tcp"] == 3.0


def test_part_b_splits_off_the_wait_for_the_round_s_last_island() -> None:
    """Two islands end their training of step 4 at 100.0 and 101.5 (a log line's time less
    its sync_s); both take the merge at 108.0 and the relay commits at 103.0: the first
    waited 1.5 s for the second's delta, which no sync could save; the rest is the same
    for both, and 1.5 s of it is up to the commit."""
    syncs = [
        {"island": "eu-0", "step": 4, "sync_s": 8.0, "end": 108.0},
        {"island": "eu-1", "step": 4, "sync_s": 6.5, "end": 108.0},
        {"island": "eu-0", "step": 6, "sync_s": 5.0, "end": 120.0},
    ]
    bench.split_skew(syncs, {4: 103.0}, {4: 105.5})
    assert [s["skew_s"] for s in syncs] == [1.5, 0.0, 0.0]
    assert [s["net_s"] for s in syncs] == [6.5, 6.5, 5.0]
    assert [s.get("to_commit_s") for s in syncs] == [1.5, 1.5, None]
    assert [s.get("after_commit_s") for s in syncs] == [5.0, 5.0, None]
    # the aggregator logs its round at 105.5: 2.5 s after the relay's commit, 2.5 s
    # before the islands take the merge
    assert [s.get("forward_step_s") for s in syncs] == [2.5, 2.5, None]
    assert [s.get("back_s") for s in syncs] == [2.5, 2.5, None]
    line = "event=sync role=island step=4 sync_s=6.5 ts=2026-12-05T09:38:24.234Z"
    assert bench.log_seconds(bench.parse_logfmt(line)) == 1796463504.234


def test_part_b_floor_of_each_sync_counts_what_could_go_before_the_last_end_of_training() -> None:
    """Step 4: eu-0 ends training at 100.0, eu-1 at 100.5; the case's work before the
    first island can have the merge is 2.0 s over the cores, one island's own path 0.75 s.
    eu-1 (the last): its own path after its end (0.75) or the 2.0 s less the 0.5 s its
    end came after the first (1.5), so 1.5.  eu-0: the 0.5 s wait plus the last island's
    path (1.25) or the whole 2.0 s, so 2.0.  Step 2's syncs are not used."""
    syncs = [
        {"step": 2, "trained": 50.0, "skew_s": 0.0},
        {"step": 4, "trained": 100.0, "skew_s": 0.5},
        {"step": 4, "trained": 100.5, "skew_s": 0.0},
    ]
    work, disk = bench.sync_floors(syncs, [4], 2.0, 0.75, 0.25)
    assert work == statistics.median([2.0, 1.5])
    # the last island's delta, then its forward, after its end of training
    assert disk == statistics.median([0.5 + 0.25, 0.25])
    # far apart, the wait and the last island's own path are the floor
    syncs[1]["trained"], syncs[1]["skew_s"] = 97.0, 3.5
    work, _ = bench.sync_floors(syncs, [4], 2.0, 0.75, 0.25)
    assert work == statistics.median([3.5 + 0.75, max(0.75, 2.0 - 3.5)])


def test_costs_measured_twice_keep_the_lesser_of_each_piece() -> None:
    a = only(tcp=1.0, digest=3.0, encode=2.0, fp32_add=5.0)
    b = only(tcp=2.0, digest=1.0, encode=4.0, fp32_add=1.0, outer=1.0)
    both = a.least(b)
    assert (both.tcp, both.digest, both.outer) == (1.0, 1.0, 0.0)
    assert both.encode == {"fp32": 0.0, "int8": 2.0}
    assert both.decode_acc == {"fp32": 1.0, "int8": 0.0}
    assert "decode+add" in both.describe()


def test_part_b_split_without_the_aggregator_s_times_leaves_the_rest_whole() -> None:
    syncs = [{"island": "eu-0", "step": 4, "sync_s": 8.0, "end": 108.0}]
    bench.split_skew(syncs, {4: 103.0})
    assert syncs[0]["after_commit_s"] == 5.0
    assert "forward_step_s" not in syncs[0] and "back_s" not in syncs[0]


def _poller_with(samples: list[tuple[float, dict[str, int], int]]) -> bench.RssPoller:
    poller = bench.RssPoller(period=3600.0)  # its thread polls nothing in this test
    poller.stopped.set()
    poller.thread.join()
    poller.cpu = [bench.CpuSample(t, d, busy) for t, d, busy in samples]
    return poller


def test_cpu_of_a_sync_window_sums_each_role_from_the_samples_after_its_ends() -> None:
    """Samples at 10, 11, 12.5 and 14 s; a sync from 10.5 to 12.2 is measured from the
    samples at 11 and 12.5 (the first at or after each end); ticks are per CLOCK_TICKS."""
    tick = bench.CLOCK_TICKS
    names = ("relay-eu", "aggregator", "island-eu-0", "island-eu-1")
    at = [
        (10.0, (0, 0, 0, 0), 0),
        (11.0, (1, 2, 3, 4), 10),
        (12.5, (1 + 2 * tick, 2 + tick, 3 + tick // 2, 4 + tick // 2), 10 + 3 * tick),
        (14.0, (9 * tick, 9 * tick, 9 * tick, 9 * tick), 20 * tick),
    ]
    poller = _poller_with([(t, dict(zip(names, v, strict=True)), busy) for t, v, busy in at])
    used = [{"trained": 10.5, "end": 12.2}, {"trained": 10.9, "end": 12.5}]
    got = bench.sync_cpu(used, poller, tcp_s=0.5)
    assert used[0]["cpu"]["seconds"] == 1.5
    assert used[0]["cpu"]["busy_cores"] == pytest.approx(2.0)
    assert got["cpu_by_role"] == {"relay": 2.0, "aggregator": 1.0, "islands": 1.0}
    assert got["cpu_s"] == 4.0 and got["busy_cores"] == pytest.approx(2.0)
    cores = bench.os.cpu_count() or 1
    assert got["cpu_bound_over_tcp"] == pytest.approx(4.0 / cores / 0.5)
    # a window the samples do not span is left out, and with none there is no figure
    assert bench.sync_cpu([{"trained": 13.0, "end": 15.0}], poller, 0.5) == {}


def test_the_poller_reads_cpu_time_of_a_process_and_of_the_machine() -> None:
    """Against this very process: burning CPU between two polls shows in both figures."""
    poller = bench.RssPoller(period=3600.0)
    poller.watch("island-me", bench.os.getpid())
    poller.poll()
    t0 = bench.time.time()
    end = bench.time.process_time() + 0.3
    while bench.time.process_time() < end:
        pass
    bench.time.sleep(0.05)
    poller.poll()
    poller.stop()
    got = poller.cpu_in(t0 - 1.0, t0 + 0.01)
    assert got is not None
    assert 0.2 <= got["daemons"]["island-me"] <= 5.0
    assert got["busy_cores"] > 0.0
