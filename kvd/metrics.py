"""Prometheus metrics, off by default (``metrics_port = 0``).

The hot path pays next to nothing: :meth:`Metrics.observe_step`, :meth:`Metrics.inc_malformed` and
:meth:`Metrics.inc_error` only bump plain ints on the event-loop thread (no locks, no prometheus
objects), and pool gauges are not kept at all: a custom collector reads them from the stats source
at scrape time. Exported (``pool`` is "gpu" or "cpu")::

    kvd_pool_blocks{pool}                 gauge    blocks in the pool
    kvd_pool_free_blocks{pool}            gauge
    kvd_pool_used_blocks{pool}            gauge
    kvd_pool_cached_blocks{pool}          gauge    blocks holding a prefix-cache hash
    kvd_pool_usage_ratio{pool}            gauge    used / blocks
    kvd_prefix_queries_total{pool}        counter  prefix-cache lookups (as the manager counts them)
    kvd_prefix_hits_total{pool}           counter
    kvd_evictions_total{pool}             counter  cached blocks evicted for reuse
    kvd_swaps_total{pool,direction}       counter  direction "out" or "in"
    kvd_cow_copies_total{pool}            counter  copy-on-write block copies
    kvd_sessions                          gauge    connected client sessions
    kvd_step_seconds                      histogram time to apply one scheduler step
    kvd_malformed_messages_total          counter
    kvd_errors_total{code,error}          counter  typed errors returned to clients
    kvd_metrics_source_errors_total       counter  scrapes whose stats source raised
    kvd_no_space_answers_total{tenant}    counter  LATER / NEVER answers to admissions and appends
    kvd_swap_requests_total{direction,result}  counter  swap_out / swap_in calls by result
                                          ("ok", "later", "never"); swap-outs that succeed are
                                          the preemptions the daemon can see (a preemption by
                                          recomputation is an ordinary free to it)
    kvd_lease_expiries_total              counter  sessions ended because their lease expired
    kvd_tenant_sessions{tenant}           gauge    sessions of each tenant
    kvd_tenant_requests{tenant}           gauge    live requests of each tenant
    kvd_tenant_block_refs{tenant}         gauge    block references its requests hold (a block
                                          shared by two requests counts twice)
    kvd_build_info{version}               gauge    always 1

``/healthz`` on the same port answers 200 "ok" while the daemon's loop runs (it calls
:meth:`Metrics.beat` every tick) and 503 when it has not for ``HEALTH_STALE_S`` seconds.

The endpoint listens on loopback by default; it has no authentication, so keep it there.

The stats source is called from the HTTP server's thread: it must be safe to call concurrently with
the event loop (return a snapshot refreshed on the loop, or read only plain ints). If it raises, the
scrape still succeeds without the pool metrics and ``kvd_metrics_source_errors_total`` goes up.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import time
from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

import kvd
from kvd.errors import ERROR_BY_CODE

__all__ = ["Metrics", "STEP_BUCKETS"]

log = logging.getLogger(__name__)

STEP_BUCKETS: tuple[float, ...] = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6,
    1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0,
)  # fmt: skip
"""Upper bounds (seconds) of the step-latency histogram; +Inf is implied."""

_POOL_GAUGES = (
    ("kvd_pool_blocks", "num_blocks", "Blocks in the pool."),
    ("kvd_pool_free_blocks", "num_free_blocks", "Free blocks (cached blocks with no user included)."),
    ("kvd_pool_used_blocks", "num_used_blocks", "Blocks referenced by at least one request."),
    ("kvd_pool_cached_blocks", "num_cached_blocks", "Blocks holding a prefix-cache hash."),
)
_POOL_COUNTERS = (
    ("kvd_prefix_queries", "prefix_queries", "Prefix-cache lookups (as the manager counts them)."),
    ("kvd_prefix_hits", "prefix_hits", "Prefix-cache hits (same unit as kvd_prefix_queries_total)."),
    ("kvd_evictions", "evictions", "Cached blocks evicted for reuse."),
    ("kvd_cow_copies", "cow_copies", "Copy-on-write block copies."),
)

StatsSource = Callable[[], dict[str, Any]]

HEALTH_STALE_S = 5.0
"""``/healthz`` answers 503 when the loop has not beaten for this long (50 ticks of 0.1 s)."""
_SWAP_RESULTS = ("ok", "later", "never")  # AllocStatus order


class Metrics:
    """The daemon's metrics. Create one, wire :meth:`set_source`, and :meth:`start_http` when
    ``metrics_port`` is set. ``registry=None`` makes a private registry (with the process
    collector), so several instances can coexist in one process (tests)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        if registry is None:
            from prometheus_client.process_collector import ProcessCollector

            registry = CollectorRegistry(auto_describe=True)
            ProcessCollector(registry=registry)
        self.registry = registry
        self._source: StatsSource | None = None
        self._buckets = [0] * (len(STEP_BUCKETS) + 1)
        self._step_sum = 0.0
        self.malformed = 0
        self.errors: dict[int, int] = {}
        self.source_errors = 0
        self.no_space: dict[str, int] = {}
        self.swaps: dict[tuple[str, str], int] = {}
        self.lease_expiries = 0
        self._last_beat = time.monotonic()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._collector = _Collector(self)
        registry.register(self._collector)

    # -- hot path (event-loop thread) -------------------------------------------------------------

    def observe_step(self, seconds: float) -> None:
        """Record the time one scheduler step took."""
        self._buckets[bisect.bisect_left(STEP_BUCKETS, seconds)] += 1
        self._step_sum += seconds

    def inc_malformed(self) -> None:
        """Count a message that could not be parsed (bad framing, size, version)."""
        self.malformed += 1

    def inc_error(self, code: int) -> None:
        """Count a typed error (``kvd.errors`` code) sent back to a client."""
        self.errors[code] = self.errors.get(code, 0) + 1

    def inc_no_space(self, tenant: str, n: int = 1) -> None:
        """Count ``n`` LATER / NEVER answers given to ``tenant``."""
        self.no_space[tenant] = self.no_space.get(tenant, 0) + n

    def inc_swap(self, out: bool, status: int, blocks: int = 0) -> None:
        """Count one swap_out (``out``) or swap_in call and its status (an ``AllocStatus``)."""
        key = ("out" if out else "in", _SWAP_RESULTS[status] if 0 <= status < 3 else "error")
        self.swaps[key] = self.swaps.get(key, 0) + 1

    def inc_lease_expired(self) -> None:
        """Count a session ended because its lease expired."""
        self.lease_expiries += 1

    def beat(self) -> None:
        """The daemon's loop is alive (called every tick; read by ``/healthz``)."""
        self._last_beat = time.monotonic()

    def healthy(self) -> bool:
        return time.monotonic() - self._last_beat < HEALTH_STALE_S

    def set_source(self, fn: StatsSource | None) -> None:
        """``fn()`` returns ``{"pools": {"gpu": {...}, "cpu": {...}}, "sessions": int}``, read at
        scrape time (from the HTTP thread)."""
        self._source = fn

    # -- endpoint -----------------------------------------------------------------------------------

    def start_http(self, host: str, port: int, *, allow_ephemeral: bool = False) -> int:
        """Serve ``/metrics`` on ``host:port``; returns the bound port. Port 0 means "off" in the
        config, so it is refused unless ``allow_ephemeral=True`` (tests), which binds any free port."""
        if self._server is not None:
            raise RuntimeError("metrics endpoint already started")
        if not 0 <= port <= 65535 or (port == 0 and not allow_ephemeral):
            from kvd.errors import InvalidArgument

            raise InvalidArgument(f"metrics port {port} (0 means off; pass allow_ephemeral=True for any free port)")
        server, thread = self._serve(host, port)
        self._server, self._thread = server, thread
        bound = int(server.server_address[1])
        log.info("metrics endpoint on http://%s:%d/metrics", _bracket(host), bound)
        return bound

    def _serve(self, host: str, port: int):
        """prometheus_client's WSGI app behind ``/metrics``, plus ``/healthz``."""
        from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family, _SilentHandler

        metrics_app = make_wsgi_app(self.registry)

        def app(environ, start_response):
            if environ.get("PATH_INFO") == "/healthz":
                ok = self.healthy()
                start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
                return [b"ok\n" if ok else b"stalled\n"]
            return metrics_app(environ, start_response)

        class Server(ThreadingWSGIServer):
            pass

        Server.address_family, addr = _get_best_family(host, port)
        httpd = make_server(addr, port, app, Server, handler_class=_SilentHandler)
        thread = threading.Thread(target=httpd.serve_forever, name="kvd-metrics", daemon=True)
        thread.start()
        return httpd, thread

    def stop(self) -> None:
        """Stop the endpoint (idempotent)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    # -- scrape -------------------------------------------------------------------------------------

    def _snapshot(self) -> dict[str, Any] | None:
        fn = self._source
        if fn is None:
            return None
        try:
            stats = fn()
            return stats if isinstance(stats, dict) else None
        except Exception:  # noqa: BLE001 - a scrape must not fail because of the source
            self.source_errors += 1
            log.debug("metrics source raised", exc_info=True)
            return None


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class _Collector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def describe(self) -> Iterator[Metric]:
        return iter(())  # unchecked collector: names are fixed, values come at scrape time

    def collect(self) -> Iterator[Metric]:
        m = self.m
        info = GaugeMetricFamily("kvd_build_info", "kvd version.", labels=["version"])
        info.add_metric([kvd.__version__], 1)
        yield info

        stats = m._snapshot()
        if stats is not None:
            pools: dict[str, dict[str, Any]] = stats.get("pools") or {}
            for name, key, doc in _POOL_GAUGES:
                g = GaugeMetricFamily(name, doc, labels=["pool"])
                for pool, p in pools.items():
                    if key in p:
                        g.add_metric([pool], float(p[key]))
                yield g
            usage = GaugeMetricFamily("kvd_pool_usage_ratio", "Used blocks / blocks.", labels=["pool"])
            for pool, p in pools.items():
                if p.get("num_blocks"):
                    usage.add_metric([pool], float(p.get("num_used_blocks", 0)) / float(p["num_blocks"]))
            yield usage
            for name, key, doc in _POOL_COUNTERS:
                c = CounterMetricFamily(name, doc, labels=["pool"])
                for pool, p in pools.items():
                    if key in p:
                        c.add_metric([pool], float(p[key]))
                yield c
            swaps = CounterMetricFamily("kvd_swaps", "Blocks swapped between pools.", labels=["pool", "direction"])
            for pool, p in pools.items():
                for direction in ("out", "in"):
                    if f"swaps_{direction}" in p:
                        swaps.add_metric([pool, direction], float(p[f"swaps_{direction}"]))
            yield swaps
            sessions = stats.get("sessions", 0)
            n = sessions if isinstance(sessions, int) else len(sessions or ())
            yield GaugeMetricFamily("kvd_sessions", "Connected client sessions.", value=n)
            yield from _tenant_gauges(stats.get("tenants") or {})

        buckets = list(m._buckets)  # one snapshot, so +Inf == count
        cumulative, acc = [], 0
        for bound, count in zip((*STEP_BUCKETS, float("inf")), buckets):
            acc += count
            cumulative.append((_le(bound), acc))
        yield HistogramMetricFamily(
            "kvd_step_seconds", "Time to apply one scheduler step.", buckets=cumulative, sum_value=m._step_sum
        )
        yield CounterMetricFamily(
            "kvd_malformed_messages", "Messages that could not be parsed.", value=m.malformed
        )
        errors = CounterMetricFamily("kvd_errors", "Typed errors returned to clients.", labels=["code", "error"])
        seen = dict.fromkeys(ERROR_BY_CODE, 0)
        seen.update(m.errors)
        for code, count in sorted(seen.items()):
            cls = ERROR_BY_CODE.get(code)
            errors.add_metric([str(code), cls.__name__ if cls else "unknown"], count)
        yield errors
        yield CounterMetricFamily(
            "kvd_metrics_source_errors", "Scrapes whose stats source raised.", value=m.source_errors
        )
        no_space = CounterMetricFamily("kvd_no_space_answers", "LATER / NEVER answers to admissions and appends.",
                                       labels=["tenant"])
        for tenant, count in sorted(dict(m.no_space).items()):
            no_space.add_metric([tenant], count)
        yield no_space
        swaps = CounterMetricFamily("kvd_swap_requests", "swap_out / swap_in calls by result.",
                                    labels=["direction", "result"])
        for (direction, result), count in sorted(dict(m.swaps).items()):
            swaps.add_metric([direction, result], count)
        yield swaps
        yield CounterMetricFamily("kvd_lease_expiries", "Sessions ended because their lease expired.",
                                  value=m.lease_expiries)


def _tenant_gauges(tenants: dict[str, dict[str, int]]) -> Iterator[Metric]:
    for name, key, doc in (("kvd_tenant_sessions", "sessions", "Sessions of each tenant."),
                           ("kvd_tenant_requests", "requests", "Live requests of each tenant."),
                           ("kvd_tenant_block_refs", "block_refs", "Block references held by each tenant.")):
        g = GaugeMetricFamily(name, doc, labels=["tenant"])
        for tenant, usage in sorted(tenants.items()):
            g.add_metric([tenant], float(usage.get(key, 0)))
        yield g


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))
