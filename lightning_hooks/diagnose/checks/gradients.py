"""Checks on gradients: vanishing or exploding against the layers' peers, along the depth, or hidden by clipping."""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Sequence

from lightning_hooks.core.select import label
from lightning_hooks.diagnose.checks.snapshot import (
    SHOWN_LAYERS,
    Evidence,
    Snapshot,
    Thresholds,
    listed,
    peer_medians,
    reached,
)

__all__ = [
    "scaled_down",
    "STARVED",
    "mean_gradients",
    "vanishing_layers",
    "FADING",
    "DEPTH_LAYERS",
    "DEPTH_FIT",
    "depth_trend",
    "gradient_spread",
    "CLIPPED",
    "SMALL_STEP",
    "clipped_away",
    "carried",
    "GIANT_STEP",
    "giant_steps",
]


def scaled_down(zero: Collection[str], layers: Collection[str]) -> frozenset[str]:
    """The layers whose gradient passes through a scale that started at zero by design (the layers in ``zero``), as
    far as module nesting tells: those inside the smallest module that holds such a scale and some other layer of
    ``layers``. A block owning its layer scale (ConvNeXt's ``layer_scale_parameter``, BEiT's ``lambda_1``), the block
    around a ``LayerScale`` module (DINOv2, CaiT), the LoRA wrapper around its ``lora_B``, a ResNet block whose last
    batch norm starts at zero (``zero_init_residual``): the output of their branch is multiplied by about zero, and so
    is the gradient of every layer in it. Not when no module but the root holds another layer (every weight zero)."""

    def holders(name: str) -> list[str]:  # the modules around it, innermost first ("a.b.c": "a.b", "a")
        parts = name.split(".")
        return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]

    holding = {module for name in layers if name not in zero for module in holders(name)}  # another layer
    owners = {next((m for m in holders(name) if m in holding), "") for name in zero} - {""}
    return frozenset(n for n in layers if n not in zero and not owners.isdisjoint(holders(n)))


STARVED = 1e-3
"""Under an adaptive optimizer, a layer whose mean ``|gradient|`` is below this share of the optimizer's ``eps`` takes
steps a thousand times smaller than its learning rate: its gradient vanished (transformers' EfficientNet trained from
scratch, its BatchNorm weights drawn from N(0, 0.02): 1e-20 against eps 1e-8). Healthy runs of the calibration corpus
stay above 0.3 of ``eps`` (BART's key projections)."""


def mean_gradients(snap: Snapshot, skip: frozenset[str] = frozenset()) -> dict[str, float]:
    """Per layer with a finite, non-zero gradient (but those in ``skip``), in model order, its mean ``|gradient|``."""
    return {
        name: state.abs_sum / state.numel
        for name in snap.order
        if (state := snap.grads.get(name)) is not None
        and state.numel
        and state.abs_sum > 0
        and math.isfinite(state.abs_sum)
        and name not in skip
    }


def vanishing_layers(snap: Snapshot, limits: Thresholds, skip: frozenset[str] = frozenset()) -> list[str]:
    """Under SGD, when the gradient shrinks steadily toward the input by ``gradient_spread`` or more along the depth
    (:func:`depth_trend`), the layers, in model order, whose mean ``|gradient|`` is that far below the largest."""
    return _fading(mean_gradients(snap, skip), snap.adaptive, limits.gradient_spread)[0]


def _fading(means: dict[str, float], adaptive: frozenset[str], spread: float) -> tuple[list[str], float]:
    """:func:`vanishing_layers` from the layers' mean ``|gradient|`` (in model order), and the largest of them."""
    plain = [n for n in means if n not in adaptive]
    if depth_trend([means[n] for n in plain]) < spread:
        return [], 0.0
    top = max(means[n] for n in plain)
    return [n for n in plain if means[n] <= top / spread], top


FADING = "fading along the depth"
"""The group of the finding for a gradient that shrinks toward the input (:func:`vanishing_layers`)."""


DEPTH_LAYERS = 6
"""``gradient_spread`` looks for a trend along the depth over at least this many layers judged by their gradient."""


DEPTH_FIT = 0.9
"""... where the logarithm of their mean ``|gradient|`` follows their depth this closely (Pearson's correlation)."""


