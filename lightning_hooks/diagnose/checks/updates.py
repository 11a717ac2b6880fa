"""Checks on the optimizer's steps: each layer's update against its weights, weight decay, rounding in bf16/fp16."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from lightning_hooks.core.select import label
from lightning_hooks.diagnose.checks.snapshot import (
    SETTLED,
    SHOWN_LAYERS,
    Evidence,
    Snapshot,
    Thresholds,
    listed,
    peer_medians,
    reached,
)

__all__ = [
    "PEER_GAP",
    "update_ratio",
    "HEAVY_DECAY",
    "SHRUNK",
    "decayed_away",
    "ROUNDED",
    "rounded_away",
    "unoptimized",
    "FADED",
]

PEER_GAP = 10.0
"""``update_ratio`` names a layer above ``update_ratio_high`` when its parameter group's learning rate is this many
times its peers', and one below ``update_ratio_low`` under an adaptive optimizer when it is this many times below."""


def update_ratio(
    snap: Snapshot,
    limits: Thresholds,
    skip: frozenset[str] = frozenset(),
    scheduled: frozenset[str] = frozenset(),
    converged: bool = False,
    faded: dict[str, float] | None = None,
    explained: Sequence[str] = (),
    fading: Sequence[str] = (),
) -> list[Evidence]:
    """Layers whose ``||Δw|| / ||w||`` lies outside ``[update_ratio_low, update_ratio_high]``; above it only when their
    parameter group's learning rate is :data:`PEER_GAP` times the peers' (see :func:`peer_medians`) and the optimizer
    is not adaptive: a large step alone is a rate the model may take (a one-hidden-layer MLP on digits under plain SGD
    at 1.0 moves each layer by 10-40 % a step and fits best there, GPT-2 under ASGD at 0.5 ends lower than at 0.15), a
    rate too high for the model shows as dying units, loss spikes, exploding gradients or NaN, which those checks name,
    and under Adam a group's ratio is its learning rate over its weights' RMS whatever the gradient (a BERT head and
    pooler at 100 times the body's AdamW rate sit at 0.10-0.16 in runs that learn and in runs that do not). Below it,
    under an adaptive optimizer, only when the median layer is below it too, or when their group's learning rate is
    :data:`PEER_GAP` times below the peers': there norm gains (about 1) are the first below the range (at DPO's 5e-7
    they alone are, while every other layer moves by some 1e-5 of its norm a step); under SGD the ratio follows the
    gradient, and a layer alone below the range has lost it, unless a layer that runs before it (but embedding tables)
    learns within the range: a gradient that reached those was not lost on the way to it (an attention's queries and
    keys get little while it is near uniform).

    Step 0, layers in ``skip`` (started at zero by design, or behind a scale that did) and layers under an adaptive
    optimizer before step :data:`SETTLED` (its first steps move every weight by the learning rate) are not judged;
    layers in ``scheduled`` (their learning rate warming up, decaying or set by the optimizer itself) are not judged
    below the range: their steps are small by design; nor is any layer once the run ``converged`` (its loss or its
    gradient fell :data:`CONVERGED`-fold): a model that fits its data takes small steps, an L-BFGS that met its
    tolerance none; nor a layer whose gradient is exactly zero: no gradient reaches it (the units after it are dead,
    which ``dead_units`` names), and a higher learning rate would change nothing; nor a layer that runs before one of
    the layers ``explained`` (those ``saturation`` names) or ``fading`` (those ``vanishing_gradients`` names for a
    gradient that fades along the depth, and the layers right after them still below the range, further along the
    same fade): the gradient reaching it passes through saturated units or fades on its way, and a higher learning
    rate would not bring it back. But a scheduled layer in ``faded`` (its learning rate, as a share of its
    peak, fell below :data:`FADED` with half the fit to go) is judged below the range: those below it make one finding,
    named after the schedule. Layers below the range with the median layer make one finding too: the learning rate is
    too low for the whole model; when it is exactly 0 in every group (a warm-up from 0 stepped once per epoch), it says
    so. A group at exactly 0 beside groups that learn is frozen on purpose, and not judged.
    """
    faded = faded or {}
    if snap.step == 0:
        return []
    judged = {
        name: ratio
        for name in snap.order
        if (ratio := snap.ratios.get(name)) is not None
        and math.isfinite(ratio)
        and name not in skip
        and snap.weights.get(name, 0.0) >= 1e-6
        and not (name in snap.adaptive and snap.step < SETTLED)
    }
    lrs = {name: lr for name, lr in snap.lrs.items() if name in judged and math.isfinite(lr)}
    if judged and all(lrs.get(name) == 0 for name in judged) and not (converged or scheduled.intersection(judged)):
        said = "the learning rate is 0 in every parameter group: no weight changes. "
        if snap.stepwise:  # stepped every step already: a schedule that ended before the fit
            said += (
                "A scheduler stepped every optimizer step holds it there: its length (`num_training_steps`, "
                "`T_max`, `total_steps`) is shorter than the fit, counted in epochs rather than steps? Size it "
                "by `self.trainer.estimated_stepping_batches`."
            )
        else:
            said += (
                "A warmup scheduler that starts at 0 and is stepped once per epoch (Lightning's default, "
                '`"interval": "epoch"`) stays at 0 for the whole first epoch; return `{"scheduler": ..., "interval": '
                '"step"}` from `configure_optimizers`, or start the warmup above 0.'
            )
        layers = tuple(label(name) for name in list(judged)[:SHOWN_LAYERS])
        return [Evidence("update_ratio", layers, 0.0, limits.update_ratio_low, said)]
    lr_peers = peer_medians(lrs) if lrs else {}
    found = []
    stalled: list[str] = []  # below the range, their learning rate faded
    crawling: list[str] = []  # below the range with the median layer: the learning rate is too low for the model
    overall = statistics.median(judged.values()) if judged else math.inf
    everywhere = overall < limits.update_ratio_low
    position = {name: i for i, name in enumerate(snap.order)}
    faded_to = max((position[n] for n in fading if n in position), default=-1)
    squashed = max([faded_to, *(position[n] for n in explained if n in position)])  # the last one explained
    for name in snap.order[faded_to + 1 :] if faded_to >= 0 else ():  # further along the same fade
        if name in judged:
            if judged[name] >= limits.update_ratio_low:
                break
            squashed = max(squashed, position[name])
    learns_before = reached(snap, judged, lambda name: judged[name] >= limits.update_ratio_low)
    for name, ratio in judged.items():
        if ratio < limits.update_ratio_low and (grad := snap.grads.get(name)) is not None and grad.abs_sum == 0:
            continue
        faster = lrs.get(name, 0.0) >= PEER_GAP * lr_peers.get(name, math.inf)  # its group's learning rate
        peers = lr_peers.get(name, 0.0)
        slower = peers > 0 and lrs.get(name, math.inf) * PEER_GAP <= peers
        if lrs.get(name) == 0 and slower:
            continue  # a group's learning rate set to 0 while its peers learn: frozen on purpose
        alone = name in snap.adaptive and not (everywhere or slower)  # see above
        below = ratio < limits.update_ratio_low and not alone
        if ratio > limits.update_ratio_high and faster and name not in snap.adaptive:
            threshold = limits.update_ratio_high
            said = (
                f"by {ratio:.1e} of their norm (healthy: about 1e-3 to 1e-2): its parameter group's learning rate, "
                f"{lrs[name]:.0e}, is ten times or more its peers' ({lr_peers[name]:.0e}), too high for it; lower it."
            )
        elif ratio < limits.update_ratio_low and name in faded and not converged:
            stalled.append(name)
            continue
        elif below and name not in scheduled and not converged and everywhere and not slower:
            if position[name] > squashed:
                crawling.append(name)
            continue
        elif below and name not in scheduled and not converged and position[name] > squashed:
            if not (slower or name in snap.adaptive or name in snap.embeddings) and learns_before[name]:
                continue  # under SGD, alone, but the gradient reached a layer before it that learns: not lost
            threshold = limits.update_ratio_low
            if slower:
                said = (
                    f"by only {ratio:.1e} of their norm (healthy: about 1e-3 to 1e-2): its parameter group's learning "
                    f"rate, {lrs[name]:.0e}, is a tenth or less of its peers' ({lr_peers[name]:.0e}); raise it."
                )
            elif name in snap.adaptive or name in snap.embeddings:
                said = (
                    f"by only {ratio:.1e} of their norm (healthy: about 1e-3 to 1e-2): it barely learns; raise the "
                    f"learning rate, or look for a vanishing gradient."
                )
            else:  # under SGD, alone: the step is its gradient times the learning rate its peers move well with
                said = (
                    f"by only {ratio:.1e} of their norm while the median layer's change by {overall:.1e} (healthy: "
                    f"about 1e-3 to 1e-2): under SGD a step is the gradient times the learning rate, so this is a "
                    f"vanishing gradient, lost on the way to it; try residual connections, normalization layers, "
                    f"ReLU/GELU instead of sigmoid or tanh, or a better initialisation."
                )
        else:
            continue
        said = f"each optimizer step changes the weights of `{label(name)}` {said}"
        found.append(Evidence("update_ratio", (label(name),), ratio, threshold, said))
    if crawling:
        said = listed(crawling) + (
            f" barely learn: each optimizer step changes their weights by less than {limits.update_ratio_low:.0e} of "
            f"their norm, the median layer's by {overall:.1e} (healthy: about 1e-3 to 1e-2): the learning rate is too "
            f"low for the model; raise it, or look for a vanishing gradient."
        )
        layers = tuple(label(name) for name in crawling[:SHOWN_LAYERS])
        found.append(Evidence("update_ratio", layers, overall, limits.update_ratio_low, said))
    if stalled:
        share = min(faded[name] for name in stalled)
        said = listed(stalled) + (
            f" barely learn: each optimizer step changes their weights by less than {limits.update_ratio_low:.0e} of "
            f"their norm, as their learning rate is {share:.0e} of its peak at step {snap.step}, having fallen below "
            f"{FADED:.0e} of it before half of the fit's {snap.total_steps:.0f} steps; a scheduler that counts epochs "
            f'but is stepped every batch (`"interval": "step"`) does this, or one sized for fewer steps than the fit.'
        )
        layers = tuple(label(name) for name in stalled[:SHOWN_LAYERS])
        found.append(Evidence("update_ratio", layers, share, FADED, said))
    return found


