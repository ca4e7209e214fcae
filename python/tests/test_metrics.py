"""kvferry's metrics in Python and in vLLM's terms.

In process: ``KVManager.metrics()`` and the engine's endpoint
(``KVArgs.metrics_addr``), read with ``kvferry.metrics.parse``.

Across processes: vLLM's path for connector stats, with the stand-ins of
test_vllm (a prefill and a decode instance, ``_vllm_instance.py``): each
worker's ``get_kv_connector_stats()`` after every step, aggregated over
the workers as vLLM does, rebuilt from its data dict
(``build_kv_connector_stats``), reduced for the log line and observed into
Prometheus metrics (``build_prom_metrics``, with recording stand-ins of
vLLM's metric classes), against what the requests really did: reads that
succeeded, and one that failed (P answers for a request it never held at
its bootstrap deadline).  The engines' own metrics, scraped over HTTP from
every decode rank, say the same.

SGLang: a deadline a rank saw itself counts in SGLang's own
``sglang:kv_transfer_timeouts_total{stage}`` (a recording stand-in of its
module here), on the rank that saw it only; a room's KVTransferMetric has
a latency above 0 even for a sub-millisecond room.
"""
import os
import sys
import time
import types
import unittest
import urllib.request

from _util import kvferry
from kvferry import metrics as M
from kvferry import vllm as V
from test_vllm import Instances, TIMEOUT


def scrape(addr):
    with urllib.request.urlopen("http://%s/metrics" % addr, timeout=10) as r:
        assert "version=0.0.4" in r.headers["Content-Type"], r.headers["Content-Type"]
        return r.read().decode()


class EngineMetricsTest(unittest.TestCase):
    def test_text_and_endpoint(self):
        args = kvferry.KVArgs(kv_data_ptrs=[bytearray(4096)], kv_item_lens=[256],
                              page_size=4, kv_head_num=2, bytes_per_head=32, num_layers=1,
                              metrics_addr="127.0.0.1:0")
        with kvferry.KVManager(args, "decode") as m:
            s = M.parse(m.metrics())
            self.assertEqual(s.get("kvferry_engine_info", side="decode"), 1)
            self.assertEqual(s.get("kvferry_engine_rooms_total"), 0)
            self.assertIn("kvferry_engine_room_failures_total", s.names())
            self.assertTrue(m.metrics_addr.startswith("127.0.0.1:"), m.metrics_addr)
            web = M.parse(scrape(m.metrics_addr))
            self.assertEqual(web.get("kvferry_engine_info", side="decode"), 1)
            self.assertEqual(len(web), len(s))
        with kvferry.KVManager(args.replace(metrics_addr=None), "decode") as m:
            self.assertIsNone(m.metrics_addr)

    def test_parse_refuses_garbage(self):
        with self.assertRaises(ValueError):
            M.parse("kvferry_x{a=\"1\"}\nnot a sample at all\n")


class _Metric:
    """A recording stand-in of vLLM's prometheus metric classes."""
    made = []

    def __init__(self, name, documentation, labelnames, buckets=None, **_):
        self.name, self.labelnames, self.values = name, list(labelnames), {}
        _Metric.made.append(self)

    def labels(self, *values):
        assert len(values) == len(self.labelnames), (self.name, values, self.labelnames)
        return _Child(self, tuple(values))


class _Child:
    def __init__(self, metric, key):
        self.metric, self.key = metric, key

    def observe(self, v):
        self.metric.values.setdefault(self.key, []).append(v)

    def inc(self, v=1):
        self.metric.values.setdefault(self.key, []).append(v)


class Gauge(_Metric):
    pass


class Counter(_Metric):
    pass


class Histogram(_Metric):
    pass


def stats_total(peer, key):
    return sum(len(e["data"][key]) for e in peer.seen if e["event"] == "stats")


