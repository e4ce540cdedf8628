"""The plugin manager and the resolved registry of every pluggable kind.

Built-in plugins are found through the ``llmgw`` entry-point group exactly as
a third party's are; the core never imports a plugin module by name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import pluggy

from . import hookspecs

log = logging.getLogger(__name__)

KINDS = {
    "routing_tiers": "register_routing_tiers",
    "scorers": "register_scorers",
    "block_key_functions": "register_block_key_functions",
    "event_decoders": "register_event_decoders",
    "tokenizer_sources": "register_tokenizer_sources",
    "engines": "register_engines",
}


class PluginError(Exception):
    """A plugin is missing, or two plugins claim the same name."""


@dataclass
class Registry:
    """Factories by kind and name, collected once from every plugin."""

    kinds: dict[str, dict[str, Callable[..., Any]]] = field(default_factory=dict)
    providers: dict[tuple[str, str], str] = field(default_factory=dict)

    def get(self, kind: str, name: str) -> Callable[..., Any]:
        try:
            return self.kinds[kind][name]
        except KeyError:
            known = ", ".join(sorted(self.kinds.get(kind, {}))) or "none"
            raise PluginError(f"no {kind.replace('_', ' ')[:-1]} named {name!r} (known: {known})") from None

    def names(self, kind: str) -> list[str]:
        return sorted(self.kinds.get(kind, {}))


def make_plugin_manager(extra_plugins: tuple[object, ...] = ()) -> pluggy.PluginManager:
    pm = pluggy.PluginManager("llmgw")
    pm.add_hookspecs(hookspecs)
    pm.load_setuptools_entrypoints("llmgw")
    for plugin in extra_plugins:
        pm.register(plugin)
    return pm


def build_registry(pm: pluggy.PluginManager) -> Registry:
    registry = Registry()
    for kind, hook_name in KINDS.items():
        found: dict[str, Callable[..., Any]] = {}
        hook = getattr(pm.hook, hook_name)
        for impl in reversed(hook.get_hookimpls()):
            provided = impl.function() or {}
            plugin_name = pm.get_name(impl.plugin) or repr(impl.plugin)
            for name, factory in provided.items():
                if name in found:
                    raise PluginError(
                        f"{kind} {name!r} is provided by both {registry.providers[(kind, name)]} and {plugin_name}"
                    )
                found[name] = factory
                registry.providers[(kind, name)] = plugin_name
        registry.kinds[kind] = found
    return registry


_default: Registry | None = None


def default_registry() -> Registry:
    """The registry of every installed plugin (built once per process)."""
    global _default
    if _default is None:
        _default = build_registry(make_plugin_manager())
    return _default


def check_config_plugins(config, registry: Registry) -> None:
    """Every plugin the config names must be installed; raises ConfigError pointing at the config lines.

    A tier class may also vet its ``routing_options`` with a
    ``check_options(options, registry) -> list[str]`` class method; its
    problems are reported for models and for profiles (a profile whose tier is
    not installed is routed round_robin by the control plane, so only models
    must name an installed tier).
    """
    from .config import ConfigError, issue_at

    issues = []
    for owner in [*config.models, *getattr(config, "profiles", ())]:
        try:
            tier = registry.get("routing_tiers", owner.routing)
        except PluginError as exc:
            if owner in config.models:
                issues.append(issue_at(owner, "routing", str(exc)))
            continue
        check_options = getattr(tier, "check_options", None)
        if check_options is not None:
            for problem in check_options(owner.routing_options, registry):
                issues.append(issue_at(owner, "routing_options", problem))
    if issues:
        raise ConfigError(issues)
