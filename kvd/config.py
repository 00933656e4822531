"""Daemon configuration: one frozen dataclass, four sources, and the logging setup.

Every field of :class:`ServeConfig` is a key of the TOML config file, a command-line flag and an
environment variable::

    block_size = 32            # kvd.toml
    --block-size 32            # flag (dashes for underscores)
    KVD_BLOCK_SIZE=32          # environment

Precedence is flag > environment > file > default. The file is named by ``--config PATH`` (or
``KVD_CONFIG=PATH``); there is no implicit search path, so what runs is what the unit file says.
An unknown key in the file, a value of the wrong type or out of range stops the daemon at start with
a :class:`ConfigError` (a :class:`kvd.errors.InvalidArgument`) whose message names the key and where
the value came from. An empty environment variable counts as unset. Unknown ``KVD_*`` variables are
reported with a warning, not rejected (other tools share the prefix).

Booleans from flags are ``--enable-prefix-caching`` / ``--no-enable-prefix-caching``; from the
environment ``1/true/yes/on`` and ``0/false/no/off``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import re
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvd.errors import InvalidArgument
from kvd.memory import parse_kv_cache
from kvd.tenancy import parse_tenants

__all__ = [
    "ConfigError",
    "ServeConfig",
    "FIELDS",
    "ENV_PREFIX",
    "add_config_flags",
    "load_config",
    "setup_logging",
]

ENV_PREFIX = "KVD_"
CONFIG_ENV = "KVD_CONFIG"
HASH_ALGOS = ("sha256", "xxh3_128", "vllm_sha256")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_DEVICE_RE = re.compile(r"cpu|cuda(:[0-9]+)?")
_ENDPOINT_RE = re.compile(r"(ipc|tcp)://.+")


class ConfigError(InvalidArgument):
    """A configuration key is unknown or its value is invalid. ``key`` names it."""

    def __init__(self, key: str, message: str, source: str | None = None) -> None:
        self.key = key
        self.source = source
        where = f" (from {source})" if source else ""
        super().__init__(f"config key {key!r}{where}: {message}")


# ---------------------------------------------------------------------------------------------------
# The configuration


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``kvd serve`` needs. Constructing one validates it (raises :class:`ConfigError`)."""

    endpoint: str = ""
    """ZeroMQ endpoint the daemon binds (ipc:// or tcp://). Empty: ipc://{runtime_dir}/kvd.sock."""
    runtime_dir: str = ""
    """Directory of the socket. Empty: $RUNTIME_DIRECTORY, else $XDG_RUNTIME_DIR/kvd, else /tmp/kvd-{uid}."""
    device: str = "cpu"
    """Where block tables and slot mappings are produced: "cpu" or "cuda[:N]"."""
    num_gpu_blocks: int = 65536
    """Blocks in the GPU pool, the null block 0 included."""
    num_cpu_blocks: int = 0
    """Blocks in the CPU swap pool (0: no swapping)."""
    block_size: int = 16
    """Tokens per block (1..1024)."""
    sliding_window: int = 0
    """Sliding-window size in tokens (0: full attention)."""
    kv_cache: str = ""
    """The daemon owns the KV cache, shared by every engine: "LAYERS,KV_HEADS,HEAD_DIM[,DTYPE]"
    (DTYPE float16, bfloat16, float32, float8_e4m3fn or float8_e5m2; default float16). It performs
    copy-on-write copies and swaps itself. Empty: the engines own their KV memory. One group only."""
    kv_events_endpoint: str = ""
    """ZeroMQ PUB endpoint of KV cache events in vLLM 0.33's format (kvd.events); empty: none."""
    kv_events_replay_endpoint: str = ""
    """ZeroMQ ROUTER endpoint that resends buffered event batches from a requested seq, as vLLM's
    ``replay_endpoint``; empty: none."""
    kv_events_buffer_steps: int = 10_000
    """Event batches kept for replay (vLLM's ``buffer_steps``)."""
    kv_events_topic: str = "{tenant}"
    """Topic of the events; "{tenant}" is replaced by the tenant they belong to (e.g.
    "kv@node1-gpu0@{tenant}" for routers that parse the topic)."""
    kv_events_data_parallel_rank: int = 0
    """``data_parallel_rank`` of every KVEventBatch (vLLM's publisher sends its DP rank)."""
    kv_events_int_hashes: bool = True
    """Publish hashes as vLLM 0.33 does by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the uint64
    of each hash's last 8 bytes; false: the full-width hash bytes."""
    kv_groups: str = ""
    """Several KV-cache groups sharing the pool, as BLOCK_SIZE[:WINDOW] per group, comma-separated
    (e.g. "16,16:4096": full attention beside a 4,096-token window). Replaces block_size and
    sliding_window when set."""
    max_model_len: int = 8192
    """Longest request, in tokens."""
    max_num_reqs: int = 4096
    """Request rows over all sessions."""
    max_sessions: int = 64
    """Concurrent client sessions."""
    max_reqs_per_session: int = 1024
    """Request rows of one session."""
    max_num_batched_tokens: int = 8192
    """Tokens of one scheduler step (slot-mapping buffer length)."""
    max_lookahead_tokens: int = 64
    """Most lookahead (speculative-decoding) slots one request may reserve beyond its tokens."""
    max_encoder_len: int = 0
    """Largest encoder input (tokens) of an encoder-decoder request; 0: no cross-attention tables."""
    encoder_block_size: int = 16
    """Block size (tokens) of the encoder-decoder cross-attention tables."""
    enable_prefix_caching: bool = True
    """Share identical prompt prefixes between requests and sessions."""
    watermark: float = 0.0
    """Fraction of the GPU pool kept free when admitting new requests (0 <= w < 1)."""
    hash_algo: str = "sha256"
    """Block hash scheme the clients use: "sha256" or "xxh3_128" (16-byte hashes), or "vllm_sha256"
    (32-byte hashes bit-identical to vLLM 0.33's default prefix caching, so that routers computing
    vLLM hashes match this daemon's KV events)."""
    hash_seed: str = "vllm-none-hash"
    """vLLM's NONE_HASH seed for "vllm_sha256" (vLLM's default; set it to the PYTHONHASHSEED of the
    vLLM deployment the router mirrors, if any)."""
    lease_s: float = 1.5
    """Seconds without a message before a session's blocks are reclaimed."""
    max_message_bytes: int = 64 << 20
    """Largest accepted message."""
    metrics_port: int = 0
    """Prometheus endpoint port (0: off)."""
    metrics_host: str = "127.0.0.1"
    """Address of the Prometheus endpoint."""
    tenants: str = ""
    """Who may take which tenant: "NAME=PRINCIPAL[,PRINCIPAL...] ..." with principals uid:N, gid:N,
    user:NAME, group:NAME (kvd.tenancy). A client that names no tenant gets its own, uid:<uid>."""
    socket_mode: str = "0660"
    """Octal mode of the ipc socket (the runtime directory gets 0750 when the daemon creates it)."""
    group: str = ""
    """Group (name or gid) of the socket, the runtime directory and the shared-memory segments:
    engines must be in it. Empty: "kvd" if that group exists, else the daemon's own group."""
    log_level: str = "info"
    """debug, info, warning, error or critical."""
    status_interval_s: float = 5.0
    """Seconds between systemd STATUS= updates."""
    busy_poll_us: int = 5000
    """After each message, keep polling the socket this long (yielding the CPU to anything else
    runnable) before sleeping in the event loop: a daemon woken from sleep pays the kernel's (and a
    VM's idle vCPU's) wake-up, ~60 µs a step back to back and ~300 µs after a 2 ms gap on a 16-core
    cloud host. 0: sleep at once."""
    warm_every_us: int = 2000
    """While the daemon busy-polls an idle socket, run a warm pass (kvd.warm: a prefix hit's
    admission and free on a shadow daemon of its own, nothing of the real one touched) once the
    socket has been idle this long, and again every this long: a message after an idle gap then
    finds the admission path warm (an H200 host, rounds alternating between a daemon with and one
    without: a cross-engine hit's round trip 0.82-0.92 ms against 0.94-1.14). A message arriving
    during a pass waits for it (~140 µs on the 2-core box). Only inside ``busy_poll_us``: a sleeping
    daemon warms nothing. 0: no warming."""
    pin_cpu: int = -1
    """Pin the daemon's loop thread and its ZeroMQ I/O thread to this CPU (-1: no pinning). The I/O
    thread then wakes on the CPU the polling loop keeps busy instead of an idle one: a bare echo
    after a 5 ms gap took 175 µs p50 (p90 241) instead of 283 (588) on a 16-core H200 host, 166 with
    the client's side pinned too; back to back, and on a 2-core machine, no gain
    (scripts/bench_wakeup.py)."""
    mailbox: bool = True
    """Give a session whose hello asks for it (``Client(mailbox=True)``) and whose process runs under
    the daemon's uid a mailbox (kvd.mailbox): its binary step messages (decode, decode_free, admit)
    and their replies then travel through shared memory, which the loop polls while it busy-polls
    (~28 against ~72 µs for a 256-request decode step's round trip on the 2-core box). False: every
    message on the socket."""
    exit_with_parent: bool = False
    """Shut down (as on SIGTERM: sessions dropped, segments unlinked, socket removed) once the
    process that started the daemon is gone. For a daemon a script or test starts as its child: a
    runner killed outright (SIGKILL, a crashed harness) then leaves no daemon behind. Not for
    systemd, whose daemon's parent is PID 1."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            checked = _check_type(f.name, f.type, value, None)
            if checked is not value:
                object.__setattr__(self, f.name, checked)
        for name, check in _CHECKS.items():
            problem = check(getattr(self, name))
            if problem:
                raise ConfigError(name, f"{getattr(self, name)!r} {problem}")
        if self.kv_cache and len({size for size, _ in self.group_specs()}) > 1:
            # one [layers, 2, blocks, block_size, ...] cache: each layer reads its group's block ids
            raise ConfigError("kv_cache", "a daemon-owned KV cache needs one block size for all KV-cache groups")
        if self.log_level != self.log_level.lower():
            object.__setattr__(self, "log_level", self.log_level.lower())

    # -- derived values ---------------------------------------------------------------------------

    def resolved_runtime_dir(self, env: Mapping[str, str] | None = None) -> str:
        """The socket directory: ``runtime_dir``, else systemd's ``$RUNTIME_DIRECTORY`` (its first
        entry), else ``$XDG_RUNTIME_DIR/kvd``, else ``/tmp/kvd-{uid}``."""
        if self.runtime_dir:
            return self.runtime_dir
        env = os.environ if env is None else env
        systemd_dir = env.get("RUNTIME_DIRECTORY", "").split(":")[0]
        if systemd_dir:
            return systemd_dir
        xdg = env.get("XDG_RUNTIME_DIR", "")
        if xdg:
            return os.path.join(xdg, "kvd")
        return f"/tmp/kvd-{os.getuid()}"

    def resolved_endpoint(self, env: Mapping[str, str] | None = None) -> str:
        """The ZeroMQ endpoint: ``endpoint``, else ``ipc://{resolved_runtime_dir()}/kvd.sock``."""
        if self.endpoint:
            return self.endpoint
        return "ipc://" + os.path.join(self.resolved_runtime_dir(env), "kvd.sock")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def group_specs(self) -> tuple[tuple[int, int], ...]:
        """(block size, sliding window or 0) of each KV-cache group."""
        if not self.kv_groups:
            return ((self.block_size, self.sliding_window),)
        return _parse_kv_groups(self.kv_groups)


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(ServeConfig)}
_TYPES: dict[str, type] = {
    name: {"str": str, "int": int, "float": float, "bool": bool}[f.type] for name, f in FIELDS.items()
}


