"""The memory fields every round's log line carries (services/wire/daemon.py)."""

from __future__ import annotations

import numpy as np

from hypertrain.wire.daemon import memory_fields


def test_memory_fields_follow_what_the_process_holds() -> None:
    before = memory_fields()
    assert set(before) == {"rss_mib", "anon_mib", "peak_mib"}
    assert 0 < before["anon_mib"] <= before["rss_mib"] <= before["peak_mib"]
    held = np.ones(96 << 20, dtype=np.uint8)  # 96 MiB, every page touched
    after = memory_fields()
    assert after["anon_mib"] - before["anon_mib"] >= 90
    assert after["peak_mib"] >= after["rss_mib"] >= before["rss_mib"] + 90
    del held
