"""One engine process against a daemon (tests and the benchmark start these with multiprocessing's
"spawn"): runs a list of requests and puts its results on a queue.

``spec`` keys: endpoint, tenant, model (kwargs of ``tiny_config`` plus ``seed``), requests
[(rid, prompt, max_new_tokens)], and optional choreography with named ``events``: ``warmup`` (run
one small request first), ``wait`` (before adding the requests), ``confirmed`` (set once every
prompt is computed and one more step ran: kvd has then been told that KV is written),
``admitted``/``hold`` (set ``admitted`` right after the reply that admitted the requests, then wait
for ``hold`` before that step's forward), ``pause_at`` (after that many steps report the blocks
held, set ``paused`` and wait for ``resume``), ``step_sleep``.
"""

from __future__ import annotations

import time


def _holding(client, rids) -> int:
    blocks = set()
    for rid in rids:
        for g in range(len(client.block_sizes)):
            blocks.update(int(b) for b in client.block_table(rid, g) if b != 0)
    return len(blocks)


def run_worker(spec: dict, events: dict, queue) -> None:
    import torch

    torch.set_num_threads(1)
    from kvd import gcheap
    from kvd_client import Client

    from .engine import Engine
    from .model import build_model, tiny_config

    mk = dict(spec["model"])
    seed = mk.pop("seed", 0)
    # the engine runs each step's forward before sending the next step: it confirms the previous one
    client = Client(spec["endpoint"], tenant=spec.get("tenant", "engine"), name=spec.get("name", "engine"),
                    steps_in_flight=0, mailbox=spec.get("mailbox", True))
    try:
        eng = Engine(client, build_model(tiny_config(**mk), seed=seed), max_tokens=spec.get("max_tokens", 256))
        if spec.get("warmup"):  # first-call costs (allocator, kernels) out of the time to first token
            eng.add("warmup", list(range(1, 2 * eng.bs + 2)), 2)
            eng.run()
            del eng.reqs["warmup"]
        gcheap.freeze()  # the model and the warm engine: out of every later collection's walk
        if "wait" in spec:
            events[spec["wait"]].wait(120)
        if "hold" in spec:
            def hold(e, res, fired=[]):
                if not fired and len(res.admit_status):
                    fired.append(1)
                    events[spec["admitted"]].set()
                    events[spec["hold"]].wait(120)
            eng.after_reply = hold
        for rid, prompt, n in spec["requests"]:
            eng.add(rid, prompt, n)
        prefilled_at = None
        while eng.busy:
            eng.step()
            if spec.get("step_sleep"):
                time.sleep(spec["step_sleep"])
            if "confirmed" in spec and prefilled_at is None and all(
                    r.computed >= len(r.prompt) for r in eng.reqs.values()):
                prefilled_at = eng.steps
            if prefilled_at is not None and eng.steps == prefilled_at + 1:
                events[spec["confirmed"]].set()
            if spec.get("pause_at") == eng.steps:
                queue.put({"name": spec.get("name"), "holding": _holding(client, eng.order)})
                events[spec["paused"]].set()
                events[spec["resume"]].wait(120)
        queue.put({"name": spec.get("name"),
                   "outputs": {r.rid: r.output for r in eng.reqs.values()},
                   "cached": {r.rid: r.cached_tokens for r in eng.reqs.values()},
                   "prefilled": {r.rid: r.prefilled_tokens for r in eng.reqs.values()},
                   "ttft": {r.rid: r.first_token_at - r.added_at for r in eng.reqs.values()}})
    except BaseException as e:  # the parent must not wait forever for a worker that failed
        queue.put({"name": spec.get("name"), "error": repr(e)})
        raise
    finally:
        client.close()
        gcheap.thaw()
