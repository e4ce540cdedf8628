"""Rules that relate different parts of one config file.

Run from ``Config._finish`` on the draft of the whole file; values that could
not be read are skipped, so one mistake is not reported twice.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .fields import Located, issue_at, known
from .issues import ConfigIssue
from .tls import check_upstream_tls

if TYPE_CHECKING:
    from .reader import Draft

_WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


def report_duplicates(draft: Draft, items: Iterable[Located], attr: str, what: str) -> None:
    """Report every item whose ``attr`` repeats an earlier item's (without quoting the value: it may be a secret)."""
    first: dict[Any, Located] = {}
    for item in items:
        value = getattr(item, attr)
        if value is None or not known(value):
            continue
        if value in first:
            earlier = first[value]
            draft.add(issue_at(item, attr, f"duplicate {what}: same as {earlier.key_of(attr)} "
                                           f"on line {earlier.line_of(attr)}"))
        else:
            first[value] = item


def check_config(draft: Draft) -> None:
    """Every whole-file rule, each reporting into ``draft``."""
    _check_listeners(draft)
    name_api_keys(draft)
    for section, attr, what in (("models", "name", "model name"), ("profiles", "name", "profile name"),
                                ("api_keys", "name", "API key name"), ("admin_tokens", "token", "admin token"),
                                ("teams", "name", "team name"), ("prices", "model", "price of model")):
        if draft.known(section):
            report_duplicates(draft, draft[section], attr, what)
    _check_api_key_hashes(draft)
    _check_key_teams(draft)
    _check_priorities(draft)
    _check_deployment_profiles(draft)
    _check_autoscaled_profiles(draft)
    _check_model_routing(draft)
    _check_adapter_names(draft)
    _check_agent_token(draft)
    check_upstream_tls(draft)
    _check_metrics_auth(draft)


def name_api_keys(draft: Draft) -> None:
    """Give every API key without a ``name`` the name ``key-N`` (N: its place in the list, from 1): stable while
    the list keeps its order, and nothing of the key itself."""
    if draft.known("api_keys"):
        draft.set("api_keys", [key if key.name is not None else dataclasses.replace(key, name=f"key-{n}")
                               for n, key in enumerate(draft["api_keys"], 1)])


def _check_api_key_hashes(draft: Draft) -> None:
    """No two API keys are the same key, whether each is written as the key or as its SHA-256."""
    if not draft.known("api_keys"):
        return
    first: dict[str, tuple[Located, str]] = {}
    for api_key in draft["api_keys"]:
        if not known(api_key.key, api_key.key_sha256) or (api_key.key is None) == (api_key.key_sha256 is None):
            continue
        attr = "key" if api_key.key is not None else "key_sha256"
        if api_key.sha256 in first:
            earlier, earlier_attr = first[api_key.sha256]
            draft.add(issue_at(api_key, attr, f"duplicate API key: same as {earlier.key_of(earlier_attr)} "
                                              f"on line {earlier.line_of(earlier_attr)}"))
        else:
            first[api_key.sha256] = (api_key, attr)


def _check_key_teams(draft: Draft) -> None:
    """Every team an API key names is under ``teams``."""
    if not draft.known("api_keys", "teams"):
        return
    names = [team.name for team in draft["teams"] if known(team.name)]
    for api_key in draft["api_keys"]:
        if known(api_key.team) and api_key.team is not None and api_key.team not in names:
            draft.add(issue_at(api_key, "team", f"no team named '{api_key.team}' under teams "
                                                f"({_hint(api_key.team, names, 'teams')})"))


def class_problem(name: str, classes: Iterable[Any]) -> str | None:
    """None when ``name`` is one of ``classes``' (flow.classes, as far as read) names; else why not."""
    names = [c.name for c in classes if known(c.name)]
    if name in names:
        return None
    return f"no priority class named '{name}' under flow.classes ({_hint(name, names, 'classes')})"


def _check_priorities(draft: Draft) -> None:
    """Every ``priority`` a key or a team names is a class of ``flow.classes``."""
    if not draft.known("flow", "api_keys", "teams") or not known(draft["flow"].classes):
        return
    classes = draft["flow"].classes
    for item in (*draft["teams"], *draft["api_keys"]):
        if known(item.priority) and item.priority is not None:
            problem = class_problem(item.priority, classes)
            if problem:
                draft.add(issue_at(item, "priority", problem))


def _hint(name: str, names: list[str], what: str) -> str:
    """A mistyped name's likely meaning, or what is defined."""
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    return f"defined: {', '.join(names)}" if names else f"no {what} are defined"


