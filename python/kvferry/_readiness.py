"""Room readiness through a prefill server's bootstrap registry, for
SGLang's ``--disaggregation-decode-allocation-policy prefill_complete``:
a decode server allocates a room's pages only once the prefill has
computed the room.

SGLang carries that signal on its backends' own connections; kvferry's
wire protocol has no per-room message before the decode's destination,
so the signal goes through the registry both sides already use: a
prefill rank posts ``POST /room_ready {bootstrap_room, status, reason}``
("ready", or "failed" with the reason, so that a decode rank waiting for
a room that will never come names the root cause), and decode ranks ask
``POST /query_room_ready {bootstrap_rooms: [...]}`` for every room they
wait on at once.

The one idea: every HTTP call runs on one worker thread per manager
(``ReadinessBoard``), so a scheduler's call never waits on the network;
the scheduler only reads what the worker last learned.
"""
import http.client
import json
import logging
import threading

logger = logging.getLogger(__name__)

# How often the worker asks about rooms that decode ranks wait on: the
# delay a ready room adds before the decode allocates, at most.
QUERY_INTERVAL_S = 0.01
_TIMEOUT_S = 5.0


class _Conn:
    """One keep-alive HTTP connection to a registry ``host:port``."""

    def __init__(self, addr):
        host, _, port = addr.rpartition(":")
        self.host = host.strip("[]")
        self.port = int(port)
        self.conn = None

    def request(self, path, body, headers):
        for attempt in (0, 1):          # once more on a dropped keep-alive
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port,
                                                       timeout=_TIMEOUT_S)
            try:
                self.conn.request("POST", path, json.dumps(body).encode(),
                                  dict({"Content-Type": "application/json"}, **headers))
                r = self.conn.getresponse()
                return r.status, r.read()
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise


class ReadinessBoard:
    """The readiness of rooms, posted (prefill) and watched (decode).

    ``headers``: a callable giving the bearer header of a write (the
    library's token).  ``post(addr, room, status, reason)`` queues a post;
    ``watch(addr, room)`` starts asking about a room and ``state(room)``
    answers what is known: None (not yet), ``("ready", None)``,
    ``("failed", reason)`` (the prefill's), ``("error", why)`` (the
    registry cannot answer: it does not serve the route); ``wait(room,
    timeout)`` waits for it to be known.  ``forget(room)``
    stops watching; ``close()`` stops the worker.
    """

    def __init__(self, headers):
        self._headers = headers
        self._cv = threading.Condition()
        self._posts = []                # (addr, body)
        self._watched = {}              # room -> addr
        self._states = {}               # room -> (status, reason)
        self._conns = {}
        self._closed = False
        self._thread = None

    def _start_locked(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvferry-ready",
                                            daemon=True)
            self._thread.start()
        self._cv.notify()

    def post(self, addr, room, status, reason=None):
        body = {"bootstrap_room": str(room), "status": status}
        if reason:
            body["reason"] = reason[:1024]
        with self._cv:
            if not self._closed:
                self._posts.append((addr, body))
                self._start_locked()

    def watch(self, addr, room):
        with self._cv:
            if not self._closed and room not in self._watched:
                self._watched[room] = addr
                self._start_locked()

    def state(self, room):
        with self._cv:
            return self._states.get(room)

    def wait(self, room, timeout):
        """``state(room)``, once known or after ``timeout`` seconds (then
        maybe None): for a caller that has nothing else to wait on."""
        with self._cv:
            self._cv.wait_for(lambda: room in self._states or self._closed, timeout)
            return self._states.get(room)

    def forget(self, room):
        with self._cv:
            self._watched.pop(room, None)
            self._states.pop(room, None)

    def close(self):
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            th = self._thread
        if th is not None and th is not threading.current_thread():
            th.join(timeout=2 * _TIMEOUT_S)
        for c in self._conns.values():
            if c.conn is not None:
                c.conn.close()

    # -- the worker ----------------------------------------------------------

    def _run(self):
        while True:
            with self._cv:
                while not self._closed and not self._posts and not self._pending():
                    self._cv.wait()
                if self._closed:
                    return
                posts, self._posts = self._posts, []
                pending = self._pending()
            for addr, body in posts:
                self._send_post(addr, body)
            for addr, rooms in pending.items():
                self._query(addr, rooms)
            with self._cv:
                if self._pending() and not self._posts and not self._closed:
                    self._cv.wait(QUERY_INTERVAL_S)

    def _pending(self):
        """{addr: [room]} of watched rooms not known yet (lock held)."""
        out = {}
        for room, addr in self._watched.items():
            if room not in self._states:
                out.setdefault(addr, []).append(room)
        return out

    def _conn(self, addr):
        c = self._conns.get(addr)
        if c is None:
            c = self._conns[addr] = _Conn(addr)
        return c

    def _send_post(self, addr, body):
        try:
            status, text = self._conn(addr).request("/room_ready", body,
                                                    self._headers())
        except (OSError, ValueError, RuntimeError, http.client.HTTPException) as e:
            logger.error("kvferry: room %s: POST /room_ready to %s failed: %s",
                         body["bootstrap_room"], addr, e)
            return
        if status != 200:
            logger.error("kvferry: room %s: POST /room_ready to %s answered %d: %s",
                         body["bootstrap_room"], addr, status,
                         text.decode(errors="replace")[:300])

    def _query(self, addr, rooms):
        try:
            status, text = self._conn(addr).request(
                "/query_room_ready", {"bootstrap_rooms": [str(r) for r in rooms]}, {})
        except (OSError, http.client.HTTPException) as e:
            logger.debug("kvferry: POST /query_room_ready to %s: %s", addr, e)
            return
        found = {}
        if status == 200:
            try:
                found = json.loads(text)
            except ValueError:
                found = {}
        elif status in (404, 405):
            # A registry without kvferry's routes (SGLang's own, e.g. the
            # embedded Rust one) can never say a room is ready.
            why = ("the bootstrap registry at %s does not serve POST "
                   "/query_room_ready (HTTP %d): --disaggregation-decode-allocation-"
                   "policy prefill_complete needs kvferry's bootstrap registry "
                   "(SGLang's embedded Rust registry has no such route)"
                   % (addr, status))
            with self._cv:
                for r in rooms:
                    if r in self._watched:
                        self._states[r] = ("error", why)
                self._cv.notify_all()
            return
        with self._cv:
            for r in rooms:
                e = found.get(str(r))
                if r in self._watched and isinstance(e, dict) and \
                        e.get("status") in ("ready", "failed"):
                    self._states[r] = (e["status"], e.get("reason"))
                    self._cv.notify_all()
