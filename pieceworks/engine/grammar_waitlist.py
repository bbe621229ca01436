"""``GrammarWaitlist``: constrained requests waiting outside the scheduler for the grammar compiler.

Building xgrammar's compiler loads the tokenizer and reads its whole vocabulary: seconds for
SmolLM2's 49,152 tokens. The engine loop does not hold every stream for that. A structured-output
request that arrives before the compiler exists is kept here (``EngineCore.add_request(...,
defer_grammar=True)``) while ``StructuredOutputManager`` builds the compiler on a thread and the
engine steps the other requests. Once the build ends, ``admit`` compiles each waiting request's
grammar and queues it in the scheduler. A request whose grammar fails, or every waiting request
when the build itself failed, is finished and its reason kept for ``take_failed``; the engine
loop sends that reason as the request's error, which the server answers with a 400.
"""

from __future__ import annotations

from pieceworks.scheduler.request import Request, RequestStatus
from pieceworks.scheduler.scheduler import Scheduler
from pieceworks.worker.structured_output import StructuredOutputManager

# How long a step with nothing to run but waiting requests waits for the compiler before it
# returns to the engine loop (which then reads new commands).
GRAMMAR_WAIT_SECONDS = 0.005


class GrammarWaitlist:
    """The requests waiting for the grammar compiler, and the reasons of those that failed."""

    def __init__(self, structured_output: StructuredOutputManager) -> None:
        self.structured_output = structured_output
        self._waiting: dict[str, Request] = {}
        self._failed: list[tuple[str, str]] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, request: Request) -> None:
        """Keep ``request`` until the compiler is built, starting its build if needed."""
        self._waiting[request.request_id] = request
        self.structured_output.build_compiler_in_background()

    def finish(self, request_id: str, status: RequestStatus) -> bool:
        """Finish a waiting request (an abort or a stop); False if none has that id."""
        request = self._waiting.pop(request_id, None)
        if request is None:
            return False
        request.finish(status)
        return True

    def admit(self, scheduler: Scheduler) -> None:
        """Once the build has ended, queue each waiting request with its grammar compiled."""
        if not self._waiting or self.structured_output.compiler_building:
            return
        waiting, self._waiting = self._waiting, {}
        try:
            self.structured_output.compiler  # noqa: B018 (raises the build's error, if any)
        except Exception as error:  # e.g. ValueError: the model has no tokenizer
            for request in waiting.values():
                self._fail(request, error)
            return
        for request in waiting.values():
            constraint = request.sampling_params.structured_outputs
            assert constraint is not None  # only constrained requests wait here
            try:
                self.structured_output.compile(constraint)
            except ValueError as error:  # naming the problem
                self._fail(request, error)
                continue
            scheduler.add_request(request)

    def wait(self) -> None:
        """Wait a little for the build (a step with nothing else to run), rather than spin."""
        self.structured_output.wait_for_compiler(GRAMMAR_WAIT_SECONDS)

    def take_failed(self) -> list[tuple[str, str]]:
        """(request id, reason) of each request finished since the last call because its
        grammar did not compile; nothing was generated for them."""
        failed, self._failed = self._failed, []
        return failed

    def _fail(self, request: Request, error: Exception) -> None:
        request.finish(RequestStatus.FINISHED_ABORTED)
        self._failed.append((request.request_id, str(error)))
