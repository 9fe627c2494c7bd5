"""Scheduler side of MstarKVConnector (runs in vLLM's engine-core process)."""
from __future__ import annotations

import logging
import secrets
from typing import Any, Optional

from .groups import has_state, publish_pages, state_tp_refusal
from .layout import LayoutError
from .metadata import LoadReq, PublishReq, ReleaseReq, StepMeta, UnpublishReq
from .params import (
    ConfigError,
    ConnectorConfig,
    make_decode_params,
    parse_remote_prefill,
    published_name,
)

log = logging.getLogger("mstar_kv.vllm")

_FINISHED_OK = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


def _first_group(block_ids: Any) -> list:
    """vLLM passes one block-id list, or one list per KV cache group."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        if len(block_ids) != 1:
            raise ConfigError(f"{len(block_ids)} KV cache groups: MstarKVConnector moves one "
                              "(hybrid models are not supported yet)")
        return list(block_ids[0])
    return list(block_ids or [])


class PageEpochs:
    """The epochs the producer's workers stamp on the pages they publish,
    chosen here so that the params of a finished request name them (the
    decode pulls at once, without asking the producer first).

    A request's pages get one fresh epoch, except pages another published
    request still holds (prefill-side prefix caching): those keep the epoch
    they have, since the workers' pools keep it while any holder does. The
    view here lags the workers' by a step (a page is let go here once the
    workers reported its request freed), so a prediction can be stale, never
    wrong in the unsafe direction: the pull then fails as stale and the
    decode asks the producer for the sequence it really published."""

    def __init__(self):
        # Random start: epochs of two scheduler lives never meet in one cache.
        self._next = secrets.randbits(61) + 1
        self._pages: dict = {}   # page -> [epoch, holders]
        self._held: dict = {}    # req_id -> pages

    def hold(self, req_id: str, pages: list) -> tuple:
        """(epoch, [(page, older epoch), ...]) of a request about to be
        published over ``pages``."""
        self.release(req_id)
        epoch, self._next = self._next, self._next + 1
        shared = []
        for p in pages:
            e = self._pages.get(p)
            if e is None:
                self._pages[p] = [epoch, 1]
            else:
                e[1] += 1
                if e[0] != epoch:
                    shared.append((p, e[0]))
        self._held[req_id] = list(pages)
        # A descriptor names its exceptions in page order (validated when
        # it is read); a request's pages are in its groups' order.
        return epoch, sorted(shared)

    def release(self, req_id: str) -> None:
        for p in self._held.pop(req_id, ()):
            e = self._pages.get(p)
            if e is not None:
                e[1] -= 1
                if e[1] <= 0:
                    del self._pages[p]

    def held(self) -> int:
        return len(self._held)


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, block_size: int, tp_size: int, is_producer: bool,
                 is_consumer: bool, cell_layout: str = "kv_cells", groups=()):
        self.cfg = cfg
        # Several KV cache groups (groups.py): block ids come as one list per
        # group, and a request's pages are the groups' pages one after another.
        self.groups = list(groups) if len(groups) > 1 else []
        self.cell_layout = cell_layout
        self.block_size = block_size
        self.tp_size = tp_size
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self._meta = StepMeta()
        self._matched: dict = {}     # req_id -> num_computed_tokens at the last match
        self._loading: set = set()   # loads handed to the workers, not finished yet
        self._sending: set = set()   # producer: requests whose blocks the workers hold
        # publish_early: remote-decode requests being prefilled, req_id -> [name,
        # prompt length, block ids]; and those published before their forward pass.
        self._prefilling: dict = {}
        self._early: dict = {}       # req_id -> (name, num_tokens, pages, epoch, shared)
        self.epochs = PageEpochs()
        self._descs: list = []       # each prefill rank's cache descriptor (handshake)
        self.stats = {"published": 0, "loads": 0, "releases": 0, "cancelled": 0,
                      "refused": 0}
        self._refused_peers: set = set()  # (host, port, tp) said once in the log
        from .state_tp import conv_layout
        self._conv_layout = conv_layout() if has_state(self.groups) else ""

    def set_descriptors(self, by_rank: dict) -> None:
        """The cache descriptor of each of this engine's TP ranks (vLLM's
        handshake metadata), carried in the params of finished requests."""
        descs = [by_rank.get(r) for r in range(self.tp_size)]
        self._descs = descs if all(descs) else []

    def _params(self, name: str, n: int, pages: list, epoch: int, shared: list,
                segs=()) -> dict:
        return make_decode_params(self.cfg, name, self.tp_size, self.block_size, n,
                                  self.cell_layout, self._descs, pages, epoch, shared, segs,
                                  self._conv_layout)

    def _blocks(self, block_ids) -> list:
        """vLLM's block ids of a request: the one group's list, or one list
        per group."""
        if self.groups:
            return [list(b) for b in block_ids]
        return _first_group(block_ids)

    def _extend(self, have: list, new) -> list:
        if self.groups:
            return [a + list(b) for a, b in zip(have, new)] if have else self._blocks(new)
        return have + _first_group(new)

    def _pages(self, req_id: str, blocks: list, n: int):
        """(pages, publish tokens, params tokens, group segments) of a
        request with ``n`` computed tokens, or None when there is nothing
        (or, several groups, nothing whole) to publish."""
        if not self.groups:
            n = min(n, len(blocks) * self.block_size)
            if n <= 0:
                return None
            return blocks[:(n + self.block_size - 1) // self.block_size], n, n, ()
        if n <= 0:
            return None
        try:
            pages, segs = publish_pages(self.groups, blocks, n)
        except LayoutError as e:
            log.warning("request %s: not published: %s", req_id, e)
            return None
        return pages, len(pages) * self.block_size, n, segs

    def on_new_request(self, request) -> None:
        """Producer of a model with a state group: the request stops one
        prompt token short, so the published state is h(N-1) and the decode
        computes the last prompt token from it (vLLM's convention,
        NixlConnector's _truncate_request_for_prefill: a state cannot be
        rolled back to recompute a token, as attention's KV can)."""
        params = request.kv_transfer_params
        if not (self.is_producer and self.groups and has_state(self.groups) and params
                and params.get("do_remote_decode") and not params.get("_mstar_truncated")):
            return
        if request.num_prompt_tokens <= 1 or request.prompt_token_ids is None:
            return
        del request.prompt_token_ids[-1:]
        del request._all_token_ids[-1:]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["_mstar_truncated"] = True

    # -- consumer --------------------------------------------------------
    def _remote(self, request) -> Optional[Any]:
        try:
            return parse_remote_prefill(request.kv_transfer_params)
        except ConfigError as e:
            log.warning("request %s: ignoring its kv_transfer_params: %s", request.request_id, e)
            return None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        if not self.is_consumer:
            return 0, False
        rp = self._remote(request)
        if rp is None or self._refuse(request, rp):
            return 0, False
        prompt = len(request.prompt_token_ids or [])
        count = min(rp.num_tokens, prompt) - num_computed_tokens
        self._matched[request.request_id] = num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _refuse(self, request, rp) -> bool:
        """A load this engine cannot do (a state group from a prefill engine
        of another TP size, groups.state_tp_refusal): none is scheduled, the
        request computes its prompt here, and the producer is told to free
        it (update_state_after_alloc: a release). Before any byte moves."""
        why = state_tp_refusal(self.groups, rp.tp_size, self.tp_size,
                               f"{rp.host}:{rp.port}") if self.groups else ""
        if not why:
            return False
        self.stats["refused"] += 1
        key = (rp.host, rp.port, rp.tp_size)
        if key not in self._refused_peers:
            if len(self._refused_peers) >= 1024:
                self._refused_peers.clear()
            self._refused_peers.add(key)
            log.error("request %s: not loaded, computed here: %s", request.request_id, why)
        return True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self.is_producer:
            self._track_prefill(request)
        if not self.is_consumer:
            return
        rp = self._remote(request)
        if rp is None:
            return
        req_id = request.request_id
        start = self._matched.pop(req_id, None)
        if num_external_tokens > 0 and start is not None:
            block_ids = self._blocks(blocks.get_block_ids())
            self._meta.load.append(LoadReq(req_id, rp, block_ids, start,
                                           start + num_external_tokens))
            self._loading.add(req_id)
            self.stats["loads"] += 1
        else:
            # Everything is cached here already: the producer may free.
            self._meta.release.append(ReleaseReq(req_id, rp))
            self.stats["releases"] += 1
        request.kv_transfer_params["do_remote_prefill"] = False  # one transfer per request

    # -- producer: published before the last prompt chunk's forward pass ----
    def _name(self, request) -> Optional[str]:
        try:
            return published_name(request.kv_transfer_params, request.request_id)
        except ConfigError as e:
            log.warning("request %s: %s; published under its vLLM id", request.request_id, e)
            return str(request.request_id)

    def _track_prefill(self, request) -> None:
        params = request.kv_transfer_params or {}
        req_id = request.request_id
        if not params.get("do_remote_decode") or req_id in self._early:
            return
        self._prefilling[req_id] = [self._name(request), len(request.prompt_token_ids or []), []]

    def _publish_early(self, so) -> None:
        """Publishes, with no layer ready, each tracked request whose last
        prompt chunk runs in this step (its blocks are all allocated now);
        the workers mark its layers as the forward pass saves them."""
        if not self._prefilling:
            return
        for req_id in getattr(so, "preempted_req_ids", None) or ():
            self._prefilling.pop(req_id, None)
        for nr in getattr(so, "scheduled_new_reqs", None) or ():
            t = self._prefilling.get(nr.req_id)
            if t is not None:
                t[2] = self._blocks(nr.block_ids)
                self._maybe_publish(nr.req_id, t, nr.num_computed_tokens, so)
        cr = getattr(so, "scheduled_cached_reqs", None)
        for i, req_id in enumerate(getattr(cr, "req_ids", None) or ()):
            t = self._prefilling.get(req_id)
            if t is None:
                continue
            new = cr.new_block_ids[i]
            if new is not None:
                # vLLM 0.32 names resumed requests (their block ids are
                # replaced); 0.34 sends them again as new requests.
                resumed = getattr(cr, "resumed_req_ids", None) or ()
                t[2] = self._blocks(new) if req_id in resumed else self._extend(t[2], new)
            self._maybe_publish(req_id, t, cr.num_computed_tokens[i], so)

    def _maybe_publish(self, req_id: str, t: list, computed: int, so) -> None:
        name, prompt, blocks = t
        end = computed + int(so.num_scheduled_tokens.get(req_id, 0))
        if end < prompt:
            return  # an earlier chunk: its layers are written by the time the last one runs
        del self._prefilling[req_id]
        got = self._pages(req_id, blocks, prompt)
        if got is None:
            return
        pages, pub_n, n, segs = got
        epoch, shared = self.epochs.hold(req_id, pages)
        self._meta.publish.append(PublishReq(req_id, pages, pub_n, layers_ready=0, name=name,
                                             epoch=epoch))
        self._early[req_id] = (name, n, pages, epoch, shared, segs)
        self._sending.add(req_id)
        self.stats["published"] += 1

    # -- both --------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> StepMeta:
        if self.is_producer:
            for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
                e = self._early.pop(req_id, None)
                if e is not None:  # its blocks go back to vLLM now: unpublish first
                    self._meta.unpublish.append(UnpublishReq(req_id, e[0], report=False))
                    self._sending.discard(req_id)
                    self.epochs.release(req_id)
            self._publish_early(scheduler_output)
        meta, self._meta = self._meta, StepMeta()
        meta.idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        return meta

    def update_connector_output(self, output) -> None:
        for req_id in getattr(output, "finished_recving", None) or ():
            self._loading.discard(req_id)
        for req_id in getattr(output, "finished_sending", None) or ():
            self._sending.discard(req_id)
            self.epochs.release(req_id)

    def request_finished(self, request, block_ids) -> tuple:
        params = request.kv_transfer_params or {}
        req_id = request.request_id
        self._matched.pop(req_id, None)
        if self.is_consumer and params.get("do_remote_prefill"):
            # Finished (aborted) before its load was set up: free the producer's blocks.
            rp = self._remote(request)
            if rp is not None:
                self._meta.release.append(ReleaseReq(req_id, rp))
                self.stats["releases"] += 1
            return False, None
        if req_id in self._loading:
            # Aborted mid-load: vLLM keeps the blocks until the worker reports
            # the load finished; the worker cancels it.
            self._meta.cancel.append(req_id)
            self.stats["cancelled"] += 1
            return False, None
        self._prefilling.pop(req_id, None)
        early = self._early.pop(req_id, None)
        finished_ok = getattr(request.status, "name", str(request.status)) in _FINISHED_OK
        if early is not None:
            # Published before its forward pass: vLLM keeps the blocks until
            # the workers free them (done notice, lease, or the unpublish).
            if not finished_ok:
                self._meta.unpublish.append(UnpublishReq(req_id, early[0], report=True))
                return True, None
            return True, self._params(*early)
        if not (self.is_producer and params.get("do_remote_decode")):
            return False, None
        if not finished_ok:
            return False, None  # aborted: nothing to hand over
        got = self._pages(req_id, self._blocks(block_ids),
                          min(int(request.num_computed_tokens),
                              len(request.prompt_token_ids or [])))
        if got is None:
            return False, None
        pages, pub_n, n, segs = got
        # Not published before its forward pass (not seen scheduled to the
        # end of its prompt): published in the next step, which the decode
        # may outrun; its pull then waits on the side channel.
        name = self._name(request)
        epoch, shared = self.epochs.hold(req_id, pages)
        self._meta.publish.append(PublishReq(req_id, pages, pub_n, name=name, epoch=epoch))
        self._sending.add(req_id)
        self.stats["published"] += 1
        return True, self._params(name, n, pages, epoch, shared, segs)

    def has_pending(self) -> bool:
        return bool(self._sending or self._loading)