class VllmStatsTest(unittest.TestCase):
    def test_stats_follow_the_requests(self):
        on = {"metrics_addr": "127.0.0.1:0"}
        inst = Instances(1, 2, p_extra={"kvferry": dict(on, bootstrap_timeout_ms=500)},
                         d_extra={"kvferry": on})
        self.addCleanup(inst.close)
        lengths = {"req-a": 13, "req-b": 31}
        params = {k: inst.prefill(k, n) for k, n in lengths.items()}
        inst.decode("req-made-up", 8, dict(params["req-a"], remote_request_id="made-up-id"))
        ev = inst.recv("req-made-up")
        self.assertEqual(ev["invalid"], sorted(ev["blocks"]), ev)
        for k, n in lengths.items():
            inst.decode(k, n, params[k])
            ev = inst.recv(k)
            self.assertEqual((ev["invalid"], ev["bad"]), ([], []), ev)
            inst.freed(k)
        # Every room of every worker reaches vLLM's stats: D has 2 TP ranks.
        ok_d, failed_d, ok_p = 2 * 2, 1 * 2, 2
        inst.d.expect(lambda e: stats_total(inst.d, "transfer_duration") >= ok_d and
                      stats_total(inst.d, "failed_status") >= failed_d, TIMEOUT, "D stats")
        inst.p.expect(lambda e: stats_total(inst.p, "transfer_duration") >= ok_p, TIMEOUT,
                      "P stats")

        def rebuilt(peer):
            agg = V.KVFerryConnector.build_kv_connector_stats()
            for e in peer.seen:
                if e["event"] == "stats":
                    agg = agg.aggregate(V.KVFerryConnector.build_kv_connector_stats(e["data"]))
            return agg
        d, p = rebuilt(inst.d), rebuilt(inst.p)
        self.assertEqual(len(d.data["transfer_duration"]), ok_d)
        self.assertEqual(len(p.data["transfer_duration"]), ok_p)
        self.assertEqual(d.data["failed_status"], ["KVF_ERR_TIMED_OUT"] * failed_d)
        self.assertEqual(d.data["failed_origin"], ["another_rank"] * failed_d)
        self.assertEqual(p.data["failed_status"], [])
        self.assertTrue(all(b > 0 for b in d.data["bytes_transferred"]), d.data)
        self.assertTrue(all(s > 0 for s in d.data["transfer_duration"]), d.data)
        # P sent what D placed: the two reads' bytes, summed over D's ranks.
        self.assertEqual(sum(p.data["bytes_transferred"]), sum(d.data["bytes_transferred"]))
        red = d.reduce()
        self.assertEqual(red["Num successful transfers"], ok_d)
        self.assertEqual(red["Num failed transfers"], failed_d)
        self.assertEqual(red["Num failed, cause on another rank"], failed_d)

        # vLLM's Prometheus path: one observation per room, failures by label.
        _Metric.made = []
        prom = V.KVFerryConnector.build_prom_metrics(
            None, {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
            ["model_name", "engine"], {0: ["m", "0"]})
        prom.observe(d.data, 0)
        by = {m.name: m for m in _Metric.made}
        self.assertEqual(len(by["vllm:kvferry_xfer_time_seconds"].values[("m", "0")]), ok_d)
        self.assertEqual(len(by["vllm:kvferry_bytes_transferred"].values[("m", "0")]), ok_d)
        self.assertEqual(by["vllm:kvferry_num_failed_transfers"].values,
                         {("m", "0", "KVF_ERR_TIMED_OUT", "another_rank"): [1] * failed_d})

        # The engines say the same, over HTTP from each decode rank.
        inst.d.send(cmd="metrics")
        ev = inst.d.expect(lambda e: e["event"] == "metrics", TIMEOUT, "D metrics")
        self.assertEqual(len(ev["addrs"]), 2)
        texts = [M.parse(scrape(a)) for a in ev["addrs"]]
        got = lambda name, **kw: sum(t.get(name, **kw) for t in texts)
        self.assertEqual(got("kvferry_engine_rooms_total", state="success"), ok_d)
        self.assertEqual(got("kvferry_engine_rooms_total", state="failed"), failed_d)
        self.assertEqual(got("kvferry_engine_room_failures_total", status="KVF_ERR_TIMED_OUT",
                             origin="another_rank"), failed_d)
        self.assertEqual(got("kvferry_engine_room_transfer_seconds_count"), ok_d)
        self.assertEqual(got("kvferry_engine_room_payload_bytes_sum"),
                         sum(d.data["bytes_transferred"]))
        for text, web in zip(ev["texts"], texts):
            self.assertEqual(M.parse(text).get("kvferry_engine_rooms_total"),
                             web.get("kvferry_engine_rooms_total"))
        inst.no_violation(self)


class _Counter:
    def __init__(self):
        self.counts = {}

    def labels(self, stage):
        return types.SimpleNamespace(inc=lambda: self.counts.__setitem__(
            stage, self.counts.get(stage, 0) + 1))


class SglangMetricsTest(unittest.TestCase):
    """Two deadlines on the prefill side: one while bootstrapping (no decode
    rank ever asks), one while waiting for input (the scheduler never
    sends); the decode side learns the second and counts nothing.  Then a
    room that succeeds, and its KVTransferMetric."""

    def setUp(self):
        self.counter = _Counter()
        self.enabled = []
        mod = types.ModuleType("sglang.srt.observability.kv_transfer_metrics")

        def get(enabled):
            self.enabled.append(enabled)
            return self.counter if enabled else None
        mod.get_kv_transfer_timeout_counter = get
        names = ["sglang", "sglang.srt", "sglang.srt.observability", mod.__name__]
        self.added = [n for n in names if n not in sys.modules]
        for n in names[:-1]:
            sys.modules.setdefault(n, types.ModuleType(n))
        sys.modules[mod.__name__] = mod
        self.env = {k: os.environ.get(k) for k in ("KVF_BOOTSTRAP_TIMEOUT_MS",
                                                   "KVF_WAITING_TIMEOUT_MS")}
        os.environ.update(KVF_BOOTSTRAP_TIMEOUT_MS="500", KVF_WAITING_TIMEOUT_MS="500")

    def tearDown(self):
        for n in self.added:
            sys.modules.pop(n, None)
        for k, v in self.env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def test_deadlines_counted_where_seen(self):
        from kvferry import sglang as S
        from test_sglang_api import kv_args, server_args
        boot = S.KVFerryKVBootstrapServer(host="127.0.0.1", port=0)
        self.addCleanup(boot.close)
        addr = "127.0.0.1:%d" % boot.port
        sa = server_args(boot.port, enable_metrics=True)
        pm = S.KVFerryKVManager(kv_args("prefill"), S.DisaggregationMode.PREFILL, sa, False)
        self.addCleanup(pm.teardown)
        # The decode side's own deadlines are long: the prefill's fire first.
        os.environ.update(KVF_BOOTSTRAP_TIMEOUT_MS="30000", KVF_WAITING_TIMEOUT_MS="30000")
        dm = S.KVFerryKVManager(kv_args("decode"), S.DisaggregationMode.DECODE, sa, False)
        self.addCleanup(dm.teardown)

        def final(h):
            deadline = time.monotonic() + 20
            while h.poll() not in (S.KVPoll.Failed, S.KVPoll.Success):
                self.assertLess(time.monotonic(), deadline, "the room never ended")
                time.sleep(0.005)
            return h.poll()

        lonely = S.KVFerryKVSender(pm, addr, 7001, [0], 0)
        self.assertEqual(final(lonely), S.KVPoll.Failed)
        with self.assertRaises(Exception):
            lonely.failure_exception()
        self.assertEqual(self.counter.counts, {"bootstrap": 1})

        tx = S.KVFerryKVSender(pm, addr, 7002, [0], 0)
        rx = S.KVFerryKVReceiver(dm, addr, 7002)
        rx.init(0)
        deadline = time.monotonic() + 20
        while rx.poll() != S.KVPoll.WaitingForInput:
            self.assertLess(time.monotonic(), deadline, "the receiver never connected")
            time.sleep(0.005)
        rx.send_metadata([1, 2], 0)
        self.assertEqual(final(tx), S.KVPoll.Failed)       # never init/send
        self.assertEqual(final(rx), S.KVPoll.Failed)
        for h in (tx, rx):
            with self.assertRaises(Exception) as cm:
                h.failure_exception()
            self.assertIn("TIMED_OUT", str(getattr(cm.exception, "status", "")) +
                          str(cm.exception))
        self.assertEqual(self.counter.counts, {"bootstrap": 1, "transfer": 1})
        self.assertTrue(all(self.enabled), self.enabled)

        # A room that succeeds: SGLang observes its KVTransferMetric only
        # with a latency above 0, which a sub-millisecond room has too.
        tx = S.KVFerryKVSender(pm, addr, 7003, [0], 0)
        rx = S.KVFerryKVReceiver(dm, addr, 7003)
        rx.init(0)
        deadline = time.monotonic() + 20
        while rx.poll() != S.KVPoll.WaitingForInput:
            self.assertLess(time.monotonic(), deadline, "the receiver never connected")
            time.sleep(0.005)
        rx.send_metadata([1, 2], 0)
        while tx.poll() != S.KVPoll.WaitingForInput:
            self.assertLess(time.monotonic(), deadline, "the sender never got its pages")
            time.sleep(0.005)
        tx.init(2, 0)
        tx.send([3, 4])
        self.assertEqual(final(tx), S.KVPoll.Success)
        self.assertEqual(final(rx), S.KVPoll.Success)
        m = tx.get_transfer_metric()
        self.assertGreater(m.transfer_latency_s, 0)
        self.assertGreater(m.transfer_total_bytes, 0)
        tx.clear()
        rx.clear()
        self.assertEqual(self.counter.counts, {"bootstrap": 1, "transfer": 1})


if __name__ == "__main__":
    unittest.main()
