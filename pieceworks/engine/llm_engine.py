"""``LLMEngine``: the step loop joining the scheduler, the model runner and the sampler.

``add_request`` validates and queues; ``step`` schedules one batch, runs it, and feeds the sampled
tokens back; finished requests come back from ``step``. Start-up (load, compile, KV cache, capture)
happens in the constructor and is timed for the report.
"""

from __future__ import annotations

import itertools
import time

from pieceworks.config import EngineConfig
from pieceworks.engine.model_runner import ModelRunner
from pieceworks.engine.request import Request
from pieceworks.engine.sampling_params import SamplingParams
from pieceworks.engine.scheduler import Scheduler
from pieceworks.logger import init_logger

logger = init_logger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        num_blocks = self.runner.initialize_kv_cache()
        self.runner.capture_model()
        max_model_len = config.model_config.max_model_len
        assert max_model_len is not None
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            max_model_len,
            num_blocks,
            num_state_slots=self.runner.num_state_slots,  # Mamba state slots (hybrid models)
        )
        self.eos_token_id = config.model_config.hf_config.get("eos_token_id")
        if isinstance(self.eos_token_id, list):
            self.eos_token_id = self.eos_token_id[0]
        self._request_ids = itertools.count()
        # (uniform decode?, number of requests, wall seconds) of each step
        self.step_seconds: list[tuple[bool, int, float]] = []

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Request:
        """Queue a request; one that can never fit raises ValueError saying why."""
        vocab_size = self.config.model_config.hf_config.get("vocab_size")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size}) for this model")
        request = Request(
            request_id=request_id or str(next(self._request_ids)),
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_id=self.eos_token_id,
        )
        self.scheduler.add_request(request)
        return request

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[Request]:
        """Run one scheduled batch; return the requests that finished in it."""
        start = time.perf_counter()
        output = self.scheduler.schedule()
        if not output.scheduled_requests:
            self.scheduler.update_from_output(output, [])
            return []
        sampled = self.runner.execute(output)  # returns after the step's one host sync
        finished = self.scheduler.update_from_output(output, sampled)
        for request in finished:
            self.runner.release(request.request_id)
        self.step_seconds.append(
            (output.is_uniform_decode, output.num_requests, time.perf_counter() - start)
        )
        return finished
