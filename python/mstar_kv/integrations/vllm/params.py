"""The connector's configuration (kv_connector_extra_config) and its
kv_transfer_params, with no vLLM import.

kv_transfer_params of a request the prefill engine finished (returned by
request_finished, passed to the decode engine with the request)::

    {"do_remote_prefill": True, "do_remote_decode": False,
     "mstar": {"v": 1, "engine": "ucx", "request_id": "<prefill request id>",
               "host": "10.0.0.5", "port": 25600, "tp_size": 1,
               "block_size": 32, "num_tokens": 57, "lease_s": 60.0,
               "cell_layout": "kv_planes"}}

``cell_layout`` says how the prefill engine's attention backend stores K
and V in a block (layout.py); the decode engine must store them alike.
``host``/``port`` is the side channel of the prefill engine's worker of TP
rank 0 (rank r listens on port + r). The decode worker asks each prefill
rank it reads from for the published sequence of ``request_id`` (the
mstar-kv SequenceInfo bytes: page table, cache descriptor with the pages'
epoch, lease), pulls with mstar-kv, and sends a done notice over the same
channel. A prefill request is sent with ``{"do_remote_decode": True}``.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
from typing import Any, Mapping, Optional, Sequence

PARAMS_VERSION = 1
# The descriptor and page table travel in the params only up to these sizes
# (a long prompt's table, a wide TP): beyond them the decode asks the side
# channel, as it does for params without them.
MAX_PARAMS_PAGES = 8192
MAX_PARAMS_DESC_BYTES = 16384
KNOWN_ENGINES = ("ucx", "shm", "cuda_ipc", "mooncake")
CELL_LAYOUTS = ("kv_cells", "kv_planes", "latent")


class ConfigError(ValueError):
    """A bad kv_connector_extra_config or kv_transfer_params value (names it)."""


def _num(d: Mapping[str, Any], key: str, default, kind, lo, hi, where: str):
    v = d.get(key, default)
    try:
        v = kind(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}[{key!r}] = {d.get(key)!r} is not a {kind.__name__}") from None
    if not lo <= v <= hi:
        raise ConfigError(f"{where}[{key!r}] = {v} out of range [{lo}, {hi}]")
    return v


def _choice(d: Mapping[str, Any], key: str, default, allowed, where: str):
    v = d.get(key, default)
    if v not in allowed:
        raise ConfigError(f"{where}[{key!r}] = {v!r} is not one of {allowed}")
    return v


@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
    """kv_connector_extra_config, validated.

    engine            mstar-kv transfer engine: 'ucx' (default; any host,
                      TCP or RDMA), 'shm' (same host, CPU caches), 'cuda_ipc'
                      (same host, GPU caches), 'mooncake'.
    host              address this engine's side channel (and the ucx
                      listener) binds and advertises (default 127.0.0.1).
    side_channel_port base port of the producer's side channel: TP rank r
                      listens on port + r (default 25600).
    lease_s           seconds a producer keeps a finished request's blocks
                      for its reader before freeing them (default 60).
    fetch_timeout_s   seconds a consumer waits for the producer's published
                      sequence (default 10).
    transfer_timeout_s engine timeout of one pull (default 30).
    max_workers       the engine's copy threads (default 3).
    layerwise         consumer: pull with start_streaming_retrieve (layer by
                      layer as the owner marks them) instead of one pull.
    engine_options    extra engine settings (str -> str), e.g. ucx_mode,
                      auth_token.
    cell_layout       'auto' (default: 'latent' for an MLA model, else
                      'kv_planes' on the CPU backend, 'kv_cells' elsewhere),
                      or one of them to force it (layout.py).
    prefill_peers     consumer: the prefill engines to stay connected to, as
                      "HOST:PORT" of each one's side channel (its host and
                      side_channel_port). The decode worker connects to them
                      when it starts, in the background, and keeps the
                      connection (reconnecting after a prefill restarts), so
                      that the first pull from them costs what a later one
                      does (default none: a prefill engine is kept connected
                      from its first pull on).
    publish_early     accepted for older configs; always on now: a
                      remote-decode request is published when its last prompt
                      chunk is scheduled, before the forward pass, with no
                      layer ready, and each layer is marked ready in
                      save_kv_layer: a reader streaming it (layerwise) pulls
                      layer l while the prefill computes layer l + 1, and the
                      params of a finished request name pages that are
                      published already.
    idle_wait_ms      consumer: in a step with nothing scheduled (vLLM runs
                      one, then sleeps 1 ms, while requests wait for their
                      KV), how long get_finished waits for a pull in flight
                      to end, so that the step reports it instead of a later
                      one (default 2; 0: never wait). A step that computes
                      anything never waits.
    state_staging_pages consumer, a Mamba state from prefill engines of
                      another TP size: pages of the staging cache each
                      worker allocates at its first such load (state_move.py;
                      a load takes one per source rank, and waits up to
                      transfer_timeout_s for them; default 8).
    """

    engine: str = "ucx"
    host: str = "127.0.0.1"
    side_channel_port: int = 25600
    lease_s: float = 60.0
    fetch_timeout_s: float = 10.0
    transfer_timeout_s: float = 30.0
    max_workers: int = 3
    layerwise: bool = False
    engine_options: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cell_layout: str = "auto"
    publish_early: bool = False
    prefill_peers: tuple = ()  # ((host, port), ...)
    state_staging_pages: int = 8
    idle_wait_ms: float = 2.0

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]]) -> "ConnectorConfig":
        extra = dict(extra or {})
        where = "kv_connector_extra_config"
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"{where} has unknown keys {unknown} (known: {sorted(known)})")
        engine = str(extra.get("engine", "ucx"))
        if engine not in KNOWN_ENGINES:
            raise ConfigError(f"{where}['engine'] = {engine!r} is not one of {KNOWN_ENGINES}")
        opts = extra.get("engine_options", {}) or {}
        if not isinstance(opts, Mapping):
            raise ConfigError(f"{where}['engine_options'] must be a dict, not {type(opts).__name__}")
        return cls(
            engine=engine,
            host=str(extra.get("host", "127.0.0.1")),
            side_channel_port=_num(extra, "side_channel_port", 25600, int, 1, 65535, where),
            lease_s=_num(extra, "lease_s", 60.0, float, 0.1, 86400.0, where),
            fetch_timeout_s=_num(extra, "fetch_timeout_s", 10.0, float, 0.01, 3600.0, where),
            transfer_timeout_s=_num(extra, "transfer_timeout_s", 30.0, float, 0.01, 3600.0,
                                    where),
            max_workers=_num(extra, "max_workers", 3, int, 1, 256, where),
            layerwise=bool(extra.get("layerwise", False)),
            engine_options={str(k): str(v) for k, v in opts.items()},
            cell_layout=_choice(extra, "cell_layout", "auto", ("auto",) + CELL_LAYOUTS, where),
            publish_early=bool(extra.get("publish_early", False)),
            prefill_peers=_peers(extra.get("prefill_peers", ()), where),
            state_staging_pages=_num(extra, "state_staging_pages", 8, int, 1, 4096, where),
            idle_wait_ms=_num(extra, "idle_wait_ms", 2.0, float, 0.0, 1000.0, where),
        )


def _peers(value, where: str) -> tuple:
    """kv_connector_extra_config['prefill_peers']: "HOST:PORT" strings."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}['prefill_peers'] = {value!r} is not a list of "
                          "\"HOST:PORT\" strings")
    if len(value) > 1024:
        raise ConfigError(f"{where}['prefill_peers'] has {len(value)} entries, at most 1024")
    out = []
    for v in value:
        host, _, port = str(v).rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not host or len(host) > 255 or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(f"{where}['prefill_peers'] entry {v!r} is not \"HOST:PORT\" "
                              "(a side channel's host and port in [1, 65535])")
        if (host, int(port)) not in out:
            out.append((host, int(port)))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class RemotePrefill:
    """What a decode engine needs to pull a request's KV (parsed params)."""

    engine: str
    request_id: str
    host: str
    port: int
    tp_size: int
    block_size: int
    num_tokens: int
    lease_s: float
    cell_layout: str = "kv_cells"
    # What the decode needs to pull without asking the producer first (all
    # or none): each prefill rank's cache descriptor, the published pages,
    # the sequence's own epoch and the pages that keep an older one (shared
    # with an earlier publication: prefix caching).
    descs: tuple = ()
    pages: tuple = ()
    epoch: int = 0
    page_epochs: tuple = ()
    # Several KV cache groups (hybrid models, groups.py): per group (name,
    # first block index, page count); ``pages`` and the published sequence
    # hold the groups' pages one group after another.
    groups: tuple = ()
    # A state group's conv state layout on the prefill ("DS", "SD"; "" when
    # it has none or does not say): a state is moved only into the same.
    conv_layout: str = ""

    @property
    def direct(self) -> bool:
        """The params carry the descriptors: no side-channel round trip."""
        return bool(self.descs)

    def rank_address(self, rank: int) -> tuple:
        return self.host, self.port + rank


