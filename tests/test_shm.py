"""Shared-memory session buffers: layout, read-only client views, unlink, stale sweep."""

import os
import subprocess
import sys

import numpy as np
import pytest

from kvd import shm as S
from kvd.api import PAD_SLOT_ID


@pytest.fixture
def seg():
    name = S.segment_name(os.getpid(), "test" + os.urandom(3).hex(), 1)
    b = S.SessionBuffers.create(name, max_reqs=8, max_blocks=[5, 3], max_tokens=16, block_sizes=[16, 32],
                                epoch="e", mode=0o640)
    yield b
    b.unlink()
    b.close()


def test_layout_and_views(seg):
    assert seg.num_groups == 2
    assert seg.tables[0].shape == (8, 5) and seg.tables[1].shape == (8, 3)
    assert seg.tables[0].dtype == np.int32 and seg.slots[0].dtype == np.int64
    assert (seg.slot_array == PAD_SLOT_ID).all()
    for a in [seg.row_tags, *seg.counts, *seg.tables, seg.slot_array]:
        assert a.ctypes.data % S.ALIGN == 0
    seg.tables[0][2, :3] = [7, 8, 9]
    seg.counts[0][2] = 3
    seg.row_tags[2] = 12345
    seg.slots[1][:2] = [1, 2]

    c = S.SessionBuffers.attach(seg.name)
    try:
        assert list(c.tables[0][2, :3]) == [7, 8, 9]
        assert c.counts[0][2] == 3 and c.row_tags[2] == 12345
        assert list(c.slots[1][:3]) == [1, 2, PAD_SLOT_ID]
        assert c.meta["block_sizes"] == [16, 32]
        with pytest.raises(ValueError):
            c.tables[0][0, 0] = 1  # read-only view
        # writes by the owner show up without re-attaching (same mapping)
        seg.tables[1][0, 0] = 42
        assert c.tables[1][0, 0] == 42
    finally:
        c.close()


def test_client_exit_does_not_unlink(seg):
    code = ("import sys; from kvd.shm import SessionBuffers as B; b = B.attach(sys.argv[1]); "
            "print(int(b.tables[0][0,0])); import os; os._exit(0)")
    seg.tables[0][0, 0] = 5
    out = subprocess.run([sys.executable, "-c", code, seg.name], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "5"
    assert os.path.exists("/dev/shm/" + seg.name)


def test_bad_names():
    with pytest.raises(ValueError):
        S.SessionBuffers.attach("../etc/passwd")
    with pytest.raises(ValueError):
        S.SessionBuffers.attach("notkvd")


def test_sweep_stale():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    dead = p.pid
    stale = S.SessionBuffers.create(S.segment_name(dead, "dead", 1), max_reqs=2, max_blocks=[2], max_tokens=4)
    live = S.SessionBuffers.create(S.segment_name(os.getpid(), "live", 1), max_reqs=2, max_blocks=[2],
                                   max_tokens=4)
    try:
        removed = S.sweep_stale()
        assert stale.name in removed
        assert not os.path.exists("/dev/shm/" + stale.name)
        assert os.path.exists("/dev/shm/" + live.name)
    finally:
        for b in (stale, live):
            b.unlink()
            b.close()


def test_segment_mode_and_no_session_id_in_the_header(seg):
    st = os.stat(os.path.join(S.SHM_DIR, seg.name))
    assert st.st_mode & 0o777 == 0o640
    c = S.SessionBuffers.attach(seg.name)
    try:
        assert "sid" not in c.meta and c.meta["epoch"] == "e"
    finally:
        c.close()
