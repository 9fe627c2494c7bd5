"""MstarKVConnector as the end-to-end tests load it into vLLM's engines
(vllm_engine_peer.py names this module as kv_connector_module_path): the
product connector, watched through its override points, with a negative
control and a slower prefill when a test asks for them.

vLLM builds the connector in processes it spawns (engine core, workers),
which a monkeypatch in the test process would not reach; they inherit the
environment, which says what to do:

  MSTAR_KV_TEST_STATS=FILE     one JSON line per finished load (decode);
                               FILE.peers once every prefill_peers rank
                               is connected (decode, prefill_peers set)
  MSTAR_KV_TEST_RECORD=1       with STATS: a digest of each published and
                               loaded request's blocks in every layer of
                               vLLM's own tensors, the time each layer was
                               marked (prefill) or landed (decode)
  MSTAR_KV_TEST_CORRUPT=1      overwrite what each pull loaded (decode)
  MSTAR_KV_TEST_SAVE_DELAY_S=S sleep S per saved layer of a request
                               published early (prefill)
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time

from mstar_kv.integrations.vllm.connector import MstarKVConnector
from mstar_kv.integrations.vllm.consumer import Consumer
from mstar_kv.integrations.vllm.producer import Producer

ENV_STATS = "MSTAR_KV_TEST_STATS"
ENV_RECORD = "MSTAR_KV_TEST_RECORD"
ENV_CORRUPT = "MSTAR_KV_TEST_CORRUPT"
ENV_SAVE_DELAY = "MSTAR_KV_TEST_SAVE_DELAY_S"


class Recorder:
    """JSON lines in the stats file, and a digest of a request's blocks in
    every layer of vLLM's own tensors (what the producer published, what the
    consumer loaded)."""

    def __init__(self, path: str, tensors: list, record: bool):
        self.path = path
        self.tensors = tensors
        self.record = record  # digests and layer times too

    def line(self, d: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(d) + "\n")

    def digest(self, block_ids) -> str:
        import torch
        h = hashlib.blake2b(digest_size=16)
        for t in self.tensors:
            for b in block_ids:
                h.update(t[b].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


class RecordingProducer(Producer):
    """Writes a line per request once every layer of it is published, with
    its digest and the times its layers were marked; sleeps per saved layer
    (save_delay_s) to give a streaming reader a prefill slower than its
    pulls."""

    def __init__(self, *args, recorder: Recorder = None, save_delay_s: float = 0.0, **kw):
        super().__init__(*args, **kw)
        self._recorder = recorder if recorder is not None and recorder.record else None
        self._save_delay_s = save_delay_s
        self._marks: dict = {}  # seq_id -> [(layer, when marked)]

    def layer_saved(self, layer: int) -> None:
        if self._streaming and self._save_delay_s:
            time.sleep(self._save_delay_s)
        super().layer_saved(layer)

    def _on_marked(self, p, layers: range, when: float) -> None:
        if self._recorder is not None:
            self._marks.setdefault(p.seq_id, []).extend((x, when) for x in layers)

    def _on_complete(self, p) -> None:
        if self._recorder is None:
            return
        r = p.req
        self._recorder.line({"published": r.name, "req": r.req_id, "tokens": r.num_tokens,
                             "blocks": list(r.block_ids), "marks": self._marks.pop(p.seq_id, []),
                             "digest": self._recorder.digest(r.block_ids)})


class RecordingConsumer(Consumer):
    """Writes a line per finished load (with its digest and the time each
    streamed layer landed); the negative control overwrites what a pull
    wrote, in every layer of vLLM's own tensors, before vLLM reads it."""

    def __init__(self, *args, recorder: Recorder = None, corrupt_tensors=None, **kw):
        super().__init__(*args, **kw)
        self._recorder = recorder
        self._corrupt_tensors = corrupt_tensors
        self._landed: dict = {}  # req_id -> [(layer, when it was in vLLM's blocks)]
        if recorder is not None and self.cfg.prefill_peers:
            threading.Thread(target=self._tell_peers_connected, args=(recorder.path + ".peers",),
                             name="test-peers", daemon=True).start()

    def _tell_peers_connected(self, path: str) -> None:
        """Writes what peers() says to ``path`` once every rank it keeps is
        connected: a test that claims a pull found its peer connected ahead
        waits for this, not for a guess at how long connecting takes."""
        while True:
            status = self.peers()
            if status and all(v["state"] == "connected" for v in status.values()):
                with open(path, "w") as f:
                    f.write(json.dumps(status) + "\n")
                return
            time.sleep(0.05)

    def _on_issued(self, ld) -> None:
        if ld.stream is None or self._recorder is None or not self._recorder.record:
            return
        landed = self._landed.setdefault(ld.req.req_id, [])
        for layer in range(ld.stream.num_layers):
            if not ld.stream.wait_for_layer(layer, self.cfg.transfer_timeout_s):
                break
            landed.append((layer, time.monotonic()))

    def _on_finished(self, ld) -> None:
        r = ld.req
        ps = self.block_size
        landed = self._landed.pop(r.req_id, [])
        digest = ""
        # Several KV cache groups: the pages the pull wrote (ld.pages).
        written = ld.pages if ld.pages is not None else r.block_ids[r.start // ps:-(-r.end // ps)]
        if ld.ok and self._recorder is not None and self._recorder.record:
            digest = self._recorder.digest(written)
        if ld.ok and self._corrupt_tensors is not None:
            for t in self._corrupt_tensors:
                for b in (written if ld.pages is not None else r.block_ids[r.start // ps:]):
                    t[b].normal_()
        if self._recorder is None:
            return
        line = {"req": r.req_id, "remote_req": r.remote.request_id, "ok": ld.ok,
                "error": ld.error, "start": r.start, "end": r.end,
                "tokens": (r.end - r.start) if ld.ok else 0,
                "seconds": round(ld.t1 - ld.t0, 6), "rank": self.tp_rank, "via": ld.via,
                "retried_stale": ld.retried, "direct": ld.direct, "bytes": ld.nbytes,
                "pages": None if ld.pages is None else len(ld.pages)}
        if self._recorder.record:
            line.update(digest=digest, landed=landed, t_end=ld.t1)
        self._recorder.line(line)


class MstarTestConnector(MstarKVConnector):
    """MstarKVConnector with RecordingProducer / RecordingConsumer as its
    worker halves, set up from the environment (module docstring)."""

    def register_kv_caches(self, kv_caches: dict) -> None:
        self._test_tensors = kv_caches
        super().register_kv_caches(kv_caches)

    def _recorder(self):
        path = os.environ.get(ENV_STATS, "")
        if not path:
            return None
        return Recorder(path, [self._test_tensors[n] for n in self.mapped.layer_names],
                        os.environ.get(ENV_RECORD) == "1")

    def _make_producer(self):
        return RecordingProducer(self.cfg, self.manager, self.tp_rank, self.mapped,
                                 recorder=self._recorder(),
                                 save_delay_s=float(os.environ.get(ENV_SAVE_DELAY, "0")))

    def _make_consumer(self, failure_policy: str):
        corrupt = list(self._test_tensors.values()) \
            if os.environ.get(ENV_CORRUPT) == "1" else None
        return RecordingConsumer(self.cfg, self.manager, self.tp_rank, self.tp_size,
                                 self.engine_id, mapped=self.mapped,
                                 failure_policy=failure_policy, kv_stats=self._stats,
                                 recorder=self._recorder(), corrupt_tensors=corrupt,
                                 groups=self.groups if self.hybrid else (),
                                 state_info=self._staging_info)