def depth_trend(means: Sequence[float]) -> float:
    """How many times the gradient grows from the first to the last of ``means`` (in model order), along a straight
    line fitted to their logarithms against depth, when it rises toward the output on a close fit (:data:`DEPTH_FIT`);
    1.0 otherwise. A deep plain ReLU MLP at PyTorch's default initialisation falls about 2.5 times a layer toward the
    input: the middle layers are the median, so neither end lies three orders of magnitude from it, though the ends
    are six apart."""
    logs = [math.log10(m) for m in means]
    if len(logs) < DEPTH_LAYERS or max(logs) == min(logs):  # too few to fit, or flat (no correlation to speak of)
        return 1.0
    depth = list(range(len(logs)))
    slope = statistics.linear_regression(depth, logs).slope
    if statistics.correlation(depth, logs) < DEPTH_FIT:
        return 1.0
    return 10.0 ** (slope * (len(logs) - 1))


def gradient_spread(
    snap: Snapshot, limits: Thresholds, skip: frozenset[str] = frozenset(), converged: bool = False
) -> list[Evidence]:
    """Layers that learn ``gradient_spread`` times less than their peers: a vanishing gradient.

    A layer is judged the way its optimizer sees it: under an adaptive optimizer by its update ratio against its peers'
    (the layers of its :func:`role`, or all layers), or by its mean ``|gradient|`` against the optimizer's ``eps``
    (:data:`STARVED`: below it, the step is the gradient over ``eps``, not over its own scale, and weight decay alone
    keeps the update ratio up); under SGD by its update ratio and by its mean ``|gradient|`` against the median layer's,
    and only when no layer that runs before it (but embedding tables) gets a gradient near the median's: one that
    reached the layers before it was not lost on the way (an attention's queries and keys get little while it is near
    uniform). Layers in ``skip`` (started at zero, or behind a scale that did: :func:`scaled_down`) are not judged, nor
    embedding tables against ``eps`` (a batch reaches a few of their rows), nor any layer against ``eps`` once the run
    ``converged``, nor a layer below ``eps`` after one that is not (the signal reached past it: at AdamW's ``eps=1e-3``
    a transformer's attention queries and keys get 1e-7 while it is near uniform). Under SGD, a gradient that shrinks
    steadily toward the input (:func:`depth_trend`) by ``gradient_spread`` or more is one finding, in the layers that
    far below the largest.

    A layer far *above* its peers is not judged: under an adaptive optimizer its step is normalised, and under SGD it
    may be the others that are slow (BART's tied embedding and output layer gets a thousand times the median layer's
    gradient in a run whose loss falls well). A gradient that explodes shows as a norm that keeps growing, a giant step
    or an overflow, which ``Moments``, :func:`giant_steps` and ``nonfinite`` name.
    """
    means = mean_gradients(snap, skip)
    if len(means) < 3:
        return []
    ratios = {n: r for n, r in snap.ratios.items() if n in means and math.isfinite(r) and r > 0}
    ratio_peers = peer_medians(ratios) if len(ratios) >= 3 else {}
    median = statistics.median(means.values())
    spread = limits.gradient_spread
    faded, top = _fading(means, snap.adaptive, spread)
    if faded:  # a slope, not outliers: the gradient fades on its way in
        first = means[faded[0]]
        said = listed(faded) + (
            f" get gradients {top / first:.0e} times smaller than the largest layer's (mean |g| {first:.2e} against "
            f"{top:.2e}), shrinking layer by layer toward the input, a vanishing gradient: their weights barely "
            f"learn; try residual connections, normalization layers, or an initialisation that keeps the signal's "
            f"scale (`nn.init.kaiming_normal_` for ReLU, `xavier_normal_` for tanh)."
        )
        layers = tuple(label(n) for n in faded[:SHOWN_LAYERS])
        return [Evidence("vanishing_gradients", layers, first / top, 1 / spread, said, group=FADING)]

    starved = {
        name: eps
        for name, mean in means.items()
        if name in snap.adaptive
        and name not in snap.embeddings
        and not converged
        and mean < (eps := snap.eps.get(name, 0.0)) * STARVED
    }
    # one starved after a layer whose gradient its optimizer can normalise is small where it is (an attention's
    # queries and keys), not lost on the way
    past = reached(snap, means, lambda name: name not in starved)
    starved = {name: eps for name, eps in starved.items() if not past[name]}

    position = {name: i for i, name in enumerate(snap.order)}
    near_median = reached(snap, means, lambda name: means[name] > median / spread)  # one before it is

    def vanishing(name: str) -> bool:
        by_ratio = name in ratio_peers and ratios[name] <= ratio_peers[name] / spread
        if name in snap.adaptive:
            return by_ratio or name in starved
        return means[name] <= median / spread and (by_ratio or name not in ratio_peers) and not near_median[name]

    found = []
    for name in sorted((n for n in means if vanishing(n) and n not in starved), key=position.__getitem__):
        said = (
            f"the gradient of `{label(name)}` is {means[name] / median:.1e} times the median layer's (mean |g| "
            f"{means[name]:.2e}) and its weights change {spread:.0e} times less than its peers': they barely learn; "
            f"try residual connections, normalization layers, ReLU/GELU instead of sigmoid or tanh, or a better "
            f"initialisation."
        )
        found.append(Evidence("vanishing_gradients", (label(name),), means[name] / median, 1 / spread, said))
    if starved:  # one finding: they starve together (every starved layer is among the low ones)
        names = sorted(starved, key=position.__getitem__)
        share = min(means[n] / starved[n] for n in names)
        said = listed(names) + (
            f" get gradients below {STARVED:.0e} of their optimizer's eps (down to {share:.0e} of it; the first's mean "
            f"|g| is {means[names[0]]:.2e}): Adam divides them by eps rather than by their own scale, so their weights "
            f"barely move (weight decay aside). The signal vanishes on its way to them: look at the scale of the "
            f"activations (`ActivationStats`) and at the initialisation (a norm's weights drawn near zero?), or lower "
            f"`eps`."
        )
        found.append(
            Evidence("vanishing_gradients", tuple(label(n) for n in names[:SHOWN_LAYERS]), share, STARVED, said)
        )
    return found


