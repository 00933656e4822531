"""Config: precedence flag > env > file > default; rejection naming the key; logging setup."""

from __future__ import annotations

import argparse
import logging
import os

import pytest

from kvd.config import FIELDS, ConfigError, ServeConfig, add_config_flags, load_config, setup_logging
from kvd.errors import InvalidArgument


def _parser() -> argparse.ArgumentParser:
    return add_config_flags(argparse.ArgumentParser())


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "kvd.toml"
    path.write_text(text)
    return str(path)


def test_defaults_match_the_interface():
    cfg = load_config(None, env={})
    assert cfg == ServeConfig()
    assert cfg.num_gpu_blocks == 65536 and cfg.block_size == 16 and cfg.max_message_bytes == 64 << 20
    assert cfg.device == "cpu" and cfg.hash_algo == "sha256" and cfg.metrics_port == 0
    assert cfg.enable_prefix_caching is True and cfg.log_level == "info"


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    path = _write(tmp_path, 'block_size = 8\nmax_sessions = 7\nlease_s = 2\nhash_algo = "xxh3_128"\n')
    env = {"KVD_BLOCK_SIZE": "32", "KVD_MAX_SESSIONS": "9"}
    ns = _parser().parse_args(["--config", path, "--block-size", "64"])
    cfg = load_config(ns, env=env)
    assert cfg.block_size == 64  # flag beats env and file
    assert cfg.max_sessions == 9  # env beats file
    assert cfg.lease_s == 2.0 and isinstance(cfg.lease_s, float)  # file (int accepted for a float)
    assert cfg.hash_algo == "xxh3_128"
    assert cfg.max_model_len == 8192  # default


def test_every_key_is_a_flag_an_env_var_and_a_file_key(tmp_path):
    overrides = {
        "endpoint": ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555"),
        "runtime_dir": ("/run/x", "/run/x"),
        "device": ("cuda:1", "cuda:1"),
        "enable_prefix_caching": ("false", False),
        "hash_algo": ("xxh3_128", "xxh3_128"),
        "metrics_host": ("::1", "::1"),
        "log_level": ("debug", "debug"),
        "watermark": ("0.25", 0.25),
        "lease_s": ("3.5", 3.5),
        "status_interval_s": ("0.5", 0.5),
        "kv_groups": ("16,32:64", "16,32:64"),
        "kv_cache": ("2,4,8,bfloat16", "2,4,8,bfloat16"),
        "kv_events_endpoint": ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557"),
        "tenants": ("alice=uid:1000,gid:2000", "alice=uid:1000,gid:2000"),
        "socket_mode": ("0640", "0640"),
        "group": ("video", "video"),
        "kv_events_replay_endpoint": ("tcp://127.0.0.1:5558", "tcp://127.0.0.1:5558"),
        "kv_events_topic": ("kv@n1@{tenant}", "kv@n1@{tenant}"),
        "hash_seed": ("1234", "1234"),
        "kv_events_int_hashes": ("false", False),
        "exit_with_parent": ("true", True),
        "mailbox": ("false", False),
    }
    for key, f in FIELDS.items():
        text, value = overrides[key] if key in overrides else (str(f.default + 3), f.default + 3)
        # environment
        assert getattr(load_config(None, env={"KVD_" + key.upper(): text}), key) == value, key
        # flag
        flag = "--" + key.replace("_", "-")
        argv = [f"--no-{key.replace('_', '-')}"] if value is False else [flag] if value is True else [flag, text]
        assert getattr(load_config(_parser().parse_args(argv), env={}), key) == value, key
        # file
        toml_value = {bool: lambda v: str(v).lower(), str: lambda v: f'"{v}"'}.get(type(value), repr)(value)
        path = _write(tmp_path, f"{key} = {toml_value}\n")
        assert getattr(load_config(None, env={}, file=path), key) == value, key


def test_config_file_from_env_and_kvd_table(tmp_path):
    path = _write(tmp_path, "[kvd]\nnum_cpu_blocks = 128\n")
    assert load_config(None, env={"KVD_CONFIG": path}).num_cpu_blocks == 128


def test_bool_flags_both_ways():
    assert load_config(_parser().parse_args(["--no-enable-prefix-caching"]), env={}).enable_prefix_caching is False
    env = {"KVD_ENABLE_PREFIX_CACHING": "off"}
    assert load_config(_parser().parse_args(["--enable-prefix-caching"]), env=env).enable_prefix_caching is True
    assert load_config(None, env=env).enable_prefix_caching is False


def test_empty_env_var_counts_as_unset():
    assert load_config(None, env={"KVD_BLOCK_SIZE": ""}).block_size == 16


def test_dict_input_strings_and_values():
    cfg = load_config({"block_size": "32", "watermark": 0.1, "config": None}, env={})
    assert cfg.block_size == 32 and cfg.watermark == 0.1


