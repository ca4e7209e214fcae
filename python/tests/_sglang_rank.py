"""One TP rank of a prefill or decode server, driving kvferry.sglang the way
SGLang's scheduler does (disaggregation/prefill.py and decode.py), call for
call, for test_sglang: the scheduler of 0094505da741 ("old" contract) or of
the newest SGLang ("new": num_kv_tokens on send, get_max_transfer_tokens()
before it, mark_prefill_complete(), the decode allocation policy, the
newest KVArgs fields and StateTypes, the KV checksum's extra metadata
buffer, optimistic prefill).

``python3 _sglang_rank.py '<json config>' FD``: FD is this rank's end of a
socket pair to the other TP rank of its server: the channel of the MIN
all-reduce SGLang runs over its attn-TP gloo group
(``poll_and_all_reduce``).  Both ranks see the same requests in the same
order and take every decision from reduced values, so their queues stay in
step, as SGLang's do.

Config: role, tp_rank, tp_size, bootstrap ("host:port"), requests
([{room, tokens, prefix?, abort?, decode?, prefill_abort?}]), chunk (tokens
per prefill chunk), state (true: a mamba-like and a swa-like group; "new":
the newest state types), draft (a draft model's KV), mla, env (set before
kvferry loads), contract ("old"/"new"), optimistic (the prefill computes
before the decode's destination is known), policy (the decode allocation
policy), hold_mark (prefill_complete: mark rooms complete only on "go"),
checksum (SGLang's --disaggregation-enable-kv-checksum), gpu (the pools
are CUDA memory of the fake driver).  Events on stdout, one JSON object a
line: "computed" (prefill, a room computed), "gated" (decode: a room
connected but kept Bootstrapping by the policy), "go-seen", and
{"event": "result", "rooms": {room: {...}}} once every request is done;
stdin takes "go" and, at the end, "exit" (so that no engine goes away
under a peer that is still finishing).
"""
import ctypes
import json
import os
import queue
import socket
import struct
import sys
import threading
import time
import types
import zlib

CFG = json.loads(sys.argv[1])
os.environ.update(CFG.get("env", {}))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from kvferry import sglang as S  # noqa: E402
from kvferry.sglang import KVPoll  # noqa: E402

ROLE = CFG["role"]
TP, TPS = CFG["tp_rank"], CFG["tp_size"]
PS = 4                      # page_size
LAYERS = 2
HEADS = 4                   # KV heads of the model
MLA = bool(CFG.get("mla"))  # one latent buffer per layer, the same on every rank
HR = 1 if MLA else HEADS // TPS     # KV heads per rank
D = 36 if MLA else 8        # head dim (uint16 elements); MLA: the latent width
DRAFT_D = 4
POOL = 64                   # KV pages per buffer
AUX_ROWS = 16
MAMBA_SLOTS, SWA_PAGES, WINDOW = 8, 32, 2 * PS
REQ_ROWS = 16               # per-request state rows (DSV4_REQUEST_STATE, QSA_PENDING)
NEW = CFG.get("contract") == "new"
DEADLINE = time.monotonic() + 90
COMMANDS = queue.Queue()    # lines from stdin ("go", "exit")


def read_commands():
    for line in sys.stdin:
        COMMANDS.put(line.strip())
    COMMANDS.put("exit")


def next_command():
    try:
        return COMMANDS.get_nowait()
    except queue.Empty:
        return None


def emit(**ev):
    print(json.dumps(dict(ev, pid=os.getpid())), flush=True)


# ---------------------------------------------------------------------------
# The MIN all-reduce over the attn-TP group (SGLang: gloo, uint8, ReduceOp.MIN)
# ---------------------------------------------------------------------------

class Group:
    def __init__(self, fd):
        self.sock = socket.socket(fileno=fd) if fd >= 0 else None

    def _recv(self, n):
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise RuntimeError("the other TP rank closed the channel")
            buf += chunk
        return buf

    def all_reduce_min(self, values):
        vals = [int(v) for v in values]
        if self.sock is None:
            return vals
        self.sock.sendall(struct.pack("<I", len(vals)) + bytes(vals))
        n, = struct.unpack("<I", self._recv(4))
        theirs = self._recv(n)
        if n != len(vals):
            raise RuntimeError("all-reduce of %d values against %d: the ranks' queues "
                               "diverged" % (len(vals), n))
        return [min(a, b) for a, b in zip(vals, theirs)]


