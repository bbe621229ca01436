"""``DraftModelProposer``: a smaller model of the target's vocabulary proposes its greedy tokens.

The draft runs beside the target as a second model with its own executor (runner, KV cache,
graphs) and its own ``Scheduler``; each target request that decodes has a mirror request there
holding the same tokens. To propose, the proposer brings every mirror up to its request's tokens
(the tokens both agree on keep their draft KV; ``num_computed_tokens`` moves back to the first
difference, as the target's does past rejected proposals) and runs draft steps, greedy, until
each mirror has ``num_speculative_tokens`` new tokens: the first step computes the tokens the
target accepted since the last call, the others decode one token each. A deterministic draft is a
point mass, so ``RejectionSampler`` verifies its tokens exactly as it does n-gram proposals.
Mirrors of finished requests (``release``) and of requests that stopped decoding are aborted.
Each draft step syncs with the host (its tokens feed the next), so a target step costs up to
``k`` draft steps of host round trips.
"""

from __future__ import annotations

from collections.abc import Sequence

from pieceworks.config import EngineConfig
from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.request import Request, RequestStatus
from pieceworks.scheduler.scheduler import Scheduler
from pieceworks.speculative_config import SpeculativeConfig
from pieceworks.worker.executor import make_executor
from pieceworks.worker.spec_decode.proposer import Proposer


class DraftModelProposer(Proposer):
    """Greedy proposals of a draft model kept in step with the target's requests."""

    skips_steps = False  # its mirrors follow every step (the engine schedules synchronously)

    def __init__(self, config: SpeculativeConfig, draft_config: EngineConfig) -> None:
        super().__init__(config)
        self.executor = make_executor(draft_config)
        max_model_len = draft_config.model_config.max_model_len
        assert max_model_len is not None
        self.scheduler = Scheduler(
            draft_config.scheduler_config,
            draft_config.cache_config,
            max_model_len,
            self.executor.runner.num_blocks,
        )
        self.mirrors: dict[str, Request] = {}

    def propose_requests(self, requests: Sequence[Request]) -> list[list[int]]:
        wanted = {request.request_id for request in requests}
        self._abort([rid for rid in self.mirrors if rid not in wanted])
        starts = [self._sync(request) for request in requests]
        mirrors = [self.mirrors[request.request_id] for request in requests]
        k = self.num_speculative_tokens
        for _ in range(4 * k + 8):  # a catch-up chunk or a preemption can take extra steps
            if all(m.num_output_tokens - s >= k or m.is_finished for m, s in zip(mirrors, starts)):
                break
            self._step()
        return [m.output_token_ids[s : s + k] for m, s in zip(mirrors, starts)]

    def _sync(self, request: Request) -> int:
        """Make the mirror of ``request`` hold its tokens; its output length (where the
        proposals start)."""
        mirror = self.mirrors.get(request.request_id)
        if mirror is None or mirror.is_finished:
            mirror = Request(
                f"draft-{request.request_id}",
                request.prompt_token_ids,
                # Its length limit is the target's: it never proposes past it.
                SamplingParams(
                    temperature=0.0, max_tokens=request.sampling_params.max_tokens, ignore_eos=True
                ),  # fmt: skip
            )
            mirror.output_token_ids = list(request.output_token_ids)
            self.scheduler.add_request(mirror)
            self.mirrors[request.request_id] = mirror
            return mirror.num_output_tokens
        old, new = mirror.output_token_ids, request.output_token_ids
        common = next(
            (i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new))
        )
        mirror.output_token_ids = list(new)
        # Draft KV stays valid up to the first difference; the last token is always recomputed.
        limit = min(mirror.num_prompt_tokens + common, mirror.num_tokens - 1)
        mirror.num_computed_tokens = min(mirror.num_computed_tokens, limit)
        return mirror.num_output_tokens

    def _step(self) -> None:
        output = self.scheduler.schedule()
        if not output.scheduled_requests:
            return
        token_ids = self.executor.execute_async(output).tolist()
        for finished in self.scheduler.update_from_output(output, token_ids):
            self.executor.release(finished.request_id)

    def _abort(self, request_ids: list[str]) -> None:
        mirror_ids = [self.mirrors.pop(request_id).request_id for request_id in request_ids]
        for finished in self.scheduler.finish_requests(mirror_ids, RequestStatus.FINISHED_ABORTED):
            self.executor.release(finished.request_id)

    def release(self, request_id: str) -> None:
        """Abort the mirror of a finished request, freeing its draft KV blocks now."""
        if request_id in self.mirrors:
            self._abort([request_id])

    def shutdown(self) -> None:
        self.executor.shutdown()
