"""One TP rank of a prefill or decode server, driving kvferry.sglang the way
SGLang's scheduler does (disaggregation/prefill.py and decode.py), call for
call, for test_sglang and test_sglang_causes: the scheduler of
0094505da741 ("old" contract) or of the newest SGLang ("new":
num_kv_tokens on send, get_max_transfer_tokens() before it,
mark_prefill_complete(), the decode allocation policy, the newest KVArgs
fields and StateTypes, the KV checksum's extra metadata buffer,
optimistic prefill).

``python3 _sglang_rank.py '<json config>' FD``: FD is this rank's end of a
socket pair to the other TP rank of its server: the channel of the MIN
all-reduce SGLang runs over its attn-TP gloo group
(``poll_and_all_reduce``).  Both ranks see the same requests in the same
order and take every decision from reduced values, so their queues stay in
step, as SGLang's do.

A sibling that dies or stops.  SGLang's gloo all-reduce raises once the
other rank's process is gone, and the scheduler then takes its whole
server down; while the other rank is stopped it hangs (until gloo's
timeout, then the same).  No surviving rank would ever say why its
requests failed, and that is what these tests check, so the channel here
goes on instead.  It waits for a silent sibling up to SILENT_S, longer
than any test stops one: a SIGCONT within it lets the all-reduce go on,
as gloo's would.  A sibling whose end closed (killed), or silent for
longer, is lost: it can no longer vouch for a request, nor say one
failed.  For LOST_GRACE_S (three heartbeat timeouts: kvferry sees a dead
or silent rank from the other side within one, and tells every rank of
its requests) its entries read Transferring, so that no request concludes
Success and one whose room fails here concludes Failed, with the cause
kvferry relayed; after that they read Failed.  The survivors thus fail
the lost rank's requests through their own rooms, as kvferry tells them,
not through a guess of the scheduler's.

Config: role ("prefill", "decode", or "registry": a bootstrap registry on
``host``, its port emitted), tp_rank, tp_size, bootstrap ("host:port"),
requests, chunk (tokens per prefill chunk), state (true: a mamba-like and
a swa-like group; "new": the newest state types), draft (a draft model's
KV), mla, env (set before kvferry loads), contract ("old", the default, or
"new"), optimistic (the prefill computes each request at once, before its
decode's destination is known, and sends it whole once it is), policy (the
decode allocation policy, "early" or "prefill_complete"), hold_mark
(prefill: mark rooms complete only after "go"; decode: note rooms that
reach WaitingForInput before "go"), checksum (SGLang's
--disaggregation-enable-kv-checksum), gpu (the pools are CUDA memory of the
fake driver), layered (the prefill sends each request's last chunk layer
by layer, as SGLang's open PR #34905 drives a sender: run_layered).  A
request is {room, tokens, prefix?, decode?, abort?, after?, starve?,
refuse?, skip?, hold?, drop_layer?}:

- prefix: tokens the decode server already holds (decode_prefix_len).
- decode: false: no decode rank ever asks for the request.
- abort: an AbortReq, which SGLang hands every TP rank of the server in
  the same step.  "prefill-bootstrap": while the request waits in the
  bootstrap queue, once request ``after`` is done (abort_request:
  sender.abort(); pop_bootstrapped then polls Failed and calls
  failure_exception()); "prefill-running": after its first chunk, in the
  running batch (process_batch_result_disagg_prefill: abort(), clear(), no
  failure_exception()); "prefill-computed": optimistic prefill, once the
  request is computed and before its decode's destination came
  (sender.abort(); the pending queue then polls Failed); "decode" (or
  true): while it waits for pages in the prealloc queue
  (receiver.abort()).
- starve: the decode server has no pages for the request: it waits in the
  prealloc queue (and on prefill in the bootstrap queue) until it fails.
- refuse: the decode rank whose allocator hands send_metadata() a page
  past its pool (the adapter refuses it before the library sees it).
- skip: the prefill rank whose scheduler never sends the request's chunks.
- drop_layer: [rank, layer]: with layered, that prefill rank never sends
  that layer of the last chunk (it still sends the final metadata).
- hold: the prefill rank that, once it sent the first chunk, emits "held"
  and waits for "go" (the test kills, stops or cuts something meanwhile);
  every decode rank emits "landed" once that chunk's bytes are in its
  pages.

Events on stdout, one JSON object a line: ready (the engine's address),
computed (prefill, optimistic: a room computed), gated (decode, hold_mark:
a room connected but kept Bootstrapping by the policy), go-seen (decode,
hold_mark), held, landed, sibling_lost, and result ({"rooms": {room:
{...}}}, once every request is done).  stdin takes "go" (a held request
goes on; hold_mark: the rooms may be marked) and, at the end, "exit" (so
that no engine goes away under a peer that is still finishing).  A failed
room's result: state, reason, from_another_rank, origin [side, rank,
addr], status, type and str of the KVTransferError, own (this rank's own
poll when the all-reduce said Failed) and waited_s (how long
failure_exception() took: it waits for a cause still on its way).
"""
import ctypes
import json
import os
import queue
import re
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
TP, TPS = CFG.get("tp_rank", 0), CFG.get("tp_size", 1)
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
HEARTBEAT_S = int(os.environ.get("KVF_HEARTBEAT_TIMEOUT_MS") or 2500) / 1000.0
SILENT_S = 30.0             # how long the all-reduce waits for a silent sibling
LOST_GRACE_S = 3 * HEARTBEAT_S


