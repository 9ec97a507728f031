"""What every log line carries (services/wire/daemon.py): memory fields at each round,
one write per line, the time it was written."""

from __future__ import annotations

import numpy as np

from hypertrain.wire.daemon import memory_fields


def test_memory_fields_follow_what_the_process_holds() -> None:
    """96 MiB touched shows in the fields.  In the full suite, threads left by earlier
    tests in this process may free memory at the same moment (the whole process is
    measured), so the growth is looked for in up to three tries, each after a
    collection and a heap trim."""
    import gc

    from hypertrain.wire.options import trim_heap

    grown: list[tuple[dict[str, int], dict[str, int]]] = []
    for _ in range(3):
        gc.collect()
        trim_heap()
        before = memory_fields()
        assert set(before) == {"rss_mib", "anon_mib", "peak_mib"}
        assert 0 < before["anon_mib"] <= before["rss_mib"] <= before["peak_mib"]
        held = np.ones(96 << 20, dtype=np.uint8)  # 96 MiB, every page touched
        after = memory_fields()
        del held
        assert after["peak_mib"] >= after["rss_mib"]
        grown.append((before, after))
        if (
            after["anon_mib"] - before["anon_mib"] >= 90
            and after["rss_mib"] >= before["rss_mib"] + 90
        ):
            return
    raise AssertionError(f"96 MiB held, the fields did not grow by it: {grown}")


def test_lines_from_many_threads_stay_whole(capsys) -> None:  # type: ignore[no-untyped-def]
    """Every line a daemon prints is one write (services/wire/lines.py): an evaluation
    thread's event and the main thread's announcement never run into one line."""
    import threading

    from hypertrain.wire.daemon import log_event
    from hypertrain.wire.server import announce

    def events(k: int) -> None:
        for i in range(300):
            log_event("eval", role="aggregator", round=k, step=i, heldout_loss=5.537755)

    threads = [threading.Thread(target=events, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for _ in range(300):
        announce("aggregator", "127.0.0.1:43615")
    for t in threads:
        t.join()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1500
    evals = [x for x in lines if x.startswith("event=eval ")]
    assert len(evals) == 1200 and all(" heldout_loss=5.537755 ts=" in x for x in evals)
    assert lines.count("hypertrain-aggregator listening on 127.0.0.1:43615") == 300


def test_every_line_ends_with_the_time_it_was_written(capsys) -> None:  # type: ignore[no-untyped-def]
    """``ts`` is the last field, UTC to the millisecond, between the clock before and after
    the write; a field's value that looks like a time changes nothing; ``log_time`` of a
    given Unix time is that time."""
    import datetime as dt
    import time

    from hypertrain.procs import parse_logfmt
    from hypertrain.wire.daemon import log_event, log_time

    before = time.time()
    log_event("round", role="relay", region="eu", message="ts=later", step=4)
    after = time.time()
    (line,) = capsys.readouterr().out.splitlines()
    head, _, ts = line.rpartition(" ts=")
    assert head == 'event=round role=relay region=eu message="ts=later" step=4'
    assert parse_logfmt(line)["ts"] == ts and parse_logfmt(line)["step"] == "4"
    assert len(ts) == len("2026-12-05T09:41:02.125Z") and ts.endswith("Z")
    when = dt.datetime.fromisoformat(ts).timestamp()
    assert int(before * 1000) / 1000 <= when <= after
    assert log_time(1796463504.2345) == "2026-12-05T09:38:24.234Z"
    assert log_time(0) == "1970-01-01T00:00:00.000Z"
