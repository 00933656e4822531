"""Hypothesis settings of the model-based state machines.

The default test run replays the same examples every time (``derandomize``): the test command must
give one answer for one tree, so a red run names a change, not a draw. New examples are drawn with
``KVD_HYPOTHESIS_EXPLORE=N`` (N times the examples, a new random seed each run): run it after
changing the manager, and turn what it finds into an exact test.
"""

import os

from hypothesis import HealthCheck, settings

EXPLORE = int(os.environ.get("KVD_HYPOTHESIS_EXPLORE") or 0)


def machine_settings(max_examples: int, steps: int) -> settings:
    # generation speed is not what these check, and a loaded 2-core CI machine is slow: no too_slow
    return settings(max_examples=max_examples * max(EXPLORE, 1), stateful_step_count=steps, deadline=None,
                    database=None, derandomize=not EXPLORE, suppress_health_check=[HealthCheck.too_slow])
