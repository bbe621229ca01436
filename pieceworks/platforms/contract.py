"""The platform contract's version and the checks that hold a ``Platform`` subclass to it.

``CONTRACT_VERSION`` is (major, minor). A platform states the version it implements in its class
attribute ``contract_version``. A plugin is compatible when its major equals the core's and its
minor is at most the core's (a minor adds members with defaults, so an older plugin keeps
working); otherwise resolution stops with ``PlatformContractError`` naming both versions and what
changed between them (``CHANGELOG``; ``docs/platforms.md`` has the same list).

When a subclass is defined (``Platform.__init_subclass__``), ``check_platform_class`` checks every
public name it defines: it must be a contract member (a typo fails at import, naming the closest
member) or be listed in the class's ``extra_members``, and a method overriding a hook must accept
the hook's parameters (same names, kinds and optional parameters; extra ones need defaults).
Names with a leading underscore are the platform's own and are not checked.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

CONTRACT_VERSION: tuple[int, int] = (1, 2)

# What each version added or changed, oldest first (a plugin of an older minor lacks these).
CHANGELOG: dict[tuple[int, int], str] = {
    (1, 0): "the members of SPEC §2: names and keys, is_available, static-graph wrapper and "
    "pool, attention/mamba backends, device_capability, check_and_update_config, device helpers",
    (1, 1): "prepare_kernel_compiler(cache_dir) -> dict[str, str]: the kernel compiler's "
    "environment (default: TRITON_CACHE_DIR only)",
    (1, 2): "capabilities() -> PlatformCapabilities, the declared record the engine reads; "
    "fp8_formats and graph_pool_sharing declarations; contract_version; members and hook "
    "signatures checked when a subclass is defined (extra_members for a platform's own names)",
}


class PlatformContractError(TypeError):
    """A platform class breaks the contract: an unknown member, a wrong hook signature, or a
    contract version this pieceworks cannot run."""


def format_version(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def changes_between(older: tuple[int, int], newer: tuple[int, int]) -> str:
    """The changelog entries after ``older`` up to ``newer``, one per line."""
    entries = [
        f"  {format_version(version)}: {text}"
        for version, text in CHANGELOG.items()
        if older < version <= newer
    ]
    return "\n".join(entries) or "  (no entry: a version this pieceworks does not know)"


def check_contract_version(platform_cls: type) -> None:
    """Raise ``PlatformContractError`` unless ``platform_cls.contract_version`` runs here."""
    stated = tuple(getattr(platform_cls, "contract_version", ()))
    qualname = f"{platform_cls.__module__}.{platform_cls.__qualname__}"
    name = f"platform {getattr(platform_cls, 'name', '?')!r} ({qualname})"
    if len(stated) != 2 or not all(isinstance(part, int) for part in stated):
        raise PlatformContractError(
            f"{name} states contract_version {stated!r}; state (major, minor), e.g. "
            f"{CONTRACT_VERSION!r}"
        )
    plugin, core = (stated[0], stated[1]), CONTRACT_VERSION
    if plugin[0] == core[0] and plugin[1] <= core[1]:
        return
    if plugin > core:
        what = f"it needs a newer pieceworks; changes after {format_version(core)} are unknown here"
        changes = changes_between(core, plugin)
    else:
        what = "the plugin was written for an older major version; port it to the changes"
        changes = changes_between(plugin, core)
    raise PlatformContractError(
        f"{name} implements platform contract {format_version(plugin)}, this pieceworks "
        f"implements {format_version(core)} (compatible: {core[0]}.0 to "
        f"{format_version(core)}): {what}:\n{changes}"
    )


def contract_members(base: type) -> dict[str, Any]:
    """The public members ``base`` (``Platform``) defines: the contract."""
    return {name: value for name, value in vars(base).items() if not name.startswith("_")}


def check_platform_class(cls: type, base: type) -> None:
    """Check the public names ``cls`` defines against ``base``'s contract (module docstring)."""
    members = contract_members(base)
    extra: set[str] = set()
    for klass in cls.__mro__:
        extra.update(vars(klass).get("extra_members", ()))
    for name, value in vars(cls).items():
        if name.startswith("_") or name in extra:
            continue
        if name not in members:
            close = difflib.get_close_matches(name, list(members), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise PlatformContractError(
                f"{cls.__name__}.{name} is not a member of the platform contract "
                f"{format_version(CONTRACT_VERSION)}{hint} (a platform's own names start with "
                "'_' or are listed in extra_members)"
            )
        _check_override(cls, name, value, members[name])


def _kind(value: Any) -> str:
    if isinstance(value, classmethod):
        return "classmethod"
    if isinstance(value, staticmethod):
        return "staticmethod"
    if isinstance(value, property):
        return "property"
    return "method" if inspect.isfunction(value) else "attribute"


def _check_override(cls: type, name: str, value: Any, contract: Any) -> None:
    kind, expected_kind = _kind(value), _kind(contract)
    where = f"{cls.__name__}.{name}"
    if expected_kind == "attribute":
        if kind != "attribute":
            raise PlatformContractError(
                f"{where} is a {kind}; the contract's {name} is a class attribute"
            )
        return
    function = getattr(contract, "__func__", contract)
    expected = inspect.signature(function)
    if kind != expected_kind:
        raise PlatformContractError(
            f"{where} is a {kind}; the contract's {name} is a {expected_kind} {name}{expected}"
        )
    if kind == "property":
        return
    actual = inspect.signature(getattr(value, "__func__", value))
    problem = signature_mismatch(expected, actual)
    if problem:
        raise PlatformContractError(
            f"{where}{actual} does not match the contract's hook {name}{expected}: {problem}"
        )


def signature_mismatch(expected: inspect.Signature, actual: inspect.Signature) -> str | None:
    """Why a method of signature ``actual`` cannot stand in for ``expected``, or None."""
    P = inspect.Parameter
    theirs = list(actual.parameters.values())[1:]  # without self / cls
    ours = list(expected.parameters.values())[1:]
    var_positional = any(p.kind == P.VAR_POSITIONAL for p in theirs)
    var_keyword = any(p.kind == P.VAR_KEYWORD for p in theirs)
    by_name = {p.name: p for p in theirs}
    positional = [p for p in theirs if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    for index, param in enumerate(ours):
        if param.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            continue
        if param.kind == P.KEYWORD_ONLY:
            match = by_name.get(param.name)
            if match is None and not var_keyword:
                return f"keyword parameter {param.name!r} is missing"
            if match is not None and match.kind == P.POSITIONAL_ONLY:
                return f"{param.name!r} must be accepted by keyword"
        else:
            match = positional[index] if index < len(positional) else None
            if match is None and not var_positional:
                return f"parameter {param.name!r} (position {index + 1}) is missing"
            if match is not None and match.name != param.name:
                return f"parameter {index + 1} is {match.name!r}, the hook's is {param.name!r}"
        if match is not None and param.default is not P.empty and match.default is P.empty:
            return f"{param.name!r} needs a default (callers may leave it out)"
    known = {p.name for p in ours}
    for param in theirs:
        required = param.default is P.empty and param.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)
        if param.name not in known and required:
            return f"extra parameter {param.name!r} needs a default (callers never pass it)"
    return None
