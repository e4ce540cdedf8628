"""The llmgw configuration file: YAML read into typed, validated, frozen objects.

``load_config(path)`` / ``parse_config(text, filename)`` return a
:class:`Config` or raise :class:`ConfigError`, whose ``errors`` list every
problem as ``file:line: key: message``. Code outside the loader that finds a
problem with a value (an unknown routing tier, an unknown engine) reports it
the same way with :func:`issue_at`. Keys are documented in
``docs/configuration.md``.
"""

from ..units import parse_duration, parse_size
from .addresses import HostPort
from .fields import Located, issue_at
from .issues import ConfigError, ConfigIssue
from .loading import load_config, parse_config
from .schema import (
    AgentsConfig,
    ApiKey,
    Config,
    Deployment,
    ExternalReplica,
    HealthConfig,
    Limits,
    LoraAdapter,
    MetricsConfig,
    ModelConfig,
    Placement,
    Profile,
)

__all__ = [
    "AgentsConfig", "ApiKey", "Config", "ConfigError", "ConfigIssue", "Deployment", "ExternalReplica",
    "HealthConfig", "HostPort", "Limits", "Located", "LoraAdapter", "MetricsConfig", "ModelConfig",
    "Placement", "Profile", "issue_at", "load_config", "parse_config", "parse_duration", "parse_size",
]
