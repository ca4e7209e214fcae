"""Reading kvferry's metrics: the Prometheus text an engine serves on its
endpoint (``KVArgs.metrics_addr``) and returns from ``KVManager.metrics()``.

``parse(text)`` gives ``Samples``: ``samples.get(name, **labels)`` is the
sum of every sample of ``name`` whose labels include ``labels`` (so
``get("kvferry_engine_rooms_total", state="failed")`` adds over sides),
0.0 when there is none.  Every metric is named in docs/OPERATIONS.md.
Standard library only; not a general Prometheus parser (no escapes in
label values beyond ``\\"`` and ``\\\\``, which kvferry's never need).
"""
import re

__all__ = ["parse", "Samples"]

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)\s*$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class Samples:
    """The samples of one scrape: ``(name, labels, value)`` triples."""

    def __init__(self, samples):
        self.samples = list(samples)

    def get(self, name, **labels):
        """The sum of the samples of ``name`` whose labels include ``labels``."""
        return sum(v for n, l, v in self.samples
                   if n == name and all(l.get(k) == str(x) for k, x in labels.items()))

    def names(self):
        """Every metric name that has a sample."""
        return sorted({n for n, _, _ in self.samples})

    def __iter__(self):
        return iter(self.samples)

    def __len__(self):
        return len(self.samples)


def parse(text):
    """``Samples`` of a Prometheus text exposition; raises ``ValueError`` on a
    line that is neither a comment nor a sample."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError("line %d is not a Prometheus sample: %r" % (i, line[:200]))
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\")
                  for k, v in _LABEL.findall(m.group(2) or "")}
        out.append((m.group(1), labels, float(m.group(3))))
    return Samples(out)