def emit(**ev):
    print(json.dumps(ev), flush=True)


# ---------------------------------------------------------------------------
# stdin: one reader thread, so that the step loop never blocks on it
# ---------------------------------------------------------------------------

class Commands:
    """The test's lines: "go" and "exit" (an end of stdin reads "exit")."""

    def __init__(self):
        self.lines = queue.Queue()
        self.exiting = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in sys.stdin:
            self.lines.put(line.strip())
        self.lines.put("exit")

    def _take(self, timeout):
        try:
            line = self.lines.get(timeout=timeout) if timeout else self.lines.get_nowait()
        except queue.Empty:
            return None
        self.exiting |= line == "exit"
        return line

    def go(self):
        """Whether a "go" came since the last call; never waits."""
        while True:
            line = self._take(None)
            if line is None or line == "go":
                return line == "go"

    def wait_go(self):
        """Until "go" comes (a held request); the case's deadline bounds it."""
        while not self.exiting:
            if self._take(max(DEADLINE - time.monotonic(), 0.01)) == "go":
                return
            if time.monotonic() > DEADLINE:
                raise RuntimeError("%s rank %d: no \"go\" in time" % (ROLE, TP))
        raise RuntimeError("%s rank %d: stdin ended while held" % (ROLE, TP))

    def wait_exit(self):
        while not self.exiting:
            self._take(3600)


# ---------------------------------------------------------------------------
# The MIN all-reduce over the attn-TP group (SGLang: gloo, uint8, ReduceOp.MIN)
# ---------------------------------------------------------------------------

