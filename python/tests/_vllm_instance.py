"""One vLLM instance (prefill or decode) driving kvferry.vllm.KVFerryConnector
the way vLLM v1 does, for test_vllm: one scheduler-side connector and one
worker-side connector per TP rank (threads of this process, each with its
own KV cache and kvferry engine), stepped like vLLM's engine core
(docs/VLLM.md, "Call sequence"):

  startup   worker register_kv_caches -> get_handshake_metadata ->
            scheduler set_xfer_handshake_metadata({tp_rank: md})
  each step scheduler: for each new request get_num_new_matched_tokens ->
            allocate -> update_state_after_alloc; build_connector_meta;
            workers (concurrently, metadata pickled as vLLM ships it):
            bind_connector_metadata, start_load_kv, [forward: a prefill
            writes its KV], wait_for_save, get_finished(finished_req_ids),
            get_block_ids_with_load_errors, clear_connector_metadata;
            scheduler: aggregate the workers' reports (an id is finished
            once every worker reported it: KVOutputAggregator), then
            request_finished for the requests that stopped.

``python3 _vllm_instance.py '<json config>'``; config: role ("prefill" /
"decode"), tp, layout ("NHD"/"HND"), mla, lease_s, kvferry (engine settings),
mode ("pull"/"push": kv_connector_extra_config.transfer_mode), chunk (push:
the tokens a prefill step computes, chunked prefill),
rank_kvferry ({tp rank: settings of that rank's engine, over kvferry's}),
collide ({forged P request id: real P request id}: this process's room
key of the forged id names the real one's room under another instance, as
two ids whose rooms collide would).  Commands on stdin, one JSON object a
line: {"cmd": "prefill", "id", "tokens", "params" (push: with the transfer_id),
"stop_after_layer" (the last chunk's forward writes and saves only the layers
below it)}, {"cmd": "decode", "id", "tokens", "params", "prefix_blocks", "abort"}, {"cmd": "metrics"}, {"cmd": "quit"}.
Events on stdout: ready, params, freed, recv, stats (the workers' connector
stats of a step, aggregated), metrics (each rank's engine metrics text and
endpoint), log, violation (a broken scheduler invariant), error.
"""
import json
import logging
import os
import pickle
import queue
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

CFG = json.loads(sys.argv[1])
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from kvferry import vllm as V  # noqa: E402

ROLE = CFG["role"]
TPS = CFG["tp"]
BS = 4                      # tokens per block
NB = 64                     # blocks per cache
LAYERS = 3
MLA = bool(CFG.get("mla"))  # one latent vector per token, the same on every rank
HEADS = 4                   # KV heads of the model
HL = 1 if MLA else HEADS // TPS     # per TP rank
D = 36 if MLA else 8        # head size (uint16 elements); MLA: the latent width
ROLES = (2,) if MLA else (0, 1)
DEADLINE = time.monotonic() + 200


def emit(**ev):
    print(json.dumps(ev), flush=True)


class _Forward(logging.Handler):
    """The connector's warnings and errors, as events (the test reads the
    reasons it logs)."""

    def emit(self, record):
        emit(event="log", level=record.levelname, msg=record.getMessage())


V.logger.addHandler(_Forward(logging.WARNING))
V.logger.propagate = False

if CFG.get("collide"):
    _real_key = V._room_key

    def _colliding_key(request_id):
        real = CFG["collide"].get(request_id)
        if real is None:
            return _real_key(request_id)
        return _real_key(real)[0], _real_key(request_id)[1]
    V._room_key = _colliding_key


class RequestStatus:
    """vLLM's RequestStatus names (the connector reads ``status.name``)."""
    WAITING = types.SimpleNamespace(name="WAITING")
    WAITING_FOR_REMOTE_KVS = types.SimpleNamespace(name="WAITING_FOR_REMOTE_KVS")
    FINISHED_LENGTH_CAPPED = types.SimpleNamespace(name="FINISHED_LENGTH_CAPPED")


class Request:
    def __init__(self, ext_id, tokens, params):
        # vLLM's InputProcessor: internal id = external id + 8 random chars.
        self.request_id = "%s-%s" % (ext_id, os.urandom(4).hex())
        self.ext_id = ext_id
        self.prompt_token_ids = list(range(tokens))
        self.kv_transfer_params = params
        self.status = RequestStatus.WAITING
        self.blocks = []
        self.num_computed_tokens = 0


