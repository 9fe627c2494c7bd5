"""What the scheduler-side connector tells its workers each step (plain data:
it is pickled to the worker processes)."""
from __future__ import annotations

import dataclasses
from typing import List, Optional

from .params import RemotePrefill


@dataclasses.dataclass
class PublishReq:
    """Producer: publish request ``req_id``'s first ``num_tokens`` tokens,
    held in ``block_ids`` (vLLM keeps them until get_finished reports it)."""
    req_id: str
    block_ids: List[int]
    num_tokens: int
    layers_ready: Optional[int] = None  # None: every layer is written; 0: mark them as saved
    name: str = ""                      # published under (kv_transfer_params' request_id)
    epoch: int = 0                      # stamped on its pages no other publication holds

    def __post_init__(self):
        if not self.name:
            self.name = self.req_id


@dataclasses.dataclass
class UnpublishReq:
    """Producer: a request published early (publish_early) that will not
    finish its prefill as published (aborted, preempted): free it now.
    ``report``: tell vLLM through get_finished (the request finished and
    vLLM waits for its blocks)."""
    req_id: str
    name: str
    report: bool


@dataclasses.dataclass
class LoadReq:
    """Consumer: pull tokens [start, end) of the remote request into the
    request's blocks ``block_ids`` (its whole local block table)."""
    req_id: str
    remote: RemotePrefill
    block_ids: List[int]
    start: int
    end: int


@dataclasses.dataclass
class ReleaseReq:
    """Consumer: nothing to pull (full local prefix hit, or aborted before its
    load started): only tell the producer it may free the blocks."""
    req_id: str
    remote: RemotePrefill


@dataclasses.dataclass
class StepMeta:
    publish: List[PublishReq] = dataclasses.field(default_factory=list)
    load: List[LoadReq] = dataclasses.field(default_factory=list)
    release: List[ReleaseReq] = dataclasses.field(default_factory=list)
    cancel: List[str] = dataclasses.field(default_factory=list)  # loads of aborted requests
    unpublish: List[UnpublishReq] = dataclasses.field(default_factory=list)
    # Nothing is scheduled in this step: the worker may wait for its pulls
    # in get_finished (ConnectorConfig.idle_wait_ms).
    idle: bool = False
