"""CPU host time of the decode path's Python: the attention layer's body and ``StepInputs``.

No device is needed. The Triton kernels are replaced by stubs whose launch does nothing, so the
attention rows time only pieceworks' own wrapper code (signature, plan lookup, argument
marshalling) on the Triton backend, not Triton's launcher; the ``StepInputs.prepare`` rows use
the CPU as the "device", so its copies are CPU memcpys, not host-to-device DMA. These numbers show
relative changes of the Python path; device host costs are measured by
``benchmarks/attention_host_overhead.py`` and ``pieceworks bench latency`` on a GPU machine.
Minimum over repeats (the least disturbed run), 8B attention shape (32 / 8 heads, dim 128).

    python benchmarks/host_path_cpu.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pieceworks.config import EngineConfig  # noqa: E402
from pieceworks.core.forward_context import set_forward_context  # noqa: E402
from pieceworks.kernels.attention import kv_cache, triton_attention  # noqa: E402
from pieceworks.models.attention.backends import TritonAttentionBackend  # noqa: E402
from pieceworks.models.attention.layer import Attention  # noqa: E402
from pieceworks.models.attention.metadata import AttentionMetadata  # noqa: E402
from pieceworks.scheduler.output import ScheduledRequest  # noqa: E402
from pieceworks.scheduler.request import Request  # noqa: E402
from pieceworks.worker.input_buffers import InputBuffers, StepShape  # noqa: E402
from pieceworks.worker.step_inputs import StepInputs  # noqa: E402

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, MAX_MODEL_LEN = 32, 8, 128, 16, 8192


class StubKernel:
    """Stands in for a ``@triton.jit`` function: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_kernels() -> None:
    for module, names in (
        (triton_attention, ["_decode_split_kv_kernel", "_decode_reduce_kernel", "_prefill_kernel"]),
        (kv_cache, ["_store_kv_cache_kernel"]),
    ):
        for name in names:
            setattr(module, name, StubKernel())


def per_call_us(fn, iters: int, repeats: int = 7) -> float:
    for _ in range(iters // 10):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return min(samples)


def attention_rows(batch_size: int) -> dict[str, float]:
    config = EngineConfig()
    layer = Attention(HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, KV_HEADS, config=config, prefix="attn")
    layer.backend = TritonAttentionBackend
    cache = torch.zeros(2, 8 * batch_size, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    layer.kv_cache = (cache[0], cache[1])
    qkv = torch.zeros(batch_size, (HEADS + 2 * KV_HEADS) * HEAD_SIZE, dtype=torch.bfloat16)
    kv_width = KV_HEADS * HEAD_SIZE
    query, key, value = qkv.split([HEADS * HEAD_SIZE, kv_width, kv_width], dim=-1)
    output = torch.empty(batch_size, HEADS * HEAD_SIZE, dtype=torch.bfloat16)
    metadata = AttentionMetadata(
        num_actual_tokens=batch_size,
        max_query_len=1,
        query_start_loc=torch.arange(batch_size + 1, dtype=torch.int32),
        seq_lens=torch.full((batch_size,), 1024, dtype=torch.int32),
        block_tables=torch.zeros(batch_size, MAX_MODEL_LEN // BLOCK_SIZE, dtype=torch.int32),
        slot_mapping=torch.zeros(batch_size, dtype=torch.int64),
    )
    rows = {}
    rows["Attention.attend"] = per_call_us(
        lambda: layer.attend(query, key, value, output, metadata), 20000
    )
    with set_forward_context(metadata, config):
        rows["op via torch.ops"] = per_call_us(
            lambda: layer.op(query, key, value, output, "attn"), 20000
        )
    return rows


def prepare_us(batch_size: int) -> float:
    buffers = InputBuffers(2048, 128, MAX_MODEL_LEN // BLOCK_SIZE, torch.device("cpu"), False)
    inputs = StepInputs(buffers, BLOCK_SIZE)
    scheduled = []
    for index in range(batch_size):
        request = Request(f"r{index}", list(range(1000)), output_token_ids=[7] * 24)
        request.num_computed_tokens = 1023
        request.block_ids = list(range(index * 64, index * 64 + 64))
        scheduled.append(ScheduledRequest(request, 1))
    shape = StepShape(batch_size, batch_size, batch_size, batch_size, 1)
    return per_call_us(lambda: inputs.prepare(scheduled, shape), 3000)


def main() -> None:
    # One thread: large CPU copies would otherwise fan out to a thread pool, a cost the device
    # path (a DMA the driver queues) does not have.
    torch.set_num_threads(1)
    stub_kernels()
    for batch_size in (1, 64):
        for name, value in attention_rows(batch_size).items():
            print(f"{name + f', decode batch {batch_size}':<44} {value:8.2f} us/call")
    for batch_size in (1, 8, 64):
        name = f"StepInputs.prepare, decode batch {batch_size}"
        print(f"{name:<44} {prepare_us(batch_size):8.2f} us/call", flush=True)


if __name__ == "__main__":
    main()
