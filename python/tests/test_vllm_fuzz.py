"""kvferry.vllm's scheduler side fed hostile kv_transfer_params.

vLLM hands a client's ``kv_transfer_params`` to the connector in its
engine core: whatever they hold must never raise there, and a request
whose params kvferry cannot use is prefilled locally (``(0, False)``, no
read) with one logged reason.  A seeded generator (``_junk.py``) makes a
few thousand cases within a time bound: valid P params damaged field by
field (wrong types, huge and negative ints, NaN, surrogates, NUL, long
strings, nested junk, descriptors broken character by character), junk
in place of the whole params, and hostile request ids on P.  Each goes
through the connector's real methods in vLLM's order.  Checked per case:
nothing raises; the answers have vLLM's types; a refused request reads
nothing and is logged once; an accepted one reads exactly what its params
name (the room of its id, the prompt's blocks); what P hands off, D takes;
no bug handler ran (except for hostile Python objects no JSON decoder
makes).  The Python descriptor reader is held to the library's: what it
accepts a decode engine accepts, and what it refuses field by field the
engine refuses.

``KVF_FUZZ_SEED`` replays a run (each run draws its own seed and prints
it); ``KVF_FUZZ_CASES`` sets the number of cases.
"""
import logging
import os
import pickle
import random
import socket
import sys
import time
import types
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _junk import Junk, mutate_text  # noqa: E402
from _util import descriptor, kvferry, make_args  # noqa: E402
from kvferry import _descriptor  # noqa: E402
from kvferry import vllm as V  # noqa: E402

SEED = int(os.environ.get("KVF_FUZZ_SEED") or random.SystemRandom().randrange(2 ** 32))
CASES = int(os.environ.get("KVF_FUZZ_CASES") or 3000)
BUDGET_S = 15.0         # the cases stop here, however many ran (the count is printed)
BS = 4                  # tokens per block
CROSS_CHECKS = 300      # descriptor sets also given to a decode engine, at most


def config(role="kv_both"):
    return types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(
            kv_role=role, engine_id="fuzz-engine", kv_connector_extra_config={}),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1),
        cache_config=types.SimpleNamespace(block_size=BS))


class Request:
    def __init__(self, rid, tokens, params, status="FINISHED_STOPPED"):
        self.request_id = rid
        self.prompt_token_ids = list(range(tokens))
        self.kv_transfer_params = params
        self.status = types.SimpleNamespace(name=status)


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_unhashed_block_ids(self):
        return list(self.ids)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        record.getMessage()             # formatting must not fail either
        self.records.append(record)