HEAVY_DECAY = 1e-2
"""``decayed_away`` judges a weight decay that removes this share of every weight each optimizer step or more, ten
times the most that usual recipes remove (AdamW at 1e-3 with 0.1: 1e-4; SGD at 0.1 with 5e-4 and momentum 0.9: 5e-4;
grokking's AdamW at 1e-3 with 1.0: 1e-3)."""


SHRUNK = 0.1
"""``decayed_away`` names a layer whose weights' norm fell to this share of its first logging step's or less."""


def decayed_away(snap: Snapshot, first: dict[str, tuple[float, float]]) -> list[Evidence]:
    """Layers whose weight decay shrank their weights' norm to :data:`SHRUNK` of what it was at their first logging
    step (``first``: per layer, the norms of its weights and of its gradient there) or less, the decay being too
    strong for any gradient to hold them: one removing :data:`HEAVY_DECAY` of every weight each step or more, or under
    an adaptive optimizer that adds it to the gradient (Adam's ``weight_decay``), one whose term ``wd × w`` was larger
    than the gradient itself at that first step. Their outputs shrink toward nothing (the next layers' outputs then
    look huge beside theirs). The caller judges it only while the loss did not fall: a model that learns despite a
    strong decay is regularised, not broken."""
    shrunk, shown = [], None
    for name in snap.order:
        decay, start, norm = snap.decay.get(name), first.get(name), snap.weights.get(name)
        if decay is None or start is None or norm is None or not start[0] > 0:
            continue
        (wd, share), (weights, gradient) = decay, start
        strong = share >= HEAVY_DECAY if not math.isnan(share) else wd * weights >= gradient > 0
        if strong and norm <= SHRUNK * weights:
            shrunk.append(name)
            shown = shown or (name, norm / weights, wd, share, wd * weights / max(gradient, 1e-30))
    if shown is None:
        return []
    name, left, wd, share, dominance = shown
    lr = snap.lrs.get(name, math.nan)
    if math.isnan(share):
        how = (
            f"`weight_decay={wd:g}` adds {wd:g} times the weights to their gradient, a term {dominance:.0f} times the "
            f"gradient itself at the first logging step; lower it (Adam's usual L2 decay is 1e-5 to 1e-4), or use "
            f"AdamW's decoupled decay (0.01 to 0.1)."
        )
    else:
        how = (
            f"`weight_decay={wd:g}` at a learning rate of {lr:.0e} pulls every weight toward zero by {share:.2g} of "
            f"itself each optimizer step (usual recipes: 1e-5 to 1e-3); lower it (AdamW's usual value is 0.01 to 0.1, "
            f"SGD's 1e-4 to 5e-4)."
        )
    said = (
        f"the weights of {listed(shrunk)} shrank to {left:.0e} of their norm at their first logging step while the "
        f"loss did not fall: the weight decay is too strong; {how}"
    )
    layers = tuple(label(n) for n in shrunk[:SHOWN_LAYERS])
    return [Evidence("update_ratio", layers, left, SHRUNK, said, group="weight decay")]


