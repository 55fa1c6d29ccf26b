"""`edgellm bench`'s load generator: in-process and HTTP targets, reports and plots."""

from __future__ import annotations

import json

from edgellm.entrypoints.async_engine import AsyncEngine
from edgellm.entrypoints.serve import ServerThread, build_app
from edgellm.eval import loadgen
from tests.conftest import byte_tokenizer, tiny_engine


def workload(n=12, dist="uniform"):
    return loadgen.make_workload(byte_tokenizer(), n, 24, 10, dist, seed=1)


def test_workload_lengths():
    w = workload(200, "uniform")
    assert all(12 <= len(p.encode()) <= 36 for p in w.prompts)  # one token per byte
    assert all(5 <= n <= 15 for n in w.max_tokens) and len(set(w.max_tokens)) > 3
    fixed = loadgen.make_workload(byte_tokenizer(), 5, 24, 10, "fixed")
    assert fixed.max_tokens == [10] * 5 and all(len(p.encode()) == 24 for p in fixed.prompts)


def test_in_process_sweep_writes_json_and_png(tmp_path):
    aeng = AsyncEngine(tiny_engine(kv_cache_mb=4.0))
    w = workload()
    try:
        results = loadgen.sweep(loadgen.EngineTarget(aeng), w, [1, 4])
        m = aeng.metrics()
    finally:
        aeng.shutdown()
    assert m["blocks_used"] == 0
    for r in results:
        assert sorted(x.output_tokens for x in r.records) == sorted(w.max_tokens)
        assert all(0 < x.ttft_s <= x.e2e_s for x in r.records)
    png = loadgen.write_report(results, {"title": "test"}, tmp_path / "bench.json")
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 4]
    for lv in data["levels"]:
        assert lv["requests"] == 12
        assert lv["e2e_p50_ms"] <= lv["e2e_p90_ms"] <= lv["e2e_p99_ms"]
        assert lv["output_tokens_per_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "| 4 | 12 |" in loadgen.format_table(results)


def test_http_target_with_poisson_arrivals():
    aeng = AsyncEngine(tiny_engine(kv_cache_mb=4.0))
    w = workload(10)
    try:
        with ServerThread(build_app(aeng, "tiny")) as srv:
            target = loadgen.HTTPTarget(srv.url, "tiny")
            (result,) = loadgen.sweep(target, w, [], rate=50.0)
    finally:
        aeng.shutdown()
    assert result.rate == 50.0 and len(result.records) == 10
    assert sorted(x.output_tokens for x in result.records) == sorted(w.max_tokens)
    assert result.summary()["requests_per_s"] > 0
