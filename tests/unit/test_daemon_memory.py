"""The memory fields every round's log line carries (services/wire/daemon.py)."""

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
    assert len(evals) == 1200 and all(x.endswith("heldout_loss=5.537755") for x in evals)
    assert lines.count("hypertrain-aggregator listening on 127.0.0.1:43615") == 300
