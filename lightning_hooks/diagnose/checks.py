"""The health checks that judge one logging step's statistics alone, each returning the :class:`Evidence` it saw."""

from __future__ import annotations

import functools
import math
import operator
import re
import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from lightning_hooks.core.select import label
from lightning_hooks.stats.state import State

__all__ = [
    "CONVERGED",
    "Evidence",
    "absent_inputs",
    "decayed_away",
    "input_scale",
    "mean_gradients",
    "no_backward",
    "no_learning",
    "saturation",
    "saturated_layers",
    "vanishing_layers",
    "silent_units",
    "stepless",
    "STEPLESS",
    "SHOWN_LAYERS",
    "Snapshot",
    "Thresholds",
    "carried",
    "clipped_away",
    "copied_units",
    "cut_off",
    "rounded_away",
    "dead_units",
    "fed_by",
    "giant_steps",
    "gradient_spread",
    "nonfinite",
    "pruned_away",
    "update_ratio",
    "zero_loss",
]

MIN_SAMPLES = 8
"""``dead_units`` judges a layer only when each of its units saw at least this many values."""
MIN_DEAD = 2
"""``dead_units`` names a layer with fewer dead units only when every unit is dead: one unit of a narrow layer is
chance (RegNet's four-unit squeeze-and-excitation bottleneck had one silent from its initialisation, 25 %)."""
OUTPUT_DEAD = 0.25
"""At the model's output ``dead_units`` takes this share of dead units, if below ``dead_fraction``: there each dead
unit is a class or a target the model cannot give (a ReLU on the logits), not spare width."""
SHOWN_LAYERS = 3
"""How many layers a finding over several names (worst first)."""
PEER_GAP = 10.0
"""``update_ratio`` names a layer above ``update_ratio_high`` when its parameter group's learning rate is this many
times its peers', and one below ``update_ratio_low`` under an adaptive optimizer when it is this many times below."""
STARVED = 1e-3
"""Under an adaptive optimizer, a layer whose mean ``|gradient|`` is below this share of the optimizer's ``eps`` takes
steps a thousand times smaller than its learning rate: its gradient vanished (transformers' EfficientNet trained from
scratch, its BatchNorm weights drawn from N(0, 0.02): 1e-20 against eps 1e-8). Healthy runs of the calibration corpus
stay above 0.3 of ``eps`` (BART's key projections)."""
SETTLED = 10
"""The optimizer step from which a run counts as past its first steps (references for growth are taken there)."""


@dataclass(frozen=True)
class Thresholds:
    """The lines the checks draw (``HealthMonitor``'s arguments of the same names)."""

    dead_fraction: float = 0.7
    gradient_spread: float = 1e3
    norm_growth: float = 100.0
    update_ratio_low: float = 1e-6
    update_ratio_high: float = 0.1
    activation_growth: float = 1e3
    spike_threshold: float = 20.0
    patience: int = 3


