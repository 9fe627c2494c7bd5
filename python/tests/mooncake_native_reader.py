"""A reader over Mooncake's C library (MooncakeNativeKVTransferEngine, the
library MSTAR_KV_MOONCAKE_LIB names) for test_mooncake_native.py, in a process
of its own: Mooncake's C library and the PyPI wheel's build of Mooncake
clash in one process, and pytest imports the wheel for its own tests.

    python mooncake_native_reader.py

Makes its engine and the one manager over a cache of the tests' geometry
(every byte 0x5A), prints "READY", then for each line "stream <hex of a
SequenceInfo>" on stdin streams the sequence into local pages 0..n-1 with
start_streaming_retrieve, checks it layer by layer (conftest's
check_layer_by_layer: in order, spread out, the bytes the owner wrote and no
poison), and prints "STREAMED <bytes> <arrival seconds per layer...>", or
"FAILED <the error>".
"""
import sys

import mstar_kv as kv
from conftest import check_layer_by_layer, local_layout, sentinel_fill


def main():
    cache = kv.KVCache(local_layout())
    sentinel_fill(cache)
    engine = kv.MooncakeKVTransferEngine(cache, "decode", None, timeout=10.0)
    assert type(engine).__name__ == "MooncakeNativeKVTransferEngine", type(engine)
    mgr = kv.KVTransferManager(engine, cache)
    print("READY", flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd != "stream":
            break
        seq = kv.SequenceInfo.from_bytes(bytes.fromhex(arg))
        local = list(range(len(seq.page_indices)))
        layout = cache.layout
        nbytes = layout.num_layers * 2 * seq.num_tokens * layout.token_bytes
        try:
            stream = mgr.start_streaming_retrieve(0, seq.num_tokens, local, seq.page_indices,
                                                  seq.kv_transfer_info)
            arrivals = check_layer_by_layer(stream, layout.num_layers, nbytes, cache, local,
                                            seq.num_tokens)
            print("STREAMED", nbytes, *(f"{a:.3f}" for a in arrivals), flush=True)
        except BaseException as e:  # the test prints it
            print("FAILED", type(e).__name__, str(e).replace("\n", " "), flush=True)
    mgr.cleanup()


if __name__ == "__main__":
    main()
