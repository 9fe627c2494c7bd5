"""Objects shaped like upstream mstar's (mstar.engine.resources.kv.cache.KVCache,
mstar.communication.tensors.LocalTransferEngine / MooncakeTransferEngine),
written here from their documented behaviour, so that the tests hand
mstar_kv.integrations.mstar what upstream would, without mstar installed.

The cache's contents are a pure function of (order, shape, dtype, seed), so
that a reader in another process knows what every byte must be."""
from __future__ import annotations

import enum
from types import SimpleNamespace

import torch

ORDERS = ("layer_page", "layer")  # upstream's older [L, P, 2, ...] and newer [L, 2, P, ...]


class KVLayout(enum.Enum):  # upstream's config enum (page layout)
    NHD = "NHD"


def shape_of(order: str, layers: int, pages: int, page_size: int, heads: int, head_dim: int):
    if order == "layer_page":
        return (layers, pages, 2, page_size, heads, head_dim)
    return (layers, 2, pages, page_size, heads, head_dim)


class KVCache:
    """Upstream's KVCache: one tensor, its config, chunk addressing."""

    def __init__(self, order: str, layers=2, pages=8, page_size=4, heads=2, head_dim=8,
                 dtype=torch.float32, device="cpu"):
        self.order = order
        self.config = SimpleNamespace(num_layers=layers, max_num_pages=pages, page_size=page_size,
                                      num_kv_heads=heads, head_dim=head_dim, layout=KVLayout.NHD)
        self.tensor = torch.zeros(shape_of(order, layers, pages, page_size, heads, head_dim),
                                  dtype=dtype, device=device)

    layout = property(lambda self: self.config.layout)
    num_layers = property(lambda self: self.config.num_layers)
    page_size = property(lambda self: self.config.page_size)
    device = property(lambda self: self.tensor.device)
    dtype = property(lambda self: self.tensor.dtype)
    nbytes = property(lambda self: self.tensor.nbytes)

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def page(self, page: int, tensor=None):
        """[L, 2, T, H, D] view of one page (K at 0, V at 1)."""
        t = self.tensor if tensor is None else tensor
        return t[:, page] if self.order == "layer_page" else t[:, :, page]

    def chunk_ptrs(self, layer_idx, page_idx, token_start, token_end, base_ptr=None):
        stride = self.tensor.stride()
        es = self.tensor.element_size()
        kv_dim, page_dim = (2, 1) if self.order == "layer_page" else (1, 2)
        base = self.data_ptr() if base_ptr is None else base_ptr
        ptrs = [base + (layer_idx * stride[0] + page_idx * stride[page_dim] + kv * stride[kv_dim]
                        + token_start * stride[3]) * es for kv in (0, 1)]
        return ptrs, (token_end - token_start) * stride[3] * es


def content(cache: KVCache, seed: int) -> torch.Tensor:
    """The tensor a producer with this seed holds (exact in every dtype)."""
    n = cache.tensor.numel()
    values = (torch.arange(n, dtype=torch.int64) * 2654435761 + seed * 97) % 251 - 125
    return values.to(cache.tensor.dtype).reshape(cache.tensor.shape)


class LocalTransferEngine:
    """Upstream's no-op engine for one host."""

    def __init__(self, hostname: str):
        self._session_id = hostname

    def register_memory(self, ptr: int, nbytes: int) -> int:
        return 0

    def unregister_memory(self, ptr: int) -> int:
        return 0

    def get_async_reader(self, device):
        return None

    def get_session_id(self) -> str:
        return self._session_id


class MooncakeTransferEngine:
    """Upstream's wrapper of the Mooncake wheel's TransferEngine (TCP here)."""

    def __init__(self, hostname: str = "127.0.0.1"):
        from mooncake.engine import TransferEngine
        self._engine = TransferEngine()
        if self._engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("mooncake initialize failed")
        self._session_id = f"{hostname}:{self._engine.get_rpc_port()}"

    def register_memory(self, ptr: int, nbytes: int) -> int:
        return self._engine.register_memory(ptr, nbytes)

    def unregister_memory(self, ptr: int) -> int:
        return self._engine.unregister_memory(ptr)

    def get_async_reader(self, device):
        raise NotImplementedError("mstar_kv reads through the wheel object itself")

    def get_session_id(self) -> str:
        return self._session_id
