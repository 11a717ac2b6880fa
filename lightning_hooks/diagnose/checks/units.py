"""Checks on output units: dead, copies of one another, or saturated at their bounds."""

from __future__ import annotations

import math
import operator
import statistics
from collections.abc import Collection

from lightning_hooks.core.select import label
from lightning_hooks.diagnose.checks.snapshot import (
    SHOWN_LAYERS,
    Evidence,
    Snapshot,
    Thresholds,
    listed,
)

__all__ = [
    "MIN_SAMPLES",
    "MIN_DEAD",
    "OUTPUT_DEAD",
    "silent_units",
    "pruned_away",
    "dead_units",
    "fed_by",
    "COPIES",
    "MIN_COPIES",
    "copied_units",
    "SATURATED",
    "ROWS_SUM_TO_ZERO",
    "CLAMPED",
    "SIGMOID_FITS",
    "saturation",
    "saturated_layers",
]

MIN_SAMPLES = 8
"""``dead_units`` judges a layer only when each of its units saw at least this many values."""


MIN_DEAD = 2
"""``dead_units`` names a layer with fewer dead units only when every unit is dead: one unit of a narrow layer is
chance (RegNet's four-unit squeeze-and-excitation bottleneck had one silent from its initialisation, 25 %)."""


OUTPUT_DEAD = 0.25
"""At the model's output ``dead_units`` takes this share of dead units, if below ``dead_fraction``: there each dead
unit is a class or a target the model cannot give (a ReLU on the logits), not spare width."""


def silent_units(snap: Snapshot) -> dict[str, list[bool]]:
    """Per layer with enough samples (:data:`MIN_SAMPLES` values per unit), which output units were zero for every
    sample of this step, leaving out the units a pruning mask removed (:func:`pruned_away`)."""
    found = {}
    away = pruned_away(snap)
    for name, counts in snap.units.items():
        act = snap.activations.get(name)
        if counts and act is not None and act.numel / len(counts) >= MIN_SAMPLES:
            flags = list(map(operator.not_, counts))  # `c == 0` (NaN is not), at C speed: 100 k units a step
            gone = away.get(name)
            found[name] = flags if gone is None else [f for f, g in zip(flags, gone, strict=True) if not g]
    return found


def pruned_away(snap: Snapshot) -> dict[str, list[bool]]:
    """Per layer, which of its units were pruned away (``torch.nn.utils.prune``, Lightning's ``ModelPruning``): all
    the weights into them are masked in it or in the last layer with weights that ran before it, looking through
    :attr:`Snapshot.channelwise` layers (a convolution's pruned channel goes through its batch norm and ReLU)."""
    found: dict[str, list[bool]] = {}
    feeder: str | None = None
    for name in snap.executed:
        if name in snap.leaves_with_params and name not in snap.channelwise:
            feeder = name
        gone = snap.pruned.get(feeder) if feeder is not None else None
        if gone is not None and len(gone) == len(snap.units.get(name, ())):
            found[name] = gone
    return found


def dead_units(snap: Snapshot, limits: Thresholds, silent: dict[str, list[bool]] | None = None) -> list[Evidence]:
    """Layers with at least ``dead_fraction`` of their output units ``silent`` (zero for every sample of the
    tracker's window; of this step by default; at the model's output, :data:`OUTPUT_DEAD`), and at least
    :data:`MIN_DEAD` of them or all. A layer right after a dead one (a pooling after a dead ReLU) carries the same dead
    units on and is not named again; a layer with weights ends the chain, except after a layer whose every unit is
    silent: layers with weights fed only zeros give out their biases alone, so the next layer with dead units is not
    named again either (the dropout after a transformer MLP's output projection, whose bias starts at zero; the ReLU
    after the convolution and batch norm that a dead ReLU feeds). A layer whose units are counted after a functional
    activation (:attr:`Snapshot.activated`), or after a module run on other layers' outputs too
    (:attr:`Snapshot.shared`), is named with it."""
    silent = silent_units(snap) if silent is None else silent
    found: list[Evidence] = []
    previous_dead = False  # the last layer without weights was dead, and no layer with weights ran since
    after_silent = False  # the last layer with units counted had every unit silent
    for name in snap.order:
        if name in snap.leaves_with_params:
            previous_dead = False
        flags = silent.get(name)
        if not flags:
            continue
        dead = sum(flags)
        share = dead / len(flags)
        every = dead == len(flags)
        output = bool(snap.executed) and name == snap.executed[-1]
        line = min(limits.dead_fraction, OUTPUT_DEAD) if output else limits.dead_fraction
        is_dead = share >= line and (dead >= MIN_DEAD or every)
        if is_dead and not previous_dead and not after_silent:
            after = f" after `{snap.activated[name]}` (in forward)" if name in snap.activated else ""
            after = f" after `{label(snap.shared[name])}`" if name in snap.shared else after
            said = (
                f"{dead} of {len(flags)} output units of `{label(name)}`{after} were zero for every sample of every "
                f"batch checked ({share:.0%}): they pass no gradient back; "
            )
            if output:
                said += (
                    "it is the model's output: an activation after the model's output layer clips its outputs at "
                    "zero; remove it (`cross_entropy` and most losses take the raw outputs)."
                )
            elif every:
                where = "its outputs are" if after else "its input is"
                which = "its weights" if after else "the layer before it"
                said += (
                    f"{where} never positive, so nothing before it learns either: look at {which}, for all-zero "
                    f"weights (a zero initialisation) or a large negative bias (set so, or driven there by a learning "
                    f"rate too high)."
                )
            else:
                said += "try a lower learning rate, LeakyReLU or GELU, or a normalization layer before the activation."
            found.append(Evidence("dead_units", (label(name),), share, line, said))
        previous_dead, after_silent = is_dead, every
    return found