class Group:
    def __init__(self, fd):
        self.sock = socket.socket(fileno=fd) if fd >= 0 else None
        self.met = False            # one exchange done: both ranks are up
        self.lost_at = None

    def _recv(self, n):
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the other TP rank closed the channel")
            buf += chunk
        return buf

    def all_reduce_min(self, values):
        vals = [int(v) for v in values]
        if self.sock is None or not vals:
            return vals     # the ranks' queues are in step: both skip an empty one
        if self.lost_at is None:
            # Until both ranks are up, only the case's deadline bounds the
            # wait: a rank may take long to start on a loaded machine.
            self.sock.settimeout(SILENT_S if self.met else
                                 max(DEADLINE - time.monotonic(), 1.0))
            try:
                self.sock.sendall(struct.pack("<I", len(vals)) + bytes(vals))
                n, = struct.unpack("<I", self._recv(4))
                theirs = self._recv(n)
            except OSError as e:            # closed, reset, or silent too long
                self._lose(e)
            else:
                if n != len(vals):
                    raise RuntimeError("all-reduce of %d values against %d: the ranks' "
                                       "queues diverged" % (len(vals), n))
                self.met = True
                return [min(a, b) for a, b in zip(vals, theirs)]
        if time.monotonic() - self.lost_at < LOST_GRACE_S:
            return [min(v, KVPoll.Transferring) for v in vals]
        return [KVPoll.Failed] * len(vals)

    def _lose(self, why):
        emit(event="sibling_lost", role=ROLE, tp_rank=TP,
             why="%s: %s" % (type(why).__name__, why))
        self.lost_at = time.monotonic()
        # Closed here too: a stopped sibling that runs again finds it lost.
        self.sock.close()


def poll_and_all_reduce(pollers, group):
    """(this rank's polls, the reduced ones)."""
    own = [p.poll() for p in pollers]
    return own, group.all_reduce_min(own)


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
        host=CFG["bootstrap"].rsplit(":", 1)[0], port=30000,
        disaggregation_bootstrap_port=bootstrap_port,
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


