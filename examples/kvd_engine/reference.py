"""The reference: Hugging Face ``generate`` (eager attention, its own contiguous cache), greedy,
one request at a time (no padding), with forced tokens replayed the way the engine forces them."""

from __future__ import annotations

import torch

from .model import use_paged


def hf_generate(model, prompt, max_new_tokens: int, forced: dict[int, int] | None = None):
    """(tokens, logits [max_new_tokens, vocab] float32) of greedy decoding. A forced token at output
    index k replaces the greedy one there; generation continues from it (split into segments)."""
    use_paged(model, False)
    dev = next(model.parameters()).device
    seq, tokens, logits = list(prompt), [], []
    stops = sorted(k for k in (forced or {}) if k < max_new_tokens) + [max_new_tokens]
    for stop in stops:
        n = stop - len(tokens) + (1 if stop < max_new_tokens else 0)
        if n > 0:
            with torch.no_grad():
                ids = torch.tensor([seq], device=dev)
                # an explicit all-ones mask: generate would otherwise mask every token equal to pad_token_id
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, output_logits=True, return_dict_in_generate=True,
                                     pad_token_id=0, eos_token_id=None)
            new = out.sequences[0, len(seq):].tolist()
            tokens += new
            logits += [lg[0].float().cpu() for lg in out.logits]
            seq += new
        if stop < max_new_tokens:
            tokens[stop] = forced[stop]
            seq[len(prompt) + stop] = forced[stop]
    return tokens[:max_new_tokens], torch.stack(logits[:max_new_tokens])
