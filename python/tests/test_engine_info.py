"""TransferEngineInfo takes the spec's calls and upstream mstar's (shm_dir,
shm_dir_factory, get_shm_dir) as one class; a manager made from either form
moves real bytes."""
import mstar_kv as kv
import numpy as np
import pytest
from conftest import assert_only_pages_written, block_offset, local_layout


def test_spec_calls_unchanged():
    info = kv.TransferEngineInfo("decode", "sess", "shm")
    assert (info.my_entity_id, info.my_session_id, info.transfer_engine) == ("decode", "sess",
                                                                             "shm")
    assert info.options == {} and info.shm_dir is None and info.get_shm_dir() is None
    info = kv.TransferEngineInfo("decode", "", "shm", {"timeout": 10.0})  # options by position
    assert info.options == {"timeout": 10.0} and info.get_shm_dir() is None


def test_upstream_keywords_and_factory_called_once(tmp_path):
    calls = []

    def factory():
        calls.append(1)
        return str(tmp_path / "deploy")

    info = kv.TransferEngineInfo(my_entity_id="w0", my_session_id="s", transfer_engine="shm",
                                 shm_dir=None, shm_dir_factory=factory)
    assert calls == []  # resolved when asked, not before
    assert info.get_shm_dir() == str(tmp_path / "deploy")
    assert info.get_shm_dir() == str(tmp_path / "deploy")
    assert calls == [1]
    fixed = kv.TransferEngineInfo("w0", "s", "shm", shm_dir=tmp_path, shm_dir_factory=factory)
    assert fixed.get_shm_dir() == str(tmp_path) and calls == [1]  # shm_dir wins
    assert kv.TransferEngineInfo("w0", "s", "shm", shm_dir=None,
                                 shm_dir_factory=None).get_shm_dir() is None


def test_upstream_positional_order():
    # upstream: TransferEngineInfo(my_entity_id, my_session_id, transfer_engine,
    #                              shm_dir=None, shm_dir_factory=None)
    info = kv.TransferEngineInfo("w0", "s", "shm", "/dev/shm/deploy")
    assert info.shm_dir == "/dev/shm/deploy" and info.options == {}
    info = kv.TransferEngineInfo("w0", "s", "shm", None, lambda: "/dev/shm/made")
    assert info.options == {} and info.get_shm_dir() == "/dev/shm/made"


def test_bad_fields_named():
    with pytest.raises(TypeError, match="options of type int"):
        kv.TransferEngineInfo("w0", "s", "shm", 5)
    with pytest.raises(TypeError, match="shm_dir_factory of type str is not callable"):
        kv.TransferEngineInfo("w0", "s", "shm", shm_dir_factory="/dev/shm/x")
    with pytest.raises(TypeError, match="shm_dir of type int"):
        kv.TransferEngineInfo("w0", "s", "shm", shm_dir=3)
    with pytest.raises(TypeError, match="by keyword"):
        kv.TransferEngineInfo("w0", "s", "shm", "/a", "/b", lambda: "/c")


def test_integration_module_uses_the_same_class():
    from mstar_kv.integrations import mstar as up
    assert up.TransferEngineInfo is kv.TransferEngineInfo


@pytest.mark.parametrize("form", ["spec", "upstream_keywords", "upstream_positional"])
def test_manager_from_either_form_moves_bytes(form, tmp_path):
    layout = local_layout()
    infos = {"spec": lambda who: kv.TransferEngineInfo(who, "", "shm", {"timeout": 10.0}),
             "upstream_keywords": lambda who: kv.TransferEngineInfo(
                 my_entity_id=who, my_session_id="", transfer_engine="shm", shm_dir=None,
                 shm_dir_factory=lambda: str(tmp_path)),
             "upstream_positional": lambda who: kv.TransferEngineInfo(who, "", "shm",
                                                                      str(tmp_path))}
    src = kv.KVCache(layout, memory="shared")
    src_bytes = src.numpy().view("uint8").reshape(-1)
    src_bytes[:] = np.random.default_rng(5).integers(0, 256, src_bytes.size, dtype=np.uint8)
    dst = kv.KVCache(layout)
    dst_bytes = dst.numpy().view("uint8").reshape(-1)
    dst_bytes[:] = 0
    owner = kv.KVTransferManager(infos[form]("prefill"), src)
    reader = kv.KVTransferManager(infos[form]("decode"), dst)
    try:
        tokens = 2 * layout.page_size
        reader.start_async_retrieve(0, tokens, [5, 9], [3, 7],
                                    owner.get_kv_transfer_info()).result(timeout=30)
        bb = layout.block_bytes
        for layer in range(layout.num_layers):
            for kvi in range(layout.num_kv):
                for local, remote in ((5, 3), (9, 7)):
                    lo = block_offset(layout, layer, kvi, local)
                    ro = block_offset(layout, layer, kvi, remote)
                    assert np.array_equal(dst_bytes[lo:lo + bb], src_bytes[ro:ro + bb])
        assert_only_pages_written(np.zeros_like(dst_bytes), dst_bytes, layout, [5, 9])
    finally:
        reader.cleanup()
        owner.cleanup()
