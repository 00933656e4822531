"""The ``kvd`` command: ``serve``, ``status``, ``bench``.

``status`` asks the daemon (its ``status`` op, through a short session it leaves out of the listing)
and prints a table of pools, sessions (name, pid, tenant, requests, idle seconds) and tenants
(sessions, requests, block references); ``--json`` prints the same view as JSON. ``bench`` runs the
packaged ZeroMQ benchmark (``kvd.bench.zmq_bench``; ``$KVD_BENCH_SCRIPT`` runs another file).

Exit codes: 0 ok; 1 failure; 2 bad command line; 3 ``status`` could not reach a daemon;
78 (EX_CONFIG) invalid configuration. The unit files set ``RestartPreventExitStatus=2 78`` so a bad
configuration fails once instead of restart-looping.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kvd
from kvd.config import ConfigError, ServeConfig, add_config_flags, load_config, setup_logging

__all__ = ["main", "build_parser", "EXIT_CONFIG", "EXIT_UNREACHABLE"]

EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_CONFIG = 78
SYSTEM_SOCKET = "/run/kvd/kvd.sock"
"""Socket of the system unit kvd.service, tried by ``kvd status`` when nothing else is configured."""

log = logging.getLogger("kvd.cli")

_DESCRIPTION = """\
kvd: a KV-cache block manager daemon for LLM inference engines.

One daemon per GPU owns the paged KV-cache block pool; engine processes on the host talk to it over
ZeroMQ and get block tables and slot mappings back through shared memory."""

_EPILOG = """\
examples:
  kvd serve --device cuda:0 --num-gpu-blocks 32768      run in the foreground
  kvd serve --config /etc/kvd/kvd.toml                  as the systemd unit does
  kvd status                                            ask the daemon on the default socket
  kvd status --endpoint ipc:///run/kvd/1/kvd.sock --json
  kvd bench --help                                      the ZeroMQ benchmark's own options
  kvd bench --scale --plot scale.png                    the scaling table (R = 64 .. 4,096)

