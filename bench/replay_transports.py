"""How a replay worker's cache is served and pulled: mstar_kv's engines (shm,
ucx, and Mooncake's wheel TransferEngine under mstar_kv's wheel engine) and
NIXL's Python agent (host memory, UCX backend), the same pages either way.

A transport has `cache`, `num_pages`, `token_bytes`, `pool` (prefill),
`publish(seq_id)`, `ready_info()`, `add_peer(msg)` and `pull(msg, runs)`
-> (bytes, None) or (0, why); `runs` are (first token, end token, local
pages) of the request, block aligned."""
import math
import time

import mstar_kv as kv
import replay_common as rc


def layout(cfg):
    return kv.KVLayout(cfg["layers"], cfg["pages"], rc.PAGE_SIZE, rc.KV_HEADS, rc.HEAD_DIM,
                       dtype="bf16")


def new_cache(cfg, memory):
    """A cache whose every page is written once before the replay starts, as
    an engine's is (torch.zeros): a host cache is mapped lazily, in huge
    pages where the kernel has them, and the first write to each would
    otherwise land inside a pull, a page fault that compacts memory for
    tens of milliseconds once free huge pages run out."""
    cache = kv.KVCache(layout(cfg), memory)
    cache.fill_pattern(0, list(range(cfg["pages"])), 0, cfg["pages"] * rc.PAGE_SIZE)
    return cache


class MstarTransport:
    def __init__(self, cfg):
        self.cfg = cfg
        self.num_pages = cfg["pages"]
        self.token_bytes = rc.token_bytes(cfg["layers"])
        name = f"{cfg['role']}-{cfg['index']}"
        engine = cfg["engine"]
        # The shm engine serves a shared cache by mapping it (a private one by
        # cross-memory attach); the network engines read host memory.
        memory = "shared" if engine == "shm" and cfg["role"] == "prefill" else "host"
        self.cache = new_cache(cfg, memory)
        if engine == "mooncake":
            from mooncake.engine import TransferEngine
            self.te = TransferEngine()
            if self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
                raise SystemExit("Mooncake TransferEngine.initialize failed")
            info = kv.MooncakeKVTransferEngine(self.cache, name, self.te,
                                               timeout=cfg["timeout"])
        else:
            info = kv.TransferEngineInfo(name, "", engine,
                                         {"timeout": cfg["timeout"], **cfg.get("engine_opts", {})})
        self.manager = kv.KVTransferManager(info, self.cache)
        self.pool = kv.KVCachePool(self.cache, self.manager, lease=0)

    def ready_info(self):
        return {}

    def add_peer(self, m):
        pass

    def publish(self, seq_id):
        return self.pool.publish(seq_id).to_bytes().hex()

    def pull(self, m, runs):
        seq = kv.SequenceInfo.from_bytes(bytes.fromhex(m["seq"]))
        futures, err = [], None
        for start, end, local in runs:
            remote = seq.page_indices[start // rc.PAGE_SIZE: math.ceil(end / rc.PAGE_SIZE)]
            try:
                futures.append(self.manager.start_async_retrieve(
                    0, end - start, local, remote, seq.kv_transfer_info))
            except Exception as e:  # noqa: BLE001 - a refusal before any byte moves
                err = f"{type(e).__name__}: {e}"
                break
        nbytes = 0
        # Every issued read is waited for, failed or not: its pages go back to
        # the free list only once no byte of it can land.
        for f in futures:
            try:
                nbytes += f.result()
            except Exception as e:  # noqa: BLE001 - the read's error, reported
                err = err or f"{type(e).__name__}: {e}"
        return (0, err) if err else (nbytes, None)


class NixlTransport:
    """The same cache (an mstar_kv KVCache, layer-major NHD, so every (layer,
    k|v, page) is one run of page bytes) registered with a NIXL agent; a pull
    is one READ of the request's runs, coalesced where both sides' pages are
    consecutive, each page clipped to its tokens as mstar_kv's planner
    clips."""

    def __init__(self, cfg):
        from nixl._api import nixl_agent, nixl_agent_config
        self.cfg = cfg
        self.num_pages = cfg["pages"]
        self.layers = cfg["layers"]
        self.token_bytes = rc.token_bytes(cfg["layers"])
        self.cache = new_cache(cfg, "host")
        self.pool = kv.KVCachePool(self.cache, None, lease=0)
        self.agent = nixl_agent(f"{cfg['role']}-{cfg['index']}",
                                nixl_agent_config(backends=["UCX"]))
        (self.base, size), = self.cache.regions
        self.agent.register_memory([(self.base, size, 0, "")], "DRAM")
        self.peers = {}  # prefill index -> (agent name, base address, pages)

    def ready_info(self):
        return {"meta": self.agent.get_agent_metadata().hex(), "base": self.base,
                "pages": self.num_pages}

    def add_peer(self, m):
        name = self.agent.add_remote_agent(bytes.fromhex(m["meta"]))
        self.peers[m["prefill"]] = (name, m["base"], m["pages"])

    def publish(self, seq_id):
        return ""

    def _offset(self, num_pages, layer, k, page):
        return ((layer * 2 + k) * num_pages + page) * (rc.PAGE_SIZE * rc.KV_HEADS
                                                       * rc.HEAD_DIM * rc.BF16)

    def _descs(self, m, runs):
        import numpy as np
        name, rbase, rpages = self.peers[m["prefill"]]
        row = rc.KV_HEADS * rc.HEAD_DIM * rc.BF16
        table = m["pages"]
        pairs = []  # (remote page, local page, bytes)
        for start, end, local in runs:
            for j, lp in enumerate(local):
                t = start + j * rc.PAGE_SIZE
                pairs.append((table[t // rc.PAGE_SIZE], lp, min(rc.PAGE_SIZE, end - t) * row))
        full = rc.PAGE_SIZE * row
        rem, loc = [], []
        for layer in range(self.layers):
            for k in (0, 1):
                for rp, lp, n in pairs:
                    ra = rbase + self._offset(rpages, layer, k, rp)
                    la = self.base + self._offset(self.num_pages, layer, k, lp)
                    if (rem and rem[-1][0] + rem[-1][1] == ra and loc[-1][0] + loc[-1][1] == la
                            and rem[-1][1] % full == 0):
                        rem[-1][1] += n
                        loc[-1][1] += n
                    else:
                        rem.append([ra, n, 0])
                        loc.append([la, n, 0])
        return (name, np.array(rem, dtype=np.uint64), np.array(loc, dtype=np.uint64),
                sum(x[1] for x in rem))

    def pull(self, m, runs):
        name, rem, loc, nbytes = self._descs(m, runs)
        a = self.agent
        h = a.initialize_xfer("READ", a.get_xfer_descs(loc, "DRAM"),
                              a.get_xfer_descs(rem, "DRAM"), name)
        try:
            deadline = time.monotonic() + self.cfg["timeout"]
            state = a.transfer(h)
            while state == "PROC":
                if time.monotonic() > deadline:
                    return 0, f"NIXL READ still in progress after {self.cfg['timeout']} s"
                state = a.check_xfer_state(h)
            if state != "DONE":
                return 0, f"NIXL READ ended in state {state}"
            return nbytes, None
        finally:
            a.release_xfer_handle(h)


def make(cfg):
    return NixlTransport(cfg) if cfg["engine"] == "nixl" else MstarTransport(cfg)