def _positive(v: int | float) -> str | None:
    return None if v > 0 else "must be > 0"


def _non_negative(v: int | float) -> str | None:
    return None if v >= 0 else "must be >= 0"


def _in_range(lo: float, hi: float):
    def check(v: int | float) -> str | None:
        return None if lo <= v <= hi else f"must be in {lo}..{hi}"

    return check


_MAX_GROUPS = 8


def _parse_kv_groups(text: str) -> tuple[tuple[int, int], ...]:
    """"16,16:4096" -> ((16, 0), (16, 4096)); ValueError with the reason when malformed."""
    groups = []
    for part in text.split(","):
        block, _, window = part.strip().partition(":")
        try:
            size, win = int(block), int(window) if window else 0
        except ValueError:
            raise ValueError(f"{part.strip()!r} is not BLOCK_SIZE[:WINDOW]") from None
        if not 1 <= size <= 1024 or win < 0:
            raise ValueError(f"{part.strip()!r}: block size must be in 1..1024, window >= 0")
        groups.append((size, win))
    if len(groups) > _MAX_GROUPS:
        raise ValueError(f"at most {_MAX_GROUPS} groups")
    return tuple(groups)


def _parses(parse, what: str):
    """A check that ``parse`` (raising ValueError with the reason) accepts the value; empty is unset."""

    def check(v: str) -> str | None:
        if not v:
            return None
        try:
            parse(v)
        except (ValueError, InvalidArgument) as exc:
            return f"is not {what}: {exc}"
        return None

    return check


