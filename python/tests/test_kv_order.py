"""``KVArgs.kv_order``: head-major pages ("HND") from a prefill rank of TP 1
to two decode ranks of TP 2, in one process: each decode rank gets its head
of every token, where the head-major order puts it; a pair whose orders
differ fails on both sides, naming both; a bad value is a ValueError."""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import FINAL, KVPoll, kvferry, wait_state  # noqa: E402

PAGE, HEADS, HB, PAGES, LAYERS = 4, 2, 8, 16, 2


def args(heads, order, **engine):
    pb = PAGE * heads * HB
    return kvferry.KVArgs(
        kv_data_ptrs=[bytearray(PAGES * pb) for _ in range(2 * LAYERS)],
        kv_item_lens=[pb], page_size=PAGE, kv_head_num=heads, total_kv_head_num=HEADS,
        bytes_per_head=HB, num_layers=LAYERS, kv_order=order,
        aux_data_ptrs=[bytearray(4 * 16)], aux_item_lens=[16], transport="tcp",
        bootstrap_timeout_ms=10000, transfer_timeout_ms=10000, **engine)


def at(order, heads, page, h, t):
    """Where head h of token t of `page` starts, in a buffer of `heads` heads."""
    inside = (h * PAGE + t) if order == "HND" else (t * heads + h)
    return page * PAGE * heads * HB + inside * HB


def value(b, head, page, t):
    """The HB bytes of global head `head`, token t of prefill page `page`, buffer b."""
    return bytes((b * 61 + head * 31 + page * 7 + t * 3 + j) % 251 for j in range(HB))


class KVOrder(unittest.TestCase):

    def pair(self, pre_order, dec_order):
        pre = kvferry.KVManager(args(HEADS, pre_order, host_bootstrap=True,
                                     bootstrap_addr="127.0.0.1:0"), "prefill")
        self.addCleanup(pre.close)
        for b, buf in enumerate(pre.args.kv_data_ptrs):
            for p in range(PAGES):
                for h in range(HEADS):
                    for t in range(PAGE):
                        o = at(pre_order, HEADS, p, h, t)
                        buf[o:o + HB] = value(b, h, p, t)
        decs = []
        for d in range(2):
            m = kvferry.KVManager(args(1, dec_order, engine_rank=d, tp_size=2), "decode")
            self.addCleanup(m.close)
            decs.append(m)
        return pre, decs

    def room(self, pre, decs, room, src, dst):
        tx = kvferry.KVSender(pre, pre.bootstrap_addr, room)
        self.addCleanup(tx.close)
        rxs = []
        for m in decs:
            rx = kvferry.KVReceiver(m, pre.bootstrap_addr, room)
            self.addCleanup(rx.close)
            rx.init(dst, 1)
            rxs.append(rx)
        if wait_state(tx, (KVPoll.WaitingForInput, KVPoll.Failed), 20) == \
                KVPoll.WaitingForInput:
            tx.init(len(src), 2)
            tx.send(src)
        return tx, rxs

    def test_hnd_tp_1_to_2(self):
        pre, decs = self.pair("HND", "HND")
        src, dst = [3, 4, 5, 9], [10, 11, 2, 7]
        tx, rxs = self.room(pre, decs, 71, src, dst)
        self.assertEqual(wait_state(tx, FINAL, 20), KVPoll.Success)
        for d, (m, rx) in enumerate(zip(decs, rxs)):
            self.assertEqual(wait_state(rx, FINAL, 20), KVPoll.Success)
            for b, buf in enumerate(m.args.kv_data_ptrs):
                for s, p in zip(src, dst):
                    for t in range(PAGE):
                        o = at("HND", 1, p, 0, t)
                        self.assertEqual(bytes(buf[o:o + HB]), value(b, d, s, t),
                                         (d, b, p, t))

    def test_mixed_orders_fail_on_both_sides(self):
        pre, decs = self.pair("NHD", "HND")
        tx, rxs = self.room(pre, decs, 72, [1], [2])
        want = ("KV page order mismatch: prefill KV pages are NHD (token-major), but "
                "decode KV pages are HND (head-major)")
        for h in [tx] + rxs:
            self.assertEqual(wait_state(h, FINAL, 20), KVPoll.Failed)
            with self.assertRaises(kvferry.KVTransferError) as cm:
                h.failure_exception()
            self.assertIn(want, str(cm.exception))

    def test_bad_value(self):
        with self.assertRaises(ValueError) as cm:
            kvferry.KVManager(args(HEADS, "THD"), "decode")
        self.assertIn("kv_order", str(cm.exception))
        with kvferry.KVManager(args(HEADS, "hnd"), "decode"):   # any case
            pass


if __name__ == "__main__":
    unittest.main()