@dataclass
class Snapshot:
    """One logging step's statistics on the host, per layer (qualified names; ``""`` is the model)."""

    step: int
    order: Sequence[str]  # the model's module order
    activations: dict[str, State] = field(default_factory=dict)  # of leaf modules
    units: dict[str, list[float]] = field(default_factory=dict)  # per output unit, its sum of squares (0: dead)
    activated: dict[str, str] = field(default_factory=dict)  # layers whose units are counted after the functional
    # operations (``F.relu``) that took their output to the next layer: those operations
    shared: dict[str, str] = field(default_factory=dict)  # layers whose units are counted after a module without
    # weights that took their output and other layers' too (a ResNet block's one ReLU): that module
    grads: dict[str, State] = field(default_factory=dict)  # each layer's parameter gradients pooled
    ratios: dict[str, float] = field(default_factory=dict)  # ||Δw|| / ||w|| per layer
    weights: dict[str, float] = field(default_factory=dict)  # ||w|| per layer
    changed: dict[str, float] = field(default_factory=dict)  # per half-precision layer, the share of weights stepped
    half: dict[str, tuple[str, float]] = field(default_factory=dict)  # per half-precision layer, its dtype and eps
    eps_lost: frozenset[str] = frozenset()  # half-precision layers whose optimizer's eps rounds to 0 in their dtype
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) of each step since the last snapshot
    norms: list[list[float]] = field(default_factory=list)  # of those steps, each parameter's gradient norm
    norm_layers: Sequence[str] = ()  # the layer of each of those parameters
    unoptimized: frozenset[str] = frozenset()  # layers with a gradient that no optimizer steps (nor zeroes)
    carried: Sequence[str] = ()  # layers whose `.grad` nothing zeroes between optimizer steps (manual optimization)
    ungraded: dict[str, tuple[float, ...]] = field(default_factory=dict)  # leaves that ran, stepped with no gradient:
    # a fingerprint of their weights
    total_steps: float = math.inf  # the optimizer steps the fit will take (``Trainer.estimated_stepping_batches``)
    leaves_with_params: frozenset[str] = frozenset()
    guard: tuple[str, int, str] | None = None  # a NonFiniteGuard's last finding: layer, step, first line
    executed: Sequence[str] = ()  # the leaves in the order they first ran (``order`` starts with them)
    last_calls: dict[str, int] = field(default_factory=dict)  # per leaf that ran, when it ran last (a call count)
    adaptive: frozenset[str] = frozenset()  # layers an adaptive optimizer (anything but SGD) updates
    weight_sizes: dict[str, int] = field(default_factory=dict)  # parameter values per layer of ``weights``
    inputs: dict[str, float] = field(default_factory=dict)  # per batch tensor but masks (path), finite non-zeros' RMS
    saturated: dict[str, float] = field(default_factory=dict)  # per sigmoid/tanh/softmax: share at the bounds
    squashing: dict[str, str] = field(default_factory=dict)  # per sigmoid, tanh and softmax layer: which
    row_sums: dict[str, float] = field(default_factory=dict)  # the output layer's gradient: Σ |row sums| / Σ |g|
    sigmoid_misfit: dict[str, float] = field(default_factory=dict)  # and its share a loss's own sigmoid leaves out
    clamped: dict[str, float] = field(default_factory=dict)  # a ReLU output layer: its gradient's share that pushes
    # outputs held at zero below it
    lrs: dict[str, float] = field(default_factory=dict)  # per layer, its group's learning rate (NaN: the optimizer's)
    eps: dict[str, float] = field(default_factory=dict)  # per layer, its adaptive optimizer's eps (where it has one)
    decay: dict[str, tuple[float, float]] = field(default_factory=dict)  # per layer with a weight decay: its value,
    # and the share of every weight it removes each optimizer step (NaN where an adaptive optimizer scales it)
    embeddings: frozenset[str] = frozenset()  # embedding tables (a batch reaches a few of their rows)
    gradless: bool = False  # the optimizer stepped with no gradient on any watched parameter
    backward: bool = True  # a backward ran in the logging step (``training_step`` returned a loss)
    backwards: int = 1  # backward passes since the previous logging step, its own included
    automatic: bool = True  # Lightning's automatic optimization (else the user calls backward and step)
    clip: tuple[str, float] | None = None  # Lightning's gradient clipping: its algorithm (norm, value) and value
    skipped_at_scale: float | None = None  # a GradScaler skipped the step, its gradients overflowing: its new scale
    pruned: dict[str, list[bool]] = field(default_factory=dict)  # per pruned layer, the output units it pruned away
    channelwise: frozenset[str] = frozenset()  # layers that keep each channel apart (batch norm)
    input_takers: dict[str, str] = field(default_factory=dict)  # per batch tensor (path), the first layer taking it
    taken: dict[str, float] = field(default_factory=dict)  # per batch tensor (path), the RMS of what its taker took
    entry: tuple[str, float] | None = None  # the first layer to take a floating-point tensor, and that tensor's RMS
    normalizers: frozenset[str] = frozenset()  # normalization layers (batch, layer, group, instance, RMS)


@dataclass(frozen=True)
class Evidence:
    """What one check saw at one step, before it became (or extended) a finding."""

    check: str
    layers: tuple[str, ...]
    value: float
    threshold: float
    message: str
    step: int | None = None
    """The step it belongs to when not the snapshot's (a loss spike between logging steps)."""
    group: str | None = None
    """Names the finding it makes or extends when that is not its check and layers: one finding over layers that come
    and go (the layers saturated at each logging step)."""


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


def fed_by(snap: Snapshot, layers: Collection[str]) -> frozenset[str]:
    """The layers with weights that run right after one of ``layers`` (labels of dead units), up to the next layer
    without weights: they take those units' zeros, so their weights get no gradient and do not move whatever the
    learning rate (the convolution after a dead ReLU, and the batch norm after it), which ``dead_units`` explains."""
    fed: set[str] = set()
    feeding = False
    for name in snap.order:
        if label(name) in layers:
            feeding = True
        elif name in snap.leaves_with_params:
            if feeding:
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
        f"every check){f', and so are those of {_listed(rest)}' if rest else ''}: they compute the same function, "
        f"get the same gradient and stay copies, so the layer learns as one unit. The weights before it are the same "
        f"for every unit (a constant initialisation, `nn.init.constant_` or `fill_`); draw them at random (PyTorch's "
        f"default, or `nn.init.kaiming_uniform_` / `xavier_uniform_`)."
    )
    share = (width - 1) / width
    return [Evidence("dead_units", tuple(label(n) for n in copied[:SHOWN_LAYERS]), share, 1 - 1 / MIN_COPIES, said)]