class Gen:
    """Cases: valid params as P makes them, then damaged."""

    def __init__(self, rng, port):
        self.rng = rng
        self.port = port
        self.junk = Junk(rng, python=True, raising=True)
        self.json = Junk(rng)

    def descriptors(self, tp):
        r = self.rng
        common = {"page": str(r.choice([1, 4, 16, 2 ** 32 - 1])),
                  "dtype": r.choice(["bfloat16", "fp8_e4m3", "float16"]),
                  "attn": r.choice(["mha", "mla"]), "heads": str(r.choice([0, 2, 8, 65536])),
                  "dp": r.choice(["0/1", "3/8"])}
        out = []
        for rank in range(tp):
            host = r.choice(["127.0.0.1", "[::1]", "127.1.2.3"])
            d = descriptor(rank, tp, addr="%s:%d" % (host, self.port), **common)
            if r.random() < 0.2:
                d += " later=field"
            if r.random() < 0.2:        # fields in another order
                toks = d.split(" ")
                rest = toks[1:]
                r.shuffle(rest)
                d = " ".join(toks[:1] + rest)
            out.append(d)
        r.shuffle(out)                  # any order of ranks
        return out

    def valid(self, tokens):
        r = self.rng
        need = -(-tokens // BS)
        tp = r.choice([1, 1, 2, 4])
        descs = self.descriptors(tp)
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": r.sample(range(100000), need + r.choice([0, 0, 1])),
                "remote_engine_id": r.choice(["P", "prefill-engine-%d" % r.randrange(99)]),
                "remote_request_id": "cmpl-%x-0-%08x" % (r.randrange(2 ** 64),
                                                         r.randrange(2 ** 32)),
                "tp_size": tp, "kvferry_descriptors": descs,
                "remote_host": "ignored", "remote_port": 5557}

    def damage(self, p):
        """``p`` damaged once; returns a word for what was done."""
        r = self.rng
        key = r.choice(sorted(p) + ["remote_block_ids", "kvferry_descriptors"] * 2)
        what = r.randrange(6)
        if what == 0:
            p[key] = self.junk.value()
        elif what == 1:
            p.pop(key, None)
        elif what == 2 and key == "remote_block_ids" and type(p.get(key)) is list:
            blocks = p[key]
            if r.random() < 0.5 and blocks:
                blocks[r.randrange(len(blocks))] = self.junk.value()
            else:
                p[key] = blocks[:r.randrange(len(blocks) + 1)]
        elif what in (2, 3) and key == "kvferry_descriptors" \
                and type(p.get(key)) is list and p[key]:
            descs = p[key]
            i = r.randrange(len(descs))
            pick = r.randrange(4)
            if pick == 0 and type(descs[i]) is str:
                descs[i] = mutate_text(r, descs[i])
            elif pick == 1:
                descs.append(descs[i])
            elif pick == 2:
                del descs[i]
            else:
                descs[i] = self.junk.value()
        elif what == 4:
            p[self.json.text()] = self.junk.value()
        else:
            p[key] = self.json.json()
        return key

    def case(self):
        r = self.rng
        tokens = r.randrange(1, 60)
        pick = r.random()
        if pick < 0.08:
            return tokens, self.junk.value()            # junk for the whole params
        p = self.valid(tokens)
        if pick < 0.2:
            return tokens, p                            # unharmed
        for _ in range(r.choice([1, 1, 1, 2, 3])):
            self.damage(p)
        return tokens, p


def _shown(v, limit=600):
    try:
        return ascii(v)[:limit]
    except Exception as e:              # a hostile object's repr raises
        return "<%s, unprintable: %s>" % (type(v).__name__, e)


def _loopback_on(port, parsed):
    """Whether a parsed descriptor names a loopback address on ``port`` (a
    decode engine without a cluster token dials loopback peers only)."""
    host, p = _descriptor._split_addr(parsed["addr"])
    raw = _descriptor._numeric_host(host)
    if int(p) != port or raw is None:
        return False
    if len(raw) == 4:
        return raw[0] == 127
    return raw == bytes(15) + b"\x01" or (raw[:12] == bytes(10) + b"\xff\xff"
                                          and raw[12] == 127)


def _hostile_python(params):
    """Whether ``params`` is an object only in-process code can make (a
    dict subclass whose methods raise): only then may a bug handler run."""
    return isinstance(params, dict) and type(params) is not dict


