"""Layer-pipelined sends of kvferry.sglang's sender: KV leaves while the
prefill computes (docs/SGLANG.md, "Layer-wise transfer").

SGLang has no merged layer-wise API yet.  This mixin takes the shape of
its open PR #34905 (``LayerPipelinedKVTransferAdapter`` drives the
sender): ``prepare_layer_pipelined_transfer(kv_indices, state_indices,
final_state_indices=..., skip_dsa_state_layer_ids=...)`` once per chunk,
``send_layers(layer_ids, ready_event=..., is_draft=False)`` after each
group of layers, ``send_final_metadata(ready_event)`` once the metadata
row is written.  PR #23515's ``send_layer(kv_indices, layer_id,
cuda_event, is_last)`` is accepted too.  Each maps onto the room's
``KVSender.send_layers`` and a last ``send``.

The one idea: SGLang names a chunk's pages and a group's layer ids; the
sender knows where the chunk starts in the room (its page cursor, as
``send`` keeps it) and which kvferry (group, layer) each id is.  A CUDA
event whose kernels are still running holds its sends back in a queue
that every later call of the room (and ``poll()``) moves on, in order, so
no call waits for the GPU until the final metadata, which needs the
bytes anyway; the Mooncake PRs wait on the event in their transfer
threads instead.  Failures fail the room, never raise, as ``send`` does.
"""
from . import _lib
from .args import KVPoll as _Poll
from ._convert import to_uint
from .errors import KVFerryError


def _event_done(event, wait):
    """Whether ``event``'s kernels have finished (True for None).  ``wait``,
    or an event that cannot be queried: synchronize on it first."""
    if event is None:
        return True
    query = getattr(event, "query", None)
    if not wait and callable(query):
        return bool(query())
    sync = getattr(event, "synchronize", None)
    if callable(sync):
        sync()
    return True


def _ids(layer_ids):
    """SGLang's layer ids (an int or an iterable of them) as ints."""
    if isinstance(layer_ids, int):
        return [to_uint("layer_id", layer_ids, 32)]
    return [to_uint("layer_ids[%d]" % i, v, 32) for i, v in enumerate(layer_ids)]


def _runs(pairs):
    """Sorted (group, layer) pairs as (group, begin, end) runs."""
    runs = []
    for g, layer in sorted(set(pairs)):
        if runs and runs[-1][0] == g and runs[-1][2] == layer:
            runs[-1][2] = layer + 1
        else:
            runs.append([g, layer, layer + 1])
    return [tuple(r) for r in runs]


def _span(layers):
    return "%d-%d" % (min(layers), max(layers)) if layers else "none"


def _run_name(g, lo, hi):
    what = "layer %d" % lo if hi - lo == 1 else "layers %d-%d" % (lo, hi - 1)
    return what if g == 0 else "%s of group %d" % (what, g)


