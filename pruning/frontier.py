"""`auto`: the slider as the measured speed/quality frontier of the model in use.

A *configuration* is a short list of members — a registry policy at a speed, plus parameter
overrides — run in order as one ``Pipeline``. Calibration (``glimpse calibrate slider``) measures
configurations on label-free prompts against the unpruned model: its agreement (the share of
answers that stay exactly the unpruned model's) and its cost (prefill FLOPs, and end-to-end time of
prefill plus a typical answer, both as a share of the unpruned model's). The *frontier* is what
survives: the configurations no other one beats on both cost and agreement.

``auto`` at speed ``s`` asks for agreement of at least ``required(s) = 1 - s (1 - floor)`` (of its
lower bound: the measured agreement less one standard error) and runs the cheapest frontier point
that reaches it. So speed 0 asks for 1.0, which only the unpruned model
has (exact), speed 1 asks for the floor, and as the speed rises the requirement only falls: the
chosen point never prunes less (fewer prefill FLOPs) and, because the frontier admits no point
measured slower end to end than a dearer one (beyond ``E2E_TOLERANCE``, the timing noise), never gets
slower end to end. Where nothing measured
reaches the requirement, ``auto`` prunes nothing.

This module is pure: profiles are read and written by ``pipeline.profiles``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from glimpse.pruning.base import check_speed

# The agreement speed 1 may fall to, judged by its lower bound (``Point.agreement_bound``): 75% of
# the answers stay exactly the unpruned model's on the calibration prompts, within one standard
# error. Speed 0.5 then asks for 87.5%, speed 0.25 for 93.75%. docs/slider.md has how this was
# chosen and what it kept on held-out questions.
DEFAULT_FLOOR = 0.75
# End-to-end ratios measured on a shared machine move by a few percent from run to run; a cheaper
# frontier point may be timed up to this much slower than a dearer one before it is dropped.
E2E_TOLERANCE = 0.03


@dataclass(frozen=True)
class Member:
    """One policy of a configuration: a registry name, a slider speed and parameter overrides."""

    policy: str
    speed: float
    params: tuple[tuple[str, object], ...] = ()  # (name, value) pairs, hashable

    @classmethod
    def of(cls, policy: str, speed: float, **params) -> "Member":
        return cls(policy, float(speed), tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                                      for k, v in params.items())))

    @property
    def label(self) -> str:
        extra = ",".join(f"{k}={_short(v)}" for k, v in self.params)
        return f"{self.policy}@{self.speed:g}" + (f"[{extra}]" if extra else "")

    def to_json(self) -> dict:
        return {"policy": self.policy, "speed": self.speed,
                "params": {k: list(v) if isinstance(v, tuple) else v for k, v in self.params}}

    @classmethod
    def from_json(cls, data: dict) -> "Member":
        return cls.of(data["policy"], data["speed"], **data.get("params", {}))


def configuration_name(members: tuple[Member, ...]) -> str:
    return "+".join(m.label for m in members) or "none"


@dataclass(frozen=True)
class Point:
    """A measured configuration. Ratios are policy / unpruned, measured side by side."""

    members: tuple[Member, ...]
    agreement: float  # share of answers identical to the unpruned model's
    flops_ratio: float  # prefill FLOPs proxy
    e2e_ratio: float | None = None  # prefill + a typical answer, wall time; None: rejected before timing
    token_match: float | None = None  # greedy-token match rate over the answer
    first_token_kl: float | None = None  # KL(p_unpruned || p_policy) of the first token
    prefill_ratio: float | None = None  # decoder prefill wall time (less the wait for the vision encoder)
    decode_speedup: float | None = None  # decode tokens/s, policy / unpruned
    kv_ratio: float | None = None  # KV-cache bytes at the end of the answer
    prompts: int = 0  # calibration prompts the agreement was measured on

    @property
    def name(self) -> str:
        return configuration_name(self.members)

    @property
    def agreement_bound(self) -> float:
        """The agreement less one standard error of its estimate over ``prompts`` answers. The
        frontier is the best of many noisy estimates, so its points' measured agreement runs high
        (on the embedded model, 6-11 points above the same configurations on held-out questions);
        choosing by the bound asks more of a point measured on few prompts.

        The standard error is taken at ``(k + 1/2) / (n + 1)`` for k agreeing of n, not at k / n: at
        k = n the latter is 0, and 12 of 12 read "at least 100%" (now 94%; 40 of 40, 98%)."""
        if self.prompts <= 0:
            return self.agreement
        n = self.prompts
        shrunk = (self.agreement * n + 0.5) / (n + 1)
        return self.agreement - math.sqrt(shrunk * (1.0 - shrunk) / n)

    def to_json(self) -> dict:
        out = {"name": self.name, "members": [m.to_json() for m in self.members]}
        for key in ("agreement", "token_match", "first_token_kl", "flops_ratio", "prefill_ratio", "decode_speedup",
                    "e2e_ratio", "kv_ratio", "prompts"):
            out[key] = getattr(self, key)
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Point":
        keys = ("agreement", "token_match", "first_token_kl", "flops_ratio", "prefill_ratio", "decode_speedup",
                "e2e_ratio", "kv_ratio", "prompts")
        point = cls(tuple(Member.from_json(m) for m in data["members"]), **{k: data[k] for k in keys if k in data})
        return point.check()

    def check(self) -> "Point":
        """This point, if it can be what a calibration measured; else ValueError. A stored profile is read back
        through here: one edited by hand (an e2e_ratio of 0 divided by zero in ``Frontier.promise``, a speed of 7
        promised ``divprune@7``: an outside pass) is then ignored with a warning, not run."""
        for member in self.members:
            check_speed(member.speed)
        ratios = [self.flops_ratio] + ([] if self.e2e_ratio is None else [self.e2e_ratio])
        if not (0.0 <= self.agreement <= 1.0 and all(math.isfinite(r) and r > 0.0 for r in ratios)
                and isinstance(self.prompts, int) and self.prompts >= 0):
            raise ValueError(f"{self.name}: not a measurement (agreement {self.agreement!r} in [0, 1], ratios "
                             f"{ratios!r} above 0, prompts {self.prompts!r} a count)")
        return self


def pareto_frontier(points: list[Point]) -> list[Point]:
    """The measured points that no other beats on both prefill FLOPs and agreement, cheapest first.

    Only points faster end to end than the unpruned model are admitted. Cost is the prefill FLOPs
    proxy (exact and repeatable; a shared machine's timings are not), and end-to-end time is held to
    it: walking from the dearest point to the cheapest, a point measured more than ``E2E_TOLERANCE``
    slower end to end than a dearer one is dropped (its decode costs more than its prefill saves,
    as LazyLLM's per-step revival or ZipVL's dequantisation can). So along the frontier FLOPs fall,
    agreement falls, and end-to-end time never rises beyond the timing noise.
    """
    admitted = sorted((p for p in points if p.e2e_ratio is not None and p.e2e_ratio < 1.0 and p.flops_ratio < 1.0),
                      key=lambda p: (p.flops_ratio, -p.agreement, p.e2e_ratio))
    frontier: list[Point] = []
    best = -1.0
    for point in admitted:  # cheapest first: keep each point that agrees better than every cheaper one
        if point.agreement > best:
            frontier.append(point)
            best = point.agreement
    kept: list[Point] = []
    for point in reversed(frontier):  # dearest first
        if not kept or point.e2e_ratio <= min(k.e2e_ratio for k in kept) + E2E_TOLERANCE:
            kept.append(point)
    return kept[::-1]


def required_agreement(speed: float, floor: float) -> float:
    return 1.0 - check_speed(speed) * (1.0 - floor)


@dataclass
class Frontier:
    """What ``auto`` runs on one model, and the promise it makes at each speed."""

    points: list[Point]  # the frontier, cheapest first
    floor: float = DEFAULT_FLOOR
    calibrated: bool = False  # measured on this model
    source: str = ""  # where the numbers come from, for the reports
    answer_tokens: int = 64  # the "typical answer" behind e2e_ratio
    measured: list[Point] = field(default_factory=list)  # every configuration calibration measured
    unmeasured: int = 0  # candidates a calibration stopped short of (its budget): the frontier may miss points

    def choose(self, speed: float) -> Point | None:
        """The cheapest frontier point whose agreement reaches ``required(speed)``; None: prune nothing.
        Speed 0 is always exact: agreement measured on a finite set is never a proof of it."""
        need = required_agreement(speed, self.floor)
        if speed == 0.0:
            return None
        reaching = [p for p in self.points if p.agreement_bound >= need - 1e-9]
        return min(reaching, key=lambda p: p.flops_ratio) if reaching else None

    def promise(self, speed: float) -> dict:
        """What ``auto`` at ``speed`` selects and what was measured of it, for the UI and the reports."""
        point = self.choose(speed)
        out = {"policy": "auto", "speed": speed, "calibrated": self.calibrated, "source": self.source,
               "floor": self.floor, **self._provenance()}
        incomplete = (f"; calibration incomplete: {self.unmeasured} of {self.unmeasured + len(self.measured)} "
                      "candidates not measured yet (rerun `glimpse calibrate slider`)"
                      if self.calibrated and self.unmeasured else "")
        if point is None:
            text = "exact: no pruning, the unpruned model's answer"
            if speed > 0.0:
                text = ("no pruning at this speed: nothing measured keeps the answers it asks for" + incomplete
                        if self.calibrated else "uncalibrated: no pruning at this speed (the default keeps too "
                        "few answers here); run `glimpse calibrate slider` for this model's frontier")
            out.update(configuration="none", agreement=1.0, flops_speedup=1.0, e2e_speedup=1.0, text=text)
            return out
        flops, e2e = 1.0 / point.flops_ratio, 1.0 / point.e2e_ratio
        out.update(configuration=point.name, agreement=point.agreement, flops_speedup=flops, e2e_speedup=e2e,
                   prompts=point.prompts)
        if self.calibrated:
            text = (f"{point.name}: keeps {point.agreement:.0%} of answers on the calibration set "
                    f"({point.prompts} prompts; at least {point.agreement_bound:.0%} within one standard error), "
                    f"{flops:.1f}x fewer prefill FLOPs, {end_to_end(e2e)} "
                    f"(prefill + {self.answer_tokens}-token answer)") + incomplete
        else:
            text = (f"uncalibrated: {point.name}; on the embedded model it kept {point.agreement:.0%} of answers "
                    f"with {flops:.1f}x fewer prefill FLOPs; run `glimpse calibrate slider` for this model's numbers")
        out["text"] = text
        return out

    def _provenance(self) -> dict:
        """Whose numbers a promise's fields are, for a reader of the JSON: this model's calibration (``complete``
        once every candidate was measured) or, uncalibrated, the embedded model's measurements."""
        if self.calibrated:
            return {"measured_on": "this model", "complete": not self.unmeasured}
        return {"measured_on": "the embedded model"}

    def promise_for(self, name: str, speed: float) -> dict:
        """A named policy at ``speed`` (not ``auto``): what calibration measured of it, if it did."""
        out = {"policy": name, "speed": speed, "calibrated": False, "source": self.source, **self._provenance()}
        if name == "none" or speed == 0.0:  # exact whatever was measured: the model's calibration, as auto's speed 0
            out.update(configuration="none", agreement=1.0, calibrated=self.calibrated,
                       text="exact: no pruning, the unpruned model's answer")
            return out
        label = Member.of(name, speed).label
        point = next((p for p in self.measured if p.name == label), None)
        if point is None or not self.calibrated:
            # Said as what it is: "calibrated": false beside "measured_on": "this model" and "complete": true read as
            # a contradiction (found from outside, for RLT, added after the shipped frontier was measured).
            among = (f"not among the {len(self.measured) + self.unmeasured} candidates calibrated on this model"
                     if self.calibrated else "not measured on this model")
            out.update(configuration=label, text=f"{label}: {among} (auto picks measured settings; asked by name, "
                                                 "it runs as set)")
            return out
        if point.e2e_ratio is None:  # stopped early: far below the floor
            out.update(configuration=label, calibrated=True, agreement=point.agreement, prompts=point.prompts,
                       text=f"{label}: keeps only {point.agreement:.0%} of answers on the first {point.prompts} "
                            f"calibration prompts, far below what auto asks at any speed: auto never runs it; asked "
                            f"by name, it runs as set")
            return out
        out.update(configuration=label, calibrated=True, agreement=point.agreement, prompts=point.prompts,
                   flops_speedup=1.0 / point.flops_ratio, e2e_speedup=1.0 / point.e2e_ratio,
                   text=f"{label}: keeps {point.agreement:.0%} of answers on the calibration set ({point.prompts} "
                        f"prompts), {1.0 / point.flops_ratio:.1f}x fewer prefill FLOPs, "
                        f"{end_to_end(1.0 / point.e2e_ratio)} (prefill + {self.answer_tokens}-token answer)")
        return out

    def to_json(self) -> dict:
        return {"kind": "slider", "floor": self.floor, "calibrated": self.calibrated, "source": self.source,
                "answer_tokens": self.answer_tokens, "frontier": [p.to_json() for p in self.points],
                "measured": [p.to_json() for p in self.measured], "unmeasured": self.unmeasured}

    @classmethod
    def from_json(cls, data: dict, calibrated: bool | None = None) -> "Frontier":
        floor = data.get("floor", DEFAULT_FLOOR)
        if not (isinstance(floor, (int, float)) and 0.0 < floor <= 1.0):  # as --floor takes it
            raise ValueError(f"floor {floor!r}: not an agreement in (0, 1]")
        return cls([Point.from_json(p) for p in data["frontier"]], floor=floor,
                   calibrated=data.get("calibrated", True) if calibrated is None else calibrated,
                   source=data.get("source", ""), answer_tokens=data.get("answer_tokens", 64),
                   measured=[Point.from_json(p) for p in data.get("measured", [])],
                   unmeasured=data.get("unmeasured", 0))


def _short(value) -> str:
    if isinstance(value, (list, tuple)):
        return "/".join(_short(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# ------------------------------------------------------------------------------- candidates
def design_pipeline_members(speed: float) -> tuple[Member, ...]:
    """The design card's pipeline: HiDivDrop's late injection, exit and pyramid, then DASH's halting,
    then ST3's visual-KV annealing in decode (no PVTP)."""
    return (Member.of("hidivdrop", speed), Member.of("dash", speed),
            Member.of("st3", speed, first_drop=0.0, end_keep=1.0))


def candidates() -> list[tuple[Member, ...]]:
    """What ``glimpse calibrate slider`` measures by default: every policy over a grid of speeds,
    the design card's pipeline, and the compositions the embedded model's measurements suggested
    (docs/slider.md): LazyLLM past its slider's end, LazyLLM or ST3 with ST3's decode annealing or
    ZipVL's packed KV, FastV's early cut under LazyLLM, an early vision exit under LazyLLM, and FastV's
    and LazyLLM's cuts with the pruned visual tokens merged into the kept ones (``merge=True``); DivPrune's
    diverse visual tokens chosen before the first layer; and RLT's repeated video tokens left out before the
    encoder, alone and under DivPrune and LazyLLM."""
    anneal = dict(first_drop=0.0, end_keep=1.0)  # ST3's decode half alone
    packed_kv = dict(tau_image=1.0, tau_video=1.0)  # ZipVL's 4/2-bit KV in decode, no sparse prefill
    out: list[tuple[Member, ...]] = []
    for speed in (0.25, 0.5, 0.75, 1.0):
        out += [(Member.of("lazyllm", speed),), (Member.of("st3", speed),), (Member.of("fastv", speed),)]
    out += [(Member.of("dash", s),) for s in (0.25, 0.5, 1.0)]
    out += [(Member.of("zipvl", s),) for s in (0.5, 1.0)]
    out += [(Member.of("hidivdrop", s),) for s in (0.25, 0.5, 1.0)]
    # HiDivDrop without its late injection (pyramid and early exit only): which part loses answers
    out += [(Member.of("hidivdrop", s, inject_fraction=0.0),) for s in (0.5, 1.0)]
    out += [design_pipeline_members(s) for s in (0.25, 0.5, 1.0)]
    out += [
        (Member.of("lazyllm", 1.0, decode_reselect=True),),  # the paper's decode, for comparison
        (Member.of("lazyllm", 1.0, percentiles=[0.5, 0.65, 0.8]),),
        (Member.of("lazyllm", 1.0, percentiles=[0.6, 0.75, 0.9]),),
        (Member.of("lazyllm", 1.0, depth_fractions=[0.1, 0.3, 0.5]),),
        (Member.of("lazyllm", 1.0, prune_text=False),),  # visual tokens only
        (Member.of("lazyllm", 1.0, prune_text=False, percentiles=[0.5, 0.65, 0.8]),),
        (Member.of("lazyllm", 1.0, prune_text=False, percentiles=[0.6, 0.75, 0.9]),),
        (Member.of("lazyllm", 1.0, prune_text=False, depth_fractions=[0.2, 0.4, 0.6], percentiles=[0.5, 0.6, 0.7]),),
        (Member.of("lazyllm", 1.0, prune_text=False, depth_fractions=[0.2, 0.4, 0.6], percentiles=[0.2, 0.3, 0.4]),),
        (Member.of("lazyllm", 1.0, prune_text=False, depth_fractions=[0.2, 0.4, 0.6], percentiles=[0.3, 0.4, 0.5]),),
        (Member.of("lazyllm", 1.0, prune_text=False, depth_fractions=[0.2, 0.4, 0.6], percentiles=[0.4, 0.5, 0.6]),),
        (Member.of("lazyllm", 1.0, prune_text=False, depth_fractions=[0.2, 0.4, 0.6], percentiles=[0.6, 0.7, 0.8]),),
        (Member.of("lazyllm", 1.0, prune_text=False, depth_fractions=[0.15, 0.3, 0.5], percentiles=[0.5, 0.6, 0.7]),),
        (Member.of("lazyllm", 1.0, prune_text=False, depth_fractions=[0.1, 0.2, 0.4], percentiles=[0.4, 0.5, 0.6]),),
        (Member.of("lazyllm", 0.5), Member.of("st3", 0.5, **anneal)),
        (Member.of("lazyllm", 1.0), Member.of("st3", 1.0, **anneal)),
        (Member.of("st3", 1.0), Member.of("zipvl", 0.5, **packed_kv)),
        (Member.of("lazyllm", 1.0), Member.of("zipvl", 0.5, **packed_kv)),
        (Member.of("fastv", 0.25), Member.of("lazyllm", 1.0)),
        (Member.of("fastv", 0.5), Member.of("lazyllm", 1.0)),
        (Member.of("hidivdrop", 0.0, exit_fraction=0.5), Member.of("lazyllm", 0.5)),
        (Member.of("hidivdrop", 0.0, exit_fraction=0.6), Member.of("fastv", 0.25)),
    ]
    # Merging instead of dropping (pruning.base.merge_into_kept): FastV's one cut and LazyLLM's
    # visual-only stages, where dropping lost the most answers (docs/pruning.md).
    merge = dict(merge=True)
    out += [(Member.of("fastv", 0.9, layer=6),), (Member.of("fastv", 0.95, layer=6),)]  # the same cuts, dropped
    out += [(Member.of("fastv", 0.75, **merge),), (Member.of("fastv", 0.8, layer=4, **merge),),
            (Member.of("fastv", 0.9, layer=6, **merge),), (Member.of("fastv", 0.95, layer=6, **merge),),
            (Member.of("lazyllm", 1.0, **merge),)]
    visual_only = dict(prune_text=False, **merge)
    out += [(Member.of("lazyllm", 1.0, depth_fractions=[0.2, 0.4, 0.6], percentiles=p, **visual_only),)
            for p in ([0.4, 0.5, 0.6], [0.5, 0.6, 0.7], [0.6, 0.7, 0.8], [0.7, 0.8, 0.9])]
    out += [(Member.of("lazyllm", 1.0, depth_fractions=[0.15, 0.3, 0.5], percentiles=[0.5, 0.6, 0.7], **visual_only),),
            (Member.of("lazyllm", 1.0, depth_fractions=[0.1, 0.2, 0.4], percentiles=[0.4, 0.5, 0.6], **visual_only),)]
    # DivPrune (pruning/divprune.py): the most diverse visual tokens of each image or frame, chosen before
    # layer 0; its slider keeps 1 - 0.8 s of them, and 30% and 25% are the steps between 0.75 and 1.
    out += [(Member.of("divprune", s),) for s in (0.25, 0.5, 0.75, 1.0)]
    out += [(Member.of("divprune", 1.0, keep=k),) for k in (0.3, 0.25)]
    # RLT (pruning/rlt.py): a video's repeated tokens left out before the vision encoder (images untouched),
    # alone and under the policies that prune what it keeps.
    out += [(Member.of("rlt", s),) for s in (0.5, 1.0)]
    out += [(Member.of("rlt", 1.0), Member.of("divprune", s)) for s in (0.5, 1.0)]
    out += [(Member.of("rlt", 1.0), Member.of("lazyllm", 1.0))]
    return out


# ------------------------------------------------------------------------------- uncalibrated
# LazyLLM's slider settings (prefill only) as the embedded model's calibration measured them on run 10,
# its weights before they were fine-tuned with DivPrune in the loop (docs/benchmarks.md, "Calibration of
# run 10's weights"): speed, agreement, prefill FLOPs ratio, end-to-end ratio. A checkpoint nobody has
# calibrated was not trained with any pruning either, as run 10 was not; LazyLLM is the one policy that
# kept run 10's answers at every speed, so it is the conservative choice there. (DivPrune, which the
# shipped run 14 was trained for, is not: training-free on run 10 it kept 75% of the answers at 3x.) The
# promise says the numbers are another model's.
UNCALIBRATED_LAZYLLM = ((0.25, 0.9, 0.8318, 0.9801), (0.5, 0.875, 0.6941, 0.9663), (0.75, 0.8, 0.5858, 0.9465),
                        (1.0, 0.825, 0.4994, 0.9237))


def uncalibrated_frontier() -> Frontier:
    points = [Point((Member.of("lazyllm", speed),), agreement, flops, e2e, prompts=40)
              for speed, agreement, flops, e2e in UNCALIBRATED_LAZYLLM]
    return Frontier(pareto_frontier(points), calibrated=False,
                    source="uncalibrated: LazyLLM's slider settings, measured on the embedded model")


def end_to_end(speedup: float) -> str:
    """A measured end-to-end speed-up in words: "1.20x faster end to end", or "1.03x slower end to end" under 1
    (a named policy can be slower: "0.97x faster" read as a speed-up), or "as fast end to end" within half a
    percent (0.998 read "1.00x slower")."""
    if abs(speedup - 1.0) < 0.005:
        return "as fast end to end"
    return (f"{speedup:.2f}x faster end to end" if speedup >= 1.0 else f"{1.0 / speedup:.2f}x slower end to end")