def make_decode_params(cfg: ConnectorConfig, request_id: str, tp_size: int, block_size: int,
                       num_tokens: int, cell_layout: str = "kv_cells",
                       descs: Sequence[bytes] = (), pages: Sequence[int] = (), epoch: int = 0,
                       page_epochs: Sequence[tuple] = (), groups: Sequence = (),
                       conv_layout: str = "") -> dict:
    """The kv_transfer_params a producer returns for a finished request.

    With ``descs`` (one cache descriptor per prefill TP rank), ``pages``
    and ``epoch`` the params say everything a pull needs, and the decode
    starts it at once; they are left out when they do not fit."""
    m = {
        "v": PARAMS_VERSION, "engine": cfg.engine, "request_id": str(request_id),
        "host": cfg.host, "port": cfg.side_channel_port, "tp_size": int(tp_size),
        "block_size": int(block_size), "num_tokens": int(num_tokens),
        "lease_s": cfg.lease_s, "cell_layout": cell_layout,
    }
    if groups:
        m["groups"] = [[str(n), int(f), int(c)] for n, f, c in groups]
    if conv_layout:
        m["conv_layout"] = conv_layout
    if (descs and epoch and len(descs) == tp_size and len(pages) <= MAX_PARAMS_PAGES
            and all(len(d) <= MAX_PARAMS_DESC_BYTES for d in descs)):
        m["descs"] = [base64.b64encode(bytes(d)).decode() for d in descs]
        m["pages"] = [int(p) for p in pages]
        m["epoch"] = int(epoch)
        m["page_epochs"] = [[int(p), int(e)] for p, e in page_epochs]
    return {"do_remote_prefill": True, "do_remote_decode": False, "mstar": m}