def poll_and_all_reduce(pollers, group):
    # The ranks' queues are in step, so both skip an empty one.
    if not pollers:
        return []
    return group.all_reduce_min([p.poll() for p in pollers])


# ---------------------------------------------------------------------------
# Pools (what SGLang's memory pools give get_contiguous_buf_infos() and
# MetadataBuffers.get_buf_infos()) and the byte patterns
# ---------------------------------------------------------------------------

def pattern(room, tok, code, d):
    """uint16[len(tok), HR, d]: the KV of tokens ``tok`` of ``room`` in the
    buffer named ``code``, for this rank's heads."""
    tok = np.asarray(tok, dtype=np.int64)[:, None, None]
    head = (np.arange(HR) if MLA else TP * HR + np.arange(HR))[None, :, None]
    e = np.arange(d)[None, None, :]
    return ((room % 65521) * 7919 + tok * 131 + code * 31 + head * 17 + e * 3) \
        % 65521


def slot_pattern(room, code, n, k=0):
    return ((np.arange(n) * 13 + (room % 251) * 7 + code * 29 + k * 5) % 251) \
        .astype(np.uint8)


class Pools:
    def __init__(self):
        self.k = [np.zeros((POOL * PS, HR, D), np.uint16) for _ in range(LAYERS)]
        self.v = [] if MLA else [np.zeros((POOL * PS, HR, D), np.uint16)
                                 for _ in range(LAYERS)]
        self.kv = self.k + self.v                 # SGLang: every K, then every V
        self.codes = list(range(len(self.kv)))
        if CFG.get("draft"):
            self.dk = np.zeros((POOL * PS, HR, DRAFT_D), np.uint16)
            self.dv = np.zeros((POOL * PS, HR, DRAFT_D), np.uint16)
            self.kv += [self.dk, self.dv]
            self.codes += [100, 101]
        self.aux = [np.zeros((AUX_ROWS, 16), np.int32),        # output_ids
                    np.zeros((AUX_ROWS, 16), np.float32),      # logprobs
                    np.zeros((AUX_ROWS, 8), np.uint64)]        # bootstrap_room
        if CFG.get("checksum"):
            # SGLang's MetadataBuffers(kv_checksum_enabled=True): one more
            # buffer, last, its row as long as the one before it.
            self.aux.append(np.zeros((AUX_ROWS, 8), np.uint64))
        self.state_types, self.state = [], []
        if CFG.get("state") == "new":
            # The newest state types that hold rows: per-slot state, per-page
            # block scales of an mxfp8 KV (whole sequence and SWA window),
            # per-request rows.
            self.state_types = [S.StateType.MAMBA, S.StateType.BLOCK_SCALE,
                                S.StateType.BLOCK_SCALE_SWA,
                                S.StateType.DSV4_REQUEST_STATE,
                                S.StateType.QSA_PENDING]
            self.state = [
                [np.zeros((MAMBA_SLOTS, 48), np.uint8)],
                [np.zeros((POOL, 8), np.uint8) for _ in range(2 * LAYERS)],
                [np.zeros((SWA_PAGES, 8), np.uint8) for _ in range(2 * LAYERS)],
                [np.zeros((REQ_ROWS, 40), np.uint8)],
                [np.zeros((REQ_ROWS, 24), np.uint8)]]
        elif CFG.get("state"):
            self.state_types = [S.StateType.MAMBA, S.StateType.SWA]
            self.state = [
                [np.zeros((MAMBA_SLOTS, 48), np.uint8),          # conv state
                 np.zeros((MAMBA_SLOTS, 96), np.uint8)],         # temporal state
                [np.zeros((SWA_PAGES, PS * HR * D * 2), np.uint8)
                 for _ in range(LAYERS)]]                        # SWA K/V pages
        if CFG.get("gpu"):
            # The fake CUDA driver calls these device memory of GPU 0, as
            # SGLang's pools on --device cuda are.
            fake = ctypes.CDLL(os.environ["KVF_CUDA_DRIVER"])
            for b in self.kv + [b for g in self.state for b in g]:
                fake.fake_cuda_add(ctypes.c_void_p(b.ctypes.data),
                                   ctypes.c_size_t(b.nbytes), 0)

    def dims(self, b):
        return DRAFT_D if self.codes[b] >= 100 else D

    def kv_args(self):
        a = S.KVArgs()
        a.engine_rank = TP
        a.kv_data_ptrs = [b.ctypes.data for b in self.kv]
        a.kv_data_lens = [b.nbytes for b in self.kv]
        a.kv_item_lens = [b[0].nbytes * PS for b in self.kv]
        a.aux_data_ptrs = [b.ctypes.data for b in self.aux]
        a.aux_data_lens = [b.nbytes for b in self.aux]
        a.aux_item_lens = [b[0].nbytes for b in self.aux]
        a.state_types = list(self.state_types)
        a.state_data_ptrs = [[b.ctypes.data for b in g] for g in self.state]
        a.state_data_lens = [[b.nbytes for b in g] for g in self.state]
        a.state_item_lens = [[b[0].nbytes for b in g] for g in self.state]
        a.state_dim_per_tensor = [[] for _ in self.state]
        a.page_size = PS
        a.pp_rank = 0
        a.system_dp_rank = 0
        a.gpu_id = 0
        a.ib_device = None
        if ROLE == "prefill" and not MLA:
            a.kv_head_num = HR
            a.total_kv_head_num = HEADS
        if ROLE == "prefill":
            a.prefill_start_layer = 0
            a.prefill_end_layer = LAYERS
        if NEW:
            # The newest SGLang's fields (docs/SGLANG.md).
            a.num_draft_entries = 2 if CFG.get("draft") else 0
            a.kv_cache_dtype_str = "auto"
            a.state_layer_ids = [list(range(len(g))) for g in self.state]
            a.state_slice_outer_counts = [[1] * len(g) for g in self.state]
            a.rust_http_port = None
        else:
            a.ib_traffic_class = None
            a.dcp_size, a.dcp_rank = 1, 0
        return a


