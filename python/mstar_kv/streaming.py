"""Layer-wise streaming: pull layer L while the owner still computes L + 1.

Owner (prefill)::

    pages = pool.allocate(seq_id, n)
    info = pool.publish(seq_id, layers_ready=0)     # before any layer is written
    for layer in range(num_layers):
        forward(layer)                              # writes the layer's K/V
        pool.mark_layers_ready(seq_id, layer + 1)   # vLLM's save_kv_layer

Reader (decode)::

    stream = mgr.start_streaming_retrieve(0, n, local, info.page_indices,
                                          info.kv_transfer_info)
    for layer in range(num_layers):
        stream.wait_for_layer(layer)                # vLLM's wait_for_layer_load
        attention(layer)
    stream.future.result()

Readiness reaches the reader over the engine's own channel: shm reads the
owner's readiness words in the memory it maps; ucx asks the owner, which
answers with a notice as soon as more layers are ready (one request
outstanding per stream); cuda_ipc reads the owner's readiness words in a
small memfd of the owner's (the owner marks a layer after its kernels
completed, e.g. KVCachePool.mark_layers_ready_after on its stream); the
Mooncake wheel engine polls the owner's registered words (bounded: every
0.5 ms), as the C++ engine over Mooncake's C library does. Every layer's
read is an ordinary read of the engine (epochs, timeouts, in-flight limits).
"""
from __future__ import annotations

from typing import Optional

from . import _core
from .errors import StatusCode, error_from_code
from .futures import TransferFuture

_OK = int(StatusCode.OK)
_IN_PROGRESS = int(StatusCode.IN_PROGRESS)


class LayerStream:
    """One streamed pull. Safe from any thread.

    ``future``: a TransferFuture of the whole pull (bytes read); cancelling it
    cancels the stream. ``wait_for_layer(layer, timeout=None)`` blocks (GIL
    released) until the layer is in the local cache and returns True; False
    when ``timeout`` seconds passed first (the stream goes on); raises the
    stream's KVTransferError when it failed before the layer arrived (a layer
    never marked ready: TransferTimeoutError; pages reused:
    StaleDescriptorError; readiness going backwards or beyond the layer count:
    CorruptDescriptorError; the owner died: NotFoundError over shm,
    PeerFailureError over ucx). ``cancel()``
    stops issuing reads; the future then resolves with TransferCancelledError
    once nothing is in flight.
    """

    def __init__(self, native: "_core._LayerStream"):
        self._native = native
        self.future = TransferFuture(native.future())

    @property
    def num_layers(self) -> int:
        return self._native.num_layers

    @property
    def layers_done(self) -> int:
        """Layers [0, layers_done) are in the local cache."""
        return self._native.layers_done

    def wait_for_layer(self, layer: int, timeout: Optional[float] = None) -> bool:
        if not 0 <= layer < self.num_layers:
            from .errors import InvalidArgumentError
            raise InvalidArgumentError(
                f"wait_for_layer of layer {layer} out of range [0, {self.num_layers})")
        code, message = self._native.wait_for_layer(layer, timeout)
        if code == _OK:
            return True
        if code == _IN_PROGRESS:
            return False
        raise error_from_code(code, message)

    def cancel(self) -> None:
        self._native.cancel()

    def __repr__(self) -> str:
        return f"LayerStream({self.layers_done}/{self.num_layers} layers)"