@functools.cache  # a model's layer names, asked at every logging step
def role(name: str) -> str:
    """A layer's role: its name with block indices starred (``h.3.attn.q`` -> ``h.*.attn.q``)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name)


def peer_medians(values: dict[str, float]) -> dict[str, float]:
    """Per layer, the median of ``values`` over the layers of its role (at least three), else over all."""
    roles: dict[str, list[float]] = {}
    for name, value in values.items():
        roles.setdefault(role(name), []).append(value)
    overall = statistics.median(values.values())
    return {n: statistics.median(roles[role(n)]) if len(roles[role(n)]) >= 3 else overall for n in values}


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
    """Layers that learn ``gradient_spread`` times less (vanishing) or more (exploding) than their peers.

    A layer is judged the way its optimizer sees it: under an adaptive optimizer by its update ratio
    against its peers' (the layers of its :func:`role`, or all layers), or by its mean ``|gradient|`` against the
    optimizer's ``eps`` (:data:`STARVED`: below it, the step is the gradient over ``eps``, not over its own scale, and
    weight decay alone keeps the update ratio up); under SGD by its update ratio and by its mean ``|gradient|`` against
    the median layer's. Layers in ``skip`` (started at zero) are not judged, nor embedding tables against ``eps`` (a
    batch reaches a few of their rows), nor any layer against ``eps`` once the run ``converged``.
    Vanishing layers are named nearest the input first and only before the first exploding one, and the
    other way round; adaptive optimizers normalise exploding gradients away, so those are not judged here. Under SGD,
    a gradient that shrinks steadily toward the input (:func:`depth_trend`) by ``gradient_spread`` or more is one
    finding, vanishing in the layers that far below the largest, and nothing is exploding.
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
        said = _listed(faded) + (
            f" get gradients {top / first:.0e} times smaller than the largest layer's (mean |g| {first:.2e} against "
            f"{top:.2e}), shrinking layer by layer toward the input, a vanishing gradient: their weights barely "
            f"learn; try residual connections, normalization layers, or an initialisation that keeps the signal's "
            f"scale (`nn.init.kaiming_normal_` for ReLU)."
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

    def off(name: str, low: bool) -> bool:
        by_ratio = name in ratio_peers and (
            ratios[name] <= ratio_peers[name] / spread if low else ratios[name] >= ratio_peers[name] * spread
        )
        if name in snap.adaptive:
            return low and (by_ratio or name in starved)
        by_gradient = means[name] <= median / spread if low else means[name] >= median * spread
        return by_gradient and (by_ratio or name not in ratio_peers)

    position = {name: i for i, name in enumerate(snap.order)}
    low = [n for n in means if off(n, True)]
    high = [n for n in means if off(n, False)]
    first_low = min((position[n] for n in low), default=math.inf)
    first_high = min((position[n] for n in high), default=math.inf)
    vanishing = (
        f" and its weights change {spread:.0e} times less than its peers': they barely learn; try residual "
        f"connections, normalization layers, ReLU/GELU instead of sigmoid or tanh, or a better initialisation."
    )
    exploding = "; try gradient clipping (`gradient_clip_val`, `GradClamp`), a lower learning rate or warm-up."
    found = []
    for check, names, before, fix, line in (
        ("vanishing_gradients", low, first_high, vanishing, 1 / spread),
        ("exploding_gradients", high, first_low, exploding, spread),
    ):
        for name in sorted((n for n in names if position[n] < before and n not in starved), key=position.__getitem__):
            ratio = means[name] / median
            said = f"the gradient of `{label(name)}` is {ratio:.1e} times the median layer's (mean |g| "
            said += f"{means[name]:.2e}){fix}"
            found.append(Evidence(check, (label(name),), ratio, line, said))
    if starved:  # one finding: they starve together (every starved layer is among the low ones)
        names = sorted(starved, key=position.__getitem__)
        share = min(means[n] / starved[n] for n in names)
        said = _listed(names) + (
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


def update_ratio(
    snap: Snapshot,
    limits: Thresholds,
    skip: frozenset[str] = frozenset(),
    scheduled: frozenset[str] = frozenset(),
    converged: bool = False,
    faded: dict[str, float] | None = None,
    explained: Sequence[str] = (),
) -> list[Evidence]:
    """Layers whose ``||Δw|| / ||w||`` lies outside ``[update_ratio_low, update_ratio_high]``; above it only when their
    parameter group's learning rate is :data:`PEER_GAP` times the peers' (see :func:`peer_medians`): a large step alone
    is a rate the model may take (a one-hidden-layer MLP on digits under plain SGD at 1.0 moves each layer by 10-40 % a
    step and fits best there, GPT-2 under ASGD at 0.5 ends lower than at 0.15), and a rate too high for the model shows
    as dying units, loss spikes, exploding gradients or NaN, which those checks name. Below it, under an adaptive
    optimizer, only when the median layer is below it too, or when their group's learning rate is :data:`PEER_GAP` times
    below the peers': there a layer's ratio is about the learning rate over its weights' RMS whatever its gradient, so
    norm gains (about 1) are the first below the range (at DPO's 5e-7 they alone are, while every other layer moves by
    some 1e-5 of its norm a step); under SGD the ratio follows the gradient, and a layer alone below the range has lost
    it.

    Step 0, layers in ``skip`` (started at zero by design) and layers under an adaptive optimizer before step
    :data:`SETTLED` (its first steps move every weight by the learning rate) are not judged; layers in
    ``scheduled`` (their learning rate warming up, decaying or set by the optimizer itself) are not judged below the
    range: their steps are small by design; nor is any layer once the run ``converged`` (its loss or its gradient fell
    :data:`CONVERGED`-fold): a model that fits its data takes small steps, an L-BFGS that met its tolerance none; nor a
    layer whose gradient is exactly zero: no gradient reaches it (the units after it are dead, which ``dead_units``
    names), and a higher learning rate would change nothing; nor a layer that runs before one of the layers
    ``explained`` (those ``saturation`` names, and those ``vanishing_gradients`` names for a gradient that fades along
    the depth): the gradient reaching it passes through saturated units or fades on its way, and a higher learning
    rate would not bring it back.
    But a scheduled layer in ``faded`` (its learning rate, as a share of its peak, fell below :data:`FADED` with half
    the fit to go) is judged below the range: those below it make one finding, named after the schedule. Layers below
    the range with the median layer make one finding too: the learning rate is too low for the whole model.
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
    lr_peers = peer_medians(lrs) if lrs else {}
    found = []
    stalled: list[str] = []  # below the range, their learning rate faded
    crawling: list[str] = []  # below the range with the median layer: the learning rate is too low for the model
    overall = statistics.median(judged.values()) if judged else math.inf
    everywhere = overall < limits.update_ratio_low
    position = {name: i for i, name in enumerate(snap.order)}
    squashed = max((position[n] for n in explained if n in position), default=-1)  # the last one explained
    for name, ratio in judged.items():
        if ratio < limits.update_ratio_low and (grad := snap.grads.get(name)) is not None and grad.abs_sum == 0:
            continue
        faster = lrs.get(name, 0.0) >= PEER_GAP * lr_peers.get(name, math.inf)  # its group's learning rate
        slower = lrs.get(name, math.inf) * PEER_GAP <= lr_peers.get(name, 0.0)
        alone = name in snap.adaptive and not (everywhere or slower)  # see above
        below = ratio < limits.update_ratio_low and not alone
        if ratio > limits.update_ratio_high and faster:
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
        said = _listed(crawling) + (
            f" barely learn: each optimizer step changes their weights by less than {limits.update_ratio_low:.0e} of "
            f"their norm, the median layer's by {overall:.1e} (healthy: about 1e-3 to 1e-2): the learning rate is too "
            f"low for the model; raise it, or look for a vanishing gradient."
        )
        layers = tuple(label(name) for name in crawling[:SHOWN_LAYERS])
        found.append(Evidence("update_ratio", layers, overall, limits.update_ratio_low, said))
    if stalled:
        share = min(faded[name] for name in stalled)
        said = _listed(stalled) + (
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
        f"the weights of {_listed(shrunk)} shrank to {left:.0e} of their norm at their first logging step while the "
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
    said = _listed(list(judged)) + (
        f" barely learn: an optimizer step changed only {share:.0%} of their {dtype} weights. The numbers near "
        f"their size (RMS {rms:.1g}) lie {rms * eps:.0e} apart, and a step of about the learning rate ({lr:.0e}) is "
        f"under half that: it rounds to no change. Keep the weights in float32 (`precision={mixed}`), or use an "
        f"optimizer that makes up for the rounding (Kahan summation, stochastic rounding)."
    )
    return [Evidence("update_ratio", tuple(label(name) for name in list(judged)[:SHOWN_LAYERS]), share, ROUNDED, said)]


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
            f"so the steps of {_listed(starved)} come to nothing. Fix the explosion: start from smaller weights "
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
        f"each optimizer step changes the weights of {_listed(judged)} by only {step:.1e} of their norm (healthy: "
        f"about 1e-3 to 1e-2): {clipping} {how}, as a learning rate that much lower would. Clipping is meant for the "
        f"rare outlier: set `gradient_clip_val` near the gradient norms you see (`GradStats` logs them), or remove it."
    )
    return [Evidence("update_ratio", tuple(label(n) for n in judged[:SHOWN_LAYERS]), factor, CLIPPED, said)]


def unoptimized(snap: Snapshot, limits: Thresholds) -> list[Evidence]:
    """Layers that get gradients but are in no optimizer's parameter groups: their update ratio is zero for good, and
    nothing zeroes their ``.grad``, which keeps growing (as their gradient norms, the other checks leave them out)."""
    layers = [name for name in snap.order if name in snap.unoptimized]
    layers += sorted(snap.unoptimized.difference(layers))
    if not layers:
        return []
    said = _listed(layers) + (
        " get gradients but are in no optimizer's parameter groups: their weights never change, and as nothing zeroes "
        "their `.grad` it keeps growing; give their parameters to the optimizer in `configure_optimizers`, or set "
        "`requires_grad=False` on them if they are to stay frozen (their backward is then skipped too)."
    )
    return [
        Evidence("update_ratio", tuple(label(n) for n in layers[:SHOWN_LAYERS]), 0.0, limits.update_ratio_low, said)
    ]


def cut_off(layers: Sequence[str], step: int) -> Evidence:
    """Layers that run in the forward and are in an optimizer, but got no gradient at two logging steps and did not
    change in between (:meth:`HealthTracker._cut_off`): their output does not reach the loss through autograd."""
    one = len(layers) == 1
    said = _listed(layers) + (
        f" {'runs' if one else 'run'} in the forward, but {'gets' if one else 'get'} no gradient and never "
        f"{'changes' if one else 'change'}: {'its' if one else 'their'} output is cut from the loss's graph (a "
        f"`.detach()`, `.item()` or `.numpy()`, `torch.tensor(...)` of a tensor, or `torch.no_grad()` inside forward, "
        f"on the way to the loss); if {'it is' if one else 'they are'} meant to stay frozen, set `requires_grad=False`."
    )
    return Evidence("no_learning", tuple(label(n) for n in layers[:SHOWN_LAYERS]), 0.0, 0.0, said, step)


def carried(layers: Sequence[str], step: int) -> Evidence:
    """Layers whose ``.grad`` nothing zeroes between optimizer steps (manual optimization without ``zero_grad``): every
    step applies the sum of all the gradients so far, and the gradient norm keeps growing."""
    said = _listed(layers) + (
        f": `.grad` is not zeroed between optimizer steps: at step {step} it still held the gradients of the steps "
        f"before when the next backward began, so each step applies the sum of every gradient so far and the gradient "
        f"norm keeps growing. Under manual optimization call `optimizer.zero_grad()` after `optimizer.step()` (or "
        f"before `self.manual_backward(loss)`)."
    )
    return Evidence("exploding_gradients", tuple(label(n) for n in layers[:SHOWN_LAYERS]), 0.0, 0.0, said)


def _listed(layers: Sequence[str]) -> str:
    """The first :data:`SHOWN_LAYERS` of ``layers``, labelled, each in backticks, and how many others ("and 2 more")."""
    more = len(layers) - SHOWN_LAYERS
    return ", ".join(f"`{label(name)}`" for name in layers[:SHOWN_LAYERS]) + (f" and {more} more" if more > 0 else "")


FADED = 1e-4
"""``update_ratio`` judges a layer whose learning rate is scheduled below the range too when that rate fell below this
share of its peak with half the fit to go (by then cosine and linear decays are at half their peak, ImageNet's step
decay at a tenth; a ``StepLR(step_size=30, gamma=0.1)`` stepped every batch is at 1e-4 by step 120)."""

CONVERGED = 1e3
"""A run whose loss fell this many times below its first logging step's has fit its data: its steps may be tiny."""

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


def nonfinite(snap: Snapshot, limits: Thresholds) -> list[Evidence]:
    """NaN/Inf in a layer's output (the first to hold them, a module that runs more than once counted at its last
    call: a module run twice, an activation or a dropout, passes on what the layers before it made far more often
    than it makes NaN/Inf; said to come from its weights when they are NaN/Inf too, written by an earlier step),
    else in a parameter gradient (the layer nearest the output: the backward made them there and every layer before
    it gets them; not with the step's loss NaN/Inf, which made them), or in a step's loss.

    Gradients that a ``GradScaler`` found overflowing, and skipped, are fp16 loss scaling at work while its scale
    stays at least 1 (``snap.skipped_at_scale``): it halves the scale and goes on. Below 1 they overflow unscaled.
    A ``NonFiniteGuard`` finding in the same Trainer (``snap.guard``) is named first. A model whose float16 weights
    an optimizer steps with an ``eps`` that float16 rounds to 0 (``snap.eps_lost``: Adam's 1e-8) is told so: every
    weight whose gradient is exactly zero then gets 0 / 0. An output's Inf, with no NaN and a finite loss and
    gradients, is not named: it is a mask (logits of invalid actions filled with ``-inf``) that the loss handles.
    """
    bad_losses = [step for step, loss in snap.losses if not math.isfinite(loss)]
    scale = snap.skipped_at_scale
    routine = scale is not None and scale >= 1  # fp16 loss scaling at work
    # An output's Inf (or a square above float32's range) with a finite loss and gradients is a mask: invalid
    # actions or classes filled with -inf, or the dtype's lowest value, before a softmax that makes them 0.
    spread = bad_losses or any(s.nonfinite for s in snap.grads.values())
    # A layer's output, or its units after the functional operations that took it to the next layer (log, division)
    after = {n for n in snap.activated if _nonfinite_units(snap.units.get(n, ()), bool(spread))}
    outputs = [
        name
        for name, state in ((n, snap.activations.get(n)) for n in snap.order)
        if state is not None and (state.nonfinite > 0 and (spread or _has_nan(state)) or name in after)
    ]
    # in the order their last calls ran: a module that runs twice (a ResNet block's one ReLU, after its first
    # convolution and after the sum) holds the NaN of its last call, made by the layers that ran in between
    outputs.sort(key=lambda name: snap.last_calls.get(name, math.inf))
    # The backward runs from the loss: what it made NaN/Inf in a layer, every layer before it gets. With the step's
    # loss NaN/Inf, the loss made them.
    grads = [
        name
        for name in reversed(snap.order)
        if name in snap.grads and snap.grads[name].nonfinite > 0 and not routine and snap.step not in bad_losses
    ]
    if outputs:
        layers, count = outputs, float(len(outputs))
        made = (
            f" after `{snap.activated[layers[0]]}` (in forward)"
            if layers[0] in after and not snap.activations[layers[0]].nonfinite
            else ""
        )
        said = (
            f"the output of `{label(layers[0])}`{made} holds NaN/Inf values (the first of {len(layers)} to hold them)"
        )
        if not math.isfinite(snap.weights.get(layers[0], 0.0)):
            said += (
                ", and so do its weights: an optimizer step before this one applied NaN/Inf gradients to them, and "
                "every output since carries them (the finding's first step is the first whose loss was NaN/Inf)"
            )
    elif grads:
        layers, count = grads, float(len(grads))
        said = (
            f"the parameter gradient of `{label(layers[0])}` holds NaN/Inf values (the nearest the output of "
            f"{len(layers)}) while every layer's output was finite: the backward made them in `{label(layers[0])}` or "
            f"between it and the next layer"
        )
        if scale is not None:
            said += f", and the GradScaler's skips have brought its scale down to {scale:.3g}: they overflow unscaled"
    elif bad_losses or snap.guard is not None:
        count = float(len(bad_losses))
        layers = [] if snap.guard else list(snap.executed[-1:])  # the output layer: the loss is computed from it
        said = (
            f"the training loss was NaN/Inf at {len(bad_losses)} step(s) from step {bad_losses[0]} while every "
            f"layer's output was finite: the loss of the output of `{label(layers[0]) if layers else 'root'}` "
            f"(a log or division of a value that reached 0)"
            if bad_losses
            else "a layer made NaN/Inf values"
        )
    else:
        return []
    named = [label(n) for n in layers]
    note = ""
    if snap.guard is not None:
        layer, step, line = snap.guard
        named = [layer, *(n for n in named if n != layer)]
        note = f" `NonFiniteGuard` found at step {step}: {line}."
    first = min([*bad_losses, *([snap.guard[1]] if snap.guard else [])], default=None)
    if lost := [name for name in snap.order if name in snap.eps_lost]:
        dtype, eps = snap.half[lost[0]][0], snap.eps[lost[0]]
        said += (
            f"; the optimizer steps {dtype} weights with an eps ({eps:.0e}) that {dtype} rounds to 0, so it divides 0 "
            f"by 0 for every weight whose gradient is exactly zero (an embedding's unused rows) and makes it NaN. Set "
            f'the optimizer\'s eps to 1e-4 or more, or keep float32 weights (`precision="16-mixed"`).{note}'
        )
    else:
        said += (
            "; add `NonFiniteGuard()` to name the operation that made them, and look for a division by zero, a log or "
            f"sqrt of a non-positive number, or an overflow.{note}"
        )
    return [Evidence("nonfinite", tuple(named[:SHOWN_LAYERS]) or ("root",), count, 0.0, said, step=first)]


def _nonfinite_units(sums: Sequence[float], spread: bool) -> bool:
    """Whether per-unit sums of squares hold a NaN, or an Inf while the loss or a gradient is NaN/Inf too (an Inf
    alone is a mask)."""
    return any(math.isnan(v) or (spread and math.isinf(v)) for v in sums)


def _has_nan(state: State) -> bool:
    """Whether a NaN is among the values behind ``state`` (its sums are NaN; an Inf alone makes them Inf)."""
    return math.isnan(state.sum_sq) or math.isnan(state.abs_sum)


INPUT_SCALE = 100.0
"""``input_scale`` names a batch tensor whose RMS (over its non-zero values) is this many times off unit scale."""
ALIKE_SCALE = 10.0
"""Two scales within this factor of each other are alike (a series and its forecast, a loss and the tensor it
compares outputs with), and one within it of 1 is unit scale (what a model that rescales its inputs gives its first
layer)."""
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


def input_scale(snap: Snapshot, limits: Thresholds) -> list[Evidence]:
    """Floating-point batch tensors whose RMS over their non-zero values is :data:`INPUT_SCALE` times off unit scale
    (a sparse input, such as a TF-IDF row normalised to unit length, is small only in its zeros), named after the
    layer that took the tensor, a view of it or a copy made of it (else the first layer to take a floating-point
    tensor, or the last one to run for the batch's last tensor, a target compared with the output). Only when what
    that layer took is still :data:`ALIKE_SCALE` times off, on the same side: a model that divides its pixels by 255
    itself, or slices the numeric columns out of a batch that also holds category indices, gives its first layer
    values of unit scale. Not when that layer is a normalization: the model standardises it. Nor targets within
    :data:`ALIKE_SCALE` of inputs the model rescales itself: a forecaster that normalises each window of a series and
    de-normalises its forecast (RevIN) is judged on the series' own scale. Nor a last tensor above the range while
    the loss is :data:`ALIKE_SCALE` times below its RMS: a loss that compared outputs of unit scale with it (an L1
    loss, a squared one) would be far above, so it is something the loss uses otherwise, or not at all: sample
    weights, survival times that only a Cox loss's ordering reads, boxes in pixels that a box coder normalises,
    timestamps."""
    found = []
    paths = list(snap.inputs)
    losses = [abs(loss) for _, loss in snap.losses if math.isfinite(loss)]
    loss = statistics.median(losses) if losses else math.inf
    rescaled = []  # the RMS of the inputs the model brought to unit scale itself
    for path, rms in snap.inputs.items():
        target = len(paths) > 1 and path == paths[-1]
        taker, took = _taker(snap, path, rms, entry=not target)
        side = _off_scale(rms)
        if not side:
            continue
        if _off_scale(took, ALIKE_SCALE) != side:  # the model brought it (near) to unit scale itself
            rescaled.append(rms)
            continue
        if taker in snap.normalizers:
            continue
        if target and any(max(rms, r) < ALIKE_SCALE * min(rms, r) for r in rescaled):
            continue
        if target and taker is None and side > 0 and loss * ALIKE_SCALE < rms:
            continue
        layers = [taker] if taker is not None else snap.executed[-1:] if target else snap.executed[:1]
        what = "targets" if target else "inputs"
        said = (
            f"the batch's {what} (`{path}`) have an RMS of {rms:.3g} (over their non-zero values), "
            f"{abs(math.log10(rms)):.0f} orders of magnitude "
            f"from unit scale: standardise them (subtract the training set's mean, divide by its standard "
            f"deviation); unscaled {what} make huge activations, losses and gradients from the first step."
        )
        found.append(Evidence("input_scale", tuple(label(n) for n in layers) or ("root",), rms, INPUT_SCALE, said))
    return found


def absent_inputs(snap: Snapshot) -> list[Evidence]:
    """Floating-point batch tensors with no finite non-zero value (all zeros: data never loaded into a buffer made with
    ``torch.zeros``, a transform that multiplies by 0), taken as they are by the layer that takes them, or by the first
    layer to take a floating-point tensor: every sample looks alike to the model, which can learn no more than the
    mean target. Only when every floating-point input is so (an RNN's initial state may be zeros beside its inputs),
    not counting the batch's last tensor of several (a target, possibly all zeros in a batch); and not one a layer
    takes only after adding something to it (a learnt embedding)."""
    paths = list(snap.inputs)
    inputs = {path: rms for path, rms in snap.inputs.items() if len(paths) == 1 or path != paths[-1]}
    if any(rms != 0 for rms in inputs.values()):  # another input carries the samples (an RNN's zero initial state)
        return []
    found = []
    for path, rms in inputs.items():
        taker, took = _taker(snap, path, rms)
        if taker is None or took != 0:
            continue
        said = (
            f"the batch's inputs (`{path}`) hold no finite non-zero value: every sample is all zeros, so "
            f"`{label(taker)}` gives each the same output and the model can learn no more than the mean target; check "
            f"the data loading (a buffer made with `torch.zeros` and never filled, a wrong column or key, a transform "
            f"that multiplies by 0)."
        )
        found.append(Evidence("input_scale", (label(taker),), 0.0, 0.0, said))
    return found


def _taker(snap: Snapshot, path: str, rms: float, entry: bool = True) -> tuple[str | None, float]:
    """The layer that took the batch tensor ``path`` (of RMS ``rms``) and the RMS of what it took; else, with
    ``entry``, the first layer to take a floating-point tensor and that tensor's RMS."""
    taker, took = snap.input_takers.get(path), snap.taken.get(path, rms)
    if taker is None and entry and snap.entry is not None:
        return snap.entry
    return taker, took


def _off_scale(rms: float, factor: float = INPUT_SCALE) -> int:
    """1 for an RMS ``factor`` times above 1 or more, -1 for one as far below (but not 0), else 0."""
    return 1 if rms >= factor else -1 if 0 < rms <= 1 / factor else 0


def zero_loss(snap: Snapshot) -> bool:
    """Whether the logging step's own loss was exactly zero (a hinge or margin loss met by every sample)."""
    return any(step == snap.step and loss == 0 for step, loss in snap.losses)


def no_learning(snap: Snapshot, limits: Thresholds, zero_from_start: bool = False) -> list[Evidence]:
    """Every parameter gradient exactly zero: nothing learns. Named after the output layer, where the gradient
    should have entered. Not when the step's loss is exactly zero too: a hinge or margin loss whose batch meets
    every margin has nothing left to learn from it; unless the loss was exactly zero at every step from step 0
    (``zero_from_start``), before the model learnt anything: a loss weighted by 0, or one comparing the output with
    itself."""
    grads = [s for s in snap.grads.values() if s.numel]
    if not snap.gradless and (not grads or any(s.abs_sum != 0 or s.nonfinite for s in grads)):
        return []
    layers = tuple(label(n) for n in snap.executed[-1:]) or ("root",)
    if zero_loss(snap):
        if not zero_from_start:
            return []
        said = (
            f"the loss was exactly 0 at every step from step 0 to step {snap.step}, before the model learnt anything, "
            f"so every gradient is zero and nothing learns: look for a loss weighted by 0, one that compares the "
            f"output with itself, or a mask that leaves out every element."
        )
        return [Evidence("no_learning", layers, 0.0, 0.0, said, step=0)]
    said = (
        f"every parameter gradient is exactly zero or missing at step {snap.step}: nothing learns; look for an "
        f"activation over one unit (a softmax over a single output is always 1), a detached tensor (`.detach()`, "
        f"`.item()`, `torch.no_grad()` inside forward) or a loss that does not depend on the model's output."
    )
    return [Evidence("no_learning", layers, 0.0, 0.0, said)]


STEPLESS = 100
"""Training batches in a row with no optimizer step (under manual optimization) before ``no_learning`` names it."""


def stepless(batches: int, step: int) -> Evidence:
    """No optimizer step in ``batches`` training batches in a row, the global step staying at ``step``: under manual
    optimization, ``optimizer.step()`` is never called, and the weights never change."""
    said = (
        f"no optimizer step ran in the last {batches} training batches (the global step stayed at {step}), so the "
        f"weights never change: under manual optimization, call `optimizer.step()` after `self.manual_backward(loss)` "
        f"(`optimizer = self.optimizers()`), once per batch or once per batches accumulated."
    )
    return Evidence("no_learning", ("root",), float(batches), float(STEPLESS), said, step)


def no_backward(snap: Snapshot, since: int) -> Evidence:
    """No backward pass and no gradient at any step from ``since`` to the logging step: the optimizer steps with no
    gradient, and nothing learns. Named after the output layer, like :func:`no_learning`."""
    if snap.automatic:
        fix = (
            "`training_step` returned `None`, and Lightning skips the backward of such a step (the way to skip a "
            'batch on purpose); return the loss, or a dict with a `"loss"` key'
        )
    else:
        fix = "under manual optimization, call `self.manual_backward(loss)` before `optimizer.step()`"
    said = (
        f"no backward pass ran at any step from step {since} to step {snap.step}, so no parameter gets a gradient and "
        f"nothing learns: {fix}."
    )
    return Evidence("no_learning", tuple(label(n) for n in snap.executed[-1:]) or ("root",), 0.0, 0.0, said, since)


def saturation(snap: Snapshot, limits: Thresholds, learnt: frozenset[str] = frozenset()) -> list[Evidence]:
    """Sigmoid, tanh and softmax layers with at least :data:`SATURATED` of their outputs at their bounds, in one
    finding named after the first in model order (they saturate for one cause: weights or inputs too large), held
    while any is; and one of them that is the model's last layer and whose gradient sums to zero over each row
    (:data:`ROWS_SUM_TO_ZERO`): a loss such as ``cross_entropy`` took its outputs for logits and applies a softmax
    of its own, so a softmax's gradient saturates, and logits bounded by a sigmoid or tanh cap every prediction's
    confidence; or whose gradient is ``binary_cross_entropy_with_logits``'s (:data:`SIGMOID_FITS`), which applies a
    sigmoid of its own. A loss of a softmax's probabilities themselves (``nll_loss`` of their log, a
    ``Categorical(probs=...)``) is not named, nor are the layers in ``learnt`` (saturated by learning). Also a ReLU
    that gives the model's output and holds at zero outputs the loss pushes below it (:data:`CLAMPED`)."""
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
        else:
            bounds = "(0, 1)" if kind == "sigmoid" else "(-1, 1)"
            said += "the loss took its "
            said += (
                f"outputs for logits (their gradient sums to zero over each row, as `cross_entropy`'s does): logits "
                f"bounded to {bounds} cap how confident any prediction can be, and the {kind} saturates as the model "
                f"pushes against them; give the loss the unbounded logits (remove the {kind})."
            )
        found.append(Evidence("saturation", (label(last),), snap.row_sums[last], ROWS_SUM_TO_ZERO, said))
    elif (share := snap.clamped.get(last, 0.0)) >= CLAMPED:
        said = (
            f"the model's output comes from the ReLU `{label(last)}`, which holds it at zero where the loss asks for "
            f"less: {share:.0%} of the loss's gradient pushes outputs at zero below it, as targets below zero do "
            f"(standardised regression targets are half negative); remove the ReLU after the output layer, or give "
            f"targets that are never negative."
        )
        found.append(Evidence("saturation", (label(last),), share, CLAMPED, said))
    elif kind and snap.sigmoid_misfit.get(last, math.inf) <= SIGMOID_FITS:
        low, high = ("0.27", "0.73") if kind == "tanh" else ("0.5", "0.73")
        said = (
            f"the model's output comes from the {kind} `{label(last)}`, and the loss took it for logits (its gradient "
            f"is the loss's own sigmoid of it minus the target, as `binary_cross_entropy_with_logits`'s is): "
            f"squashed twice, every predicted probability lies between {low} and {high}; give "
            f"`binary_cross_entropy_with_logits` the logits (remove the {kind}), or the probabilities to "
            f"`binary_cross_entropy`."
        )
        found.append(Evidence("saturation", (label(last),), snap.sigmoid_misfit[last], SIGMOID_FITS, said))
    if squashed := saturated_layers(snap, learnt):
        first, rest = squashed[0], squashed[1:]
        share = snap.saturated[first]
        after = f" after `{snap.activated[first]}` (in forward)" if first in snap.activated else ""
        said = (
            f"{share:.0%} of the outputs of `{label(first)}`{after} are within 0.1 % of their bounds"
            f"{f', and over half of those of {_listed(rest)}' if rest else ''}: saturated units pass almost no "
            f"gradient back; normalise the inputs, use a smaller initialisation or a lower learning rate, or give "
            f"`cross_entropy` / `binary_cross_entropy_with_logits` the logits instead of a softmax or sigmoid."
        )
        layers = tuple(label(n) for n in squashed[:SHOWN_LAYERS])
        found.append(Evidence("saturation", layers, share, SATURATED, said, group="saturated layers"))
    return found


def saturated_layers(snap: Snapshot, learnt: frozenset[str] = frozenset()) -> list[str]:
    """The sigmoid, tanh and softmax layers, in model order, with :data:`SATURATED` of their outputs at their bounds,
    but the model's last layer (:func:`saturation` judges it by its gradient) and those in ``learnt``."""
    last = snap.executed[-1] if snap.executed else ""
    return [
        name
        for name in snap.order
        if snap.saturated.get(name, 0.0) >= SATURATED and name != last and name not in learnt
    ]
