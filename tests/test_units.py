"""The systemd units and the example config: systemd-analyze verify/security, required settings."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvd.config import FIELDS, ServeConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
UNITS = ROOT / "systemd"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def _kvd_binary() -> str:
    exe = Path(sys.executable).parent / "kvd"
    return str(exe) if exe.exists() else (shutil.which("kvd") or "/bin/true")


def installed_copy(tmp_path: Path, name: str) -> Path:
    """The unit with ExecStart= pointing at the kvd of this environment (verify checks it exists);
    the template is instantiated as @0."""
    text = (UNITS / name).read_text().replace("/opt/kvd/bin/kvd", _kvd_binary())
    dest = tmp_path / name.replace("@.", "@0.")
    dest.write_text(text)
    return dest


def settings(name: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        m = re.match(r"^([A-Za-z]+)=(.*)$", line)
        if m:
            out.setdefault(m.group(1), []).append(m.group(2))
    return out


@pytest.mark.parametrize("name", ["kvd.service", "kvd@.service"])
def test_unit_has_the_required_settings(name):
    s = settings(name)
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert s["Restart"] == ["on-failure"]
    assert s["WatchdogSec"] and s["UMask"] == ["0007"]
    assert s["RuntimeDirectoryMode"] == ["0750"] and s["Group"] == ["kvd"]
    assert any(v.startswith("TRITON_CACHE_DIR=%C/kvd") for v in s["Environment"])
    assert s["CacheDirectory"] == ["kvd"]
    assert "char-nvidia rw" in s["DeviceAllow"] and "char-nvidia-uvm rw" in s["DeviceAllow"]
    assert "78" in s["RestartPreventExitStatus"][0].split()
    assert s["ExecStart"][0].split()[1] == "serve"


def test_template_pins_device_and_endpoint():
    s = settings("kvd@.service")
    assert s["RuntimeDirectory"] == ["kvd/%i"]
    assert "CUDA_VISIBLE_DEVICES=%i" in s["Environment"]
    exec_start = s["ExecStart"][0]
    assert "--device cuda:0" in exec_start and "--endpoint ipc://%t/kvd/%i/kvd.sock" in exec_start


def _analyze(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([ANALYZE, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


@needs_analyze
@pytest.mark.parametrize("name", ["kvd.service", "kvd@.service"])
def test_systemd_analyze_verify(tmp_path, name):
    unit = installed_copy(tmp_path, name)
    out = _analyze("verify", str(unit), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    # Lines about our unit are problems; lines about other units on the host are not ours to fix.
    ours = [line for line in (out.stdout + out.stderr).splitlines() if unit.name in line]
    assert not ours, ours


@needs_analyze
@pytest.mark.parametrize("name", ["kvd.service", "kvd@.service"])
def test_systemd_analyze_security_rating(tmp_path, name):
    unit = installed_copy(tmp_path, name)
    out = _analyze("security", "--offline=true", "--no-pager", str(unit), cwd=tmp_path)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout + out.stderr)
    if m is None and "offline" in out.stderr:
        pytest.skip(f"this systemd-analyze cannot rate unit files offline: {out.stderr.strip()[:200]}")
    assert m, out.stdout + out.stderr
    assert float(m.group(1)) <= 2.0, out.stdout


def test_example_config_lists_every_key_and_loads(tmp_path):
    text = (UNITS / "kvd.example.toml").read_text()
    keys = re.findall(r"^# ([a-z_]+) = ", text, flags=re.M)
    assert sorted(keys) == sorted(FIELDS)
    path = tmp_path / "kvd.toml"
    path.write_text(re.sub(r"^# ([a-z_]+ = )", r"\1", text, flags=re.M))
    assert load_config(None, env={}, file=str(path)) == ServeConfig()
    empty = tmp_path / "as-shipped.toml"
    empty.write_text(text)
    assert load_config(None, env={}, file=str(empty)) == ServeConfig()


def test_sysusers_entry():
    line = [x for x in (UNITS / "kvd.sysusers").read_text().splitlines() if x and not x.startswith("#")]
    assert line and line[0].split()[:2] == ["u", "kvd"]
