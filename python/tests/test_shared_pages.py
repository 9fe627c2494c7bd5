"""Shared pages (prefix caching): KVCachePool.adopt(..., allow_shared=True)
lets a second sequence hold pages a first one holds, as vLLM's prefix cache
shares blocks. Both publish; each pulls byte-exact over the shm engine; the
first one's done never breaks the second's pull; the last holder's done
frees the pages, and a reuse fails the old SequenceInfo as stale."""
import mstar_kv as kv
import pytest


def _pair():
    layout = kv.KVLayout(num_layers=2, num_pages=8, page_size=16, num_kv_heads=2, head_dim=16,
                         dtype="fp16")
    owner = kv.KVCache(layout, "shared")
    omgr = kv.KVTransferManager(kv.TransferEngineInfo("o", "", "shm"), owner)
    reader = kv.KVCache(layout)
    rmgr = kv.KVTransferManager(kv.TransferEngineInfo("r", "", "shm"), reader)
    return owner, omgr, reader, rmgr


def test_shared_pages_pull_byte_exact_until_the_last_holder_is_done():
    owner, omgr, reader, rmgr = _pair()
    pool = kv.KVCachePool(owner, omgr, lease=0)
    a_pages, b_pages = [6, 1], [6, 1, 3]   # b's first two blocks are a's prefix
    owner.fill_pattern(5, b_pages, 0, 40)
    pool.adopt(7, 32, a_pages)
    with pytest.raises(kv.InvalidArgumentError, match="page 6 is held by a live sequence"):
        pool.adopt(8, 40, b_pages)
    with pytest.raises(kv.InvalidArgumentError, match="page 3 is named twice"):
        pool.adopt(8, 40, [6, 3, 3], allow_shared=True)
    assert (pool.holders(6), pool.holders(3)) == (1, 0)   # the refused calls changed nothing
    pool.adopt(8, 40, b_pages, allow_shared=True)
    assert (pool.holders(6), pool.holders(1), pool.holders(3)) == (2, 2, 1)

    a = kv.SequenceInfo.from_bytes(pool.publish(7).to_bytes())
    b_sent = pool.publish(8)
    b = kv.SequenceInfo.from_bytes(b_sent.to_bytes())
    assert b == b_sent
    ea = a.kv_transfer_info.epoch
    assert a.kv_transfer_info.page_epochs == []
    assert b.kv_transfer_info.page_epochs == [(1, ea), (6, ea)]
    assert b.kv_transfer_info.epoch not in (0, ea)

    assert rmgr.sync_retrieve(0, 32, [0, 2], a.page_indices, a.kv_transfer_info) > 0
    assert reader.verify_pattern(5, [0, 2], 0, 32)["ok"]
    assert rmgr.sync_retrieve(0, 40, [3, 4, 5], b.page_indices, b.kv_transfer_info) > 0
    assert reader.verify_pattern(5, [3, 4, 5], 0, 40)["ok"]

    # a's done: b still reads every byte (fresh local pages, so nothing is left over).
    assert pool.done(7, ea)
    fut = rmgr.start_async_retrieve(0, 40, [0, 2, 7], b.page_indices, b.kv_transfer_info)
    fut.result(timeout=10)
    assert fut.bytes_read > 0
    assert reader.verify_pattern(5, [0, 2, 7], 0, 40)["ok"]

    # b's done frees the pages; a third sequence reuses them with other KV.
    assert pool.done(8, b.kv_transfer_info.epoch)
    assert [pool.holders(p) for p in b_pages] == [0, 0, 0]
    pool.adopt(9, 40, [3, 1, 6])
    owner.fill_pattern(9, [3, 1, 6], 0, 40)
    c = pool.publish(9)
    for seq in (a, b):
        with pytest.raises(kv.StaleDescriptorError):
            rmgr.sync_retrieve(0, seq.num_tokens, [0, 2, 7][:len(seq.page_indices)],
                               seq.page_indices, seq.kv_transfer_info)
    assert rmgr.sync_retrieve(0, 40, [0, 2, 7], c.page_indices, c.kv_transfer_info) > 0
    assert reader.verify_pattern(9, [0, 2, 7], 0, 40)["ok"]
    rmgr.cleanup()
    omgr.cleanup()