@pytest.mark.parametrize(
    "source, key",
    [
        ({"file": "blok_size = 16\n"}, "blok_size"),
        ({"file": "block_size = 0\n"}, "block_size"),
        ({"file": "block_size = 2048\n"}, "block_size"),
        ({"file": 'block_size = "16"\n'}, "block_size"),
        ({"file": "num_gpu_blocks = true\n"}, "num_gpu_blocks"),
        ({"file": 'device = "gpu"\n'}, "device"),
        ({"file": 'hash_algo = "md5"\n'}, "hash_algo"),
        ({"file": "enable_prefix_caching = 1\n"}, "enable_prefix_caching"),
        ({"env": {"KVD_WATERMARK": "1.0"}}, "watermark"),
        ({"env": {"KVD_LEASE_S": "nan"}}, "lease_s"),
        ({"env": {"KVD_NUM_CPU_BLOCKS": "-1"}}, "num_cpu_blocks"),
        ({"env": {"KVD_MAX_SESSIONS": "many"}}, "max_sessions"),
        ({"env": {"KVD_ENABLE_PREFIX_CACHING": "maybe"}}, "enable_prefix_caching"),
        ({"flags": ["--metrics-port", "70000"]}, "metrics_port"),
        ({"flags": ["--endpoint", "udp://x"]}, "endpoint"),
        ({"flags": ["--runtime-dir", "relative/dir"]}, "runtime_dir"),
        ({"flags": ["--log-level", "loud"]}, "log_level"),
        ({"dict": {"no_such_key": 1}}, "no_such_key"),
        ({"file": 'kv_groups = "16,x"\n'}, "kv_groups"),
        ({"env": {"KVD_KV_GROUPS": "16:-4"}}, "kv_groups"),
        ({"flags": ["--kv-groups", "2048"]}, "kv_groups"),
    ],
)
def test_rejects_naming_the_key(tmp_path, source, key):
    file = _write(tmp_path, source["file"]) if "file" in source else None
    args = source.get("dict") or (_parser().parse_args(source["flags"]) if "flags" in source else None)
    with pytest.raises(ConfigError) as info:
        load_config(args, env=source.get("env", {}), file=file)
    assert info.value.key == key
    assert repr(key) in str(info.value)
    assert isinstance(info.value, InvalidArgument)


def test_rejection_says_where_the_value_came_from(tmp_path):
    with pytest.raises(ConfigError, match=r"'block_size' \(from KVD_BLOCK_SIZE\)"):
        load_config(None, env={"KVD_BLOCK_SIZE": "0"})
    with pytest.raises(ConfigError, match=r"'block_size' \(from --block-size\)"):
        load_config(_parser().parse_args(["--block-size", "0"]), env={})
    path = _write(tmp_path, "block_size = 0\n")
    with pytest.raises(ConfigError, match=r"'block_size' \(from .*kvd.toml\)"):
        load_config(None, env={}, file=path)
    with pytest.raises(ConfigError, match="did you mean 'block_size'"):
        load_config(None, env={}, file=_write(tmp_path, "block-size = 16\n"))


def test_bad_or_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(None, env={}, file=str(tmp_path / "nope.toml"))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(None, env={}, file=_write(tmp_path, "block_size = = 3\n"))


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match="block_size"):
        ServeConfig(block_size=0)
    with pytest.raises(ConfigError, match="device"):
        ServeConfig(device="cuda:x")
    assert ServeConfig(device="cuda").device == "cuda"
    assert ServeConfig(log_level="DEBUG").log_level == "debug"


def test_resolved_paths(monkeypatch):
    env = {"RUNTIME_DIRECTORY": "/run/kvd/0", "XDG_RUNTIME_DIR": "/run/user/1"}
    assert ServeConfig().resolved_runtime_dir(env) == "/run/kvd/0"
    assert ServeConfig().resolved_endpoint(env) == "ipc:///run/kvd/0/kvd.sock"
    assert ServeConfig().resolved_runtime_dir({"XDG_RUNTIME_DIR": "/run/user/1"}) == "/run/user/1/kvd"
    assert ServeConfig().resolved_runtime_dir({}) == f"/tmp/kvd-{os.getuid()}"
    assert ServeConfig(runtime_dir="/srv/k").resolved_endpoint(env) == "ipc:///srv/k/kvd.sock"
    assert ServeConfig(endpoint="tcp://127.0.0.1:1").resolved_endpoint(env) == "tcp://127.0.0.1:1"
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/a:/run/b")
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert ServeConfig().resolved_runtime_dir() == "/run/a"


def test_unknown_kvd_env_var_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="kvd.config"):
        load_config(None, env={"KVD_BLOK_SIZE": "3"})
    assert "KVD_BLOK_SIZE" in caplog.text


def test_setup_logging_one_line_per_event(capsys, monkeypatch):
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, logging.getLogger("kvd").level)
    try:
        setup_logging("warning")
        setup_logging("debug")  # idempotent: one handler
        log = logging.getLogger("kvd.test")
        log.debug("hello\nworld")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 2
        assert "DEBUG" in err[0] and "kvd.test: hello | world" in err[0]
        assert "ERROR" in err[1] and "ValueError: boom" in err[1]
        setup_logging("info")
        log.debug("hidden")
        assert capsys.readouterr().err == ""
        with pytest.raises(ConfigError):
            setup_logging("loud")
    finally:
        for h in list(root.handlers):
            if h not in saved[0]:
                root.removeHandler(h)
        root.setLevel(saved[1])
        logging.getLogger("kvd").setLevel(saved[2])


def test_kv_groups_replace_the_single_group_keys(tmp_path):
    assert ServeConfig(block_size=32, sliding_window=128).group_specs() == ((32, 128),)
    cfg = load_config(None, env={"KVD_KV_GROUPS": " 16, 32:4096 "}, file=_write(tmp_path, "block_size = 8\n"))
    assert cfg.group_specs() == ((16, 0), (32, 4096))
    flag = load_config(_parser().parse_args(["--kv-groups", "64:0,16"]), env={})
    assert flag.group_specs() == ((64, 0), (16, 0))
