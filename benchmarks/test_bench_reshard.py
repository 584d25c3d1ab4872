"""pytest-benchmark suite: sharded trainer ranks into TP engine ranks, point to point beside the rank-0 funnel.

    python -m pytest benchmarks/test_bench_reshard.py --benchmark-only -s

One run of `wsync bench reshard` (4 trainer ranks -> 2 engine ranks, both paths, full and delta versions, in
spawned processes over tcp loopback): its small model by default, the 100 MB bench one with
WSYNC_BENCH_RESHARD=full.
It checks what does not depend on the machine (both paths leave the same bytes on every engine rank; the
busiest rank's share of the bytes and the delta's share of a full version meet the issue's targets) and
records the time ratios in extra_info: read them, never assert them.
"""
from __future__ import annotations

import os

from wsync_bench import reshard

FULL = os.environ.get("WSYNC_BENCH_RESHARD") == "full"


def test_reshard_point_to_point_vs_gather(benchmark):
    benchmark.group = "reshard 4 -> 2, publish -> committed on every engine rank"
    kw = {} if FULL else {"dims": reshard.SIZES["small"], "full_versions": 2, "delta_versions": 3}
    res = benchmark.pedantic(lambda: reshard.run(**kw), rounds=1, iterations=1)
    print("\n" + reshard.render(res))
    modes = res["modes"]
    benchmark.extra_info.update(model_bytes=res["model_bytes"], delta_vs_full_bytes=res["delta_vs_full_bytes"],
                                **{f"{m}_{k}": r[k] for m, r in modes.items()
                                   for k in ("time_vs_gather", "busiest_vs_gather")},
                                **{f"{m}_busiest_share": r["sharded"]["busiest_share"] for m, r in modes.items()})
    assert all(r["same_bytes_on_every_engine_rank"] for r in modes.values())
    for r in modes.values():  # no rank carries much more than its share: bytes, not times
        assert r["sharded"]["busiest_share"] <= r["busiest_target"], r
    assert res["delta_vs_full_bytes"] <= 0.02, res["delta_vs_full_bytes"]