def server_args(bootstrap_port):
    sa = types.SimpleNamespace(
        host="127.0.0.1", port=30000, disaggregation_bootstrap_port=bootstrap_port,
        dist_init_addr=None, tp_size=TPS, dp_size=1, pp_size=1,
        enable_dp_attention=False, load_balance_method="round_robin",
        kv_cache_dtype="auto", dtype="bfloat16",
        device="cuda" if CFG.get("gpu") else "cpu",
        disaggregation_ib_device=None,
        speculative_algorithm="EAGLE" if CFG.get("draft") else None)
    if NEW:
        sa.disaggregation_decode_allocation_policy = CFG.get("policy", "early")
        sa.optimistic_prefill_attempts = 1 if CFG.get("optimistic") else 0
        sa.disaggregation_enable_kv_checksum = bool(CFG.get("checksum"))
        sa.api_key = None
        sa.dcp_size = 1
    sa.get_hf_config = lambda: types.SimpleNamespace(num_hidden_layers=LAYERS)
    return sa


class Allocator:
    """Pages (or slots) handed out in a fixed scattered order, the same on
    both TP ranks of a server."""

    def __init__(self, n, seed):
        self.free = list(np.random.RandomState(seed).permutation(n))

    def alloc(self, k):
        if k > len(self.free):
            return None
        out, self.free = self.free[:k], self.free[k:]
        return [int(x) for x in out]