def _direct(m: Mapping[str, Any], tp_size: int, where: str) -> dict:
    """The optional direct-pull fields of params['mstar'], checked (the
    bytes themselves are checked again by mstar-kv when decoded)."""
    if "descs" not in m:
        return {}
    descs, pages, pe = m.get("descs"), m.get("pages"), m.get("page_epochs", [])
    if not isinstance(descs, list) or len(descs) != tp_size:
        raise ConfigError(f"{where}['descs'] must be a list of {tp_size} descriptors (one per "
                          f"prefill rank), not {type(descs).__name__} of "
                          f"{len(descs) if isinstance(descs, list) else '?'}")
    out = []
    for i, d in enumerate(descs):
        if not isinstance(d, str) or len(d) > MAX_PARAMS_DESC_BYTES * 4 // 3 + 4:
            raise ConfigError(f"{where}['descs'][{i}] is not a base64 string of at most "
                              f"{MAX_PARAMS_DESC_BYTES} bytes")
        try:
            out.append(base64.b64decode(d, validate=True))
        except (binascii.Error, ValueError):
            raise ConfigError(f"{where}['descs'][{i}] is not base64") from None
    if not isinstance(pages, list) or len(pages) > MAX_PARAMS_PAGES or \
            not all(isinstance(p, int) and 0 <= p < 1 << 32 for p in pages):
        raise ConfigError(f"{where}['pages'] must be a list of at most {MAX_PARAMS_PAGES} "
                          "page numbers in [0, 2^32)")
    epoch = _num(m, "epoch", None, int, 1, (1 << 64) - 1, where)
    if not isinstance(pe, list) or len(pe) > len(pages) or not all(
            isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) for v in x)
            and 0 <= x[0] < 1 << 32 and 1 <= x[1] < 1 << 64 for x in pe):
        raise ConfigError(f"{where}['page_epochs'] must be a list of at most {len(pages)} "
                          "[page, epoch] pairs (epoch >= 1)")
    return dict(descs=tuple(out), pages=tuple(pages), epoch=epoch,
                page_epochs=tuple((x[0], x[1]) for x in pe))