def _endpoint(v: str) -> str | None:
    return None if not v or _ENDPOINT_RE.fullmatch(v) else "must be empty, ipc://PATH or tcp://HOST:PORT"


def _runtime_dir(v: str) -> str | None:
    return None if not v or os.path.isabs(v) else "must be empty or an absolute path"


def _device(v: str) -> str | None:
    return None if _DEVICE_RE.fullmatch(v) else "must be 'cpu', 'cuda' or 'cuda:N'"


def _one_of(choices: tuple[str, ...], *, fold: bool = False):
    def check(v: str) -> str | None:
        return None if (v.lower() if fold else v) in choices else f"must be one of {', '.join(choices)}"

    return check


def _finite(inner):
    def check(v: float) -> str | None:
        if not math.isfinite(v):
            return "must be a finite number"
        return inner(v)

    return check


_CHECKS = {
    "endpoint": _endpoint,
    "runtime_dir": _runtime_dir,
    "device": _device,
    "num_gpu_blocks": _in_range(2, 2**31 - 1),
    "num_cpu_blocks": _in_range(0, 2**31 - 1),
    "block_size": _in_range(1, 1024),
    "sliding_window": _non_negative,
    "kv_cache": _parses(parse_kv_cache, "a KV cache spec"),
    "kv_events_endpoint": _endpoint,
    "kv_events_replay_endpoint": _endpoint,
    "kv_events_buffer_steps": _in_range(1, 10_000_000),
    "kv_events_topic": lambda v: None if len(v.encode()) <= 1024 else "must be at most 1024 bytes",
    "kv_events_data_parallel_rank": _in_range(0, 2**31 - 1),
    "kv_events_int_hashes": lambda v: None,
    "kv_groups": _parses(_parse_kv_groups, "a group list"),
    "max_model_len": _in_range(1, 2**31 - 1),
    "max_num_reqs": _in_range(1, 2**31 - 1),
    "max_sessions": _in_range(1, 2**31 - 1),
    "max_reqs_per_session": _in_range(1, 2**31 - 1),
    "max_num_batched_tokens": _in_range(1, 2**31 - 1),
    "max_lookahead_tokens": _in_range(0, 2**20),
    "max_encoder_len": _in_range(0, 2**31 - 1),
    "encoder_block_size": _in_range(1, 1024),
    "enable_prefix_caching": lambda v: None,
    "watermark": _finite(lambda v: None if 0.0 <= v < 1.0 else "must be in [0, 1)"),
    "hash_algo": _one_of(HASH_ALGOS),
    "hash_seed": lambda v: None,
    "lease_s": _finite(_positive),
    "max_message_bytes": _in_range(1024, 2**31 - 1),
    "metrics_port": _in_range(0, 65535),
    "metrics_host": lambda v: None if v.strip() else "must not be empty",
    "tenants": _parses(parse_tenants, "a tenant list"),
    "socket_mode": lambda v: None if re.fullmatch(r"0?[0-7]{3}", v.strip()) else "must be an octal mode like 0660",
    "group": lambda v: None,
    "log_level": _one_of(LOG_LEVELS, fold=True),
    "status_interval_s": _finite(_positive),
    "busy_poll_us": _in_range(0, 1_000_000),
    "warm_every_us": _in_range(0, 1_000_000),
    "pin_cpu": _in_range(-1, 65535),
    "mailbox": lambda v: None,
    "exit_with_parent": lambda v: None,
}
assert set(_CHECKS) == set(FIELDS), set(_CHECKS) ^ set(FIELDS)


