"""The model side: a Hugging Face decoder whose attention is kvd's paged path.

HF hooks used: ``transformers.AttentionInterface.register("kvd_paged", fn)`` (the attention of every
layer) and ``AttentionMaskInterface.register("kvd_paged", ...)`` (no dense mask is built: masking is
positional inside ``paged_attention``). A step is one packed forward, ``input_ids [1, T]`` and
``position_ids [1, T]``, with the step's metadata (``StepMeta``) passed as the forward kwarg
``kvd_meta``, which HF forwards untouched to the attention function of every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ATTN_NAME = "kvd_paged"


@dataclass
class StepMeta:
    """What one packed forward needs from kvd, per KV-cache group ``g`` (tensors on the model's device):
    ``slots[g]`` int64 [T], ``tables[g]`` int32 [session rows, max blocks] (rows of the scheduled
    requests are ``rows``), and the varlen layout ``seq_lens`` / ``query_start_loc`` (int32)."""

    kv: torch.Tensor                 # [layers, 2, blocks, block_size, kv_heads, head_dim]
    layer_group: list[int]           # layer -> KV-cache group
    slots: list[torch.Tensor]
    tables: list[torch.Tensor]
    rows: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """``x [1, H, T, D]`` as ``[T, H, D]``, copied only where the head dim is strided: the K/V write
    takes any token and head stride (a fused projection's K and V are slices of a wider product)."""
    x = x[0].transpose(0, 1)
    return x if x.stride(-1) == 1 else x.contiguous()


def _paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     sliding_window=None, kvd_meta: StepMeta | None = None, **kwargs):
    """HF attention signature: query [1, H_q, T, D], key/value [1, H_kv, T, D] (RoPE applied);
    returns ([1, T, H_q, D], None)."""
    import kvd_kernels

    if kvd_meta is None:
        raise RuntimeError("the kvd_paged attention needs the step's metadata (forward kwarg kvd_meta)")
    m, layer = kvd_meta, module.layer_idx
    g = m.layer_group[layer]
    kv_layer = m.kv[layer]
    q = query[0].transpose(0, 1).contiguous()
    k, v = _tokens_first(key), _tokens_first(value)
    kvd_kernels.write_kv(k, v, kv_layer, m.slots[g])
    out = kvd_kernels.paged_attention(q, kv_layer, m.tables[g], m.seq_lens, m.query_start_loc,
                                      scale=float(scaling if scaling is not None else q.shape[-1] ** -0.5),
                                      sliding_window=int(sliding_window or 0), row_indices=m.rows)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    return None


def register() -> None:
    """Make ``attn_implementation="kvd_paged"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, _paged_attention)
    AttentionMaskInterface.register(ATTN_NAME, _no_mask)


def tiny_config(kind: str = "llama", *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                vocab: int = 512, window: int = 0, max_pos: int = 2048):
    """A small config. ``kind``: "llama" (GQA, full attention) or "hybrid" (Qwen2 with per-layer
    ``layer_types``: even layers sliding_attention over ``window`` tokens, odd ones full)."""
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                  tie_word_embeddings=False, initializer_range=0.25)
    if kind == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    if kind == "hybrid":
        from transformers import Qwen2Config

        if window <= 0:
            raise ValueError("the hybrid config needs a sliding window > 0")
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return Qwen2Config(**common, use_sliding_window=True, sliding_window=window, max_window_layers=0,
                           layer_types=types)
    raise ValueError(f"unknown model kind {kind!r}")


def build_model(config=None, *, seed: int = 0, dtype=torch.float32, device="cpu", path: str | None = None):
    """A causal LM with seeded random weights from ``config`` (no downloads), or loaded from the local
    directory ``path``. Eval mode; attention "eager" (switch with ``use_paged``)."""
    from transformers import AutoModelForCausalLM

    register()
    if path is not None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager",
                                                     local_files_only=True)
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return model.to(device).eval()


def use_paged(model, paged: bool) -> None:
    """Switch the model between kvd's paged attention and HF's eager attention (the reference); a
    model given ``fused.install`` runs its fused kernels only while paged."""
    model.config._attn_implementation = ATTN_NAME if paged else "eager"
    if getattr(model, "_kvd_fused", False):
        from .fused import ACTIVE

        ACTIVE[0] = paged


def layer_groups(config) -> list[int]:
    """Layer -> KV-cache group: 0 for full attention, 1 for sliding-window layers (the engine's
    ``--kv-groups`` order: group 0 full, group 1 the window)."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [1 if t == "sliding_attention" else 0 for t in types]


def window_of(config) -> int:
    types = getattr(config, "layer_types", None) or []
    return int(config.sliding_window or 0) if "sliding_attention" in types else 0