def fed_by(snap: Snapshot, layers: Collection[str], silenced: Collection[str] = ()) -> frozenset[str]:
    """The layers with weights that run right after one of ``layers`` (labels of dead units), up to the next layer
    without weights: they take those units' zeros, so their weights get no gradient and do not move whatever the
    learning rate (the convolution after a dead ReLU, and the batch norm after it), which ``dead_units`` explains.
    After one of ``silenced`` (every unit dead), every layer with weights: what reaches them from it is a constant."""
    fed: set[str] = set()
    feeding = cut = False
    for name in snap.order:
        cut = cut or label(name) in silenced
        if label(name) in layers:
            feeding = True
        elif name in snap.leaves_with_params:
            if feeding or cut:
                fed.add(name)
        else:
            feeding = False
    return frozenset(fed)


COPIES = 1e-4
"""Output units whose sums of squares over a step agree to this share are copies of one another (the rounding of
identical dot products computed apart stays below 1e-6; units of random weights differ by tens of percent)."""


MIN_COPIES = 4
"""``copied_units`` judges layers with at least this many output units."""


def copied_units(snap: Snapshot) -> list[Evidence]:
    """The first layer, in model order, whose output units (:data:`MIN_COPIES` or more, with :data:`MIN_SAMPLES`
    values each) all had the same non-zero sum of squares, and the layers after it of which that holds too: every
    unit computes the same function of the input, so each gets the same gradient and they stay copies; the layer
    learns as one unit. Only weights that are the same for every unit make that (one constant for every weight,
    ``nn.init.constant_``): a layer of random weights breaks it.

    Not judged: a normalization, whose units have the same second moment by construction (a batch or instance norm
    without affine weights), a layer that passes on a normalization's output unchanged (an ``nn.Identity``), nor a
    saturated sigmoid or tanh (every output at 1 has the same square)."""
    copied = []
    before = dict(zip(snap.executed[1:], snap.executed, strict=False))  # the leaf that ran just before each
    for name in snap.order:
        sums, act = snap.units.get(name), snap.activations.get(name)
        if not sums or len(sums) < MIN_COPIES or act is None or act.numel / len(sums) < MIN_SAMPLES:
            continue
        if name in snap.normalizers or (before.get(name) in snap.normalizers and snap.units.get(before[name]) == sums):
            continue
        if snap.saturated.get(name, 0.0) >= SATURATED:  # every output at its bound: `saturation` names it
            continue
        low, high = min(sums), max(sums)
        if low > 0 and math.isfinite(high) and high - low <= COPIES * high:
            copied.append(name)
    if not copied:
        return []
    width, rest = len(snap.units[copied[0]]), copied[1:]
    said = (
        f"all {width} output units of `{label(copied[0])}` are copies of one another (the same sum of squares at "
        f"every check){f', and so are those of {listed(rest)}' if rest else ''}: they compute the same function, "
        f"get the same gradient and stay copies, so the layer learns as one unit. The weights before it are the same "
        f"for every unit (a constant initialisation, `nn.init.constant_` or `fill_`); draw them at random (PyTorch's "
        f"default, or `nn.init.kaiming_uniform_` / `xavier_uniform_`)."
    )
    share = (width - 1) / width
    return [Evidence("dead_units", tuple(label(n) for n in copied[:SHOWN_LAYERS]), share, 1 - 1 / MIN_COPIES, said)]


SATURATED = 0.5
"""``saturation`` names a layer with at least this share of its outputs within 0.1 % of their bounds."""


