"""kvd_kernels: the GPU work kvd does for its clients, each kernel beside its numpy reference.

Imports nothing of kvd. The ``*_ref`` numpy references (``reference.py``) import with numpy alone:
they are what the daemon runs on a CPU pool. The torch wrappers (Triton inside) load torch and
Triton on first use (PEP 562 module ``__getattr__``), so a CPU daemon never pays for those imports;
they raise without torch/Triton. The engine-side kernels (``write_kv``, ``paged_attention``) have
torch references (``attention_ref.py``, loaded lazily too) that an engine also runs on the CPU.
"""

from importlib import import_module

from .reference import (NULL_BLOCK, PAD_SLOT_ID, apply_block_table_updates_ref, copy_blocks_between_ref,
                        copy_blocks_ref, gather_block_tables_ref, gather_slot_mapping_ref,
                        slot_mapping_from_ranges_ref, slot_mapping_ref, swap_blocks_ref)

# name -> submodule that defines it (imported on first access)
_LAZY = {
    "HAS_TRITON": "_triton", "MAX_GROUPS_PER_LAUNCH": "_triton",
    "GatherSlotMappingPlan": "block_table", "apply_block_table_updates": "block_table",
    "gather_block_tables": "block_table", "gather_slot_mapping": "block_table",
    "copy_blocks": "copy", "pool_layout": "copy",
    "SlotMappingPlan": "slots", "slot_mapping": "slots",
    "DMA_MIN_REGION_BYTES": "swap", "swap_blocks": "swap",
    "paged_attention_ref": "attention_ref", "write_kv_ref": "attention_ref",
    "paged_attention": "attention", "paged_attention_triton": "attention",
    "write_kv": "kv_write", "write_kv_triton": "kv_write",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvd_kernels' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "NULL_BLOCK", "PAD_SLOT_ID", "apply_block_table_updates_ref", "copy_blocks_between_ref",
    "copy_blocks_ref", "gather_block_tables_ref", "gather_slot_mapping_ref",
    "slot_mapping_from_ranges_ref", "slot_mapping_ref", "swap_blocks_ref", *_LAZY,
]