ROUNDED = 0.25
"""Below this share of half-precision weights changed by the optimizer's step, three quarters of its update are lost."""


def rounded_away(snap: Snapshot, skip: frozenset[str] = frozenset()) -> list[Evidence]:
    """Half-precision weights (``precision="bf16-true"``, ``"16-true"``) that an adaptive optimizer's steps do not move:
    under :data:`ROUNDED` of them changed by the step, and the learning rate is below half the spacing of the numbers
    near a weight of their RMS (``eps / 2`` of it), so a step of about the learning rate rounds to no change. The cause
    is the model's: every layer judged is named, in model order (the finding holds from one logging step to the next).

    Not judged: layers under SGD (a step follows each gradient's own size), embeddings (the rows a batch does not use
    are left alone), layers started at zero by design, any layer before step :data:`SETTLED`."""
    if snap.step < SETTLED:
        return []
    judged: dict[str, tuple[float, float, float]] = {}  # share changed, learning rate, RMS of the weights
    for name in snap.order:
        share, lr = snap.changed.get(name), snap.lrs.get(name, math.nan)
        size, norm = snap.weight_sizes.get(name, 0), snap.weights.get(name, 0.0)
        if share is None or name not in snap.adaptive or name in snap.embeddings or name in skip:
            continue
        if math.isfinite(lr) and lr > 0 and size and norm > 0:
            judged[name] = (share, lr, norm / math.sqrt(size))
    if not judged:
        return []
    sizes = {name: snap.weight_sizes[name] for name in judged}
    total = sum(sizes.values())
    share = sum(judged[name][0] * size for name, size in sizes.items()) / total
    rms = math.sqrt(sum(snap.weights[name] ** 2 for name in judged) / total)
    lr = statistics.median(lr for _, lr, _ in judged.values())
    dtype, eps = snap.half[next(iter(judged))]
    if share >= ROUNDED or lr >= rms * eps / 2:
        return []
    mixed = '"bf16-mixed"' if dtype == "bfloat16" else '"16-mixed"'
    said = listed(list(judged)) + (
        f" barely learn: an optimizer step changed only {share:.0%} of their {dtype} weights. The numbers near "
        f"their size (RMS {rms:.1g}) lie {rms * eps:.0e} apart, and a step of about the learning rate ({lr:.0e}) is "
        f"under half that: it rounds to no change. Keep the weights in float32 (`precision={mixed}`), or use an "
        f"optimizer that makes up for the rounding (Kahan summation, stochastic rounding)."
    )
    return [Evidence("update_ratio", tuple(label(name) for name in list(judged)[:SHOWN_LAYERS]), share, ROUNDED, said)]


