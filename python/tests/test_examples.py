"""examples/python run as docs/PYTHON.md shows: prefill.py + decode.py in two
processes (both registry styles), and failure.py's two scenarios."""
import os
import subprocess
import sys
import tempfile
import time
import unittest

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                        "examples", "python")


def script(name):
    return os.path.join(EXAMPLES, name)


@unittest.skipUnless(os.path.isdir(EXAMPLES), "examples/python not found")
class Examples(unittest.TestCase):

    def _pair(self, *prefill_flags):
        with tempfile.TemporaryDirectory() as d:
            port_file = os.path.join(d, "addr")
            pre = subprocess.Popen([sys.executable, script("prefill.py"), "--rooms", "4",
                                    "--tokens", "300", "--port-file", port_file,
                                    "--timeout", "60"] + list(prefill_flags),
                                   stdout=subprocess.PIPE, text=True)
            try:
                deadline = time.monotonic() + 30
                while not os.path.exists(port_file) and time.monotonic() < deadline:
                    time.sleep(0.05)
                with open(port_file) as f:
                    addr = f.read()
                dec = subprocess.run([sys.executable, script("decode.py"), "--bootstrap",
                                      addr, "--rooms", "4", "--tokens", "300",
                                      "--timeout", "60"],
                                     capture_output=True, text=True, timeout=120)
                self.assertEqual(dec.returncode, 0, dec.stdout + dec.stderr)
                self.assertEqual(dec.stdout.count("Success, verified"), 4, dec.stdout)
                out, _ = pre.communicate(timeout=60)
                self.assertEqual(pre.returncode, 0, out)
                self.assertEqual(out.count(": Success"), 4, out)
            finally:
                pre.kill()
                pre.wait()
                pre.stdout.close()

    def test_prefill_and_decode_with_bootstrap_server(self):
        self._pair()

    def test_prefill_and_decode_with_host_bootstrap(self):
        self._pair("--host-bootstrap")

    def test_failure_page_size(self):
        r = subprocess.run([sys.executable, script("failure.py"), "--scenario",
                            "page-size"], capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("Page size mismatch: prefill server has page_size=16", r.stdout)

    def test_failure_killed_peer(self):
        r = subprocess.run([sys.executable, script("failure.py"), "--scenario",
                            "killed-peer"], capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("is_from_another_rank: False", r.stdout)


if __name__ == "__main__":
    unittest.main()
