# Copyright mstar-kv authors.
#
# NVIDIA NIXL as a peer row of `mstar-kv-bench` (bench/mstar-kv-bench, which
# runs `python3 nixl_peer.py initiator BLOCK COUNT ITERS` from the source
# tree): two processes, each with a
# NIXL agent on the UCX backend over DRAM; the target fills a buffer with a
# pattern and hands its agent metadata and buffer address to the initiator
# over a pipe; the initiator prepares the scattered descriptors once (COUNT
# blocks of BLOCK bytes, the remote blocks in a shuffled order), re-posts
# the READ ITERS times, verifies every byte of the last one and prints
# "GBPS <1e9 bytes per second>". Any failure prints "ERROR <why>" and exits 1.
# Agents are never torn down: the process ends with os._exit (the wheel's
# bundled libraries can crash at interpreter exit).
import os
import struct
import subprocess
import sys
import time

# What this process says goes to its stdout as it was at start; anything
# else written to fd 1 afterwards (NIXL's and UCX's logs) goes to stderr.
OUT = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)


def say(line):
    OUT.write(line.encode() + b"\n")
    OUT.flush()


def fail(why):
    say("ERROR %s" % why)
    os._exit(1)


def send(stream, data):
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def recv(stream):
    head = stream.read(4)
    if len(head) != 4:
        fail("the target closed its pipe")
    (n,) = struct.unpack("<I", head)
    return stream.read(n)


def agent(name):
    from nixl._api import nixl_agent, nixl_agent_config
    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def pattern(np, size):
    # Bytes that differ block to block and byte to byte.
    return (np.arange(size, dtype=np.uint64) * 2654435761 >> 7).astype(np.uint8)


def target(size):
    import numpy as np
    a = agent("mstar-nixl-target")
    buf = pattern(np, size)
    a.register_memory([(buf.ctypes.data, size, 0, "")], "DRAM")
    send(OUT, a.get_agent_metadata())
    send(OUT, struct.pack("<QQ", buf.ctypes.data, size))
    sys.stdin.buffer.read()  # until the initiator closes the pipe
    os._exit(0)


def initiator(block, count, iters):
    import nixl._api  # noqa: F401 - missing NIXL is said here, before the target starts
    import numpy as np
    size = block * count
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "target", str(size)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    meta = recv(child.stdout)
    base, remote_size = struct.unpack("<QQ", recv(child.stdout))
    if remote_size != size:
        fail("the target registered %d bytes, not %d" % (remote_size, size))
    a = agent("mstar-nixl-initiator")
    peer = a.add_remote_agent(meta)
    local = np.zeros(size, dtype=np.uint8)
    a.register_memory([(local.ctypes.data, size, 0, "")], "DRAM")
    order = np.random.default_rng(7).permutation(count)
    remote_descs = np.array([(base + int(i) * block, block, 0) for i in order], dtype=np.uint64)
    local_descs = np.array([(local.ctypes.data + j * block, block, 0) for j in range(count)],
                           dtype=np.uint64)
    remote_side = a.prep_xfer_dlist(peer, remote_descs, "DRAM")
    local_side = a.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs, "DRAM")
    idx = np.arange(count, dtype=np.int32)
    for _ in range(100):  # the connection comes up with the first transfers
        if a.check_remote_metadata(peer):
            break
        time.sleep(0.05)
    xfer = a.make_prepped_xfer("READ", local_side, idx, remote_side, idx)

    def once():
        state = a.transfer(xfer)
        while state == "PROC":
            state = a.check_xfer_state(xfer)
        if state != "DONE":
            fail("NIXL READ ended in state %s" % state)

    once()  # warm-up: connection and registration caches
    t0 = time.perf_counter()
    for _ in range(iters):
        once()
    seconds = time.perf_counter() - t0
    want = pattern(np, size).reshape(count, block)[order].reshape(-1)
    if not np.array_equal(local, want):
        fail("the bytes read do not match the target's pattern")
    child.stdin.close()
    say("GBPS %.6f" % (size * iters / seconds / 1e9))
    os._exit(0)


if __name__ == "__main__":
    try:
        if sys.argv[1] == "target":
            target(int(sys.argv[2]))
        else:
            initiator(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    except ImportError as e:
        fail("NIXL is not installed (%s; pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1)" % e)
    except Exception as e:  # noqa: BLE001 - reported to the bench as its reason
        fail("%s: %s" % (type(e).__name__, e))
