"""Memory kinds from Python: an object that says it is CUDA memory (a torch
CUDA tensor's ``.device``, ``__cuda_array_interface__``) registers as device
memory of its ordinal; the library then asks the CUDA driver, so a host
buffer that claims to be device memory, or CUDA memory where no driver is,
is refused with the reason, never read.  Needs no torch and no GPU; what
needs them is skipped with the reason."""
import ctypes
import os
import sys
import types
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import POOL_PAGES, HEADS, HEAD_BYTES, kvferry, make_args  # noqa: E402
from kvferry._convert import buffer_memory  # noqa: E402


class FakeCudaTensor:
    """What the binding reads of a torch CUDA tensor, over host memory."""

    def __init__(self, nbytes, index=0):
        self._buf = ctypes.create_string_buffer(nbytes)
        self.nbytes = nbytes
        self.device = types.SimpleNamespace(type="cuda", index=index)

    def data_ptr(self):
        return ctypes.addressof(self._buf)


class FakeCai:
    """An object with only ``__cuda_array_interface__`` (CuPy-like)."""

    def __init__(self, nbytes):
        self._buf = ctypes.create_string_buffer(nbytes)
        self.__cuda_array_interface__ = {"data": (ctypes.addressof(self._buf), False),
                                         "shape": (nbytes,), "typestr": "|u1",
                                         "version": 3}


class Kinds(unittest.TestCase):
    def test_what_each_object_is(self):
        self.assertEqual(buffer_memory(FakeCudaTensor(64, 1)), ("cuda", 1))
        self.assertEqual(buffer_memory(FakeCai(64)), ("cuda", 0))
        self.assertEqual(buffer_memory(bytearray(8)), ("host", None))
        self.assertEqual(buffer_memory(12345), ("host", None))

    def test_a_family_is_one_memory(self):
        a = make_args(4)
        pb = a.kv_item_lens[0]
        a.kv_data_ptrs[0] = FakeCudaTensor(POOL_PAGES * pb)
        with self.assertRaises(ValueError) as cm:
            kvferry.KVManager(a, "decode")
        self.assertIn("kv_data_ptrs mixes memories", str(cm.exception))

    def test_cuda_memory_is_checked_by_the_driver(self):
        """Host memory that claims to be CUDA memory is refused: without a
        driver because there is none, with one because it is host memory."""
        a = make_args(4)
        pb = 4 * HEADS * HEAD_BYTES
        a.kv_data_ptrs = [FakeCudaTensor(POOL_PAGES * pb) for _ in a.kv_data_ptrs]
        with self.assertRaises(kvferry.KVFerryError) as cm:
            kvferry.KVManager(a, "decode")
        self.assertIn("CUDA", str(cm.exception))


class Torch(unittest.TestCase):
    def test_torch_cuda_tensor(self):
        try:
            import torch
        except ImportError:
            self.skipTest("skipped: torch is not installed")
        if not torch.cuda.is_available():
            self.skipTest("skipped: torch sees no CUDA device")
        a = make_args(4)
        pb = a.kv_item_lens[0]
        a.kv_data_ptrs = [torch.zeros(POOL_PAGES * pb, dtype=torch.uint8, device="cuda")
                          for _ in a.kv_data_ptrs]
        m = kvferry.KVManager(a, "decode")
        m.close()


if __name__ == "__main__":
    unittest.main()
