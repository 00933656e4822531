"""kvd.gcheap: what is frozen leaves the collector's walk, and thawing gives it back."""

import gc
import weakref

from kvd import gcheap


def test_freeze_takes_every_survivor_out_of_the_walk_and_thaw_gives_them_back():
    gcheap.thaw()  # start from an unfrozen heap whatever ran before
    keep = [[i] for i in range(1000)]  # 1,001 tracked containers that survive the freeze

    class Node:
        pass

    cycle = Node()
    cycle.me = cycle  # garbage only the collector frees
    dead = weakref.ref(cycle)
    del cycle
    before = gcheap.status()["collections"][2]
    gcheap.freeze()
    try:
        st = gcheap.status()
        assert st["collections"][2] == before + 1  # its one full collection ...
        assert dead() is None  # ... freed the garbage first instead of freezing it for good
        assert st["frozen"] >= 1001
        made_since = [[1]]
        walked = {id(o) for o in gc.get_objects()}
        assert id(keep) not in walked and not any(id(x) in walked for x in keep)
        assert id(made_since) in walked
    finally:
        gcheap.thaw()
    assert gcheap.status()["frozen"] == 0
    walked = {id(o) for o in gc.get_objects()}
    assert id(keep) in walked and all(id(x) in walked for x in keep)
