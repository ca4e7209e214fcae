"""Log lines that a client can cause at will, kept to a quota.

A request refused for its parameters logs why, once; but a client that
sends refused requests in a loop must not flood the server's log, nor
slow its scheduler with writes.  ``LogQuota`` lets ``burst`` lines through
per ``window_s`` seconds and counts the rest; the next line that gets
through says how many were left out, so the log still tells how often it
happened.
"""
import threading
import time

__all__ = ["LogQuota"]


class LogQuota:
    """At most ``burst`` lines per ``window_s`` seconds through ``logger``."""

    def __init__(self, logger, burst=10, window_s=60.0, clock=time.monotonic):
        self.logger = logger
        self.burst = burst
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()       # callers may run on several threads
        self._start = None
        self._used = 0
        self._dropped = 0

    def log(self, level, msg, *args, exc_info=None):
        """Log ``msg % args`` at ``level`` if the quota allows; return
        whether it was logged."""
        with self._lock:
            now = self._clock()
            if self._start is None or now - self._start >= self.window_s:
                self._start, self._used = now, 0
            if self._used >= self.burst:
                self._dropped += 1
                return False
            self._used += 1
            dropped, self._dropped = self._dropped, 0
        if dropped:
            msg += " (and %d more like it since the last one logged, left out: at most " \
                   "%d such lines are logged per %g s)"
            args += (dropped, self.burst, self.window_s)
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True