Every serve option is also a TOML key (--config) and an environment variable KVD_<KEY>."""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


class _WrapFormatter(argparse.HelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvd", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=_Formatter
    )
    parser.add_argument("--version", action="version", version=f"kvd {kvd.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    serve = sub.add_parser(
        "serve",
        help="run the daemon in the foreground (systemd Type=notify)",
        description="Run the daemon in the foreground. Under systemd it reports READY=1 once the "
        "socket is bound, the pool allocated and the kernels warmed, pings the watchdog and "
        "reports STOPPING=1 on SIGTERM.",
        formatter_class=_WrapFormatter,
    )
    add_config_flags(serve)

    status = sub.add_parser(
        "status",
        help="show pools, sessions, usage, hit rate and evictions of a running daemon",
        description="Ask a running daemon for its statistics. The daemon is found the way "
        "`kvd serve` would bind it: --endpoint, else --runtime-dir, else $KVD_ENDPOINT, "
        "the --config file, $RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/kvd or /tmp/kvd-UID. "
        "Exit status 3 if no daemon answers.",
        formatter_class=_WrapFormatter,
    )
    status.add_argument("--json", action="store_true", help="print the raw statistics as JSON")
    status.add_argument("--config", metavar="PATH", default=None, help="TOML config file of the daemon")
    status.add_argument("--endpoint", metavar="STR", default=None, help="the daemon's ZeroMQ endpoint")
    status.add_argument("--runtime-dir", metavar="DIR", default=None, help="directory of the daemon's socket")

    sub.add_parser(
        "bench",
        help="run the ZeroMQ benchmark (kvd.bench.zmq_bench); arguments are passed through",
        description="Run kvd.bench.zmq_bench with the remaining arguments (see `kvd bench --help`).",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `bench` forwards everything after it, --help included, to the benchmark's own parser.
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        cfg = load_config(args)
    except ConfigError as exc:
        return _config_error(exc)
    if args.command == "serve":
        return _serve(cfg)
    if args.command == "status":
        return _status(cfg, as_json=args.json)
    raise AssertionError(args.command)  # pragma: no cover


def _config_error(exc: ConfigError) -> int:
    from kvd.systemd import notify

    print(f"kvd: invalid configuration: {exc}", file=sys.stderr)
    notify(f"STATUS=invalid configuration: {exc}")
    return EXIT_CONFIG


# ---------------------------------------------------------------------------------------------------
# serve


def _serve(cfg: ServeConfig) -> int:
    setup_logging(cfg.log_level)
    log.info(
        "kvd %s starting: device=%s endpoint=%s gpu_blocks=%d cpu_blocks=%d groups=%s",
        kvd.__version__,
        cfg.device,
        cfg.resolved_endpoint(),
        cfg.num_gpu_blocks,
        cfg.num_cpu_blocks,
        ",".join(f"{bs}:{sw}" if sw else str(bs) for bs, sw in cfg.group_specs()),
    )
    log.debug("effective configuration: %s", json.dumps(cfg.to_dict(), sort_keys=True))
    from kvd import server  # lazy: pulls in zmq, uvloop and (on GPU) torch + triton

    try:
        code = server.serve(cfg)
    except ConfigError as exc:
        return _config_error(exc)
    except KeyboardInterrupt:
        return 130
    return int(code or 0)


# ---------------------------------------------------------------------------------------------------
# status


def _status(cfg: ServeConfig, *, as_json: bool) -> int:
    endpoint = cfg.resolved_endpoint()
    if endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://") :]):
        # Nothing configured explicitly: fall back to the system unit's socket.
        if not (cfg.endpoint or cfg.runtime_dir) and os.path.exists(SYSTEM_SOCKET):
            endpoint = "ipc://" + SYSTEM_SOCKET
        else:
            print(f"kvd status: no daemon socket at {endpoint[len('ipc://'):]}", file=sys.stderr)
            return EXIT_UNREACHABLE
    try:
        from kvd_client import Client
    except ImportError as exc:  # pragma: no cover - packaging problem
        print(f"kvd status: the client library is not installed: {exc}", file=sys.stderr)
        return 1
    client = None
    try:
        client = Client(endpoint, name=STATUS_SESSION_NAME, heartbeat=False)
        status = client.daemon_status()
    except Exception as exc:  # noqa: BLE001 - any failure to talk to the daemon is "unreachable"
        print(f"kvd status: no answer from {endpoint}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    finally:
        close = getattr(client, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001
                pass
    status = status_view(status)
    if as_json:
        print(json.dumps(status, indent=2, sort_keys=True, default=_json_default))
    else:
        print(format_status_table(status, endpoint))
    return 0


STATUS_SESSION_NAME = "kvd status"
"""The name of the session ``kvd status`` opens to ask; left out of the sessions it lists."""


def status_view(status: dict[str, Any]) -> dict[str, Any]:
    """The daemon's ``status`` answer as ``kvd status`` shows it: pools split (``normalize_stats``),
    sessions and tenants as lists, this command's own session left out."""
    if "pool" not in status:
        return normalize_stats(status)
    view = normalize_stats(dict(status["pool"]))
    mine = os.getpid()
    sessions, own = [], []
    for s in status.get("sessions", ()):
        (own if s.get("name") == STATUS_SESSION_NAME and s.get("pid") == mine else sessions).append(s)
    tenants = []
    for t in status.get("tenants", ()):
        t = dict(t, sessions=t.get("sessions", 0) - sum(s.get("tenant") == t.get("tenant") for s in own))
        if t["sessions"] > 0 or t.get("requests", 0):
            tenants.append(t)
    view.update(daemon=status.get("daemon", {}), sessions=sessions, tenants=tenants)
    return view


POOL_KEYS = (
    "num_blocks", "num_free_blocks", "num_used_blocks", "num_cached_blocks", "prefix_queries",
    "prefix_hits", "evictions", "swaps_out", "swaps_in", "cow_copies",
)  # fmt: skip


def normalize_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """The ``{"pools": {"gpu": {...}, "cpu": {...}}, "sessions": ...}`` shape, also from a flat
    manager stats dict (pool keys at the top, ``num_cpu_blocks`` / ``num_free_cpu_blocks``)."""
    if not isinstance(stats, dict) or "pools" in stats:
        return stats
    rest = dict(stats)
    gpu = {k: rest.pop(k) for k in POOL_KEYS if k in rest}
    pools: dict[str, dict[str, Any]] = {"gpu": gpu}
    if "num_cpu_blocks" in rest:
        total = int(rest.pop("num_cpu_blocks"))
        free = int(rest.pop("num_free_cpu_blocks", total))
        if total:
            pools["cpu"] = {"num_blocks": total, "num_free_blocks": free, "num_used_blocks": total - free}
    return {"pools": pools, "sessions": rest.pop("sessions", 0), **rest}


def _json_default(obj: Any) -> Any:
    for attr in ("tolist", "item"):
        if hasattr(obj, attr):
            return getattr(obj, attr)()
    if isinstance(obj, bytes):
        return obj.hex()
    return str(obj)


