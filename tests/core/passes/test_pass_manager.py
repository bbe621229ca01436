"""The pass manager: which passes ``PassConfig`` runs, how Inductor gets them, and the uuid.

The uuid identifies the code a compile ran: it must change when a pass's source changes or the
``PassConfig`` changes, stay equal otherwise, and reach pieceworks' compile-cache key through
the Inductor adaptor's hash factors, under the factor names the cache's files and messages show.
A sequence runs its passes in order and reports the sum of its passes' rewrites of its last call;
the manager's factors name its config, its joint passes and each pass.
Run: pytest tests/core/passes/test_pass_manager.py
"""

from __future__ import annotations

import dataclasses
import importlib.util
import platform
import sys
import textwrap

import pytest
import torch

from pieceworks.config import EngineConfig
from pieceworks.core.cache.cache_key import cache_key_factors
from pieceworks.core.compiler_interface import EagerAdaptor, InductorAdaptor, make_compiler
from pieceworks.core.config import CompilationConfig, PassConfig
from pieceworks.core.passes.fix_functionalization import FixFunctionalizationPass
from pieceworks.core.passes.fusion import RMSNormQuantFusionPass
from pieceworks.core.passes.inductor_pass import InductorPass
from pieceworks.core.passes.noop_elimination import NoOpEliminationPass
from pieceworks.core.passes.pass_manager import PassSequence, PostGradPassManager
from pieceworks.platforms import current_platform
from pieceworks.utils import hash_factors


def pass_types(config: PassConfig) -> list[type]:
    return [type(graph_pass) for graph_pass in PostGradPassManager(config).passes]


def test_pass_config_selects_passes_and_fix_functionalization_runs_last():
    no_fusion = PassConfig(enable_fusion=False)
    assert pass_types(PassConfig(enable_noop=False, enable_fusion=False)) == [
        FixFunctionalizationPass
    ]
    assert pass_types(no_fusion) == [NoOpEliminationPass, FixFunctionalizationPass]
    assert pass_types(PassConfig()) == [
        NoOpEliminationPass,
        RMSNormQuantFusionPass,
        FixFunctionalizationPass,
    ]


def test_fusion_also_runs_on_the_joint_graph():
    """Before Inductor's joint-graph patterns (torch 2.11 folds the residual's bfloat16 round
    trip there), in the slot Inductor calls first; its uuid enters the manager's."""
    no_fusion = PassConfig(enable_fusion=False)
    assert PostGradPassManager(no_fusion).joint_passes is None
    manager = PostGradPassManager(PassConfig())
    assert manager.joint_passes is not None
    joint = [type(graph_pass) for graph_pass in manager.joint_passes.passes]
    assert joint == [NoOpEliminationPass, RMSNormQuantFusionPass]
    without_noop = PostGradPassManager(PassConfig(enable_noop=False, enable_fusion=True))
    assert without_noop.joint_passes is not None
    assert [type(graph_pass) for graph_pass in without_noop.joint_passes.passes] == [
        RMSNormQuantFusionPass
    ]
    assert manager.config_patches()["joint_custom_pre_pass"] is manager.joint_passes
    assert "joint_custom_pre_pass" not in PostGradPassManager(no_fusion).config_patches()
    assert manager.config_factors()["joint"] == manager.joint_passes.uuid()


def test_fusion_without_noop_warns(caplog):
    with caplog.at_level("WARNING"):
        PassConfig(enable_noop=False, enable_fusion=True)
    assert "enable_noop" in caplog.text


def test_inductor_gets_the_manager_and_functionalization_v1():
    manager = PostGradPassManager(PassConfig())
    patches = manager.config_patches()
    assert patches["post_grad_custom_post_pass"] is manager
    assert patches["enable_auto_functionalized_v2"] is False
    assert hasattr(torch._inductor.config, "enable_auto_functionalized_v2")  # torch has the flag
    with torch._inductor.config.patch(patches):  # Inductor accepts both entries
        assert torch._inductor.config.post_grad_custom_post_pass is manager


def test_uuid_is_stable_and_follows_the_pass_config():
    uuids = {
        (noop, fusion): PostGradPassManager(PassConfig(noop, fusion)).uuid()
        for noop in (False, True)
        for fusion in (False, True)
    }
    assert len(set(uuids.values())) == 4
    assert PostGradPassManager(PassConfig()).uuid() == uuids[(True, True)]  # the defaults


PASS_SOURCE = """
from pieceworks.core.passes.inductor_pass import InductorPass

class ScalePass(InductorPass):
    def __call__(self, graph):
        self.num_rewrites = {value}
"""


