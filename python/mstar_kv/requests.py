"""Request-scoped descriptors: upstream mstar's calling convention over the
one manager (include/mstar/kv/core/requests.hpp; docs/integrations/mstar.md).

``KVTransferManager(info, cache, resource_key="kv", needs_remote_transfer=True)``
publishes ``get_kv_transfer_info(request_id, label, page_indices, seq_len,
reset_generation)``: a RequestKVTransferInfo naming those pages with the
epochs the manager stamped on them, so that a read after ``remove_request``,
after another ``reset_generation`` or after ``cleanup()`` fails with
StaleDescriptorError instead of returning another request's KV.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from . import _core
from .errors import InvalidArgumentError, KVTransferError
from .futures import wrap_native

_Native = _core._RequestInfo


class RequestKVTransferInfo:
    """One publication of a request's labelled cache (resource_key,
    request_id, label, reset_generation, seq_len, page_indices, the pages'
    epochs, the publishing manager and its engine's descriptor).

    Equal, and hashing alike, when the bytes are (the same publication of one
    manager); picklable as its bytes. Unpickled bytes are decoded when first
    used: a corrupt descriptor raises CorruptDescriptorError there (naming the
    field), from an attribute or from the read it is given to, not from
    ``pickle.loads``, so that one bad descriptor fails one request only."""

    __slots__ = ("_data", "_native")

    def __init__(self, native: "_Native"):
        self._native = native
        self._data = native.to_bytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> "RequestKVTransferInfo":
        """Decodes at once (untrusted input: CorruptDescriptorError naming the field)."""
        return cls(_Native.from_bytes(bytes(data)))

    def to_bytes(self) -> bytes:
        return self._data

    def _decoded(self) -> "_Native":
        if self._native is None:
            self._native = _Native.from_bytes(self._data)
        return self._native

    resource_key = property(lambda self: self._decoded().resource_key)
    request_id = property(lambda self: self._decoded().request_id)
    label = property(lambda self: self._decoded().label)
    reset_generation = property(lambda self: self._decoded().reset_generation)
    seq_len = property(lambda self: self._decoded().seq_len)
    page_size = property(lambda self: self._decoded().page_size)
    page_indices = property(lambda self: tuple(self._decoded().page_indices))
    page_epochs = property(lambda self: tuple(self._decoded().page_epochs))
    owner = property(lambda self: self._decoded().owner)
    kv_transfer_info = property(lambda self: self._decoded().cache,
                                doc="The engine's descriptor of the whole cache.")

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, RequestKVTransferInfo) and self._data == other._data

    def __hash__(self) -> int:
        return hash(self._data)

    def __reduce__(self):
        return (_restore, (self._data, type(self)))

    def __repr__(self) -> str:
        try:
            d = self._decoded()
        except KVTransferError as e:
            return f"RequestKVTransferInfo(<corrupt: {e}>)"
        return (f"RequestKVTransferInfo(resource_key={d.resource_key!r}, "
                f"request_id={d.request_id!r}, label={d.label!r}, "
                f"reset_generation={d.reset_generation!r}, seq_len={d.seq_len}, "
                f"{len(d.page_indices)} pages, engine={d.cache.engine!r})")


def _restore(data: bytes, cls: type = RequestKVTransferInfo) -> RequestKVTransferInfo:
    """Unpickles (subclasses too: an integration's own descriptor types)
    without decoding: the bytes are checked where the descriptor is used."""
    if not (isinstance(cls, type) and issubclass(cls, RequestKVTransferInfo)):
        cls = RequestKVTransferInfo
    obj = cls.__new__(cls)
    obj._data = bytes(data)
    obj._native = None
    return obj


def as_request_info(info: RequestKVTransferInfo, cls: type) -> RequestKVTransferInfo:
    """The same descriptor as an instance of ``cls`` (a subclass), sharing
    its bytes and decoded form."""
    obj = cls.__new__(cls)
    obj._data = info._data
    obj._native = info._native
    return obj


_REQUEST_ARGS = ("request_id", "label", "page_indices", "seq_len")


class RequestScopedMethods:
    """KVTransferManager's request-scoped methods (mixed into it): ``self._m``
    is the bound C++ manager, ``self.engine`` its engine."""

    _m: Any
    engine: Any

    @property
    def resource_key(self) -> str:
        return self._m.resource_key

    @property
    def needs_remote_transfer(self) -> bool:
        return self._m.needs_remote_transfer

    def get_kv_transfer_info(self, request_id: Optional[str] = None, label: Optional[str] = None,
                             page_indices: Optional[Sequence[int]] = None,
                             seq_len: Optional[int] = None,
                             reset_generation: Optional[int] = None):
        """Without arguments, the spec's descriptor of the whole cache (None
        for local-only, or when the scope needs no remote transfer). With
        request_id, label, page_indices and seq_len, publishes them (stamping
        the pages' epochs) and returns their RequestKVTransferInfo, equal for
        equal arguments, or None where nothing is published. Raises
        InvalidArgumentError naming a missing argument or a bad value."""
        from .errors import ShutdownError
        if self._m.closed:
            raise ShutdownError("KVTransferManager.get_kv_transfer_info() after cleanup()")
        given = (request_id, label, page_indices, seq_len)
        if all(v is None for v in given) and reset_generation is None:
            if not self._m.needs_remote_transfer:
                return None
            return self.engine.get_kv_transfer_info()
        missing = [n for n, v in zip(_REQUEST_ARGS, given) if v is None]
        if missing:
            raise InvalidArgumentError(
                f"get_kv_transfer_info: a request-scoped descriptor needs {', '.join(missing)}")
        native = self._m.publish(str(request_id), str(label), page_indices, int(seq_len),
                                 None if reset_generation is None else int(reset_generation))
        return None if native is None else RequestKVTransferInfo(native)

    def owns_transfer_info(self, transfer_info: Any, request_id: str, label: str) -> bool:
        """Whether this manager published ``transfer_info`` for (request_id,
        label) and has not removed the request since. A descriptor of the
        whole cache is owned when it is this manager's."""
        if isinstance(transfer_info, RequestKVTransferInfo):
            try:
                native = transfer_info._decoded()
            except KVTransferError:
                return False
            return self._m.owns_transfer_info(native, str(request_id), str(label))
        return transfer_info is not None and transfer_info == self.get_kv_transfer_info()

    def remove_request(self, request_id: str) -> None:
        """Releases every publication of ``request_id`` (reads of its
        descriptors then fail with StaleDescriptorError); no-op when unknown."""
        self._m.remove_request(str(request_id))

    def read_batched_async(self, remote_kv_info: Any, read_info: Sequence[Any]):
        """Reads planned by the caller. For a RequestKVTransferInfo every
        read's remote page must be one it published and its tokens within its
        seq_len (InvalidArgumentError naming the read otherwise), each page read
        with its epoch; other descriptors go to the engine as they are.
        Returns a Future of the bytes read, or None for no reads."""
        if isinstance(remote_kv_info, RequestKVTransferInfo):
            return wrap_native(self._m.read_request_async(remote_kv_info._decoded(),
                                                          list(read_info)))
        return self.engine.read_batched_async(remote_kv_info, read_info)


def native_descriptor(info: Any) -> Any:
    """What the bound manager takes for ``info``: a RequestKVTransferInfo's
    decoded form (CorruptDescriptorError if its bytes are corrupt), else info."""
    return info._decoded() if isinstance(info, RequestKVTransferInfo) else info