class Blocks:
    """vLLM's KVCacheBlocks: the request's blocks, the first ``hashed`` of
    them local prefix-cache hits."""

    def __init__(self, ids, hashed):
        self.ids, self.hashed = ids, hashed

    def get_block_ids(self):
        return (list(self.ids),)

    def get_unhashed_block_ids(self):
        return list(self.ids[self.hashed:])


def seed_of(ext_id):
    return sum(ext_id.encode()) * 7 % 1000


def expected(ext_id, layer, role, tp_rank, ntok):
    """The KV of tokens 0..ntok of request ``ext_id`` for ``tp_rank``'s heads:
    (ntok, HL, D) uint16, a value per layer, K/V, global head, token, dim."""
    t = np.arange(ntok, dtype=np.int64)[:, None, None]
    g = ((0 if MLA else tp_rank * HL) + np.arange(HL, dtype=np.int64))[None, :, None]
    k = np.arange(D, dtype=np.int64)[None, None, :]
    v = seed_of(ext_id) * 1009 + layer * 131 + role * 61 + g * 17 + t * 7 + k * 3
    return (v % 65521).astype(np.uint16)


def make_cache():
    """One layer's cache as vLLM hands it over: logical shape (2, NB, BS, HL, D);
    HND: a permuted view of head-major memory; MLA: (NB, BS, D)."""
    if MLA:
        return np.zeros((NB, BS, D), np.uint16)
    if CFG.get("layout", "NHD") == "HND":
        return np.zeros((2, NB, HL, BS, D), np.uint16).transpose(0, 1, 3, 2, 4)
    return np.zeros((2, NB, BS, HL, D), np.uint16)


def vllm_config(tp_rank=None):
    engine = dict(CFG.get("kvferry", {}), **CFG.get("rank_kvferry", {}).get(str(tp_rank), {}))
    extra = {"lease_s": CFG.get("lease_s", 120), "kvferry": engine,
             "transfer_mode": CFG.get("mode", "pull")}
    if tp_rank is not None:
        extra["tp_rank"] = tp_rank
    return types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(
            kv_role=CFG.get("kv_role", "kv_both"), engine_id="%s-engine" % ROLE,
            kv_connector_extra_config=extra),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=TPS),
        cache_config=types.SimpleNamespace(block_size=BS))