ROWS_SUM_TO_ZERO = 1e-3
"""An output layer's gradient sums to zero over each row, up to this share of its magnitude: its outputs went into a
loss that applies a softmax of its own (exactly zero but for rounding; a loss of a softmax's probabilities
themselves, such as the NLL of their log, sums to its whole magnitude)."""


CLAMPED = 0.25
"""``saturation`` names a ReLU that gives the model's output (as many values as the targets) when at least this share
of the gradient the loss gives it asks outputs it holds at zero to go lower: targets below zero, which it cannot give
(none when the targets are never negative, as counts are: an output at zero is then above or at its target)."""


SIGMOID_FITS = 1e-3
"""An output layer's gradient is ``binary_cross_entropy_with_logits``'s of it, up to this share of its magnitude beyond
its dtype's rounding: the loss applies a sigmoid of its own (0 when it does, in float32 and bfloat16 alike; at least
1e-2 for `binary_cross_entropy` or a mean squared error of a sigmoid's outputs)."""


BEYOND = 3.0
"""``saturation`` names a sigmoid or tanh that gives the model's output (values of magnitude below 1) when the batch's
targets have an RMS ``r`` this many times that bound and the loss stays at ``(r - 1)²`` or more, about the least a
squared error of such an output against them can be: a regression onto targets the output cannot reach (a loss
that only weighs the output with such a tensor, as sample weights under a cross-entropy, is far below it)."""


def saturation(snap: Snapshot, limits: Thresholds, learnt: frozenset[str] = frozenset()) -> list[Evidence]:
    """Sigmoid, tanh and softmax layers with at least :data:`SATURATED` of their outputs at their bounds, in one
    finding named after the first in model order (they saturate for one cause: weights or inputs too large), held
    while any is; and one of them (or a ReLU) that is the model's last layer and whose gradient sums to zero over
    each row (:data:`ROWS_SUM_TO_ZERO`): a loss such as ``cross_entropy`` took its outputs for logits and applies a
    softmax of its own, so a softmax's gradient saturates, logits bounded by a sigmoid or tanh cap every
    prediction's confidence, and a ReLU passes no gradient to the logits it holds at zero; or whose gradient is
    ``binary_cross_entropy_with_logits``'s (:data:`SIGMOID_FITS`), which applies a sigmoid of its own. A loss of a
    softmax's probabilities themselves (``nll_loss`` of their log, a ``Categorical(probs=...)``) is not named, nor are
    the layers in ``learnt`` (saturated by learning); but when that loss is negative, in ``[-1, 0)`` at every step, it
    is ``nll_loss`` of the probabilities, not of their log. Also a ReLU that gives the model's output and holds at
    zero outputs the loss pushes below it (:data:`CLAMPED`)."""
    found = []
    last = snap.executed[-1] if snap.executed else ""
    kind = snap.squashing.get(last, "")
    if kind and snap.row_sums.get(last, math.inf) <= ROWS_SUM_TO_ZERO:
        said = f"the model's output comes from the {kind} `{label(last)}`, and "
        if kind == "softmax":
            said += (
                "the gradient the loss gives it sums to zero over each row, as that of `cross_entropy` (which applies "
                "a softmax of its own) or of a squared error against one-hot targets does: either way the gradient "
                "through this softmax saturates and learning crawls; give `cross_entropy` the logits (or end with "
                "`nn.LogSoftmax` and use `nll_loss`)."
            )
        elif kind == "ReLU":
            said += (
                "the loss took its outputs for logits (their gradient sums to zero over each row, as `cross_entropy`'s "
                "does): the ReLU holds every negative logit at zero, where it passes no gradient, so a class it holds "
                "there for every sample can no longer be learnt; give the loss the logits (remove the ReLU)."
            )
        else:
            bounds = "(0, 1)" if kind == "sigmoid" else "(-1, 1)"
            said += "the loss took its "
            said += (
                f"outputs for logits (their gradient sums to zero over each row, as `cross_entropy`'s does): logits "
                f"bounded to {bounds} cap how confident any prediction can be, and the {kind} saturates as the model "
                f"pushes against them; give the loss the unbounded logits (remove the {kind})."
            )
        found.append(Evidence("saturation", (label(last),), snap.row_sums[last], ROWS_SUM_TO_ZERO, said))
    elif kind == "softmax" and snap.row_sums.get(last, 0.0) >= 1 - ROWS_SUM_TO_ZERO and _probabilities_lost(snap):
        loss = max(loss for _, loss in snap.losses)
        said = (
            f"the model's output comes from the softmax `{label(last)}`, and the loss is negative (up to {loss:.3g}, "
            f"never below -1), its gradient one value a row: `nll_loss` was given the probabilities where it takes "
            f"their log, so it minimises minus the target's probability, whose gradient vanishes where the model is "
            f"most wrong; end with `nn.LogSoftmax` instead (or give `cross_entropy` the logits)."
        )
        found.append(Evidence("saturation", (label(last),), loss, 0.0, said))
    elif (share := snap.clamped.get(last, 0.0)) >= CLAMPED:
        said = (
            f"the model's output comes from the ReLU `{label(last)}`, which holds it at zero where the loss asks for "
            f"less: {share:.0%} of the loss's gradient pushes outputs at zero below it, as targets below zero do "
            f"(standardised regression targets are half negative); remove the ReLU after the output layer, or give "
            f"targets that are never negative."
        )
        found.append(Evidence("saturation", (label(last),), share, CLAMPED, said))
    elif kind in ("sigmoid", "tanh") and (beyond := _unreachable_targets(snap)):
        path, rms, loss = beyond
        bounds = "(0, 1)" if kind == "sigmoid" else "(-1, 1)"
        said = (
            f"the model's output comes from the {kind} `{label(last)}`, which gives values in {bounds}, but"
            f" the batch's targets (`{path}`) have an RMS of {rms:.3g} and the loss stays at "
            f"{loss:.3g}: the output cannot reach them; remove the {kind} after the output layer (or scale the "
            f"targets into {bounds} and the predictions back)."
        )
        found.append(Evidence("saturation", (label(last),), rms, BEYOND, said))
    elif kind and snap.sigmoid_misfit.get(last, math.inf) <= SIGMOID_FITS:
        low, high = {"tanh": ("0.27", "0.73"), "ReLU": ("0.5", "1")}.get(kind, ("0.5", "0.73"))
        said = (
            f"the model's output comes from the {kind} `{label(last)}`, and the loss took it for logits (its gradient "
            f"is the loss's own sigmoid of it minus the target, as `binary_cross_entropy_with_logits`'s is): "
            f"{'held at zero or above' if kind == 'ReLU' else 'squashed twice'}, every predicted probability lies "
            f"between {low} and {high}; give `binary_cross_entropy_with_logits` the logits (remove the {kind})"
            f"{'' if kind == 'ReLU' else ', or the probabilities to `binary_cross_entropy`'}."
        )
        found.append(Evidence("saturation", (label(last),), snap.sigmoid_misfit[last], SIGMOID_FITS, said))
    if squashed := saturated_layers(snap, learnt):
        first, rest = squashed[0], squashed[1:]
        share = snap.saturated[first]
        after = f" after `{snap.activated[first]}` (in forward)" if first in snap.activated else ""
        said = (
            f"{share:.0%} of the outputs of `{label(first)}`{after} are within 0.1 % of their bounds"
            f"{f', and over half of those of {listed(rest)}' if rest else ''}: saturated units pass almost no "
            f"gradient back; normalise the inputs, use a smaller initialisation or a lower learning rate, or give "
            f"`cross_entropy` / `binary_cross_entropy_with_logits` the logits instead of a softmax or sigmoid."
        )
        layers = tuple(label(n) for n in squashed[:SHOWN_LAYERS])
        found.append(Evidence("saturation", layers, share, SATURATED, said, group="saturated layers"))
    return found


