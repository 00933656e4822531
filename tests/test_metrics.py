"""The Prometheus endpoint, scraped over HTTP on loopback, with values checked exactly."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvd.errors import CapacityExceeded, InvalidArgument, UnknownRequest
from kvd.metrics import HEALTH_STALE_S, STEP_BUCKETS, Metrics

POOL = dict(
    num_blocks=1000, num_free_blocks=700, num_used_blocks=300, num_cached_blocks=120,
    prefix_queries=50, prefix_hits=20, evictions=7, swaps_out=4, swaps_in=3, cow_copies=2,
)  # fmt: skip


@pytest.fixture
def metrics():
    m = Metrics()
    try:
        yield m
    finally:
        m.stop()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_scrape_exact_values(metrics):
    state = {"pools": {"gpu": dict(POOL), "cpu": dict(POOL, num_blocks=10, num_used_blocks=5)}, "sessions": 3,
             "tenants": {"alice": {"sessions": 2, "requests": 5, "block_refs": 40}}}
    metrics.set_source(lambda: state)
    for seconds in (30e-6, 30e-6, 0.002, 5.0):
        metrics.observe_step(seconds)
    metrics.observe_step(STEP_BUCKETS[0])  # on a bound: counted in that bucket (le)
    metrics.inc_malformed()
    metrics.inc_malformed()
    metrics.inc_error(UnknownRequest.code)
    metrics.inc_error(UnknownRequest.code)
    metrics.inc_error(CapacityExceeded.code)
    metrics.inc_error(99)  # unknown code: still counted
    metrics.inc_no_space("alice", 3)
    metrics.inc_no_space("", 1)
    metrics.inc_swap(True, 0)
    metrics.inc_swap(True, 0)
    metrics.inc_swap(False, 1)
    metrics.inc_lease_expired()
    port = metrics.start_http("127.0.0.1", 0, allow_ephemeral=True)
    s = scrape(port)

    gpu = (("pool", "gpu"),)
    assert s[("kvd_pool_blocks", gpu)] == 1000
    assert s[("kvd_pool_free_blocks", gpu)] == 700
    assert s[("kvd_pool_used_blocks", gpu)] == 300
    assert s[("kvd_pool_cached_blocks", gpu)] == 120
    assert s[("kvd_pool_usage_ratio", gpu)] == 0.3
    assert s[("kvd_pool_usage_ratio", (("pool", "cpu"),))] == 0.5
    assert s[("kvd_prefix_queries_total", gpu)] == 50
    assert s[("kvd_prefix_hits_total", gpu)] == 20
    assert s[("kvd_evictions_total", gpu)] == 7
    assert s[("kvd_cow_copies_total", gpu)] == 2
    assert s[("kvd_swaps_total", (("direction", "out"), ("pool", "gpu")))] == 4
    assert s[("kvd_swaps_total", (("direction", "in"), ("pool", "gpu")))] == 3
    assert s[("kvd_sessions", ())] == 3
    assert s[("kvd_malformed_messages_total", ())] == 2
    assert s[("kvd_errors_total", (("code", "18"), ("error", "UnknownRequest")))] == 2
    assert s[("kvd_errors_total", (("code", "23"), ("error", "CapacityExceeded")))] == 1
    assert s[("kvd_errors_total", (("code", "99"), ("error", "unknown")))] == 1
    assert s[("kvd_errors_total", (("code", "32"), ("error", "ProtocolError")))] == 0
    assert s[("kvd_no_space_answers_total", (("tenant", "alice"),))] == 3
    assert s[("kvd_no_space_answers_total", (("tenant", ""),))] == 1
    assert s[("kvd_swap_requests_total", (("direction", "out"), ("result", "ok")))] == 2
    assert s[("kvd_swap_requests_total", (("direction", "in"), ("result", "later")))] == 1
    assert s[("kvd_lease_expiries_total", ())] == 1
    alice = (("tenant", "alice"),)
    assert s[("kvd_tenant_sessions", alice)] == 2 and s[("kvd_tenant_requests", alice)] == 5
    assert s[("kvd_tenant_block_refs", alice)] == 40
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
        assert resp.status == 200 and resp.read() == b"ok\n"
    metrics._last_beat -= HEALTH_STALE_S + 1  # the loop stopped beating
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)
    assert e.value.code == 503
    metrics.beat()
    assert s[("kvd_step_seconds_count", ())] == 5
    assert s[("kvd_step_seconds_sum", ())] == pytest.approx(5.002085)
    assert s[("kvd_step_seconds_bucket", (("le", "2.5e-05"),))] == 1
    assert s[("kvd_step_seconds_bucket", (("le", "5e-05"),))] == 3
    assert s[("kvd_step_seconds_bucket", (("le", "0.0025"),))] == 4
    assert s[("kvd_step_seconds_bucket", (("le", "1.0"),))] == 4
    assert s[("kvd_step_seconds_bucket", (("le", "+Inf"),))] == 5
    assert s[("kvd_metrics_source_errors_total", ())] == 0
    assert s[("kvd_build_info", (("version", __import__("kvd").__version__),))] == 1

    # Read at scrape time: a change in the source shows up in the next scrape.
    state["pools"]["gpu"]["evictions"] = 8
    state["sessions"] = [{"id": "a"}]
    s = scrape(port)
    assert s[("kvd_evictions_total", gpu)] == 8
    assert s[("kvd_sessions", ())] == 1


def test_no_source_and_failing_source(metrics):
    port = metrics.start_http("127.0.0.1", 0, allow_ephemeral=True)
    s = scrape(port)
    assert ("kvd_pool_blocks", (("pool", "gpu"),)) not in s
    assert s[("kvd_step_seconds_count", ())] == 0

    def broken():
        raise RuntimeError("dict changed size during iteration")

    metrics.set_source(broken)
    s = scrape(port)  # the scrape still succeeds
    assert s[("kvd_metrics_source_errors_total", ())] == 1
    assert s[("kvd_malformed_messages_total", ())] == 0


def test_port_zero_means_off_unless_asked(metrics):
    with pytest.raises(InvalidArgument):
        metrics.start_http("127.0.0.1", 0)
    with pytest.raises(InvalidArgument):
        metrics.start_http("127.0.0.1", 70000)


def test_stop_closes_the_port_and_is_idempotent():
    m = Metrics()
    try:
        port = m.start_http("127.0.0.1", 0, allow_ephemeral=True)
        scrape(port)
    finally:
        m.stop()
    m.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_instances_do_not_collide_and_custom_registry():
    reg = CollectorRegistry()
    a, b = Metrics(reg), Metrics()
    a.inc_malformed()
    assert reg.get_sample_value("kvd_malformed_messages_total") == 1
    assert b.registry.get_sample_value("kvd_malformed_messages_total") == 0


def test_hot_path_is_cheap():
    import time

    m = Metrics()
    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        m.observe_step(1e-4)
    per_call = (time.perf_counter() - t0) / n
    assert per_call < 5e-6, per_call  # plain ints, no locks (typically ~0.2 µs)