CLIPPED = 100.0
"""Gradient clipping that scales every step down this many times or more is judged (see :func:`clipped_away`)."""


SMALL_STEP = 1e-4
"""A step that changes the median layer's weights by less than this share of their norm is small (healthy: 1e-3)."""


def clipped_away(snap: Snapshot, limits: Thresholds, skip: frozenset[str] = frozenset()) -> list[Evidence]:
    """Lightning's gradient clipping (``gradient_clip_val``) shrinking every SGD step :data:`CLIPPED`-fold or more.
    The gradient the monitor reads is the one before clipping: by norm, it is scaled by ``gradient_clip_val`` over its
    total norm; by value, its norm after clipping is at most the value times the square root of its size.

    When one layer's gradient is ``gradient_spread`` times the rest's together and other layers' steps are below
    :data:`SMALL_STEP` of their weights, that layer's gradient explodes (an RNN's) and clipping hides it: scaled down
    to its size, the other layers' steps round to nothing (``exploding_gradients``). Otherwise, with the median layer's
    steps below :data:`SMALL_STEP`, clipping meant for the rare outlier acts as a learning rate a hundred times lower
    (``update_ratio``). Not under an adaptive optimizer, whose steps do not follow the gradient's size."""
    if snap.clip is None:
        return []
    algorithm, value = snap.clip
    norms = {name: math.sqrt(s.sum_sq) for name, s in snap.grads.items() if s.numel}
    judged = [n for n in snap.order if n in snap.ratios and n not in snap.adaptive and n not in skip]
    if not norms or not judged or value <= 0:
        return []
    total = math.sqrt(math.fsum(v * v for v in norms.values()))
    left = value if algorithm == "norm" else value * math.sqrt(sum(s.numel for s in snap.grads.values()))
    factor = total / left
    if not factor >= CLIPPED:  # NaN compares false
        return []
    clipping = f"gradient clipping (`gradient_clip_val={value:g}`, by {algorithm})"
    top = max(norms, key=norms.__getitem__)
    rest = math.sqrt(math.fsum(v * v for name, v in norms.items() if name != top))
    starved = [n for n in judged if n != top and snap.ratios[n] < SMALL_STEP]
    if top in judged and starved and norms[top] >= limits.gradient_spread * rest:
        ratio = norms[top] / max(rest, 1e-30)
        said = (
            f"the gradient of `{label(top)}` has a norm of {norms[top]:.2g} before clipping, {ratio:.1e} times the "
            f"other layers' together: it explodes, and {clipping} hides it, scaling every step down {factor:.2g}-fold, "
            f"so the steps of {listed(starved)} come to nothing. Fix the explosion: start from smaller weights "
            f"(recurrent weights above 1 make an RNN's gradient grow with the sequence), or lower the learning rate."
        )
        return [Evidence("exploding_gradients", (label(top),), ratio, limits.gradient_spread, said)]
    step = statistics.median(snap.ratios[n] for n in judged)
    if not step < SMALL_STEP:
        return []
    if algorithm == "norm":
        how = f"scales every gradient down about {factor:.0f}-fold (their norm before clipping is {total:.2g})"
    else:
        how = (
            f"clips every gradient value to ±{value:g}, shrinking the gradient at least {factor:.0f}-fold (its norm "
            f"before clipping is {total:.2g})"
        )
    said = (
        f"each optimizer step changes the weights of {listed(judged)} by only {step:.1e} of their norm (healthy: "
        f"about 1e-3 to 1e-2): {clipping} {how}, as a learning rate that much lower would. Clipping is meant for the "
        f"rare outlier: set `gradient_clip_val` near the gradient norms you see (`GradStats` logs them), or remove it."
    )
    return [Evidence("update_ratio", tuple(label(n) for n in judged[:SHOWN_LAYERS]), factor, CLIPPED, said)]


