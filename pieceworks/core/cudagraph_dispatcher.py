"""``CudagraphDispatcher``: which captured graph (if any) serves a batch.

Keys are ``BatchDescriptor``s registered per runtime mode from the capture sizes and the graph
mode. Every mode whose decodes run FULL (FULL itself, FULL_DECODE_ONLY, FULL_AND_PIECEWISE) gets
a uniform decode graph per capture size up to ``max_num_seqs``: its attention is the split-KV
decode kernel, where a general FULL graph would run decodes through the prefill kernel, one
program per query block and no split of long contexts. ``dispatch`` tries, in the seed's order:
FULL for the exact descriptor, FULL for the same token count as a general batch, PIECEWISE for
the general batch, else NONE (run without graphs). With speculative decoding, the FULL decode
keys also hold the verify batches: every sequence a decode with ``1 + k`` query tokens, one key
per decode capture size of sequences.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pieceworks.core.config import CUDAGraphMode
from pieceworks.core.forward_context import BatchDescriptor

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig


class CudagraphDispatcher:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.cudagraph_keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.FULL: set(),
            CUDAGraphMode.PIECEWISE: set(),
        }
        self.initialize_cudagraph_keys()

    def initialize_cudagraph_keys(self) -> None:
        compilation = self.config.compilation_config
        mode = compilation.cudagraph_mode
        assert mode is not None
        sizes = compilation.cudagraph_capture_sizes or []
        mixed = mode.mixed_mode()
        if mixed != CUDAGraphMode.NONE:
            self.cudagraph_keys[mixed] |= {BatchDescriptor(size) for size in sizes}
        if mode.decode_mode() == CUDAGraphMode.FULL:  # FULL too: its decodes get these
            max_num_seqs = self.config.scheduler_config.max_num_seqs
            self.cudagraph_keys[CUDAGraphMode.FULL] |= {
                BatchDescriptor(size, uniform_decode=True) for size in sizes if size <= max_num_seqs
            }
            self.cudagraph_keys[CUDAGraphMode.FULL] |= self._verify_keys()

    def _verify_keys(self) -> set[BatchDescriptor]:
        """The uniform verify batches of speculative decoding (none without it): ``S`` sequences
        of ``1 + k`` tokens each (``SpeculativeConfig.verify_graph_sizes``)."""
        spec = self.config.speculative_config
        if spec is None:
            return set()
        query_len = 1 + spec.num_speculative_tokens
        return {
            BatchDescriptor(num_tokens, uniform_decode=True, uniform_query_len=query_len)
            for num_tokens in spec.verify_graph_sizes(self.config)
        }

    def dispatch(self, descriptor: BatchDescriptor) -> tuple[CUDAGraphMode, BatchDescriptor | None]:
        """(runtime mode, the descriptor to capture/replay under) for a padded batch."""
        non_uniform = descriptor.non_uniform
        if descriptor in self.cudagraph_keys[CUDAGraphMode.FULL]:
            return CUDAGraphMode.FULL, descriptor
        if non_uniform in self.cudagraph_keys[CUDAGraphMode.FULL]:
            return CUDAGraphMode.FULL, non_uniform
        if non_uniform in self.cudagraph_keys[CUDAGraphMode.PIECEWISE]:
            return CUDAGraphMode.PIECEWISE, non_uniform
        return CUDAGraphMode.NONE, None

    def capture_descriptors(self) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Every (mode, descriptor) to capture, largest token count first."""
        keys = [(mode, key) for mode, keys in self.cudagraph_keys.items() for key in keys]
        return sorted(keys, key=lambda item: (-item[1].num_tokens, item[0].name))