def _check_type(key: str, type_name: str, value: Any, source: str | None) -> Any:
    """Type check of a value that is already a Python object (file, dict, dataclass)."""
    want = {"str": str, "int": int, "float": float, "bool": bool}[type_name]
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if want is int and isinstance(value, bool):
        raise ConfigError(key, f"expected an integer, got {value!r}", source)
    if not isinstance(value, want):
        kind = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false"}
        raise ConfigError(key, f"expected {kind[type_name]}, got {value!r}", source)
    return value


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse_text(key: str, text: str, source: str) -> Any:
    """Parse a flag or environment string into the key's type."""
    want = _TYPES[key]
    s = text.strip()
    try:
        if want is bool:
            if s.lower() in _TRUE:
                return True
            if s.lower() in _FALSE:
                return False
            raise ValueError
        if want is int:
            return int(s)
        if want is float:
            return float(s)
    except ValueError:
        kind = {bool: "true or false", int: "an integer", float: "a number"}[want]
        raise ConfigError(key, f"expected {kind}, got {text!r}", source) from None
    return text


# ---------------------------------------------------------------------------------------------------
# Sources


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--config`` and one flag per :class:`ServeConfig` field to ``parser``.

    Every flag defaults to None ("not given"), so :func:`load_config` can tell a flag that was set
    from one that was not. Values are parsed (and rejected with the key's name) by load_config."""
    group = parser.add_argument_group(
        "configuration",
        "Each option is also a key of the --config TOML file and an environment variable KVD_<KEY>; "
        "precedence: flag > environment > file > default.",
    )
    group.add_argument(
        "--config",
        metavar="PATH",
        default=None,
        help=f"TOML config file (default: ${CONFIG_ENV}, else none)",
    )
    for name, f in FIELDS.items():
        doc = _FIELD_DOCS.get(name, "")
        default = f.default
        shown = repr(default) if isinstance(default, str) else str(default).lower()
        help_text = f"{doc} [default: {shown}; env {ENV_PREFIX}{name.upper()}]"
        if _TYPES[name] is bool:
            group.add_argument(
                _flag(name), dest=name, default=None, action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            metavar = {int: "N", float: "X", str: "STR"}[_TYPES[name]]
            group.add_argument(_flag(name), dest=name, default=None, metavar=metavar, help=help_text)
    return parser


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("config", f"file not found: {path}") from None
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{path} is not valid TOML: {exc}") from None
    # Accept a [kvd] table too, so kvd's keys can live in a shared file.
    if set(data) == {"kvd"} and isinstance(data["kvd"], dict):
        data = data["kvd"]
    return data


def load_config(
    argv_namespace_or_dict: argparse.Namespace | Mapping[str, Any] | None = None,
    env: Mapping[str, str] = os.environ,
    file: str | os.PathLike | None = None,
) -> ServeConfig:
    """Build the effective :class:`ServeConfig` from flags (a Namespace from
    :func:`add_config_flags`, or a dict of already-typed or string values), the environment and the
    TOML file, with precedence flag > env > file > default.

    The file is ``file``, else the ``config`` entry of the flags, else ``$KVD_CONFIG``, else none.
    Raises :class:`ConfigError` naming the offending key."""
    if argv_namespace_or_dict is None:
        flags: dict[str, Any] = {}
        strict = False
    elif isinstance(argv_namespace_or_dict, argparse.Namespace):
        flags = vars(argv_namespace_or_dict)
        strict = False  # a namespace also carries the subcommand's own options
    else:
        flags = dict(argv_namespace_or_dict)
        strict = True

    path = file
    if path is None:
        path = flags.get("config") or env.get(CONFIG_ENV) or None

    values: dict[str, Any] = {}
    if path is not None:
        source = str(path)
        for key, value in _read_file(os.fspath(path)).items():
            if key not in FIELDS:
                raise ConfigError(key, f"unknown key{_suggest(key)}", source)
            values[key] = _check_type(key, FIELDS[key].type, value, source)

    for key in FIELDS:
        var = ENV_PREFIX + key.upper()
        text = env.get(var)
        if text:
            values[key] = _parse_text(key, text, var)
    unknown_env = sorted(
        k for k in env if k.startswith(ENV_PREFIX) and k != CONFIG_ENV and k[len(ENV_PREFIX):].lower() not in FIELDS
    )
    for var in unknown_env:
        if var.startswith(("KVD_TEST", "KVD_BENCH", "KVD_CLIENT")):
            continue
        logging.getLogger("kvd.config").warning("ignoring unknown environment variable %s", var)

    for key, value in flags.items():
        if key == "config":
            continue
        if key not in FIELDS:
            if strict:
                raise ConfigError(key, f"unknown key{_suggest(key)}", "arguments")
            continue
        if value is None:
            continue
        source = _flag(key)
        if isinstance(value, str) and _TYPES[key] is not str:
            values[key] = _parse_text(key, value, source)
        else:
            values[key] = _check_type(key, FIELDS[key].type, value, source)

    try:
        return ServeConfig(**values)
    except ConfigError as exc:
        # Say where the bad value came from.
        src = _source_of(exc.key, flags, env, path)
        if src and exc.source is None:
            raise ConfigError(exc.key, str(exc).split(": ", 1)[1], src) from None
        raise


def _source_of(key: str, flags: Mapping[str, Any], env: Mapping[str, str], path: Any) -> str | None:
    if flags.get(key) is not None:
        return _flag(key)
    if env.get(ENV_PREFIX + key.upper()):
        return ENV_PREFIX + key.upper()
    if path is not None:
        return str(path)
    return None


def _suggest(key: str) -> str:
    import difflib

    close = difflib.get_close_matches(str(key).replace("-", "_"), list(FIELDS), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(FIELDS)})"


def _field_docs() -> dict[str, str]:
    """The attribute docstrings above, for --help."""
    import ast
    import inspect

    try:
        tree = ast.parse(inspect.getsource(ServeConfig))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = nxt.value.value.strip()
    return docs


_FIELD_DOCS = _field_docs()


# ---------------------------------------------------------------------------------------------------
# Logging


class _LineFormatter(logging.Formatter):
    """One line per event. Under journald (``$JOURNAL_STREAM`` names our stderr) the line starts
    with a ``<N>`` syslog priority and carries no timestamp: journald adds time, unit and pid."""

    _PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def __init__(self, journald: bool) -> None:
        super().__init__()
        self.journald = journald

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            msg += "\n" + record.stack_info
        msg = msg.rstrip("\n").replace("\r", "").replace("\n", " | ")
        if self.journald:
            pri = self._PRIORITY.get(record.levelno, 7 if record.levelno < logging.INFO else 4)
            return f"<{pri}>{record.name}: {msg}"
        ts = self.formatTime(record, "%Y-%m-%dT%H:%M:%S")
        return f"{ts}.{int(record.msecs):03d} {record.levelname:<7} {record.name}: {msg}"


def _stderr_is_journal() -> bool:
    stream = os.environ.get("JOURNAL_STREAM", "")
    if not stream:
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
        dev, ino = (int(x) for x in stream.split(":"))
    except (OSError, ValueError, AttributeError):
        return False
    return st.st_dev == dev and st.st_ino == ino


class _KvdHandler(logging.StreamHandler):
    pass


def setup_logging(level: str | int = "info") -> None:
    """Send log records to stderr, one line each, at ``level`` (a name such as "debug" or a
    logging int). Idempotent: calling it again replaces the handler it installed."""
    if isinstance(level, str):
        name = level.strip().lower()
        if name == "warn":
            name = "warning"
        if name not in LOG_LEVELS:
            raise ConfigError("log_level", f"{level!r} must be one of {', '.join(LOG_LEVELS)}")
        levelno = getattr(logging, name.upper())
    else:
        levelno = int(level)
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, _KvdHandler):
            root.removeHandler(h)
    handler = _KvdHandler(sys.stderr)
    handler.setFormatter(_LineFormatter(_stderr_is_journal()))
    root.addHandler(handler)
    root.setLevel(levelno)
    logging.getLogger("kvd").setLevel(levelno)
    # Chatty third-party loggers stay at warning unless we debug.
    for noisy in ("asyncio", "urllib3"):
        logging.getLogger(noisy).setLevel(levelno if levelno <= logging.DEBUG else logging.WARNING)