class Worker:
    def __init__(self, rank):
        self.rank = rank
        self.conn = V.KVFerryConnector(vllm_config(rank), V.KVConnectorRole.WORKER)
        self.caches = {"model.layers.%d.self_attn.attn" % i: make_cache()
                       for i in range(LAYERS)}
        self.conn.register_kv_caches(self.caches)
        self.reported = set()           # ids this worker reported (once each)
        self.writes = []                # (request, blocks, lo, hi, layers) for the forward

    def layer(self, i, role):
        """Role's (NB, BS, HL, D) view of layer i's cache."""
        c = self.caches["model.layers.%d.self_attn.attn" % i]
        return c[:, :, None, :] if MLA else c[role]

    def write(self, ext_id, blocks, ntok, lo=0, layers=range(LAYERS)):
        """Tokens [lo, ntok) of the request, into its blocks, in ``layers``."""
        t = np.arange(lo, ntok)
        b, s = np.asarray(blocks, dtype=np.int64)[t // BS], t % BS
        for i in layers:
            for role in ROLES:
                self.layer(i, role)[b, s] = expected(ext_id, i, role, self.rank, ntok)[lo:]

    def check(self, ext_id, blocks, ntok):
        t = np.arange(ntok)
        b, s = np.asarray(blocks, dtype=np.int64)[t // BS], t % BS
        bad = []
        for i in range(LAYERS):
            for role in ROLES:
                got = self.layer(i, role)[b, s]
                want = expected(ext_id, i, role, self.rank, ntok)
                if not np.array_equal(got, want):
                    wrong = np.argwhere(got != want)
                    bad.append({"rank": self.rank, "layer": i, "role": role,
                                "count": int(len(wrong)), "first": wrong[0].tolist()})
        return bad

    def zero(self, blocks):
        return all(not self.layer(i, r)[blocks].any() for i in range(LAYERS) for r in ROLES)

    def step(self, meta_bytes, finished_req_ids):
        c = self.conn
        c.bind_connector_metadata(pickle.loads(meta_bytes))
        c.start_load_kv(types.SimpleNamespace(attn_metadata=None))
        # The forward pass, layer by layer: each attention layer writes its
        # KV of this step's tokens, then calls save_kv_layer (vLLM's
        # unified_attention -> maybe_save_kv_layer_to_connector).  A
        # forward that stops after a layer saves no more.
        for i in range(min([w[4] for w in self.writes] or [LAYERS])):
            for ext_id, blocks, lo, hi, _ in self.writes:
                self.write(ext_id, blocks, hi, lo, [i])
            name = "model.layers.%d.self_attn.attn" % i
            c.save_kv_layer(name, self.caches[name], None)
        self.writes = []
        c.wait_for_save()                   # vLLM calls it even when the forward raised
        sending, recving = c.get_finished(set(finished_req_ids))
        invalid = c.get_block_ids_with_load_errors()
        c.clear_connector_metadata()
        # What vLLM's model runner ships with the step's output.
        stats = c.get_kv_connector_stats()
        out = (set(sending or ()), set(recving or ()), set(invalid or ()), stats)
        for rid in out[0] | out[1]:
            if rid in self.reported:
                emit(event="violation", what="rank %d reported %s twice" % (self.rank, rid))
            self.reported.add(rid)
        return out

    def manager(self):
        """The engine of this instance's role (a kv_both worker has two)."""
        w = self.conn._worker
        return w.decode if ROLE == "decode" else w.prefill


def schedule_prefills(sched, prefilling, free, workers):
    """One step of vLLM's chunked prefill for the prefill requests: each
    computes up to CFG["chunk"] more tokens, its blocks allocated as it
    grows (update_state_after_alloc on its first step), and the step's
    SchedulerOutput (scheduled_new_reqs, scheduled_cached_reqs,
    num_scheduled_tokens).  Returns it and the requests whose prompt is
    now computed (they stop: max_tokens=1)."""
    chunk = CFG.get("chunk") or 1 << 30
    new, tokens, done = [], {}, []
    cached = types.SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[])
    for req in prefilling:
        ntok = len(req.prompt_token_ids)
        lo = req.num_computed_tokens
        hi = min(ntok, lo + chunk)
        added = [free.pop() for _ in range(-(-hi // BS) - len(req.blocks))]
        req.blocks += added
        if lo == 0:
            sched.update_state_after_alloc(req, Blocks(req.blocks, 0), 0)
            new.append(types.SimpleNamespace(req_id=req.request_id, num_computed_tokens=lo,
                                             block_ids=(list(req.blocks),)))
        else:
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append((added,) if added else None)
            cached.num_computed_tokens.append(lo)
        tokens[req.request_id] = hi - lo
        for w in workers:
            w.writes.append((req.ext_id, req.blocks, lo, hi,
                             req.stop_after if hi == ntok else LAYERS))
        req.num_computed_tokens = hi
        if hi == ntok:
            done.append(req)
    for req in done:
        prefilling.remove(req)
    return types.SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                                 num_scheduled_tokens=tokens), done


def main():
    workers = [Worker(r) for r in range(TPS)]
    sched = V.KVFerryConnector(vllm_config(), V.KVConnectorRole.SCHEDULER)
    sched.set_xfer_handshake_metadata({w.rank: w.conn.get_handshake_metadata()
                                       for w in workers})
    free = [i * 7 % NB for i in range(NB)]        # scattered blocks
    requests = {}                   # request_id -> Request (scheduler's self.requests)
    finished_ids = set()            # ids finished since the previous step
    counts = {}                     # id -> reports (KVOutputAggregator)
    invalid = set()
    announced = set()               # ids given to the workers in finished_req_ids
    cmds = queue.Queue()

    def read():
        for line in sys.stdin:
            cmds.put(json.loads(line))
        cmds.put({"cmd": "quit"})
    threading.Thread(target=read, daemon=True).start()
    prefilling = []                 # prefill requests still computing their prompt
    emit(event="ready", addrs=[w.conn._worker.prefill.address for w in workers
                               if w.conn._worker.prefill is not None],
         descriptors=sched._scheduler.descriptors,
         decode_addrs=[w.conn._worker.decode.address for w in workers
                       if w.conn._worker.decode is not None])
    pool = ThreadPoolExecutor(TPS)
    stopping = []
    while time.monotonic() < DEADLINE:
        # -- schedule: new requests
        try:
            while True:
                c = cmds.get_nowait()
                if c["cmd"] == "quit":
                    raise SystemExit
                if c["cmd"] == "metrics":   # each rank's engine: its text and endpoint
                    emit(event="metrics", texts=[w.manager().metrics() for w in workers],
                         addrs=[w.manager().metrics_addr for w in workers])
                    continue
                req = Request(c["id"], c["tokens"], c.get("params"))
                nblocks = -(-c["tokens"] // BS)
                if ROLE == "prefill":
                    n, async_ = sched.get_num_new_matched_tokens(req, 0)
                    if (n, async_) != (0, False):
                        emit(event="violation", what="prefill matched %r" % ((n, async_),))
                    req.stop_after = c.get("stop_after_layer", LAYERS)
                    prefilling.append(req)        # max_tokens=1: stops once computed
                elif c.get("abort"):
                    # Aborted while waiting, before the scheduler allocated it.
                    req.status = types.SimpleNamespace(name="FINISHED_ABORTED")
                    out = sched.request_finished(req, [])
                    emit(event="recv", id=c["id"], loaded=False, finished=list(out))
                    continue
                else:
                    hit = c.get("prefix_blocks", 0)
                    n, async_ = sched.get_num_new_matched_tokens(req, hit * BS)
                    req.blocks = [free.pop() for _ in range(nblocks)]
                    for w in workers:             # the local prefix-cache hit
                        w.write(req.ext_id, req.blocks[:hit], hit * BS)
                    sched.update_state_after_alloc(req, Blocks(req.blocks, hit), n or 0)
                    if not async_:
                        emit(event="recv", id=c["id"], loaded=False, matched=n)
                        continue
                    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                requests[req.request_id] = req
        except queue.Empty:
            pass
        out, done = schedule_prefills(sched, prefilling, free, workers)
        stopping.extend(done)
        out.finished_req_ids = set(finished_ids)
        meta = sched.build_connector_meta(out)
        if meta is None:
            emit(event="violation", what="build_connector_meta returned None")
        blob = pickle.dumps(meta)
        results = list(pool.map(lambda w: w.step(blob, finished_ids), workers))
        announced |= finished_ids
        finished_ids = set()
        done_send, done_recv = set(), set()
        # The workers' stats, aggregated as vLLM's KVOutputAggregator does.
        stats = None
        for r in results:
            if r[3] is not None:
                stats = r[3] if stats is None else stats.aggregate(r[3])
        if stats is not None and not stats.is_empty():
            emit(event="stats", data=stats.data)
        for sending, recving, inv, _ in results:
            invalid |= inv
            if sending - announced:
                emit(event="violation", what="finished_sending %s before finished_req_ids"
                     % sorted(sending - announced))
            for rid in sending | recving:
                counts[rid] = counts.get(rid, 0) + 1
                if counts[rid] == TPS:
                    (done_send if rid in sending else done_recv).add(rid)
        for rid in done_send:
            req = requests.pop(rid, None)
            if req is None or req.status is not RequestStatus.FINISHED_LENGTH_CAPPED:
                emit(event="violation", what="finished_sending %s not a held request" % rid)
                continue
            free.extend(req.blocks)
            emit(event="freed", id=req.ext_id, request_id=rid)
        for rid in done_recv:
            req = requests.pop(rid, None)
            if req is None or req.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
                emit(event="violation", what="finished_recving %s not loading" % rid)
                continue
            ntok = len(req.prompt_token_ids)
            bad = sum((w.check(req.ext_id, req.blocks, ntok) for w in workers), [])
            mine = sorted(invalid & set(req.blocks))
            invalid -= set(mine)
            emit(event="recv", id=req.ext_id, loaded=True, blocks=req.blocks, invalid=mine,
                 bad=bad, zero=all(w.zero(req.blocks) for w in workers))
        # -- update_from_output: the requests that stopped this step
        for req in stopping:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            delay, params = sched.request_finished(req, list(req.blocks))
            emit(event="params", id=req.ext_id, request_id=req.request_id, delay=delay,
                 params=params)
            finished_ids.add(req.request_id)
            if not delay:
                requests.pop(req.request_id, None)
                free.extend(req.blocks)
        stopping = []
        time.sleep(0.002)               # the engine loop's pace
    emit(event="error", message="deadline")


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        pass
    except Exception as e:          # report, so the test fails with the reason
        import traceback
        emit(event="error", message="%s: %s" % (type(e).__name__, e),
             trace=traceback.format_exc())
        raise
    finally:
        emit(event="bye")