@pytest.fixture
def load_pass(tmp_path, monkeypatch):
    """``load_pass(value)``: (re)write a pass's source file, import it, return an instance."""
    path = tmp_path / "scale_pass.py"

    def load(value: int):
        path.write_text(textwrap.dedent(PASS_SOURCE.format(value=value)))
        spec = importlib.util.spec_from_file_location("scale_pass", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        # inspect finds a class's file through its module
        monkeypatch.setitem(sys.modules, "scale_pass", module)
        spec.loader.exec_module(module)
        return module.ScalePass()

    return load


def test_uuid_changes_with_a_pass_source(load_pass):
    # An edit of another length: a file's digest is kept per process while its size and
    # modification time stay the same, and two writes can fall within one timestamp tick.
    first_uuid = load_pass(1).uuid()
    assert load_pass(1).uuid() == first_uuid
    assert load_pass(20).uuid() != first_uuid
    manager = PostGradPassManager(PassConfig())
    without_pass = manager.uuid()
    manager.passes.insert(0, load_pass(1))
    with_pass = manager.uuid()
    load_pass(20)  # the same pass's file edited
    assert len({without_pass, with_pass, manager.uuid()}) == 3


def test_pass_manager_uuid_enters_the_compile_cache_key(load_pass):
    def key(pass_config: PassConfig, compiler=None) -> str:
        config = EngineConfig(compilation_config=CompilationConfig(pass_config=pass_config))
        compiler = compiler or make_compiler("inductor", pass_config)
        return hash_factors(cache_key_factors(config, compiler, []))

    compiler = make_compiler("inductor", PassConfig())
    assert isinstance(compiler, InductorAdaptor)
    factors = compiler.compute_hash_factors()
    assert factors["pass_manager_uuid"] == compiler.pass_manager.uuid()
    assert key(PassConfig()) == key(PassConfig())
    assert key(PassConfig()) != key(PassConfig(enable_fusion=False))
    # Same config, a pass's source edited: only the compiler factors differ, and the key does.
    compiler.pass_manager.passes.insert(0, load_pass(3))
    before_edit = key(PassConfig(), compiler)
    load_pass(4)
    assert key(PassConfig(), compiler) != before_edit


def test_each_compilers_key_factors_by_name():
    """The names ``cache_key_factors.json`` and a miss's reason give each compiler factor."""
    assert make_compiler("eager", PassConfig()).compute_hash_factors() == {"name": "eager"}
    factors = make_compiler("inductor", PassConfig()).compute_hash_factors()
    assert sorted(factors) == [
        "auto_functionalized_v2",
        "device",
        "inductor_config",
        "name",
        "pass_manager_uuid",
        "python",
        "static_size_options",
        "torch",
        "torch_git",
        "triton",
    ]
    named = (factors["name"], factors["device"], factors["torch"], factors["python"])
    assert named == (
        "inductor",
        current_platform().device_name(),
        torch.__version__,
        platform.python_version(),
    )
    assert factors["auto_functionalized_v2"] is False


@pytest.mark.parametrize("backend,cls", [("eager", EagerAdaptor), ("inductor", InductorAdaptor)])
def test_make_compiler(backend, cls):
    assert isinstance(make_compiler(backend, PassConfig()), cls)


class CountingPass(InductorPass):
    """Appends its name to the graph's record and reports ``count`` rewrites."""

    def __init__(self, name: str, count: int, seen: list[str]) -> None:
        super().__init__()
        self.name, self.count, self.seen = name, count, seen

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.seen.append(self.name)
        self.num_rewrites = self.count

    def config_factors(self) -> dict:
        return {"name": self.name}


def test_a_sequence_runs_its_passes_in_order_and_counts_the_last_call_s_rewrites():
    seen: list[str] = []
    first, second = CountingPass("first", 2, seen), CountingPass("second", 3, seen)
    sequence = PassSequence([first, second])
    assert sequence.num_rewrites == 0  # before any call
    sequence(torch.fx.Graph())
    assert (seen, sequence.num_rewrites) == (["first", "second"], 5)
    first.count = 0
    sequence(torch.fx.Graph())
    assert sequence.num_rewrites == 3
    assert sequence.config_factors() == {"passes": [first.uuid(), second.uuid()]}
    assert PassSequence([second, first]).uuid() != sequence.uuid()  # the order is part of it


def test_the_manager_s_factors_name_its_config_its_joint_passes_and_each_pass():
    config = PassConfig(enable_noop=False, enable_fusion=False)
    manager = PostGradPassManager(config)
    assert manager.config_factors() == {
        "pass_config": dataclasses.asdict(config),
        "joint": None,
        "passes": [graph_pass.uuid() for graph_pass in manager.passes],
    }
    assert PostGradPassManager(PassConfig(enable_attn_quant_fusion=False)).uuid() != (
        PostGradPassManager(PassConfig()).uuid()
    )