def carried(layers: Sequence[str], step: int) -> Evidence:
    """Layers whose ``.grad`` nothing zeroes between optimizer steps (manual optimization without ``zero_grad``): every
    step applies the sum of all the gradients so far, and the gradient norm keeps growing."""
    said = listed(layers) + (
        f": `.grad` is not zeroed between optimizer steps: at step {step} it still held the gradients of the steps "
        f"before when the next backward began, so each step applies the sum of every gradient so far and the gradient "
        f"norm keeps growing. Under manual optimization call `optimizer.zero_grad()` after `optimizer.step()` (or "
        f"before `self.manual_backward(loss)`)."
    )
    return Evidence("exploding_gradients", tuple(label(n) for n in layers[:SHOWN_LAYERS]), 0.0, 0.0, said)


GIANT_STEP = 1e3
"""An SGD step that changes a layer's weights by this many times their norm or more is an exploding gradient (a
healthy step moves them by 1e-3 to 1e-2 of it; a full-batch regression's first steps at the edge of stability, by up
to 1.4 times; a recurrent layer with weights 6 times too large, by 1e5 to 1e6 times)."""


def giant_steps(snap: Snapshot, skip: frozenset[str] = frozenset()) -> list[Evidence]:
    """Layers that one SGD step moved by :data:`GIANT_STEP` times their weights' norm or more, step 0 included: an SGD
    step is the gradient times the learning rate, so that gradient exploded (an RNN's, in one step: after it the layer
    may be saturated for good, so the check cannot wait for ``patience`` logging steps). Not under an adaptive
    optimizer, whose steps do not follow the gradient's size, nor for layers in ``skip`` (started at zero)."""
    leaps = {
        name: ratio
        for name, ratio in snap.ratios.items()
        if name not in snap.adaptive
        and name not in skip
        and snap.weights.get(name, 0.0) >= 1e-6
        and ratio >= GIANT_STEP
    }  # NaN compares false
    if not leaps:
        return []
    worst = sorted(leaps, key=lambda n: -leaps[n])[:SHOWN_LAYERS]
    said = (
        f"one SGD step changed the weights of `{label(worst[0])}` by {leaps[worst[0]]:.3g} times their norm: the "
        f"gradient exploded; clip gradients (`gradient_clip_val`, `GradClamp`), lower the learning rate, or start "
        f"from smaller weights (recurrent weights above 1 make an RNN's gradient grow with the sequence)."
    )
    return [Evidence("exploding_gradients", tuple(label(n) for n in worst), leaps[worst[0]], GIANT_STEP, said)]