def pages_of(tokens):
    return -(-tokens // PS)


# ---------------------------------------------------------------------------
# Prefill: PrefillBootstrapQueue, forward with chunked prefill, inflight queue
# ---------------------------------------------------------------------------

class Req:
    def __init__(self, r):
        self.room = r["room"]
        self.tokens = r["tokens"]
        self.abort = r.get("abort", False)
        self.prefill_abort = r.get("prefill_abort", False)
        self.prefix = r.get("prefix", 0)
        self.rid = "req-%d" % self.room
        self.result = None
        self.early = False


class Allocs:
    """The scheduler's allocators, the same order on both TP ranks."""

    def __init__(self, seed):
        self.kv, self.aux = Allocator(POOL, seed), Allocator(AUX_ROWS, seed + 1)
        self.mamba = Allocator(MAMBA_SLOTS, seed + 2)
        self.swa = Allocator(SWA_PAGES, seed + 3)
        self.rows = Allocator(REQ_ROWS, seed + 4)

    def state(self, pools, req):
        """The request's state slots (all of them on both sides)."""
        if pools.state:
            req.mamba = self.mamba.alloc(1)
            req.swa = self.swa.alloc(pages_of(req.tokens))
            req.rows = self.rows.alloc(2) if CFG.get("state") == "new" else None


def state_indices_of(pools, req, dtype):
    """One index list per state type, parallel to state_types (SGLang's
    payload table: the slot, the pages, the window's pages, the rows)."""
    if not pools.state:
        return None
    if CFG.get("state") == "new":
        return [np.array(req.mamba, dtype), np.array(req.pages, dtype),
                np.array(swa_window(req), dtype), np.array(req.rows, dtype),
                np.array(req.rows[:1], dtype)]
    return [np.array(req.mamba, dtype), np.array(swa_window(req), dtype)]


def prefill_main(group, boot_port):
    pools = Pools()
    mgr = S.KVFerryKVManager(pools.kv_args(), S.DisaggregationMode.PREFILL,
                             server_args(boot_port), MLA)
    addr = CFG["bootstrap"]
    al = Allocs(1)
    reqs = [Req(r) for r in CFG["requests"]]
    bootstrap_q, running, inflight, done = [], [], [], []
    pending, to_mark = [], []           # optimistic: computed, waiting for decode
    go = [not CFG.get("hold_mark")]     # hold_mark: mark rooms complete once told
    for req in reqs:                                  # PrefillBootstrapQueue.add
        req.sender = S.KVFerryKVSender(mgr=mgr, bootstrap_addr=addr,
                                       bootstrap_room=req.room, dest_tp_ranks=[TP],
                                       pp_rank=0)
        if CFG.get("optimistic"):
            # Optimistic prefill: the request computes at once, while its
            # sender is still Bootstrapping.
            take_pages(pools, al, req)
            running.append(req)
        else:
            bootstrap_q.append(req)
    while len(done) < len(reqs):
        if time.monotonic() > DEADLINE:
            raise RuntimeError("prefill rank %d: requests not done in time: %s"
                               % (TP, [(r.room, r.sender.poll()) for r in reqs
                                       if r not in done]))
        if next_command() == "go":
            go[0] = True
        if go[0]:
            for req in to_mark:
                req.sender.mark_prefill_complete()
            to_mark = []
        # pop_bootstrapped
        polls = poll_and_all_reduce([r.sender for r in bootstrap_q], group)
        keep = []
        for req, poll in zip(bootstrap_q, polls):
            if poll == KVPoll.Bootstrapping:
                keep.append(req)
                continue
            if poll == KVPoll.Failed:
                req.result = failed(req.sender)
                done.append(req)
                continue
            finalize_bootstrap(al, req)
            take_pages(pools, al, req)
            running.append(req)
        bootstrap_q = keep
        # One forward: a chunk of every running request, then send_kv_chunk.
        still = []
        for req in running:
            end = min(req.filled + CFG["chunk"], req.tokens)
            forward(pools, req, req.filled, end)
            req.filled = end
            last = end == req.tokens
            if CFG.get("optimistic"):
                if last:
                    computed(req, pending, to_mark)
                else:
                    still.append(req)
                continue
            send_kv_chunk(pools, req, last)
            if last:
                inflight.append(req)
            else:
                still.append(req)
        running = still
        # Optimistic: computed requests wait for their decode's destination
        # (pending_bootstrap), then send everything at once.
        polls = poll_and_all_reduce([r.sender for r in pending], group)
        keep = []
        for req, poll in zip(pending, polls):
            if poll == KVPoll.Bootstrapping:
                keep.append(req)
            elif poll == KVPoll.Failed:
                req.result = failed(req.sender)
                req.result["decode_prefix_len"] = None
                done.append(req)
            else:
                finalize_bootstrap(al, req)
                send_kv_chunk(pools, req, True)
                inflight.append(req)
        pending = keep
        # process_disagg_prefill_inflight_queue
        polls = poll_and_all_reduce([r.sender for r in inflight], group)
        keep = []
        for req, poll in zip(inflight, polls):
            if poll in (KVPoll.WaitingForInput, KVPoll.Transferring):
                keep.append(req)
                continue
            if poll == KVPoll.Success:
                req.result = {"state": "Success"}
                req.sender.clear()
            else:
                req.result = failed(req.sender)
            m = req.sender.get_transfer_metric()
            req.result["metric"] = [m.transfer_total_bytes, m.alloc_latency_s,
                                    m.transfer_latency_s]
            req.result["decode_prefix_len"] = req.decode_prefix_len
            done.append(req)
        inflight = keep
        time.sleep(0.001)
    return mgr, reqs


def computed(req, pending, to_mark):
    """The prefill has computed the whole request (optimistic prefill)."""
    emit(event="computed", role=ROLE, tp_rank=TP, room=req.room)
    if req.prefill_abort:
        req.sender.abort()              # e.g. the prefill's own AbortReq
    elif NEW:
        to_mark.append(req)             # marked complete in the loop
    pending.append(req)


def finalize_bootstrap(al, req):
    """The decode's destination is known: SGLang's metadata row, the prefix
    it holds, and init with the pages after it."""
    req.metadata_buffer_index = al.aux.alloc(1)[0]
    decode_prefix_len = req.sender.pop_decode_prefix_len()
    req.start_send_idx = decode_prefix_len
    req.decode_prefix_len = decode_prefix_len
    num_pages = pages_of(req.tokens - decode_prefix_len)
    req.sender.init(num_pages, req.metadata_buffer_index)


def take_pages(pools, al, req):
    """The request's own KV pages (all of the prompt: prefill computes it
    whole) and its state."""
    req.pages = al.kv.alloc(pages_of(req.tokens))
    req.req_to_token = np.concatenate(
        [np.arange(p * PS, (p + 1) * PS) for p in req.pages])[:req.tokens]
    al.state(pools, req)
    req.filled = 0


def forward(pools, req, start, end):
    """The model writes the KV of tokens [start, end) into the request's
    pages (and, at the end, its state)."""
    locs = req.req_to_token[start:end]
    toks = np.arange(start, end)
    for b, buf in enumerate(pools.kv):
        buf[locs] = pattern(req.room, toks, pools.codes[b], pools.dims(b))
    if end == req.tokens and pools.state:
        for g, idx in enumerate(state_indices_of(pools, req, np.int64)):
            for k, buf in enumerate(pools.state[g]):
                for j, i in enumerate(idx):
                    buf[i] = slot_pattern(req.room, 1 + 10 * g + j, buf.shape[1], k)


def swa_window(req):
    """SWA pool pages of the window (the last WINDOW tokens, floored to a
    page), as SGLang's prefill and decode both compute them."""
    first = max(req.tokens - WINDOW, 0) // PS
    return req.swa[first:pages_of(req.tokens)]


def kv_digest(pools, req, locs):
    """SGLang's KV checksum (Adler-32) of the rows at ``locs``, buffer by
    buffer, in token order: what the prefill computes over what it sends
    and the decode over what landed."""
    h = 1
    for buf in pools.kv:
        h = zlib.adler32(np.ascontiguousarray(buf[locs]).tobytes(), h)
    return h


def send_kv_chunk(pools, req, last_chunk):
    """SGLang's PrefillMixin.send_kv_chunk."""
    start_idx = req.start_send_idx
    end_idx = min(req.filled, req.tokens)
    if not last_chunk:
        end_idx = end_idx - end_idx % PS
    if end_idx < start_idx:
        return
    kv_indices = req.req_to_token[start_idx:end_idx]
    state_indices = None
    if last_chunk:
        row = req.metadata_buffer_index                 # set_buf(req)
        pools.aux[0][row] = np.arange(16) + req.room % 1000
        pools.aux[1][row] = np.arange(16) * 0.5 + req.room % 7
        pools.aux[2][row] = 0
        pools.aux[2][row, 0] = req.room
        if CFG.get("checksum"):                        # set_kv_checksum(req, ...)
            pools.aux[3][row] = 0
            pools.aux[3][row, 0] = kv_digest(
                pools, req, req.req_to_token[req.decode_prefix_len:req.tokens])
        state_indices = state_indices_of(pools, req, np.int64)
    page_indices = kv_indices[::PS] // PS
    if not req.sender.should_send_kv_chunk(len(page_indices), last_chunk):
        return
    if NEW:
        # The newest scheduler asks how much one send may carry (None: all).
        limit = req.sender.get_max_transfer_tokens()
        if limit is not None:
            raise RuntimeError("kvferry's sender cut a send at %r tokens" % (limit,))
        req.sender.send(page_indices, state_indices, num_kv_tokens=end_idx - start_idx)
    else:
        req.sender.send(page_indices, state_indices)
    req.start_send_idx = end_idx


def failed(h):
    try:
        h.failure_exception()
    except S.KVTransferError as e:
        return {"state": "Failed", "reason": e.failure_reason,
                "from_another_rank": e.is_from_another_rank,
                "type": type(e).__name__, "str": str(e)}
    return {"state": "Failed", "reason": None, "type": "no exception"}


# ---------------------------------------------------------------------------
# Decode: DecodePreallocQueue, DecodeTransferQueue
# ---------------------------------------------------------------------------

def decode_main(group, boot_port):
    pools = Pools()
    mgr = S.KVFerryKVManager(pools.kv_args(), S.DisaggregationMode.DECODE,
                             server_args(boot_port), MLA)
    addr = CFG["bootstrap"]
    al = Allocs(11)
    reqs = [Req(r) for r in CFG["requests"] if r.get("decode", True)]
    prealloc, pending, transfer, done = [], [], [], []
    go = not CFG.get("hold_mark")
    for req in reqs:                                  # DecodePreallocQueue.add
        req.receiver = S.KVFerryKVReceiver(mgr=mgr, bootstrap_addr=addr,
                                           bootstrap_room=req.room)
        req.waiting_for_input = False
        req.gated = False
        info = mgr.prefill_info_table.get(addr)       # _resolve_prefill_dp_rank
        if info is not None:
            req.receiver.init(0 if info.dp_size == 1 else req.room % info.dp_size)
        else:
            pending.append(req)
        prealloc.append(req)
    while len(done) < len(reqs):
        if time.monotonic() > DEADLINE:
            raise RuntimeError("decode rank %d: requests not done in time: %s"
                               % (TP, [(r.room, r.receiver.poll() if r.receiver
                                        else None) for r in reqs if r not in done]))
        if not go and next_command() == "go":
            go = True
            emit(event="go-seen", role=ROLE, tp_rank=TP)
        # pop_preallocated: _resolve_pending_reqs
        if pending and mgr.try_ensure_parallel_info(addr):
            info = mgr.prefill_info_table[addr]
            for req in pending:
                # A request the all-reduce failed meanwhile left the queue.
                if req.receiver is not None:
                    req.receiver.init(0 if info.dp_size == 1 else req.room % info.dp_size)
            pending = []
        # _update_handshake_waiters
        polls = poll_and_all_reduce([r.receiver for r in prealloc], group)
        keep = []
        for req, poll in zip(prealloc, polls):
            if poll == KVPoll.Bootstrapping:
                note_gated(req)
                keep.append(req)
            elif poll == KVPoll.WaitingForInput:
                req.early |= not go
                req.waiting_for_input = True
                keep.append(req)
            elif poll == KVPoll.Failed:
                req.result = failed(req.receiver)
                req.receiver.clear()
                req.receiver = None
                done.append(req)
            else:
                raise ValueError("Unexpected poll case: %s" % poll)
        prealloc = keep
        # AbortReq for requests still in the prealloc queue
        for req in prealloc:
            if req.abort and req.waiting_for_input and not getattr(req, "aborted", 0):
                req.aborted = True
                req.receiver.abort()
        keep = []
        for req in prealloc:
            if not req.waiting_for_input or getattr(req, "aborted", False):
                keep.append(req)
                continue
            delta = req.tokens - req.prefix
            req.pages = al.kv.alloc(pages_of(delta))           # _pre_alloc
            req.metadata_buffer_index = al.aux.alloc(1)[0]
            al.state(pools, req)
            kv_indices = np.concatenate([np.arange(p * PS, (p + 1) * PS)
                                         for p in req.pages])[:delta] \
                if req.pages else np.zeros(0, np.int64)
            page_indices = (kv_indices[::PS] // PS).astype(np.int32)
            req.receiver.send_metadata(page_indices, req.metadata_buffer_index,
                                       state_indices_of(pools, req, np.int32),
                                       decode_prefix_len=req.prefix)
            transfer.append(req)
        prealloc = keep
        # pop_transferred, with the metadata gate
        polls = [r.receiver.poll() for r in transfer]
        for i, req in enumerate(transfer):
            if polls[i] == KVPoll.Success and \
                    pools.aux[2][req.metadata_buffer_index, 0] != req.room:
                polls[i] = KVPoll.Transferring
        polls = group.all_reduce_min(polls)
        keep = []
        for req, poll in zip(transfer, polls):
            if poll == KVPoll.Failed:
                req.result = failed(req.receiver)
                req.receiver.clear()
                req.receiver = None
                done.append(req)
            elif poll == KVPoll.Success:
                req.result = {"state": "Success", "bad": verify(pools, req)}
                req.receiver.clear()
                req.receiver = None
                pools.aux[2][req.metadata_buffer_index, 0] = 0
                done.append(req)
            else:
                keep.append(req)
        transfer = keep
        time.sleep(0.001)
    for req in reqs:
        req.result["early"] = req.early
    return mgr, reqs


def note_gated(req):
    """prefill_complete: the room is connected (the library's receiver is
    WaitingForInput) while SGLang still sees Bootstrapping."""
    h = req.receiver._h
    if CFG.get("hold_mark") and not req.gated and h is not None and \
            h.poll() >= KVPoll.WaitingForInput:
        req.gated = True
        emit(event="gated", role=ROLE, tp_rank=TP, room=req.room)


def verify(pools, req):
    """Every byte of the request's destination: KV of tokens [prefix, tokens)
    in every buffer (draft included), the aux rows (SGLang's KV checksum
    included: it must match what landed), the state."""
    bad = []
    delta = req.tokens - req.prefix
    locs = np.zeros(0, np.int64)
    if delta:
        locs = np.concatenate([np.arange(p * PS, (p + 1) * PS)
                               for p in req.pages])[:delta]
        toks = np.arange(req.prefix, req.tokens)
        for b, buf in enumerate(pools.kv):
            want = pattern(req.room, toks, pools.codes[b], pools.dims(b))
            if not np.array_equal(buf[locs], want):
                bad.append("kv buffer %d" % b)
    row = req.metadata_buffer_index
    if not np.array_equal(pools.aux[0][row], np.arange(16) + req.room % 1000) or \
            not np.array_equal(pools.aux[1][row], np.arange(16) * 0.5 + req.room % 7) \
            or pools.aux[2][row, 0] != req.room:
        bad.append("aux row %d" % row)
    if CFG.get("checksum") and pools.aux[3][row, 0] != kv_digest(pools, req, locs):
        bad.append("SGLang's KV checksum")
    if pools.state:
        for g, idx in enumerate(state_indices_of(pools, req, np.int64)):
            for k, buf in enumerate(pools.state[g]):
                for j, i in enumerate(idx):
                    if not np.array_equal(buf[i], slot_pattern(
                            req.room, 1 + 10 * g + j, buf.shape[1], k)):
                        bad.append("state %s buffer %d index %d"
                                   % (pools.state_types[g].value, k, i))
    return bad


def main():
    threading.Thread(target=read_commands, daemon=True).start()
    group = Group(int(sys.argv[2]))
    port = int(CFG["bootstrap"].rsplit(":", 1)[1])
    mgr, reqs = (prefill_main if ROLE == "prefill" else decode_main)(group, port)
    emit(event="result", role=ROLE, tp_rank=TP,
         rooms={str(r.room): r.result for r in reqs})
    while COMMANDS.get() != "exit":
        pass
    mgr.teardown()


if __name__ == "__main__":
    try:
        main()
    except Exception as e:
        import traceback
        emit(event="error", role=ROLE, tp_rank=TP,
             message="%s: %s" % (type(e).__name__, e), tb=traceback.format_exc())
        sys.exit(1)