def _pct(num: float, den: float) -> str:
    return f"{100.0 * num / den:.1f}%" if den else "-"


def format_status_table(stats: dict[str, Any], endpoint: str = "") -> str:
    """Human-readable ``kvd status`` output."""
    lines = []
    head = "kvd"
    if stats.get("version"):
        head += f" {stats['version']}"
    if endpoint:
        head += f" at {endpoint}"
    daemon = stats.get("daemon") or {}
    if daemon:
        head += " (" + ", ".join(f"{k} {_short(daemon[k])}" for k in ("pid", "epoch", "steps") if k in daemon) + ")"
    lines.append(head)
    pools = stats.get("pools") or {}
    cols = ("pool", "blocks", "free", "used", "cached", "usage", "hit rate", "evictions", "swaps out/in", "cow")
    rows = [cols]
    for name, p in pools.items():
        g = lambda k: int(p.get(k, 0))  # noqa: E731
        rows.append(
            (
                name,
                str(g("num_blocks")),
                str(g("num_free_blocks")),
                str(g("num_used_blocks")),
                str(g("num_cached_blocks")),
                _pct(g("num_used_blocks"), g("num_blocks")),
                _pct(g("prefix_hits"), g("prefix_queries")),
                str(g("evictions")),
                f"{g('swaps_out')}/{g('swaps_in')}",
                str(g("cow_copies")),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    sessions = stats.get("sessions", 0)
    if isinstance(sessions, int):
        lines.append(f"sessions: {sessions}")
    else:
        items = list(sessions.values()) if isinstance(sessions, dict) else list(sessions or ())
        if isinstance(sessions, dict):
            items = [{"id": k, **v} if isinstance(v, dict) else {"id": k, "value": v} for k, v in sessions.items()]
        lines.append(f"sessions: {len(items)}")
        lines += _table(items, (("name", "name"), ("pid", "pid"), ("tenant", "tenant"),
                                ("requests", "requests"), ("idle_s", "idle s")))
    tenants = stats.get("tenants")
    if tenants is not None:
        lines.append(f"tenants: {len(tenants)}")
        lines += _table(tenants, (("tenant", "tenant"), ("sessions", "sessions"), ("requests", "requests"),
                                  ("block_refs", "block refs")))
    for key in sorted(set(stats) - {"pools", "sessions", "tenants", "version", "daemon"}):
        lines.append(f"{key}: {_short(stats[key])}")
    return "\n".join(lines)


def _table(items: list, columns: tuple[tuple[str, str], ...]) -> list[str]:
    """Indented, aligned rows of ``items`` (dicts); keys outside ``columns`` are appended as k=v."""
    if not items:
        return []
    known = [k for k, _ in columns]
    rows = [[title for _, title in columns] + [""]]
    for it in items:
        if not isinstance(it, dict):
            rows.append([""] * len(columns) + [_short(it)])
            continue
        cells = ["''" if k == "tenant" and it.get(k) == "" else _short(it.get(k, "-")) for k in known]
        extra = " ".join(f"{k}={_short(v)}" for k, v in it.items() if k not in known)
        rows.append(cells + [extra])
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + ("  " + r[-1] if r[-1] else "")
            for r in rows]


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, bytes):
        return v.hex()
    return str(v)


# ---------------------------------------------------------------------------------------------------
# bench


def _bench_script() -> Path | None:
    """``$KVD_BENCH_SCRIPT`` (another benchmark file, for development), else None: the packaged one."""
    env = os.environ.get("KVD_BENCH_SCRIPT")
    return Path(env) if env else None


def _bench(args: list[str]) -> int:
    path = _bench_script()
    saved_argv = sys.argv
    try:
        if path is None:
            from kvd.bench.zmq_bench import main as bench_main

            sys.argv = ["kvd bench", *args]
        else:
            bench_main = _load_bench(path)
            if bench_main is None:
                return 1
            sys.argv = [str(path), *args]
        takes_args = bool(inspect.signature(bench_main).parameters)
        code = bench_main(args) if takes_args else bench_main()
    except SystemExit as exc:  # argparse --help / errors inside the benchmark
        code = exc.code
    finally:
        sys.argv = saved_argv
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _load_bench(path: Path):
    if not path.is_file():
        print(f"kvd bench: {path} not found", file=sys.stderr)
        return None
    spec = importlib.util.spec_from_file_location("kvd_bench_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    bench_main = getattr(module, "main", None)
    if bench_main is None:
        print(f"kvd bench: {path} has no main()", file=sys.stderr)
    return bench_main
