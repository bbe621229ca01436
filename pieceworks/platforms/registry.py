"""Platform resolution: forced by name, out-of-tree plugins, then built-in probes.

Order (SPEC §2): ``PIECEWORKS_PLATFORM=<name>`` forces a platform; otherwise the active out-of-tree
plugins (entry-point group ``pieceworks.platforms``, filtered by ``PIECEWORKS_PLUGINS``), then the
built-ins cuda, rocm, cpu. A plugin is a zero-argument function returning a platform qualname, or
None to decline. Every probe is recorded (``PlatformProbe``) so `pieceworks platforms` can show what
was tried and why it failed; a probe that raises is logged with its exception, never swallowed.
A plugin whose platform states a contract version this pieceworks cannot run stops resolution
with ``PlatformContractError`` naming both versions (``contract.check_contract_version``): it is
never skipped in silence for a built-in.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from importlib.metadata import entry_points

from pieceworks import envs
from pieceworks.logger import init_logger
from pieceworks.platforms.contract import PlatformContractError, check_contract_version
from pieceworks.platforms.interface import Platform
from pieceworks.utils import resolve_obj_by_qualname

logger = init_logger(__name__)

PLUGIN_GROUP = "pieceworks.platforms"

BUILTIN_PLATFORMS: dict[str, str] = {
    "cuda": "pieceworks.platforms.cuda.CudaPlatform",
    "rocm": "pieceworks.platforms.rocm.RocmPlatform",
    "cpu": "pieceworks.platforms.cpu.CpuPlatform",
}

# Plugins registered from Python (tests, notebooks); they obey the allow-list like entry points.
_programmatic_plugins: dict[str, Callable[[], str | None]] = {}


def register_platform_plugin(name: str, plugin: Callable[[], str | None]) -> None:
    """Register an out-of-tree platform plugin without packaging it (tests, notebooks)."""
    _programmatic_plugins[name] = plugin


def unregister_platform_plugin(name: str) -> None:
    _programmatic_plugins.pop(name, None)


@dataclasses.dataclass
class PlatformProbe:
    """What one candidate platform said when asked."""

    name: str  # platform name (plugins: the platform's own name once loaded, else the plugin's)
    source: str  # "builtin" or "plugin:<entry point name>"
    available: bool
    reason: str = ""  # why not available (or what was probed)
    qualname: str | None = None


@dataclasses.dataclass
class PlatformResolution:
    """Which platform was chosen, by which rule, and every probe made on the way."""

    platform_name: str
    rule: str  # "env" (PIECEWORKS_PLATFORM), "plugin", or "probe"
    probes: list[PlatformProbe]

    def describe(self) -> str:
        rules = {
            "env": "forced by PIECEWORKS_PLATFORM",
            "plugin": "out-of-tree plugin",
            "probe": "first available built-in (cuda, rocm, cpu)",
        }
        lines = [f"resolved platform: {self.platform_name} ({rules[self.rule]})"]
        for probe in self.probes:
            state = "available" if probe.available else f"unavailable: {probe.reason}"
            lines.append(f"  {probe.name:<10} [{probe.source}] {state}")
        return "\n".join(lines)


def _allowed_plugins() -> dict[str, Callable[[], Callable[[], str | None]]]:
    """Entry-point and programmatic plugins that pass the PIECEWORKS_PLUGINS allow-list."""
    plugins: dict[str, Callable[[], Callable[[], str | None]]] = {}
    for entry_point in entry_points(group=PLUGIN_GROUP):
        plugins[entry_point.name] = entry_point.load
    for name, plugin in _programmatic_plugins.items():
        plugins[name] = functools.partial(lambda fn: fn, plugin)
    allow = envs.PIECEWORKS_PLUGINS
    if allow is None:
        return plugins
    for name in allow:
        if name not in plugins:
            logger.warning(
                "PIECEWORKS_PLUGINS names %r, but no such plugin is installed (installed: %s)",
                name,
                sorted(plugins) or "none",
            )
    return {name: loader for name, loader in plugins.items() if name in allow}


def _probe_plugin(ep_name: str, load: Callable[[], Callable[[], str | None]]) -> PlatformProbe:
    source = f"plugin:{ep_name}"
    try:
        qualname = load()()
        if qualname is None:
            return PlatformProbe(ep_name, source, False, "plugin declined (returned None)")
        platform_cls = resolve_obj_by_qualname(qualname)
        check_contract_version(platform_cls)
        available = bool(platform_cls.is_available())
        reason = "" if available else "is_available() returned False"
        return PlatformProbe(platform_cls.name, source, available, reason, qualname)
    except PlatformContractError:
        raise  # a plugin for another contract: an error naming both versions, not a fallback
    except Exception as error:  # a broken plugin must not hide the others; it is reported
        logger.warning("platform plugin %r raised while probing: %r", ep_name, error)
        return PlatformProbe(ep_name, source, False, f"probe raised {error!r}")


def _probe_builtin(name: str) -> PlatformProbe:
    qualname = BUILTIN_PLATFORMS[name]
    try:
        platform_cls = resolve_obj_by_qualname(qualname)
        if platform_cls.is_available():
            return PlatformProbe(name, "builtin", True, "", qualname)
        return PlatformProbe(name, "builtin", False, platform_cls().unavailable_reason(), qualname)
    except Exception as error:
        logger.warning("probing built-in platform %r raised: %r", name, error)
        return PlatformProbe(name, "builtin", False, f"probe raised {error!r}", qualname)


def probe_all() -> list[PlatformProbe]:
    """Probe every allowed plugin and every built-in, in resolution order."""
    probes = [_probe_plugin(name, load) for name, load in _allowed_plugins().items()]
    return probes + [_probe_builtin(name) for name in BUILTIN_PLATFORMS]


def _forced(name: str, probes: list[PlatformProbe], asked_as: str | None = None) -> PlatformProbe:
    """The available probe called ``name``; an error listing every platform otherwise.
    ``asked_as``: how the user named it, for the message (default: the environment variable)."""
    matches = [p for p in probes if name in (p.name, p.source.removeprefix("plugin:"))]
    usable = [p for p in matches if p.available]
    if usable:
        return usable[0]
    known = "\n".join(
        f"  {p.name} [{p.source}]: {'available' if p.available else 'unavailable: ' + p.reason}"
        for p in probes
    )
    what = "is not available here" if matches else "is not a known platform"
    if asked_as is None:
        asked_as, hint = (
            f"PIECEWORKS_PLATFORM={name!r}",
            "Unset PIECEWORKS_PLATFORM to pick automatically",
        )
    else:  # a plugin may decline unless the environment asks for it (simgraph does)
        hint = f"A plugin that activates only on request needs PIECEWORKS_PLATFORM={name}"
    raise RuntimeError(
        f"{asked_as} {what}. Platforms known:\n{known}\n{hint}, or install the plugin that "
        "provides it."
    )


def _active_plugin(probes: list[PlatformProbe]) -> PlatformProbe | None:
    active = [p for p in probes if p.source.startswith("plugin:") and p.available]
    if len(active) > 1:
        names = ", ".join(f"{p.name} ({p.source})" for p in active)
        raise RuntimeError(
            f"more than one out-of-tree platform plugin is active: {names}. "
            "Choose one with PIECEWORKS_PLATFORM=<name> or restrict "
            "PIECEWORKS_PLUGINS to one plugin."
        )
    return active[0] if active else None


def platform_by_name(name: str) -> Platform:
    """A new instance of the platform called ``name`` (a built-in, or a plugin's platform or
    entry-point name), as ``PIECEWORKS_PLATFORM=<name>`` would choose it; the same error if it
    is unknown or unavailable (`pieceworks platforms --check NAME`)."""
    chosen = _forced(name, probe_all(), asked_as=f"platform {name!r}")
    assert chosen.qualname is not None
    return resolve_obj_by_qualname(chosen.qualname)()


def resolve_platform() -> tuple[Platform, PlatformResolution]:
    """Resolve the platform for this process (see the module docstring for the order)."""
    probes = probe_all()
    forced = envs.PIECEWORKS_PLATFORM
    if forced:
        chosen, rule = _forced(forced, probes), "env"
    else:
        plugin = _active_plugin(probes)
        builtin = next(p for p in probes if p.source == "builtin" and p.available)
        chosen, rule = (plugin, "plugin") if plugin else (builtin, "probe")
    assert chosen.qualname is not None
    platform = resolve_obj_by_qualname(chosen.qualname)()
    resolution = PlatformResolution(platform.name, rule, probes)
    logger.debug("%s", resolution.describe())
    return platform, resolution
