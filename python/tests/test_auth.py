"""Authenticated peers (include/mstar/kv/engines/ucx.hpp, "auth_token"): a UCX owner
with a shared secret serves only readers that prove it, in a challenge-
response that never sends the secret; a reader with a token refuses an
owner that cannot prove it. Refusals raise PermissionDeniedError before any
byte lands in the reader's cache."""
import os

import mstar_kv as kv
import pytest
from conftest import SEED, TOKENS, local_layout, sentinel_fill

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

TOKEN = "python-shared-secret-0123"

pytestmark = pytest.mark.skipif("ucx" not in kv.built_engines(),
                                reason="the ucx engine is not built")


def reader(token=None):
    cache = kv.KVCache(local_layout())
    opts = {"timeout": 10.0}
    if token is not None:
        opts["auth_token"] = token
    return cache, kv.KVTransferManager(kv.TransferEngineInfo("decode", "", "ucx", opts), cache)


def test_only_a_reader_that_proves_the_token_is_served(peer_factory):
    peer = peer_factory("ucx", "--auth-token", TOKEN)
    seq = peer.seqs[0]
    local = list(range(len(seq.page_indices)))
    for token, needle in ((None, "requires an auth_token"),
                          ("a-different-secret-of-16", "proof of the auth_token is wrong")):
        cache, mgr = reader(token)
        with mgr:
            before = sentinel_fill(cache).copy()
            with pytest.raises(kv.PermissionDeniedError, match=needle) as ei:
                mgr.start_async_retrieve(0, seq.num_tokens, local, seq.page_indices,
                                         seq.kv_transfer_info).result(timeout=30)
            assert TOKEN not in str(ei.value)
            assert (cache.numpy().view("uint8").reshape(-1) == before).all(), "bytes moved"
    cache, mgr = reader(TOKEN)
    with mgr:
        assert mgr.sync_retrieve(0, seq.num_tokens, local, seq.page_indices,
                                 seq.kv_transfer_info) > 0
        assert cache.verify_pattern(SEED + 1, local, 0, TOKENS)["ok"]


def test_a_reader_with_a_token_refuses_an_owner_without_one(peer_factory):
    peer = peer_factory("ucx")
    seq = peer.seqs[0]
    cache, mgr = reader(TOKEN)
    with mgr:
        with pytest.raises(kv.PermissionDeniedError, match="did not prove it"):
            mgr.sync_retrieve(0, seq.num_tokens, list(range(len(seq.page_indices))),
                              seq.page_indices, seq.kv_transfer_info)


def test_a_short_token_is_refused_naming_the_limit():
    with pytest.raises(kv.InvalidArgumentError, match="16 bytes"):
        reader("short")
