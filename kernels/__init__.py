"""kvd_kernels: the GPU work kvd does for its clients, each kernel beside its numpy reference.

Imports nothing of kvd and needs only numpy: the ``*_ref`` functions are what the daemon runs on a
CPU pool; the torch wrappers (Triton inside) are for a GPU pool and raise without torch/Triton.
"""

from ._triton import HAS_TRITON, MAX_GROUPS_PER_LAUNCH
from .block_table import (NULL_BLOCK, GatherSlotMappingPlan, apply_block_table_updates,
                          apply_block_table_updates_ref, gather_block_tables,
                          gather_block_tables_ref, gather_slot_mapping, gather_slot_mapping_ref)
from .copy import copy_blocks, copy_blocks_between_ref, copy_blocks_ref, pool_layout
from .slot_mapping import (PAD_SLOT_ID, SlotMappingPlan, slot_mapping,
                           slot_mapping_from_ranges_ref, slot_mapping_ref)
from .swap import DMA_MIN_REGION_BYTES, swap_blocks, swap_blocks_ref

__all__ = [
    "HAS_TRITON", "MAX_GROUPS_PER_LAUNCH", "NULL_BLOCK", "PAD_SLOT_ID",
    "apply_block_table_updates", "apply_block_table_updates_ref",
    "copy_blocks", "copy_blocks_between_ref", "copy_blocks_ref", "pool_layout",
    "gather_block_tables", "gather_block_tables_ref", "gather_slot_mapping",
    "gather_slot_mapping_ref", "GatherSlotMappingPlan", "SlotMappingPlan",
    "slot_mapping", "slot_mapping_from_ranges_ref", "slot_mapping_ref",
    "DMA_MIN_REGION_BYTES", "swap_blocks", "swap_blocks_ref",
]
