"""Shared by the examples: a small model's KV layout and the byte pattern.

The prefill process writes, into each room's source pages, bytes that
depend only on (room, buffer, page-of-room); the decode process recomputes
them to check every byte it received.  A real server's buffers would be
torch tensors (``KVArgs`` accepts anything with ``data_ptr()``); here they
are bytearrays.
"""
import hashlib
import os
import sys

# Use the package from the source tree when it is not installed.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                "..", "..", "python"))
import kvferry  # noqa: E402

LAYERS = 4            # K and V buffer per layer: 8 KV buffers
KV_HEADS = 2
HEAD_DIM_BYTES = 64   # e.g. head_dim 32 in bfloat16
AUX_SLOT_BYTES = 64   # first output token + the room id as a tag
POOL_PAGES = 512      # pages per KV buffer
AUX_SLOTS = 64


def page_bytes(page_size):
    return page_size * KV_HEADS * HEAD_DIM_BYTES


def make_args(page_size, **engine):
    """KVArgs for one rank; ``engine`` sets KVArgs engine fields."""
    pb = page_bytes(page_size)
    kv = [bytearray(POOL_PAGES * pb) for _ in range(2 * LAYERS)]
    aux = [bytearray(AUX_SLOTS * AUX_SLOT_BYTES)]
    return kvferry.KVArgs(
        kv_data_ptrs=kv, kv_item_lens=[pb] * len(kv),
        aux_data_ptrs=aux, aux_item_lens=[AUX_SLOT_BYTES],
        page_size=page_size, kv_dtype="bfloat16", attention="mha",
        num_layers=LAYERS, kv_head_num=KV_HEADS, bytes_per_head=HEAD_DIM_BYTES,
        **engine)


def pattern(room, buf, i, n):
    """``n`` bytes for page ``i`` of ``room`` in KV buffer ``buf``."""
    seed = hashlib.blake2b(b"%d:%d:%d" % (room, buf, i)).digest()
    return (seed * (n // len(seed) + 1))[:n]


def aux_record(room):
    return (b"room=%d first_token=42;" % room).ljust(AUX_SLOT_BYTES, b"\0")


def room_pages(tokens, page_size):
    return (tokens + page_size - 1) // page_size
