"""pieceworks' kernels: every jitted (Triton, Gluon) kernel and its launcher, grouped by family.

Families: ``gemv`` (the decode GEMV, its rotary and resident-weight forms, tile rules),
``activation`` (SiLU-and-mul), ``norm_quant`` (RMSNorm + static FP8 quantization), ``attention``
(paged KV store, paged attention), ``mamba`` (causal conv1d, chunked SSD scan, state update),
``sampling`` (greedy argmax) and ``rope`` (the rotary's torch form). Shared by all: where the
kernels run (``triton_device.py``), the launch options (``triton_launch.py``), the
programmatic-launch policy (``programmatic_launch.py``) and rounding that gives the same bytes
on every backend (``triton_rounding.py``).

Which implementation each op runs is decided by the engine's ``KernelChooser`` (``chooser.py``),
once per layer when its model is built; ``register_kernel`` (``registry.py``) is the vendor seam
through which an out-of-tree platform adds its own implementation of any op
(``docs/platforms.md``).

Sits below ``models`` and above ``core``: models call these ops, nothing here imports a model.
Importing this package imports no Triton; importing a family does, but resolves no platform and
registers no op.
"""

from pieceworks.kernels.chooser import KernelChooser, describe_kernel_choices
from pieceworks.kernels.implementation import Choice, KernelImpl, Supports
from pieceworks.kernels.registry import register_kernel, unregister_kernel

__all__ = [
    "Choice",
    "KernelChooser",
    "KernelImpl",
    "Supports",
    "describe_kernel_choices",
    "register_kernel",
    "unregister_kernel",
]
