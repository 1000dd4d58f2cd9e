"""Token-pruning policies, their composition and the speed slider.

``pruning`` knows nothing of Gradio, files or HTTP.
"""

from __future__ import annotations

from dataclasses import fields, replace

from pruning.base import NoPruning, Policy
from pruning.compose import Pipeline
from pruning.dash import DASH
from pruning.fastv import FastV
from pruning.hidivdrop import HiDivDrop
from pruning.lazyllm import LazyLLM
from pruning.st3 import ST3
from pruning.zipvl import ZipVL

POLICIES: dict[str, type[Policy]] = {
    "none": NoPruning,
    "dash": DASH,
    "zipvl": ZipVL,
    "st3": ST3,
    "lazyllm": LazyLLM,
    "fastv": FastV,
    "hidivdrop": HiDivDrop,
}
NAMES = ["auto", *POLICIES]


def default_pipeline(speed: float) -> Pipeline:
    """``auto``: the design card's default pipeline at one speed: HiDivDrop's late injection, early
    exit and pyramid, then DASH's halting in prefill, then ST3's visual-KV annealing in decode.
    """
    return Pipeline(policies=(HiDivDrop.from_speed(speed), DASH.from_speed(speed), ST3.annealing_only(speed)),
                    label="auto")


def make_policy(name: str = "auto", speed: float = 0.0, overrides: dict | None = None) -> Policy:
    """A policy by registry name with parameters from the speed slider, then ``overrides``.

    ``overrides`` maps parameter names to values (``{"rho": 0.5}``); for ``auto`` prefix them with
    the member's name (``{"dash.rho": 0.5}``).
    """
    if name == "auto":
        policy = default_pipeline(speed)
        members = {p.name: p for p in policy.policies}
        by_member: dict[str, dict] = {}
        for key, value in (overrides or {}).items():
            member, _, param = key.partition(".")
            if member not in members or not param:
                raise ValueError(f"auto's parameters are named member.param, members: {', '.join(members)}; got {key!r}")
            by_member.setdefault(member, {})[param] = value
        return Pipeline(policies=tuple(_override(p, by_member.get(p.name, {})) for p in policy.policies), label="auto")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(NAMES)}")
    return _override(POLICIES[name].from_speed(speed), overrides or {})


def _override(policy: Policy, overrides: dict) -> Policy:
    allowed = {f.name for f in fields(policy) if f.init}
    unknown = set(overrides) - allowed
    if unknown:
        raise ValueError(f"{policy.name} has no parameter {', '.join(sorted(unknown))}; "
                         f"its parameters: {', '.join(sorted(allowed))}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    return replace(policy, **values)


__all__ = ["DASH", "NAMES", "POLICIES", "FastV", "HiDivDrop", "LazyLLM", "NoPruning", "Pipeline", "Policy", "ST3",
           "ZipVL", "default_pipeline", "make_policy"]