def _probabilities_lost(snap: Snapshot) -> bool:
    """Whether every loss since the last logging step lies in ``[-1, 0)``: minus a probability, as ``nll_loss`` gives
    of probabilities (of log-probabilities it is positive)."""
    return bool(snap.losses) and all(-1.0 <= loss < 0.0 for _, loss in snap.losses)


def _unreachable_targets(snap: Snapshot) -> tuple[str, float, float] | None:
    """The targets' path and RMS, and the loss, where an output bounded by 1 cannot reach them (:data:`BEYOND`)."""
    paths = list(snap.inputs)
    losses = [abs(loss) for _, loss in snap.losses if math.isfinite(loss)]
    if len(paths) < 2 or not losses:
        return None
    rms, loss = snap.inputs[paths[-1]], statistics.median(losses)
    if rms >= BEYOND and loss >= (rms - 1) ** 2:
        return paths[-1], rms, loss
    return None


def saturated_layers(snap: Snapshot, learnt: frozenset[str] = frozenset()) -> list[str]:
    """The sigmoid, tanh and softmax layers, in model order, with :data:`SATURATED` of their outputs at their bounds,
    but the model's last layer (:func:`saturation` judges it by its gradient) and those in ``learnt``."""
    last = snap.executed[-1] if snap.executed else ""
    return [
        name
        for name in snap.order
        if snap.saturated.get(name, 0.0) >= SATURATED and name != last and name not in learnt
    ]
