"""A prefill worker for test_vllm_worker.py: MstarKVConnector's worker side
(kv_producer) over vLLM's own KV tensors, in its own process. It fills a
request's blocks with block_values, publishes them (metadata as the
scheduler sends it), prints READY, then runs get_finished until stdin
closes, printing FREED once the request is freed. On stdin, "seq" prints SEQ
and the published SequenceInfo (base64), "served" prints SERVED and what its
engine served (the stats' "served" part, JSON).

  python vllm_worker_peer.py MODEL_DIR PORT LAYOUT BLOCKS TOKENS SEED [TP_RANK TP_SIZE]
  python vllm_worker_peer.py --zygote SOCKET

--zygote imports vLLM, torch and mstar_kv once (about 25 s of the tests'
time per peer on a loaded 2-core VM) and forks a peer for each request on
SOCKET: a JSON {"argv": [...], "env": {...}} with the peer's stdin and
stdout passed as file descriptors; it answers the child's pid. Nothing but
imports runs before a fork (no tensor op: no thread pool to inherit).
"""
import os
import sys
from pathlib import Path


def main():
    model, port, layout, blocks, tokens, seed = sys.argv[1:7]
    tp_rank, tp_size = (int(x) for x in (sys.argv[7:9] or ["0", "1"]))
    sys.path.insert(0, str(Path(__file__).parent))
    import vllm_kit as K
    from mstar_kv.integrations.vllm import MstarConnectorMetadata, MstarKVConnector
    from mstar_kv.integrations.vllm import connector as conn_mod
    from mstar_kv.integrations.vllm.metadata import PublishReq, StepMeta
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    extra = {"side_channel_port": int(port), "lease_s": float(os.environ.get("PEER_LEASE_S", "300")),
             "cell_layout": os.environ.get("PEER_CELL_LAYOUT", "kv_cells")}
    cfg = K.make_vllm_config(Path(model), "kv_producer", extra, K.PRODUCER_BS, layout=layout)
    conn_mod._tp = lambda _c: (tp_rank, tp_size)
    c = MstarKVConnector(cfg, KVConnectorRole.WORKER, K.kv_cache_config(cfg, 1))
    # An MLA latent is the same on every TP rank: each rank holds it whole.
    mla = bool(cfg.model_config.use_mla)
    heads = 1 if mla else 2 // tp_size
    if tp_size == 1 or mla:
        kv = K.vllm_kv_tensors(cfg, 64)
    else:  # a TP rank's tensors hold its heads only (layer-major HND, as LBHNC)
        import torch
        base = torch.zeros(2, 64, heads, K.PRODUCER_BS, 128, dtype=torch.bfloat16)
        kv = {f"model.layers.{i}.self_attn.attn": base[i] for i in range(2)}
    c.register_kv_caches(kv)
    block_ids = [int(b) for b in blocks.split(",")]
    n = int(tokens)
    names = sorted(kv, key=lambda x: kv[x].data_ptr())
    cell = int(kv[names[0]].shape[3])
    for li, name in enumerate(names):
        for j, b in enumerate(block_ids):
            vals = K.block_values(int(seed), li, j, 1 if mla else 2, K.PRODUCER_BS, cell)
            kv[name][b].copy_(vals if mla else vals[tp_rank * heads:(tp_rank + 1) * heads])
    layerwise = os.environ.get("PEER_LAYERWISE") == "1"
    c.bind_connector_metadata(MstarConnectorMetadata(StepMeta(publish=[
        PublishReq("p1", block_ids, n, 0 if layerwise else None)])))
    print("READY", flush=True)
    if layerwise:  # marks layer l once the test says "next" (as save_kv_layer would)
        for layer in range(len(names)):
            sys.stdin.readline()
            c.producer.mark_layers_ready("p1", layer + 1)
            print(f"MARKED {layer}", flush=True)
    import select
    freed = False
    while True:  # until stdin closes (it still answers the commands once freed)
        sending, _ = c.get_finished({"p1"})
        if sending and "p1" in sending and not freed:
            print("FREED", flush=True)
            freed = True
        r, _, _ = select.select([sys.stdin], [], [], 0.01)
        if not r:
            continue
        cmd = sys.stdin.readline()
        if not cmd:
            break
        if cmd.strip() == "seq" and not freed:
            import base64
            print("SEQ " + base64.b64encode(c.producer._lookup("p1", True)).decode(), flush=True)
        elif cmd.strip() == "served":
            import json
            print("SERVED " + json.dumps(c.manager.stats()["served"]), flush=True)
    c.shutdown()


def zygote(sock_path):
    import json
    import signal
    import socket
    import traceback
    sys.path.insert(0, str(Path(__file__).parent))
    import vllm.config  # noqa: F401
    import vllm.v1.worker.utils  # noqa: F401
    import vllm_kit  # noqa: F401
    from mstar_kv.integrations.vllm import connector  # noqa: F401  (vLLM's connector base)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the peers
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(16)
    print("READY", flush=True)
    while True:
        conn, _ = srv.accept()
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
        req = json.loads(msg)
        pid = os.fork()
        if pid == 0:
            srv.close()
            conn.close()
            os.dup2(fds[0], 0)
            os.dup2(fds[1], 1)
            for fd in fds:
                os.close(fd)
            os.environ.clear()
            os.environ.update(req["env"])
            sys.argv = req["argv"]
            code = 0
            try:
                main()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            os._exit(code)
        for fd in fds:
            os.close(fd)
        conn.sendall(str(pid).encode())
        conn.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--zygote"]:
        zygote(sys.argv[2])
    else:
        main()
