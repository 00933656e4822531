"""kvd's benchmarks, shipped in the package so that ``kvd bench`` works from a wheel.

``kvd.bench.zmq_bench``: the standard workload through a daemon (``kvd bench``);
``kvd.bench.core``: the same workload in process (``python -m kvd.bench.core``);
``kvd.bench.scaling``: ``kvd bench --scale``, the step time against R beside the echo floor and
vLLM's manager (``kvd.bench.vllm_peer``); ``kvd.bench.plots``: their figures (matplotlib).
Each prints tables and ends with one JSON line of figures and honesty checks.
"""