def unoptimized(snap: Snapshot, limits: Thresholds) -> list[Evidence]:
    """Layers that get gradients but are in no optimizer's parameter groups: their update ratio is zero for good, and
    nothing zeroes their ``.grad``, which keeps growing (as their gradient norms, the other checks leave them out)."""
    layers = [name for name in snap.order if name in snap.unoptimized]
    layers += sorted(snap.unoptimized.difference(layers))
    if not layers:
        return []
    said = listed(layers) + (
        " get gradients but are in no optimizer's parameter groups: their weights never change, and as nothing zeroes "
        "their `.grad` it keeps growing; give their parameters to the optimizer in `configure_optimizers`, or set "
        "`requires_grad=False` on them if they are to stay frozen (their backward is then skipped too)."
    )
    return [
        Evidence("update_ratio", tuple(label(n) for n in layers[:SHOWN_LAYERS]), 0.0, limits.update_ratio_low, said)
    ]


FADED = 1e-4
"""``update_ratio`` judges a layer whose learning rate is scheduled below the range too when that rate fell below this
share of its peak with half the fit to go (by then cosine and linear decays are at half their peak, ImageNet's step
decay at a tenth; a ``StepLR(step_size=30, gamma=0.1)`` stepped every batch is at 1e-4 by step 120)."""