def pages_of(tokens):
    return -(-tokens // PS)


def token_locs(pages, start, end):
    """Token slots [start, end) of a request whose pages are ``pages``."""
    return np.concatenate([np.arange(p * PS, (p + 1) * PS) for p in pages])[start:end] \
        if pages else np.zeros(0, np.int64)


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


def swa_window(req):
    """SWA pool pages of the window (the last WINDOW tokens, floored to a
    page), as SGLang's prefill and decode both compute them."""
    first = max(req.tokens - WINDOW, 0) // PS
    return req.swa[first:pages_of(req.tokens)]


def kv_digest(pools, locs):
    """SGLang's KV checksum (Adler-32) of the rows at ``locs``, buffer by
    buffer, in token order: what the prefill computes over what it sends
    and the decode over what landed."""
    h = 1
    for buf in pools.kv:
        h = zlib.adler32(np.ascontiguousarray(buf[locs]).tobytes(), h)
    return h


class Req:
    def __init__(self, r):
        self.room = r["room"]
        self.tokens = r["tokens"]
        self.abort = r.get("abort", False)
        if self.abort is True:
            self.abort = "decode"
        self.prefix = r.get("prefix", 0)
        self.decode = r.get("decode", True)
        self.after = r.get("after")
        self.starve = r.get("starve", False)
        self.refuse = r.get("refuse") == TP
        self.skip = r.get("skip") == TP
        drop = r.get("drop_layer")
        self.drop_layer = drop[1] if drop and drop[0] == TP else None
        self.hold = r.get("hold") == TP
        self.watch_first_chunk = r.get("hold") is not None
        self.rid = "req-%d" % self.room
        self.result = None


def failed(h, own):
    """The result of a room the all-reduce said Failed: its KVTransferError,
    ``own`` (this rank's own poll then) and how long failure_exception()
    took."""
    t0 = time.monotonic()
    try:
        h.failure_exception()
    except S.KVTransferError as e:
        return {"state": "Failed", "reason": e.failure_reason,
                "from_another_rank": e.is_from_another_rank, "origin": origin_of(e),
                "status": getattr(e, "status", None), "type": type(e).__name__,
                "str": str(e), "own": KVPoll(own).name,
                "waited_s": round(time.monotonic() - t0, 4)}
    return {"state": "Failed", "reason": None, "type": "no exception"}


def origin_of(e):
    """[side, rank, addr] of the root cause: the exception's attributes, else
    what its str() says (kvferry's: "origin decode rank 0 at host:port")."""
    if getattr(e, "origin_side", None) is not None:
        return [e.origin_side, e.origin_rank, e.origin_addr]
    m = re.search(r"origin (\w+) rank (\d+) at ([^,\]]+)", str(e))
    return [m.group(1), int(m.group(2)), m.group(3)] if m else None


# ---------------------------------------------------------------------------
# Prefill: PrefillBootstrapQueue, forward with chunked prefill, the pending
# queue of optimistic prefill, the inflight queue
# ---------------------------------------------------------------------------

def prefill_main(group, boot_port, commands):
    pools = Pools()
    mgr = S.KVFerryKVManager(pools.kv_args(), S.DisaggregationMode.PREFILL,
                             server_args(boot_port), MLA)
    emit(event="ready", role=ROLE, tp_rank=TP, addr=mgr.engine.address)
    sched = types.SimpleNamespace(
        pools=pools, al=Allocs(1), commands=commands, bootstrap_q=[], running=[],
        pending=[], to_mark=[], inflight=[], done=[], go=not CFG.get("hold_mark"))
    reqs = [Req(r) for r in CFG["requests"]]
    for req in reqs:                                  # PrefillBootstrapQueue.add
        req.sender = S.KVFerryKVSender(mgr=mgr, bootstrap_addr=CFG["bootstrap"],
                                       bootstrap_room=req.room, dest_tp_ranks=[TP],
                                       pp_rank=0)
        if CFG.get("optimistic"):
            # Optimistic prefill: the request computes at once, while its
            # sender is still Bootstrapping.
            take_pages(sched, req)
            sched.running.append(req)
        else:
            sched.bootstrap_q.append(req)
    while len(sched.done) < len(reqs):
        if time.monotonic() > DEADLINE:
            raise RuntimeError("prefill rank %d: requests not done in time: %s"
                               % (TP, [(r.room, r.sender.poll()) for r in reqs
                                       if r not in sched.done]))
        if not sched.go and commands.go():
            sched.go = True
        if sched.go:                        # prefill_complete: readiness
            for req in sched.to_mark:
                req.sender.mark_prefill_complete()
            sched.to_mark = []
        # An AbortReq, once the request it waits for is done (every rank
        # sees that in the same step): abort_request aborts the senders of
        # the bootstrap queue.
        finished = {r.room for r in sched.done}
        for req in sched.bootstrap_q:
            if req.abort == "prefill-bootstrap" and req.after in finished | {None}:
                req.abort = "sent"
                req.sender.abort()
        pop_bootstrapped(sched, group)
        run_batch(sched)
        pop_pending(sched, group)
        process_inflight(sched, group)
        time.sleep(0.001)
    return mgr, reqs


def pop_bootstrapped(sched, group):
    own, polls = poll_and_all_reduce([r.sender for r in sched.bootstrap_q], group)
    keep = []
    for req, mine, poll in zip(sched.bootstrap_q, own, polls):
        if poll == KVPoll.Bootstrapping:
            keep.append(req)
            continue
        if poll == KVPoll.Failed:
            req.result = failed(req.sender, mine)
            sched.done.append(req)
            continue
        finalize_bootstrap(sched, req)
        take_pages(sched, req)
        sched.running.append(req)
    sched.bootstrap_q = keep


def finalize_bootstrap(sched, req):
    """The decode's destination is known: SGLang's metadata row, the prefix
    it holds, and init with the pages after it."""
    req.metadata_buffer_index = sched.al.aux.alloc(1)[0]
    decode_prefix_len = req.sender.pop_decode_prefix_len()
    req.start_send_idx = decode_prefix_len
    req.decode_prefix_len = decode_prefix_len
    num_pages = pages_of(req.tokens - decode_prefix_len)
    req.sender.init(num_pages, req.metadata_buffer_index)


def take_pages(sched, req):
    """The request's own KV pages (all of the prompt: prefill computes it
    whole) and its state."""
    req.pages = sched.al.kv.alloc(pages_of(req.tokens))
    req.req_to_token = token_locs(req.pages, 0, req.tokens)
    sched.al.state(sched.pools, req)
    req.filled = 0


def run_batch(sched):
    """One forward: a chunk of every running request, then send_kv_chunk
    (optimistic prefill: nothing sent until the request is computed)."""
    still = []
    for req in sched.running:
        if req.abort == "prefill-running" and req.filled:
            # process_batch_result_disagg_prefill, a request whose to_finish
            # is FINISH_ABORT: the sender is aborted and cleared; SGLang
            # reports the abort itself, not a KVTransferError.
            req.sender.abort()
            req.sender.clear()
            req.result = {"state": "Aborted", "poll": KVPoll(req.sender.poll()).name}
            sched.done.append(req)
            continue
        end = min(req.filled + CFG["chunk"], req.tokens)
        last = end == req.tokens
        if last and CFG.get("layered"):
            run_layered(sched.pools, req, req.filled, end)
            sched.inflight.append(req)
            continue
        forward(sched.pools, req, req.filled, end)
        req.filled = end
        if CFG.get("optimistic"):
            if last:
                computed(sched, req)
            else:
                still.append(req)
            continue
        send_kv_chunk(sched.pools, req, last)
        if req.hold:
            req.hold = False
            emit(event="held", role=ROLE, tp_rank=TP, room=req.room)
            sched.commands.wait_go()
        (sched.inflight if last else still).append(req)
    sched.running = still


def computed(sched, req):
    """Optimistic prefill has computed the whole request: it waits in the
    pending queue for its decode's destination."""
    emit(event="computed", role=ROLE, tp_rank=TP, room=req.room)
    if req.abort == "prefill-computed":
        req.sender.abort()              # the prefill's own AbortReq
    elif NEW:
        sched.to_mark.append(req)       # marked complete in the loop
    sched.pending.append(req)


def pop_pending(sched, group):
    """Optimistic prefill: computed requests wait for their decode's
    destination (pending_bootstrap), then send everything at once."""
    own, polls = poll_and_all_reduce([r.sender for r in sched.pending], group)
    keep = []
    for req, mine, poll in zip(sched.pending, own, polls):
        if poll == KVPoll.Bootstrapping:
            keep.append(req)
        elif poll == KVPoll.Failed:
            req.result = failed(req.sender, mine)
            req.result["decode_prefix_len"] = None
            sched.done.append(req)
        else:
            finalize_bootstrap(sched, req)
            send_kv_chunk(sched.pools, req, True)
            sched.inflight.append(req)
    sched.pending = keep


def process_inflight(sched, group):
    """process_disagg_prefill_inflight_queue."""
    own, polls = poll_and_all_reduce([r.sender for r in sched.inflight], group)
    keep = []
    for req, mine, poll in zip(sched.inflight, own, polls):
        if poll in (KVPoll.WaitingForInput, KVPoll.Transferring):
            keep.append(req)
            continue
        if poll == KVPoll.Success:
            req.result = {"state": "Success"}
            req.sender.clear()
        else:
            req.result = failed(req.sender, mine)
        m = req.sender.get_transfer_metric()
        req.result["metric"] = [m.transfer_total_bytes, m.alloc_latency_s,
                                m.transfer_latency_s]
        req.result["decode_prefix_len"] = req.decode_prefix_len
        sched.done.append(req)
    sched.inflight = keep


def forward(pools, req, start, end, buffers=None):
    """The model writes the KV of tokens [start, end) into the request's
    pages (``buffers``: only those KV buffers; and, at the end, its
    state)."""
    locs = req.req_to_token[start:end]
    toks = np.arange(start, end)
    for b, buf in enumerate(pools.kv):
        if buffers is None or b in buffers:
            buf[locs] = pattern(req.room, toks, pools.codes[b], pools.dims(b))
    if buffers is not None:
        return
    if end == req.tokens and pools.state:
        for g, idx in enumerate(state_indices_of(pools, req, np.int64)):
            for k, buf in enumerate(pools.state[g]):
                for j, i in enumerate(idx):
                    buf[i] = slot_pattern(req.room, 1 + 10 * g + j, buf.shape[1], k)


class Event:
    """A CUDA event of the fake GPU: complete once its kernels ran (the
    scheduler runs them after the call it gave the event to)."""

    def __init__(self, done=False):
        self.done = done

    def query(self):
        return self.done

    def synchronize(self):
        if not self.done:
            raise RuntimeError("synchronize() on an event whose kernels the test "
                               "runs only after this call returns")


def layer_buffers(pools, layer):
    """The KV buffers of the model's ``layer`` (K and V; MLA: one)."""
    return {layer} if MLA else {layer, LAYERS + layer}


def run_layered(pools, req, start, end):
    """The last chunk as PR #34905's LayerPipelinedKVTransferAdapter drives
    a sender: prepare_layer_pipelined_transfer with the chunk's pages (from
    start_send_idx) and every state type's indices; for each layer, the
    call send_layers(layer_ids, ready_event) and then the layer's kernels
    (the bytes land after the call: the sender must wait for the event);
    the draft model's layers (is_draft); then set_buf and
    send_final_metadata (finalize_pipelined_transfer)."""
    s = req.start_send_idx
    req.filled = end
    state_indices = state_indices_of(pools, req, np.int64)
    req.sender.prepare_layer_pipelined_transfer(
        req.req_to_token[s:end][::PS] // PS, state_indices,
        final_state_indices=None, skip_dsa_state_layer_ids=None)
    for layer in range(LAYERS):
        ev = Event()
        if layer != req.drop_layer:
            req.sender.send_layers([layer], ready_event=ev)
        forward(pools, req, start, end, layer_buffers(pools, layer))
        ev.done = True
    if CFG.get("draft"):
        ev = Event()
        req.sender.send_layers([0], is_draft=True, ready_event=ev)
        forward(pools, req, start, end, {len(pools.kv) - 2, len(pools.kv) - 1})
        ev.done = True
    forward(pools, req, end, end)                       # the state, at the end
    set_buf(pools, req)
    req.sender.send_final_metadata(Event(done=True))
    req.start_send_idx = end


def set_buf(pools, req):
    """SGLang's MetadataBuffers.set_buf (and the KV checksum) for the
    request's row."""
    row = req.metadata_buffer_index
    pools.aux[0][row] = np.arange(16) + req.room % 1000
    pools.aux[1][row] = np.arange(16) * 0.5 + req.room % 7
    pools.aux[2][row] = 0
    pools.aux[2][row, 0] = req.room
    if CFG.get("checksum"):                        # set_kv_checksum(req, ...)
        pools.aux[3][row] = 0
        pools.aux[3][row, 0] = kv_digest(
            pools, req.req_to_token[req.decode_prefix_len:req.tokens])


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
        set_buf(pools, req)
        state_indices = state_indices_of(pools, req, np.int64)
    page_indices = kv_indices[::PS] // PS
    if not req.sender.should_send_kv_chunk(len(page_indices), last_chunk) or req.skip:
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


# ---------------------------------------------------------------------------
# Decode: DecodePreallocQueue, DecodeTransferQueue
# ---------------------------------------------------------------------------

def decode_main(group, boot_port, commands):
    pools = Pools()
    mgr = S.KVFerryKVManager(pools.kv_args(), S.DisaggregationMode.DECODE,
                             server_args(boot_port), MLA)
    emit(event="ready", role=ROLE, tp_rank=TP, addr=mgr.engine.address)
    addr = CFG["bootstrap"]
    sched = types.SimpleNamespace(
        mgr=mgr, pools=pools, al=Allocs(11), prealloc=[], pending=[], transfer=[],
        done=[], go=not CFG.get("hold_mark"))
    reqs = [Req(r) for r in CFG["requests"]]
    reqs = [req for req in reqs if req.decode]
    for req in reqs:                                  # DecodePreallocQueue.add
        req.receiver = S.KVFerryKVReceiver(mgr=mgr, bootstrap_addr=addr,
                                           bootstrap_room=req.room)
        req.waiting_for_input = False
        req.aborted = req.landed = req.gated = req.early = False
        info = mgr.prefill_info_table.get(addr)       # _resolve_prefill_dp_rank
        if info is not None:
            req.receiver.init(0 if info.dp_size == 1 else req.room % info.dp_size)
        else:
            sched.pending.append(req)
        sched.prealloc.append(req)
    while len(sched.done) < len(reqs):
        if time.monotonic() > DEADLINE:
            raise RuntimeError("decode rank %d: requests not done in time: %s"
                               % (TP, [(r.room, r.receiver.poll() if r.receiver
                                        else None) for r in reqs
                                       if r not in sched.done]))
        if not sched.go and commands.go():
            sched.go = True
            emit(event="go-seen", role=ROLE, tp_rank=TP)
        pop_preallocated(sched, group)
        watch_first_chunks(sched)
        pop_transferred(sched, group)
        time.sleep(0.001)
    for req in reqs:
        req.result["early"] = req.early
    return mgr, reqs


def conclude_failed(sched, req, own):
    req.result = failed(req.receiver, own)
    req.receiver.clear()
    req.receiver = None
    sched.done.append(req)
    if req in sched.pending:        # failed before this rank could init it
        sched.pending.remove(req)


def pop_preallocated(sched, group):
    addr = CFG["bootstrap"]
    if sched.pending and sched.mgr.try_ensure_parallel_info(addr):
        info = sched.mgr.prefill_info_table[addr]      # _resolve_pending_reqs
        for req in sched.pending:
            req.receiver.init(0 if info.dp_size == 1 else req.room % info.dp_size)
        sched.pending = []
    # _update_handshake_waiters
    own, polls = poll_and_all_reduce([r.receiver for r in sched.prealloc], group)
    keep = []
    for req, mine, poll in zip(sched.prealloc, own, polls):
        if poll == KVPoll.Bootstrapping:
            note_gated(req)
            keep.append(req)
        elif poll == KVPoll.WaitingForInput:
            req.early |= not sched.go
            req.waiting_for_input = True
            keep.append(req)
        elif poll == KVPoll.Failed:
            conclude_failed(sched, req, mine)
        else:
            raise ValueError("Unexpected poll case: %s" % poll)
    # AbortReq for requests still in the prealloc queue
    for req in keep:
        if req.abort == "decode" and req.waiting_for_input and not req.aborted:
            req.aborted = True
            req.receiver.abort()
    sched.prealloc = []
    for req in keep:
        if not req.waiting_for_input or req.aborted or req.starve:
            sched.prealloc.append(req)
        else:
            give_destination(sched, req)
            sched.transfer.append(req)


def note_gated(req):
    """prefill_complete: the room is connected (the library's receiver is
    WaitingForInput) while SGLang still sees Bootstrapping."""
    h = req.receiver._h
    if CFG.get("hold_mark") and not req.gated and h is not None and \
            h.poll() >= KVPoll.WaitingForInput:
        req.gated = True
        emit(event="gated", role=ROLE, tp_rank=TP, room=req.room)


def give_destination(sched, req):
    """_pre_alloc, then send_metadata."""
    pools = sched.pools
    delta = req.tokens - req.prefix
    req.pages = sched.al.kv.alloc(pages_of(delta))
    req.metadata_buffer_index = sched.al.aux.alloc(1)[0]
    sched.al.state(pools, req)
    page_indices = (token_locs(req.pages, 0, delta)[::PS] // PS).astype(np.int32)
    if req.refuse:
        # An allocator that handed this rank a page past its pool.
        page_indices[-1] = POOL + 7
    req.receiver.send_metadata(page_indices, req.metadata_buffer_index,
                               state_indices_of(pools, req, np.int32),
                               decode_prefix_len=req.prefix)


def watch_first_chunks(sched):
    """"landed": the first chunk of a held request is in this rank's pages."""
    for req in sched.transfer:
        if req.watch_first_chunk and not req.landed and req.receiver is not None:
            end = min(CFG["chunk"], req.tokens)
            if not bad_kv(sched.pools, req, req.prefix, end):
                req.landed = True
                emit(event="landed", role=ROLE, tp_rank=TP, room=req.room)


def pop_transferred(sched, group):
    """pop_transferred, with the metadata gate: Success counts once the
    aux row names the room."""
    pools = sched.pools
    own = [r.receiver.poll() for r in sched.transfer]
    gated = list(own)
    for i, req in enumerate(sched.transfer):
        if own[i] == KVPoll.Success and \
                pools.aux[2][req.metadata_buffer_index, 0] != req.room:
            gated[i] = KVPoll.Transferring
    polls = group.all_reduce_min(gated)
    keep = []
    for req, mine, poll in zip(sched.transfer, own, polls):
        if poll == KVPoll.Failed:
            conclude_failed(sched, req, mine)
        elif poll == KVPoll.Success:
            req.result = {"state": "Success", "bad": verify(pools, req)}
            req.receiver.clear()
            req.receiver = None
            pools.aux[2][req.metadata_buffer_index, 0] = 0
            sched.done.append(req)
        else:
            keep.append(req)
    sched.transfer = keep


def bad_kv(pools, req, start, end):
    """The KV buffers whose tokens [start, end) of the request are not in
    its pages (start >= its prefix)."""
    if end <= start:
        return []
    locs = token_locs(req.pages, start - req.prefix, end - req.prefix)
    toks = np.arange(start, end)
    return ["kv buffer %d" % b for b, buf in enumerate(pools.kv)
            if not np.array_equal(buf[locs], pattern(req.room, toks, pools.codes[b],
                                                      pools.dims(b)))]


def verify(pools, req):
    """Every byte of the request's destination: KV of tokens [prefix, tokens)
    in every buffer (draft included), the aux rows (SGLang's KV checksum
    included: it must match what landed), the state."""
    bad = bad_kv(pools, req, req.prefix, req.tokens)
    row = req.metadata_buffer_index
    if not np.array_equal(pools.aux[0][row], np.arange(16) + req.room % 1000) or \
            not np.array_equal(pools.aux[1][row], np.arange(16) * 0.5 + req.room % 7) \
            or pools.aux[2][row, 0] != req.room:
        bad.append("aux row %d" % row)
    if CFG.get("checksum") and pools.aux[3][row, 0] != kv_digest(
            pools, token_locs(req.pages, 0, req.tokens - req.prefix)):
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


def registry_main(commands):
    """The prefill server's bootstrap registry, in a process of its own
    (in a network namespace of the test's)."""
    boot = S.KVFerryKVBootstrapServer(host=CFG["host"], port=0)
    emit(event="registry", port=boot.port)
    commands.wait_exit()
    boot.close()


def main():
    commands = Commands()
    if ROLE == "registry":
        return registry_main(commands)
    group = Group(int(sys.argv[2]))
    port = int(CFG["bootstrap"].rsplit(":", 1)[1])
    mgr, reqs = (prefill_main if ROLE == "prefill" else decode_main)(group, port, commands)
    emit(event="result", role=ROLE, tp_rank=TP,
         rooms={str(r.room): r.result for r in reqs})
    commands.wait_exit()
    mgr.teardown()


if __name__ == "__main__":
    try:
        main()
    except Exception as e:
        import traceback
        emit(event="error", role=ROLE, tp_rank=TP,
             message="%s: %s" % (type(e).__name__, e), tb=traceback.format_exc())
        sys.exit(1)