class SchedulerFuzz(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # A port nothing listens on: descriptors that pass every check name
        # it, so an engine that dials one is refused at once.
        cls.sock = socket.socket()
        cls.sock.bind(("127.0.0.1", 0))
        cls.port = cls.sock.getsockname()[1]
        cls.decode = kvferry.KVManager(make_args(4), "decode")

    @classmethod
    def tearDownClass(cls):
        cls.decode.close()
        cls.sock.close()

    def setUp(self):
        self.log = Records()
        V.logger.addHandler(self.log)
        self.addCleanup(V.logger.removeHandler, self.log)
        self.bugs = []
        self.cross = 0

    def connector(self, role="kv_both"):
        c = V.KVFerryConnector(config(role), V.KVConnectorRole.SCHEDULER)
        s = c._scheduler
        c.set_xfer_handshake_metadata(
            {0: V.KVFerryHandshakeMetadata(tp_rank=0, descriptor=descriptor(port=self.port))})
        self.assertIsNotNone(s.descriptors)
        real = s.internal_error

        def spy(request, where, final=False):
            self.bugs.append((request.request_id, where, sys.exc_info()[1]))
            real(request, where, final)
        s.internal_error = spy
        return c

    def engine_takes(self, remote):
        """Whether a decode engine takes these descriptors (a receiver is
        made, then closed: it dials only our port, which refuses)."""
        try:
            rx = kvferry.KVReceiver.remote(self.decode, remote.room, list(remote.descriptors),
                                           remote.instance)
        except (kvferry.KVFerryError, ValueError, TypeError) as e:
            return e
        rx.close()
        return None

    def check_accepted(self, where, req, remote, rm, local):
        p = req.kv_transfer_params
        need = -(-len(req.prompt_token_ids) // BS)
        self.assertEqual(rm.local_block_ids, local, where)
        self.assertEqual(rm.remote_block_ids, list(p["remote_block_ids"][:need]), where)
        self.assertEqual(rm.remote_request_id, p["remote_request_id"], where)
        self.assertEqual((rm.room, rm.instance), kvferry.room_key(p["remote_request_id"]),
                         where)
        self.assertEqual(rm.descriptors, list(p["kvferry_descriptors"]), where)
        self.assertEqual(len(rm.descriptors), p["tp_size"], where)
        pickle.loads(pickle.dumps(rm))              # vLLM ships it to the workers
        if self.cross < CROSS_CHECKS and len(rm.descriptors) <= 8 and all(
                _loopback_on(self.port, d)
                for d in map(_descriptor.parse_descriptor, rm.descriptors)):
            self.cross += 1
            self.assertIsNone(self.engine_takes(remote), (where, rm.descriptors))

    def run_decode(self, c, i, tokens, params):
        s = c._scheduler
        rid = "d-%d" % i
        req = Request(rid, tokens, params)
        where = "seed %d case %d: params %s" % (SEED, i, _shown(params))
        computed = self.rng.choice([0, 0, BS, tokens])
        before = len(self.log.records)
        n, load = c.get_num_new_matched_tokens(req, computed)
        self.assertIs(type(n), int, where)
        self.assertIs(type(load), bool, where)
        self.assertEqual(c.get_num_new_matched_tokens(req, computed), (n, load), where)
        remote = s.judged.get(rid, (None, None))[1]
        if load:
            self.assertIsNotNone(remote, where)
            self.assertEqual(n, tokens - computed, where)
        else:
            self.assertEqual(n, 0, where)
        aborted = self.rng.random() < 0.15
        blocks = [1000 + b for b in range(-(-tokens // BS))]
        local = blocks[computed // BS:]            # the first ones: a local prefix hit
        if not aborted:
            c.update_state_after_alloc(req, Blocks(local), n)
            c.update_state_after_alloc(req, Blocks(local), n)     # a second call reads nothing
        finished = c.request_finished(req, [] if aborted else blocks)
        self.assertIsInstance(finished, tuple, where)
        meta = c.build_connector_meta(None)
        pickle.loads(pickle.dumps(meta))
        rm = meta.reqs_to_recv.get(rid)
        if load:
            self.assertIsNotNone(rm, where)
            self.assertTrue(rm.report if not aborted else not rm.report, where)
            self.check_accepted(where, req, remote, rm, [] if aborted else local)
        elif rm is not None:
            # Only a notice that P may free: valid params, nothing to load.
            self.assertFalse(rm.report, where)
            self.assertEqual(rm.local_block_ids, [], where)
            self.check_accepted(where, req, remote, rm, [])
        if remote is None and not self.bugs:
            mine = [r for r in self.log.records[before:]
                    if "request %s:" % rid in r.getMessage()]
            self.assertLessEqual(len(mine), 1, (where, [r.getMessage() for r in mine]))
            for r in mine:
                self.assertIn("refused", r.getMessage(), where)
        if finished[0]:
            # kv_both also prefills for decoders: P's params must be D's.
            self.assertIsNone(V.check_params(finished[1], tokens, BS), where)
        return load

    def run_prefill(self, c, i):
        r = self.rng
        rid = r.choice([self.json.text(), "p-%d" % i, "p-%d-%s" % (i, self.json.text())])
        if not isinstance(rid, str):
            rid = "p-%d" % i
        params = {"do_remote_decode": r.choice([True, True, self.json.json()])}
        tokens = r.randrange(1, 40)
        req = Request(rid, tokens, params, status=r.choice(
            ["FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED", "FINISHED_ABORTED"]))
        blocks = list(range(-(-tokens // BS)))
        where = "seed %d case %d: request id %s, params %s" % (SEED, i, _shown(rid, 200),
                                                                _shown(params, 200))
        self.assertEqual(c.get_num_new_matched_tokens(req, 0), (0, False), where)
        c.update_state_after_alloc(req, Blocks(blocks), 0)
        delay, out = c.request_finished(req, blocks)
        meta = c.build_connector_meta(None)
        pickle.loads(pickle.dumps(meta))
        if delay:
            self.assertIsNone(V.check_params(out, tokens, BS), where)
            self.assertEqual(list(meta.reqs_to_hold), [rid], where)
        else:
            self.assertIsNone(out, where)
            self.assertEqual(meta.reqs_to_hold, {}, where)

    def test_hostile_params(self):
        print("\n%s: KVF_FUZZ_SEED=%d" % (self.id(), SEED), file=sys.stderr)
        self.rng = random.Random(SEED)
        gen = Gen(self.rng, self.port)
        self.json = Junk(self.rng)
        c = self.connector()
        loads = refusals = done = 0
        deadline = time.monotonic() + BUDGET_S
        for i in range(CASES):
            if time.monotonic() > deadline:
                break
            if self.rng.random() < 0.1:
                self.run_prefill(c, i)
            else:
                tokens, params = gen.case()
                bugs = len(self.bugs)
                if self.run_decode(c, i, tokens, params):
                    loads += 1
                elif type(params) is not dict or params.get("do_remote_prefill") is not None:
                    refusals += 1
                if not _hostile_python(params):
                    self.assertEqual(self.bugs[bugs:], [],
                                     "seed %d case %d: a bug handler ran for %s"
                                     % (SEED, i, _shown(params)))
            done += 1
        s = c._scheduler
        # Nothing kept per request once vLLM is done with it.
        self.assertEqual((s.judged, s.refused, s.holds, s.recvs), ({}, set(), {}, {}))
        # Refusals a client can repeat are logged within the quota.
        warned = [r for r in self.log.records if r.levelno == logging.WARNING]
        windows = 1 + int(BUDGET_S // s.quota.window_s) + 1
        self.assertLessEqual(len(warned), s.quota.burst * windows)
        print("%s: %d cases (%d loaded, %d refused or not asked), %d checked against "
              "the library" % (self.id(), done, loads, refusals, self.cross), file=sys.stderr)
        self.assertGreater(loads, 0)
        self.assertGreater(refusals, 0)

    def test_reader_matches_the_library(self):
        """A descriptor damaged once: where the Python reader refuses it
        field by field, the library refuses it too; where it accepts it,
        the library accepts it."""
        rng = random.Random(SEED ^ 0x5EED)
        base = descriptor(port=self.port)
        agree = 0
        for i in range(400):
            text = mutate_text(rng, base)
            try:
                _descriptor.parse_descriptor(text)
                python = None
            except ValueError as e:
                python = str(e)
            if python is not None and ("printable ASCII" in python
                                       or "characters long" in python):
                continue                # stricter than the library on purpose
            if "\x00" in text or "\ud800" in text or not text.isascii():
                continue
            room = 1 << 40 | i
            try:
                rx = kvferry.KVReceiver.remote(self.decode, room, [text], 0)
                rx.close()
                library = None
            except (kvferry.KVFerryError, ValueError) as e:
                library = str(e)
            if python is None:
                parsed = _descriptor.parse_descriptor(text)
                try:
                    _descriptor.check_prefill_server([parsed])
                except ValueError:
                    continue            # not a whole server (role=decode, TP 2): not asked
                if _loopback_on(self.port, parsed):
                    self.assertIsNone(library, "seed %d: %r" % (SEED, text))
            else:
                self.assertIsNotNone(library, "seed %d: %r refused here (%s), taken by the "
                                     "library" % (SEED, text, python))
            agree += 1
        self.assertGreater(agree, 100)


class ReaderTable(unittest.TestCase):
    """Descriptor edge cases, one by one, against the library."""

    @classmethod
    def setUpClass(cls):
        cls.sock = socket.socket()
        cls.sock.bind(("127.0.0.1", 0))
        cls.port = cls.sock.getsockname()[1]
        cls.decode = kvferry.KVManager(make_args(4), "decode")

    @classmethod
    def tearDownClass(cls):
        cls.decode.close()
        cls.sock.close()

    def library(self, text):
        try:
            kvferry.KVReceiver.remote(self.decode, 7, [text], 0).close()
        except (kvferry.KVFerryError, ValueError):
            return False
        return True

    def test_table(self):
        p = self.port
        taken = [descriptor(port=p), descriptor(port=p, addr="[::1]:%d" % p),
                 descriptor(port=p, addr="[127.0.0.1]:%d" % p),
                 descriptor(port=p, addr="[::ffff:127.0.0.1]:%d" % p),
                 descriptor(port=p, addr="127.0.0.1:%05d" % p),
                 descriptor(port=p) + " later=1", descriptor(port=p) + " =x",
                 descriptor(port=p, heads="0"), descriptor(port=p, heads="65536"),
                 descriptor(port=p, page="4294967295"), descriptor(port=p, tp="0/01"),
                 descriptor(port=p, dtype="a" * 63), descriptor(port=p, attn="mla"),
                 descriptor(port=p, id="ffffffffffffffff")]
        refused = [descriptor(port=p, id="0" * 16), descriptor(port=p, id="F" * 16),
                   descriptor(port=p, addr="0.0.0.0:%d" % p),
                   descriptor(port=p, addr="[::]:%d" % p),
                   descriptor(port=p, addr="[::ffff:0.0.0.0]:%d" % p),
                   descriptor(port=p, addr="[::ffff:0:0]:%d" % p),
                   descriptor(port=p, addr="0.1.2.3:%d" % p),
                   descriptor(port=p, addr="224.0.0.1:%d" % p),
                   descriptor(port=p, addr="255.255.255.255:%d" % p),
                   descriptor(port=p, addr="[::1.2.3.4]:%d" % p),
                   descriptor(port=p, addr="[fe80::1]:%d" % p),
                   descriptor(port=p, addr="[ff02::1]:%d" % p),
                   descriptor(port=p, addr="127.0.0.1:0"),
                   descriptor(port=p, addr="127.0.0.1:65536"),
                   descriptor(port=p, addr="localhost:%d" % p),
                   descriptor(port=p, addr="::1:%d" % p),
                   descriptor(port=p, addr="127.0.0.01:%d" % p),
                   descriptor(port=p, tp="1/1"), descriptor(port=p, tp="-0/1"),
                   descriptor(port=p, tp="+0/1"), descriptor(port=p, tp="0/4097"),
                   descriptor(port=p, page="0"), descriptor(port=p, page="4294967296"),
                   descriptor(port=p, heads="65537"), descriptor(port=p, dtype="a" * 64),
                   descriptor(port=p, attn="gqa"), descriptor(port=p, heads=None),
                   descriptor(port=p) + " tp=0/1", descriptor(port=p) + " ",
                   descriptor(port=p).replace(" ", "  ", 1), "kvf2" + descriptor(port=p)[4:]]
        for text in taken:
            with self.subTest(text):
                self.assertIn("addr", _descriptor.parse_descriptor(text))
                self.assertTrue(self.library(text))
        for text in refused:
            with self.subTest(text):
                with self.assertRaises(ValueError):
                    _descriptor.parse_descriptor(text)
                self.assertFalse(self.library(text))


if __name__ == "__main__":
    unittest.main()
