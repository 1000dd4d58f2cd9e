"""Token-pruning policies, their composition and the speed slider.

``pruning`` knows nothing of Gradio, files or HTTP.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields, replace

from glimpse.common import UserError
from glimpse.common.jsonable import plain_number
from glimpse.pruning.base import NoPruning, Policy
from glimpse.pruning.compose import Pipeline
from glimpse.pruning.dash import DASH
from glimpse.pruning.divprune import DivPrune
from glimpse.pruning.fastv import FastV
from glimpse.pruning.frontier import Frontier, Member, Point, design_pipeline_members, uncalibrated_frontier
from glimpse.pruning.hidivdrop import HiDivDrop
from glimpse.pruning.lazyllm import LazyLLM
from glimpse.pruning.rlt import RLT
from glimpse.pruning.st3 import ST3
from glimpse.pruning.zipvl import ZipVL

POLICIES: dict[str, type[Policy]] = {
    "none": NoPruning,
    "dash": DASH,
    "zipvl": ZipVL,
    "st3": ST3,
    "lazyllm": LazyLLM,
    "fastv": FastV,
    "hidivdrop": HiDivDrop,
    "divprune": DivPrune,
    "rlt": RLT,
}
NAMES = ["auto", *POLICIES]  # what --policy, the chat's dropdown and the API accept
PRUNING_NAMES = [name for name in POLICIES if name != "none"]  # the policies a benchmark compares
TEXT_PRUNING_NAMES = [name for name, policy in POLICIES.items() if policy.prunes_text]  # ... on text-only prompts


def prunes_nothing(policy: Policy) -> bool:
    """No pruning at all, so every layer computes every prompt token exactly as an unpruned model does:
    ``none``, or ``auto`` where the frontier selects nothing (speed 0). Such a prefill may reuse another
    unpruned prompt's keys and values (pipeline/prefix_cache.py). A policy that merely happens to prune
    nothing at its parameters is not counted: its callbacks still run."""
    if isinstance(policy, Pipeline):
        return all(prunes_nothing(member) for member in policy.policies)
    return type(policy) is NoPruning


def configuration(members: tuple[Member, ...], label: str = "") -> Pipeline:
    """A configuration (``pruning.frontier``) as one policy: its members from the slider, then
    their overrides, run in order."""
    policies = []
    for member in members:
        if member.policy not in POLICIES:
            raise UserError(f"unknown policy {member.policy!r} in a configuration; available: {', '.join(POLICIES)}")
        policies.append(_override(POLICIES[member.policy].from_speed(member.speed), dict(member.params)))
    return Pipeline(policies=tuple(policies), label=label)


def design_pipeline(speed: float) -> Pipeline:
    """The design card's pipeline at one speed: HiDivDrop's late injection, early exit and pyramid,
    then DASH's halting in prefill, then ST3's visual-KV annealing in decode. One candidate of the
    frontier that ``auto`` reads, chosen only where calibration measured that it keeps quality."""
    return configuration(design_pipeline_members(speed))


def make_policy(name: str = "auto", speed: float = 0.0, overrides: dict | None = None,
                frontier: Frontier | None = None) -> Policy:
    """A policy by registry name with parameters from the speed slider, then ``overrides``.

    ``auto`` runs the configuration ``frontier`` selects at ``speed`` (the model's calibrated
    frontier; without one, the uncalibrated default). ``overrides`` maps parameter names to values
    (``{"rho": 0.5}``); for ``auto`` prefix them with the member's name (``{"lazyllm.percentiles": ...}``).
    """
    if overrides is not None and not isinstance(overrides, dict):
        raise UserError(f"overrides are a dict of parameter names to values, e.g. {{'rho': 0.5}}; got {overrides!r}")
    speed = plain_number(speed)
    if name == "auto":
        frontier = frontier or uncalibrated_frontier()
        point = frontier.choose(speed)
        policy = configuration(point.members if point else (), label="auto")
        members = {p.name: p for p in policy.policies}
        by_member: dict[str, dict] = {}
        for key, value in (overrides or {}).items():
            member, _, param = key.partition(".")
            if not members:  # speed 0 (or a frontier point that prunes nothing): nothing to set
                raise UserError(f"auto prunes nothing at speed {speed:g}, so it has no parameters to set ({key!r}); "
                                "raise the speed, or choose the policy by name to set its parameters")
            if member not in members or not param:
                chosen = ", ".join(members)
                raise UserError(f"auto's parameters are named member.param; its members at speed {speed:g}: "
                                 f"{chosen}; got {key!r}")
            by_member.setdefault(member, {})[param] = value
        policy = Pipeline(policies=tuple(_override(p, by_member.get(p.name, {})) for p in policy.policies), label="auto")
    elif name in POLICIES:
        policy = _override(POLICIES[name].from_speed(speed), overrides or {})
    else:
        raise UserError(f"unknown policy {name!r}; available: {', '.join(NAMES)}")
    policy.check()  # what can be refused before a model is loaded is refused now
    return policy


def parse_params(items) -> dict:
    """Parameter overrides as users write them, one ``name=value`` each (the CLI's ``--param``, the
    chat's overrides box): ``["rho=0.6", "percentiles=[0.3,0.4,0.5]"]`` -> ``{"rho": 0.6, "percentiles":
    [0.3, 0.4, 0.5]}``. A value is read as JSON when it is JSON, else kept as text."""
    params = {}
    for item in items:
        name, sep, text = item.partition("=")
        name, text = name.strip(), text.strip()
        if not sep or not name:
            raise UserError(f"a parameter is written name=value, got {item!r}")
        try:
            params[name] = json.loads(text)
        except json.JSONDecodeError:
            params[name] = text
    return params


def _override(policy: Policy, overrides: dict) -> Policy:
    allowed = {f.name for f in fields(policy) if f.init}
    unknown = set(overrides) - allowed
    if unknown and not allowed:  # `none`
        raise UserError(f"{policy.name} has no parameters to set (got {', '.join(sorted(unknown))})")
    if unknown:
        raise UserError(f"{policy.name} has no parameter {', '.join(sorted(unknown))}; "
                         f"its parameters: {', '.join(sorted(allowed))}")
    types = {f.name: f.type for f in fields(policy)}
    # numpy's numbers as Python's: checked as those, and kept in the policy's parameters as JSON can write them
    overrides = {name: [plain_number(v) for v in value] if isinstance(value, (list, tuple)) else plain_number(value)
                 for name, value in overrides.items()}
    for name, value in overrides.items():
        # JSON readers take NaN and Infinity, and NaN passes any range check written as `if x < low: raise`.
        items = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(item, float) and not math.isfinite(item) for item in items):
            finite = "finite numbers" if isinstance(value, (list, tuple)) else "a finite number"
            raise UserError(f"{policy.name}.{name} must be {finite}, got {value!r}")
        if not _fits(value, str(types[name])):
            hint = ""
            if isinstance(value, str) and "tuple" in str(types[name]):  # (0.3, 0.4) is not JSON: it stays text
                hint = f"; write a list as JSON, e.g. {name}=[0.3, 0.4]"
            raise UserError(f"{policy.name}.{name} must be {types[name]}, got {value!r}{hint}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    return replace(policy, **values)


def _fits(value, annotation: str) -> bool:
    """Whether a user's value (parsed from JSON) fits a parameter's annotation: ``float``, ``int``,
    ``bool``, ``str``, ``tuple[float, ...]``, ``tuple[int, ...]``, each possibly ``| None``."""
    for option in (part.strip() for part in annotation.split("|")):
        if option == "None" and value is None:
            return True
        if option == "bool" and isinstance(value, bool):
            return True
        if option == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if option == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if option == "str" and isinstance(value, str):
            return True
        if option.startswith("tuple[") and isinstance(value, (list, tuple)):
            item = option[len("tuple["):].split(",")[0].strip()
            if all(_fits(v, item) for v in value):
                return True
    return False


__all__ = ["DASH", "DivPrune", "NAMES", "POLICIES", "PRUNING_NAMES", "TEXT_PRUNING_NAMES", "FastV", "Frontier", "HiDivDrop", "LazyLLM", "Member", "NoPruning", "Pipeline",
           "Point", "Policy", "RLT", "ST3", "ZipVL", "configuration", "design_pipeline", "make_policy", "parse_params"]