class LayerwiseSender:
    """What KVFerryKVSender adds for layer-pipelined sends.  Uses the
    sender's ``_h`` (the room), ``curr_idx``, ``_lead``/``_pad`` (the
    decode's prefix pages that lead a held room), ``_dummy``,
    ``conclude_state``, ``kv_mgr`` and ``_fail_here``."""

    def _layers_setup(self):
        self._chunk = None       # (first room page, pages) of the layer-wise chunk
        self._queued = []        # (event, pages, first, group, begin, end) not sent yet
        self._layer_states = None
        self._ended = False      # the final metadata went out

    def _layered_live(self):
        return not self._dummy and self._h is not None and self.conclude_state is None \
            and self._h.poll() != _Poll.Failed

    def prepare_layer_pipelined_transfer(self, kv_indices, state_indices=None,
                                         final_state_indices=None, **_unused):
        """PR #34905: the chunk whose layers follow (SGLang's page indices
        from ``start_send_idx``, as ``send`` gets them) and its state
        indices.  kvferry moves state whole with the final metadata, so
        ``state_indices`` (every type) go then, else
        ``final_state_indices``; ``skip_dsa_state_layer_ids`` is unused."""
        n = len(kv_indices) if kv_indices is not None else 0
        self._chunk = (self._lead + self.curr_idx, [] if kv_indices is None else kv_indices)
        self.curr_idx += n
        self._layer_states = state_indices if state_indices is not None \
            else final_state_indices
        if self._pad and self._layered_live():
            # The decode's prefix pages lead a held room (no reader takes
            # them), the same for every layer: one plain send of them first.
            from .sglang import _after_placeholders     # (sglang imports this module)
            lead = _after_placeholders([], self._pad)
            self._attempt("the held room's %d leading prefix pages" % self._pad,
                          lambda: self._h.send(lead, is_last=False))
            self._pad = 0

    def send_layers(self, layer_ids, ready_event=None, is_draft=False):
        """PR #34905: the prepared chunk's pages for ``layer_ids`` (the
        model's layers, or with ``is_draft`` the draft model's), once
        ``ready_event`` (a CUDA event recorded after their kernels) has
        completed: the bytes must be written before kvferry reads them."""
        if not self._layered_live():
            return
        if self._chunk is None:
            self._fail_here("KVSender.send_layers on prefill rank %d before "
                            "prepare_layer_pipelined_transfer: no chunk to send"
                            % self.kv_mgr.attn_tp_rank)
            return
        layers = {}
        for layer, _role, g in self.kv_mgr.ferry_args.kv_tags:
            layers.setdefault(g, set()).add(layer)
        try:
            pairs = [_layer_of(layers, i, bool(is_draft)) for i in _ids(layer_ids)]
        except (ValueError, TypeError) as e:
            self._fail_here("KVSender.send_layers(%s) refused on prefill rank %d: %s"
                            % (_shown(layer_ids), self.kv_mgr.attn_tp_rank, e),
                            code=_lib.KVF_ERR_BAD_INDICES)
            return
        first, pages = self._chunk
        self._queued += [(ready_event, pages, first) + r for r in _runs(pairs)]
        self._flush_layers(False)

    def send_layer(self, kv_indices, layer_id, cuda_event=None, is_last=False):
        """PR #23515: one layer of the request's pages (the same pages for
        every layer: the first call prepares them).  ``is_last`` (the
        model's last layer) ends nothing: ``send_final_metadata`` does,
        once the first token is in the metadata row."""
        if self._chunk is None:
            self.prepare_layer_pipelined_transfer(kv_indices)
        self.send_layers([layer_id], ready_event=cuda_event)

    def send_final_metadata(self, ready_event=None, state_indices=None, *_, **__):
        """Ends the room: waits for the queued layers' events and
        ``ready_event`` (the metadata row written), then the last ``send``
        with no pages, aux and state.  A layer that did not have every
        page by then fails the room on every rank, the reason naming it."""
        if self._dummy:
            self.conclude_state = _Poll.Success
            return
        self._flush_layers(True)
        if not self._layered_live():
            return
        _event_done(ready_event, True)
        states = state_indices if state_indices is not None else self._layer_states
        self._ended = self._attempt(
            "the final metadata", lambda: self._h.send([], self._last_states(states),
                                                       is_last=True))

    def _flush_layers(self, wait):
        """Send the queued layers whose events completed, in order (each
        layer's pages in page order); ``wait``: synchronize on each."""
        while self._queued and _event_done(self._queued[0][0], wait):
            _, pages, first, g, lo, hi = self._queued.pop(0)
            if not self._layered_live() or not self._attempt(
                    "%s, pages %d-%d" % (_run_name(g, lo, hi), first, first + len(pages) - 1),
                    lambda: self._h.send_layers(pages, first, lo, hi, group=g)):
                self._queued = []

    def _attempt(self, what, call):
        """``call()``; a refusal fails the room (unless it had failed:
        poll() says why).  True when it went through."""
        try:
            call()
            return True
        except (KVFerryError, ValueError, TypeError) as e:
            if self._h.poll() != _Poll.Failed:
                self._fail_here("KVSender layer-wise send (%s) refused on prefill rank %d: "
                                "%s: %s" % (what, self.kv_mgr.attn_tp_rank,
                                            type(e).__name__, e),
                                code=_lib.KVF_ERR_BAD_INDICES)
            return False


def _layer_of(layers, lid, draft):
    """kvferry's (group, layer) of SGLang's layer id, ``layers`` the
    registered layers of each group.  The model's ids are global (a
    pipeline stage's own).  The draft model's are its own (0 on), or
    numbered after the model's (SGLang's MTP layers); a draft registered
    through ``kv_layer_ids`` is in group 0."""
    main, extra = layers.get(0, set()), layers.get(1)
    if not draft:
        if lid in main:
            return 0, lid
        raise ValueError("layer %d is not one of this rank's (layers %s)"
                         % (lid, _span(main)))
    if extra is None and lid in main:
        return 0, lid
    if extra and lid in extra:
        return 1, lid
    if extra and main and lid - (max(main) + 1) in extra:
        return 1, lid - (max(main) + 1)
    raise ValueError("draft layer %d is not one this rank registered (the draft "
                     "model's layers: %s)" % (lid, _span(extra or set())))


def _shown(v):
    try:
        return ascii(list(v) if not isinstance(v, int) else v)[:40]
    except Exception:
        return "a %s" % type(v).__name__

