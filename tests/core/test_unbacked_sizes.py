"""A piece whose op returns a data-dependent (unbacked) size compiles, with either backend.

Between two splitting ops the toy model calls ``silly_unbacked::positive_rows``, whose fake
implementation returns a tensor of ``ctx.new_dynamic_size()`` rows: the piece holds a size known
only when it runs; in the second model that size crosses the splitting op into the next piece.
Running the split module on fake tensors to find each piece's example inputs creates that size's
symbol again; it must not be left pending in the shape environment, where Inductor's compile of
the piece (retracing under the same environment) would look for it in vain
(``PendingUnbackedSymbolNotFound``). The compiled model matches the eager one.

Run: pytest tests/core/test_unbacked_sizes.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.library import Library

from pieceworks.config import EngineConfig, SchedulerConfig
from pieceworks.core.config import CompilationConfig, CUDAGraphMode
from pieceworks.core.counters import compilation_counter
from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.core.decorators import support_torch_compile
from tests.core.test_piecewise import device, run
from tests.core.toy_model import SILLY_OP, silly_attention_op

pytestmark = pytest.mark.platform_agnostic
unbacked_lib = Library("silly_unbacked", "FRAGMENT")


def _positive_rows(x: torch.Tensor) -> torch.Tensor:
    return x[x[:, 0] > 0]


def _positive_rows_fake(x: torch.Tensor) -> torch.Tensor:
    num_rows = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty((num_rows, x.shape[1]))


def positive_rows_op():
    return direct_register_custom_op(
        "positive_rows",
        _positive_rows,
        mutates_args=[],
        fake_impl=_positive_rows_fake,
        target_lib=unbacked_lib,
    )


@support_torch_compile
class DataDependentModel(nn.Module):
    """linear, silly attention (split), the positive rows' sum added to every row, attention."""

    def __init__(self, *, config: EngineConfig, prefix: str = "", hidden_size: int = 8) -> None:
        super().__init__()
        self.attention = silly_attention_op()
        self.positive_rows = positive_rows_op()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        out = torch.empty_like(x)
        self.attention(x, x, x, out)
        x = out + self.positive_rows(out).sum(dim=0)  # (T, H) + (H,): the unbacked rows summed
        out = torch.empty_like(x)
        self.attention(x, x, x, out)
        return out * 0.5


@support_torch_compile
class CrossingModel(nn.Module):
    """linear, the positive rows, attention over them (split): the unbacked size crosses it."""

    def __init__(self, *, config: EngineConfig, prefix: str = "", hidden_size: int = 8) -> None:
        super().__init__()
        self.attention = silly_attention_op()
        self.positive_rows = positive_rows_op()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        rows = self.positive_rows(x)  # (u0, H)
        out = torch.empty_like(rows)
        self.attention(rows, rows, rows, out)
        return x + out.sum(dim=0)


MODELS = {"between": (DataDependentModel, 3), "crossing": (CrossingModel, 2)}


def make_model(
    level: int, backend: str = "eager", name: str = "between"
) -> tuple[EngineConfig, nn.Module]:
    compilation = CompilationConfig(
        level=level,
        backend=backend,
        splitting_ops=[SILLY_OP],
        cudagraph_mode=CUDAGraphMode.NONE,
    )
    config = EngineConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=4), compilation_config=compilation
    )
    torch.manual_seed(0)
    model = MODELS[name][0](config=config).to(device()).requires_grad_(False)
    return config, model


def check_against_eager(backend: str, name: str) -> None:
    config, model = make_model(3, backend, name)
    eager_config, eager_model = make_model(0, name=name)
    # One capturable piece before, between and after the splitting ops.
    num_pieces = MODELS[name][1]
    with compilation_counter.expect(num_graphs_seen=1, num_backend_compilations=num_pieces):
        for num_tokens in (4, 3):
            x = torch.randn(num_tokens, 8, device=device())
            expected = run(eager_model, eager_config, x)
            torch.testing.assert_close(run(model, config, x), expected)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_unbacked_size_compiles_with_the_eager_backend(name):
    check_against_eager("eager", name)


@pytest.mark.inductor
@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_unbacked_size_compiles_with_inductor(name):
    import torch._inductor.config

    # A cached piece skips the retrace that looks for the symbol's binding: compile for real.
    with torch._inductor.config.patch(force_disable_caches=True):
        check_against_eager("inductor", name)
