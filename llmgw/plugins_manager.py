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


def plugin_issues(objects, registry: Registry) -> list:
    """The config problems plugins find in ``objects`` (the models and profiles among them).

    Every model and every profile (deployed or not) must name an installed routing tier, checked alike, and
    every profile an installed engine: a name no plugin registers is an error at its line, listing the known
    names, never a round-robin fallback at run time. A tier class vets its ``routing_options`` with its
    ``check_options(options, registry) -> list[str]`` class method (:class:`llmgw.plugin.RoutingTier`'s finds
    nothing; a factory without one is not asked). Values the loader already found invalid are skipped (reported
    once).
    """
    from .config import ModelConfig, Profile, issue_at
    from .config.fields import known

    issues = []
    for owner in objects:
        if not isinstance(owner, (ModelConfig, Profile)):
            continue
        if isinstance(owner, Profile) and known(owner.engine):
            try:
                registry.get("engines", owner.engine)
            except PluginError as exc:
                issues.append(issue_at(owner, "engine", str(exc)))
        if not known(owner.routing):
            continue
        try:
            tier = registry.get("routing_tiers", owner.routing)
        except PluginError as exc:
            issues.append(issue_at(owner, "routing", str(exc)))
            continue
        check_options = getattr(tier, "check_options", None)
        if check_options is not None and known(owner.routing_options):
            for problem in check_options(owner.routing_options, registry):
                issues.append(issue_at(owner, "routing_options", problem))
    return issues


def check_config_plugins(config, registry: Registry) -> None:
    """Raise ConfigError, pointing at the config lines, when a plugin the config names is missing or refuses its
    options (:func:`plugin_issues`)."""
    from .config import ConfigError

    issues = plugin_issues([*config.models, *config.profiles], registry)
    if issues:
        raise ConfigError(issues)


def load_checked_config(path, registry: Registry | None = None, *, text: str | None = None):
    """:func:`llmgw.config.load_config` and the plugin checks in one pass: one ConfigError lists the problems of
    both (an unknown tier is reported next to a bad key, not after it is fixed). ``text``: the file's content, when
    the caller already read it (a reload parses the bytes it read once); ``path`` then only names it."""
    from .config import ConfigError, load_config, parse_config

    registry = registry or default_registry()
    try:
        config = load_config(path) if text is None else parse_config(text, str(path))
    except ConfigError as exc:
        raise ConfigError(exc.errors + plugin_issues(exc.objects, registry)) from None
    check_config_plugins(config, registry)
    return config
