"""kvd_engine: a continuous-batching engine running a Hugging Face decoder on kvd (issue 11).

Import with ``examples/`` on ``sys.path`` (tests and ``scripts/bench_engine.py`` add it). Needs the
``engine`` extra (``pip install -e ".[engine]"``: transformers).
"""

from .engine import Engine, OwnedKv, Request, daemon_kv
from .inproc import InProcClient
from .model import StepMeta, build_model, layer_groups, register, tiny_config, use_paged, window_of
from .reference import hf_generate

__all__ = ["Engine", "OwnedKv", "Request", "daemon_kv", "InProcClient", "StepMeta", "build_model", "layer_groups",
           "register", "tiny_config", "use_paged", "window_of", "hf_generate"]
