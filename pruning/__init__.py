"""Token-pruning policies. ``pruning`` knows nothing of Gradio, files or HTTP."""

from pruning.base import NoPruning, Policy

POLICIES: dict[str, type[Policy]] = {"none": NoPruning}


def make_policy(name: str = "none", speed: float = 0.0) -> Policy:
    """A policy by registry name, with parameters from the speed slider.

    ``auto`` is the design card's default pipeline; until its policies land it means no pruning.
    """
    if name == "auto":
        name = "none"
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(['auto', *POLICIES])}")
    return POLICIES[name].from_speed(speed)


__all__ = ["POLICIES", "NoPruning", "Policy", "make_policy"]