def test_a_shared_descriptor_without_its_page_epochs_fails_stale():
    """Negative control: the per-page epochs are what make b's pull succeed;
    the same bytes without them read the shared pages with b's own epoch and
    the engine refuses them."""
    owner, omgr, reader, rmgr = _pair()
    pool = kv.KVCachePool(owner, omgr, lease=0)
    owner.fill_pattern(5, [6, 1, 3], 0, 40)
    pool.adopt(7, 32, [6, 1])
    pool.adopt(8, 40, [6, 1, 3], allow_shared=True)
    pool.publish(7)
    b = pool.publish(8)
    bare = kv.KVTransferInfo(b.kv_transfer_info.engine, b.kv_transfer_info.payload)
    bare.epoch = b.kv_transfer_info.epoch
    assert bare.page_epochs == []
    with pytest.raises(kv.StaleDescriptorError):
        rmgr.sync_retrieve(0, 40, [0, 2, 4], b.page_indices, bare)
    assert rmgr.sync_retrieve(0, 40, [0, 2, 4], b.page_indices, b.kv_transfer_info) > 0
    assert reader.verify_pattern(5, [0, 2, 4], 0, 40)["ok"]
    rmgr.cleanup()
    omgr.cleanup()


def test_a_layerwise_stream_of_a_shared_sequence_reads_every_byte():
    """What the vLLM consumer does in layerwise mode: the shared pages are
    ready (the first request published them), the new page is marked layer
    by layer; the stream watches and reads each page with its own epoch."""
    owner, omgr, reader, rmgr = _pair()
    pool = kv.KVCachePool(owner, omgr, lease=0)
    owner.fill_pattern(5, [6, 1], 0, 32)
    pool.adopt(7, 32, [6, 1])
    pool.publish(7)
    pool.adopt(8, 40, [6, 1, 3], allow_shared=True)
    b = kv.SequenceInfo.from_bytes(pool.publish(8, 0).to_bytes())
    stream = rmgr.start_streaming_retrieve(0, 40, [0, 2, 4], b.page_indices, b.kv_transfer_info,
                                           ready_timeout=10.0)
    assert not stream.wait_for_layer(0, timeout=0.05)   # page 3 has no layer yet
    owner.fill_pattern(5, [6, 1, 3], 32, 40)
    pool.mark_layers_ready(8, 2)
    assert stream.future.result(timeout=10) > 0
    assert reader.verify_pattern(5, [0, 2, 4], 0, 40)["ok"]
    rmgr.cleanup()
    omgr.cleanup()


def test_page_epochs_set_from_untrusted_input_are_checked_and_refusals_change_nothing():
    """The vLLM connector sets page_epochs from a request's params: bad pairs
    are refused as a decoded frame's would be, naming the field."""
    info = kv.KVTransferInfo("shm", b"payload")
    info.epoch = 5
    info.page_epochs = [(1, 3), (4, 2)]
    assert info.page_epochs == [(1, 3), (4, 2)]
    assert kv.KVTransferInfo.from_bytes(info.to_bytes()).page_epochs == [(1, 3), (4, 2)]
    for bad in ([(4, 2), (1, 3)], [(1, 0)], [(1, 5)], [(1, 3), (1, 3)]):
        with pytest.raises(kv.CorruptDescriptorError, match="page_epochs"):
            info.page_epochs = bad
    with pytest.raises(kv.InvalidArgumentError, match="pairs"):
        info.page_epochs = [(1,)]
    assert info.page_epochs == [(1, 3), (4, 2)]