def _check_listeners(draft: Draft) -> None:
    if not draft.known("listen", "control_listen"):
        return
    data, control = draft["listen"], draft["control_listen"]
    same_host = data.host == control.host or {data.host, control.host} & _WILDCARD_HOSTS
    if data.port and data.port == control.port and same_host:
        draft.problem("control_listen", f"must not be the same address as listen ({data})")


def _check_deployment_profiles(draft: Draft) -> None:
    if not draft.known("profiles", "deployments"):
        return
    names = [profile.name for profile in draft["profiles"] if known(profile.name)]
    for deployment in draft["deployments"]:
        if not known(deployment.profile) or deployment.profile in names:
            continue
        draft.add(issue_at(deployment, "profile", f"no profile named '{deployment.profile}' "
                                                  f"({_hint(deployment.profile, names, 'profiles')})"))


def _check_autoscaled_profiles(draft: Draft) -> None:
    """An autoscaled deployment is keyed by its profile: that profile has no other deployment."""
    if not draft.known("deployments"):
        return
    first: dict[str, Any] = {}
    for deployment in draft["deployments"]:
        if known(deployment.profile) and deployment.profile not in first:
            first[deployment.profile] = deployment
        elif known(deployment.profile) and (deployment.autoscaled or first[deployment.profile].autoscaled):
            earlier = first[deployment.profile]
            draft.add(issue_at(deployment, "profile", f"profile '{deployment.profile}' is also deployed by "
                                                      f"{earlier.key_of()} on line {earlier.line_of()}; an "
                                                      "autoscaled profile has one deployment"))


def _check_model_routing(draft: Draft) -> None:
    """A model name served by several declarations must be routed the same way by all of them."""
    if not draft.known("models", "profiles"):
        return
    declarations = [(model, "name", model.name) for model in draft["models"]]
    declarations += [(profile, "served_model_name", profile.served_model_name) for profile in draft["profiles"]]
    first: dict[str, tuple[Any, str]] = {}  # a ModelConfig or a Profile, as far as it was read
    for obj, name_attr, model_name in declarations:
        if not known(model_name, obj.routing, obj.routing_options):
            continue
        if model_name not in first:
            first[model_name] = (obj, name_attr)
            continue
        earlier, earlier_attr = first[model_name]
        if name_attr == earlier_attr == "name":
            continue  # two entries under models: already a duplicate name
        where = f"{earlier.key_of(earlier_attr)} on line {earlier.line_of(earlier_attr)}"
        if obj.routing != earlier.routing:
            draft.add(issue_at(obj, "routing", f"model '{model_name}' is also declared by {where} with routing "
                                               f"'{earlier.routing}'; one model has one routing tier"))
        elif obj.routing_options != earlier.routing_options:
            draft.add(issue_at(obj, "routing_options", f"model '{model_name}' is also declared by {where} "
                                                       "with different routing_options"))


def _check_adapter_names(draft: Draft) -> None:
    """A LoRA adapter's name is a model name to clients: it must not be a model's, nor another model's adapter's."""
    if not draft.known("models", "profiles"):
        return
    served = {model.name for model in draft["models"]} | {profile.served_model_name for profile in draft["profiles"]}
    owners: dict[str, str] = {}
    for obj, model_name in [(m, m.name) for m in draft["models"]] + [(p, p.served_model_name)
                                                                       for p in draft["profiles"]]:
        for adapter in obj.lora_adapters if known(obj.lora_adapters) else ():
            if not known(adapter.name):
                continue
            if adapter.name in served:
                draft.add(issue_at(adapter, "name", f"LoRA adapter '{adapter.name}' has the name of a model; "
                                                    "clients could not ask for one or the other"))
            elif owners.setdefault(adapter.name, model_name) != model_name:
                draft.add(issue_at(adapter, "name", f"LoRA adapter '{adapter.name}' is also an adapter of model "
                                                    f"'{owners[adapter.name]}'; one name routes to one model"))


def _check_agent_token(draft: Draft) -> None:
    if not draft.known("deployments", "agents") or not draft["deployments"]:
        return
    agents = draft["agents"]
    if not known(agents.embedded, agents.token, agents.tokens) or agents.embedded or agents.token is not None \
            or agents.tokens:
        return
    message = ("agents.token is required for remote agents (deployments run on agents); "
               "set one, or set agents.embedded: true to run them on this machine only")
    line = agents.line_of() if draft.was_written("agents") else draft.line_of("deployments")
    draft.add(ConfigIssue(draft.where.file, line, agents.key_of("token"), message))


def _check_metrics_auth(draft: Draft) -> None:
    if not draft.known("metrics", "admin_tokens") or draft["admin_tokens"]:
        return
    metrics = draft["metrics"]
    if known(metrics.require_auth) and metrics.require_auth:
        draft.add(issue_at(metrics, "require_auth", "needs admin_tokens: /metrics would ask for a token that "
                                                    "nobody can have"))