def _groups(m: Mapping[str, Any], where: str) -> tuple:
    """params['mstar']['groups'], checked: [[name, first block, pages], ...]."""
    g = m.get("groups")
    if g is None:
        return ()
    if not isinstance(g, list) or not 1 <= len(g) <= 64 or not all(
            isinstance(x, list) and len(x) == 3 and isinstance(x[0], str) and len(x[0]) <= 64
            and all(isinstance(v, int) and 0 <= v < 1 << 32 for v in x[1:]) for x in g):
        raise ConfigError(f"{where}['groups'] must be a list of 1 to 64 [name, first block, "
                          "page count] triples")
    if sum(x[2] for x in g) > MAX_PARAMS_PAGES * 64:
        raise ConfigError(f"{where}['groups'] name more than {MAX_PARAMS_PAGES * 64} pages")
    return tuple((x[0], x[1], x[2]) for x in g)


def published_name(params: Optional[Mapping[str, Any]], req_id: str) -> str:
    """The name a prefill request's KV is published under: the client's
    ``mstar_request_id`` when it chose one (so that a proxy can send the
    decode request at once, with params it made itself, and the decode
    streams the prefill as it runs), else vLLM's request id. Raises
    ConfigError for a malformed name."""
    name = (params or {}).get("mstar_request_id")
    if name is None:
        return str(req_id)
    if not isinstance(name, str) or not name or len(name) > 1024:
        raise ConfigError(f"kv_transfer_params['mstar_request_id'] = {name!r} is not a "
                          "non-empty string of at most 1024 characters")
    return name


def parse_remote_prefill(params: Optional[Mapping[str, Any]]) -> Optional[RemotePrefill]:
    """RemotePrefill of a request's kv_transfer_params, or None when the
    request has no remote prefill to load. Raises ConfigError naming the
    field when the params are malformed (untrusted input: they come from a
    client or a proxy)."""
    if not params or not params.get("do_remote_prefill"):
        return None
    m = params.get("mstar")
    where = "kv_transfer_params['mstar']"
    if not isinstance(m, Mapping):
        raise ConfigError(f"{where} is missing or not a dict (do_remote_prefill is set)")
    if m.get("v") != PARAMS_VERSION:
        raise ConfigError(f"{where}['v'] = {m.get('v')!r}, this connector reads {PARAMS_VERSION}")
    engine = m.get("engine")
    if engine not in KNOWN_ENGINES:
        raise ConfigError(f"{where}['engine'] = {engine!r} is not one of {KNOWN_ENGINES}")
    rid = m.get("request_id")
    host = m.get("host")
    if not isinstance(rid, str) or not rid or len(rid) > 1024:
        raise ConfigError(f"{where}['request_id'] = {rid!r} is not a non-empty string")
    if not isinstance(host, str) or not host or len(host) > 255:
        raise ConfigError(f"{where}['host'] = {host!r} is not a host name")
    tp_size = _num(m, "tp_size", None, int, 1, 1024, where)
    return RemotePrefill(
        engine=engine, request_id=rid, host=host,
        port=_num(m, "port", None, int, 1, 65535, where),
        tp_size=tp_size,
        block_size=_num(m, "block_size", None, int, 1, 1 << 20, where),
        num_tokens=_num(m, "num_tokens", None, int, 0, 1 << 40, where),
        lease_s=_num(m, "lease_s", 60.0, float, 0.0, 1e9, where),
        cell_layout=_choice(m, "cell_layout", "kv_cells", CELL_LAYOUTS, where),
        groups=_groups(m, where),
        conv_layout=_choice(m, "conv_layout", "", ("", "DS", "SD"), where),
        **_direct(m, tp_size, where),
    )
