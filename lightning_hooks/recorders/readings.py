"""What ``HealthMonitor`` reads of a model per layer: which layer each parameter belongs to, what kind each layer
is, and the per-layer statistics a logging step's fetched values give (a health ``Snapshot``'s fields)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_hooks.core.nested import named_tensors
from lightning_hooks.core.select import label
from lightning_hooks.recorders.activations import UnitRecorder
from lightning_hooks.stats.batch import Fetched, StatBatch
from lightning_hooks.stats.state import State, combine

__all__ = [
    "Layers",
    "Outputs",
    "fingerprints",
    "layer_gradients",
    "layer_outputs",
    "layer_updates",
    "pruned_units",
    "ungraded_weights",
    "watch_batch",
]

SQUASHING = {nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.Softmax: "softmax", nn.ReLU: "ReLU", nn.ReLU6: "ReLU"}
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
NORMS = (
    *BATCH_NORMS,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)

LABELS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
"""The dtypes of class labels."""


@dataclass
class Layers:
    """The watched parameters' layers (module labels) and what kind of layer each watched module is."""

    owner: dict[str, str] = field(default_factory=dict)  # per parameter name, its layer
    numel: dict[str, int] = field(default_factory=dict)  # per parameter name, its size
    of: dict[int, str] = field(default_factory=dict)  # per parameter id, its layer
    sizes: dict[str, int] = field(default_factory=dict)  # per layer, its parameter values
    order: list[str] = field(default_factory=list)  # every watched module, in the model's order
    with_params: frozenset[str] = frozenset()  # the modules with parameters of their own
    squashing: dict[str, str] = field(default_factory=dict)  # sigmoid, tanh and softmax modules: which
    channelwise: frozenset[str] = frozenset()  # batch norms, which keep each channel apart
    normalizers: frozenset[str] = frozenset()
    embeddings: frozenset[str] = frozenset()
    half: dict[str, torch.dtype] = field(default_factory=dict)  # per layer with half-precision weights, their dtype

    @classmethod
    def of_model(
        cls,
        modules: list[tuple[str, nn.Module]],
        leaves: list[tuple[str, nn.Module]],
        params: list[tuple[str, nn.Parameter]],
    ) -> Layers:
        """The layers of the watched ``modules``, their ``leaves`` and the trainable ``params`` among them."""
        owners = {id(p): name for name, m in modules for p in m.parameters(recurse=False)}
        owner = {pname: label(owners[id(p)]) for pname, p in params}
        sizes: dict[str, int] = {}
        for name, p in params:
            sizes[owner[name]] = sizes.get(owner[name], 0) + p.numel()
        return cls(
            owner=owner,
            numel={name: p.numel() for name, p in params},
            of={id(p): owner[name] for name, p in params},
            sizes=sizes,
            order=[label(name) for name, _ in modules],
            with_params=frozenset(label(n) for n, m in modules if next(m.parameters(recurse=False), None) is not None),
            squashing={label(n): kind for n, m in leaves for cls_, kind in SQUASHING.items() if isinstance(m, cls_)},
            channelwise=frozenset(label(name) for name, m in leaves if isinstance(m, BATCH_NORMS)),
            normalizers=frozenset(label(name) for name, m in leaves if isinstance(m, NORMS)),
            embeddings=frozenset(label(name) for name, m in modules if isinstance(m, EMBEDDINGS)),
            half={owner[n]: p.dtype for n, p in params if p.dtype in (torch.float16, torch.bfloat16)},
        )

    def facts(self, eps: dict[str, float]) -> dict[str, Any]:
        """What a health ``Snapshot`` holds of the layers' kinds, under its fields' names (``eps``: per layer, its
        adaptive optimizer's ``eps``, which float16 may round to 0)."""
        return {
            "squashing": self.squashing,
            "embeddings": self.embeddings,
            "channelwise": self.channelwise,
            "normalizers": self.normalizers,
            "weight_sizes": self.sizes,
            "leaves_with_params": self.with_params,
            "half": {
                layer: (str(dtype).removeprefix("torch."), torch.finfo(dtype).eps) for layer, dtype in self.half.items()
            },
            "eps_lost": frozenset(  # float16's smallest number is 6e-8: Adam's 1e-8 rounds to 0
                layer
                for layer, dtype in self.half.items()
                if (e := eps.get(layer)) is not None and float(torch.tensor(e, dtype=dtype)) == 0
            ),
        }


@dataclass
class Outputs:
    """What the layers' outputs and the batch gave in a logging step, under the names of a health ``Snapshot``'s
    fields: per layer, its outputs pooled (``activations``) and its output units' sums of squares (``units``), with
    the layers whose units were counted after a functional activation (``activated``) or after a module without
    weights that other layers fed too (``shared``); the leaves in the order they ran and last ran; the share of each
    sigmoid, tanh and softmax output at its bounds; the output layer's gradient; the batch tensors' RMS and the layers
    that took them; the class labels' count, sum and sum of squares; the units pruned away."""

    order: list[str] = field(default_factory=list)
    executed: list[str] = field(default_factory=list)
    last_calls: dict[str, int] = field(default_factory=dict)
    output_width: int = 0
    activations: dict[str, State] = field(default_factory=dict)
    units: dict[str, list[float]] = field(default_factory=dict)
    activated: dict[str, str] = field(default_factory=dict)
    shared: dict[str, str] = field(default_factory=dict)
    saturated: dict[str, float] = field(default_factory=dict)
    row_sums: dict[str, float] = field(default_factory=dict)
    sigmoid_misfit: dict[str, float] = field(default_factory=dict)
    clamped: dict[str, float] = field(default_factory=dict)
    inputs: dict[str, float] = field(default_factory=dict)
    taken: dict[str, float] = field(default_factory=dict)
    entry: tuple[str, float] | None = None
    input_takers: dict[str, str] = field(default_factory=dict)
    pruned: dict[str, list[bool]] = field(default_factory=dict)
    labels: dict[str, tuple[float, float, float]] = field(default_factory=dict)


def layer_outputs(fetched: Fetched, recorder: UnitRecorder, replicas: int, layers: Layers) -> Outputs:
    """The :class:`Outputs` of what ``recorder`` added to the fetched batch, ``replicas`` data-parallel processes
    having seen batches alike."""
    vectors = fetched.vectors
    executed = [label(name) for name in recorder.order]
    ran = set(executed)
    output_grads = {label(k[1]): v for k, v in vectors.items() if k[0] == "rowsum" and v[1] > 0}
    found = Outputs(
        order=[*executed, *(name for name in layers.order if name not in ran)],
        executed=executed,
        last_calls={label(name): call for name, call in recorder.last_call.items()},
        output_width=recorder.output_width,
        saturated={
            label(k[1]): v[0] / max(recorder.saturable.get(k[1], 0) * replicas * fetched.parts.get(k, 1), 1)
            for k, v in vectors.items()
            if k[0] == "sat"
        },
        row_sums={layer: rows / size for layer, (rows, size, _) in output_grads.items()},
        sigmoid_misfit={layer: misfit / size for layer, (_, size, misfit) in output_grads.items()},
        clamped={label(k[1]): v[0] / v[1] for k, v in vectors.items() if k[0] == "clamped" and v[1] > 0},
        inputs={  # not an additive mask in every micro-batch (its fills all alike)
            k[1]: _rms(v) for k, v in vectors.items() if k[0] == "input" and v[2] < v[3]
        },
        taken={k[1]: _rms(v) for k, v in vectors.items() if k[0] == "taken"},
        entry=next(((label(k[1]), _rms(v)) for k, v in vectors.items() if k[0] == "entry"), None),
        input_takers={path: label(name) for path, name in recorder.takers.items()},
        pruned={label(k[1]): [v > 0 for v in values] for k, values in vectors.items() if k[0] == "pruned"},
        labels={k[1]: (v[0], v[1], v[2]) for k, v in vectors.items() if k[0] == "labels"},
    )
    pooled: dict[str, list[State]] = {}  # a nested output's tensors pooled into their layer's
    units = found.units
    for key, values in vectors.items():
        if key[0] != "units":
            continue
        layer, per_unit = key[1].split(".out.", 1)[0], key in recorder.per_unit
        sum_sq = math.fsum(values)
        # the values each unit saw: this process's count times the data-parallel processes, times the
        # tensor-parallel shards added up into one sum
        numel = float(recorder.samples.get(key, 0) * len(values) * replicas * fetched.parts.get(key, 1))
        pooled.setdefault(layer, []).append(
            State(numel=numel, sum_sq=sum_sq, nonfinite=float(not math.isfinite(sum_sq)))
        )
        if per_unit:
            units.setdefault(layer, values)
    for key, values in vectors.items():  # a layer's units after a functional activation (another process may have
        # seen them alone)
        if key[0] == "fed" and key[1] in pooled and key[1] not in units:
            units[key[1]], found.activated[key[1]] = values, recorder.activated.get(key[1], "an operation")
    for key, values in vectors.items():  # after a module without weights that also took other layers' outputs
        if key[0] == "after" and key[1] in pooled and key[1] not in units:
            units[key[1]], found.shared[key[1]] = values, recorder.after.get(key[1], "a module")
    for carrier, (maker, width, ops) in recorder.carried.items():
        # a dropout or pooling module that took them: its units are the layer's
        if len(units.get(carrier, ())) == width and maker in pooled and maker not in units:
            units[maker], found.activated[maker] = units.pop(carrier), ops
    found.activations = {layer: combine(states) for layer, states in pooled.items()}
    return found


def layer_gradients(fetched: Fetched, names: list[list[str]], layers: Layers) -> dict[str, State]:
    """Per layer, its parameters' gradients pooled, from the ``("grads", <i>)`` vectors of the parameters ``names``."""
    pooled: dict[str, list[State]] = {}
    for i, read in enumerate(names):
        values, n = fetched.vectors[("grads", str(i))], len(read)
        for name, l1, l2_squared in zip(read, values[:n], values[n:], strict=True):
            state = State(
                numel=layers.numel[name], abs_sum=l1, sum_sq=l2_squared, nonfinite=float(not math.isfinite(l1))
            )
            pooled.setdefault(layers.owner[name], []).append(state)
    return {layer: combine(states) for layer, states in pooled.items()}


def layer_updates(fetched: Fetched, layers: Layers) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Per layer, ``||Δw|| / ||w||`` of the optimizer step, ``||w||``, and (half-precision layers) the share of
    its weights the step changed."""
    squares: dict[str, list[tuple[float, float]]] = {}  # per layer, ||Δw||² and ||w||² of each parameter
    for (group, name), value in fetched.scalars.items():
        if group == "ratio":
            norm = fetched.scalars.get(("wnorm", name), math.nan)
            squares.setdefault(layers.owner.get(name, name), []).append(((value * norm) ** 2, norm**2))
    for (group, name), change in fetched.states.items():  # sharded parameters: pooled squares of Δw and w
        if group == "update":
            weight = max(fetched.states[("weight", name)].sum_sq, 0.0)
            squares.setdefault(layers.owner.get(name, name), []).append((max(change.sum_sq, 0.0), weight))
    norms = {layer: math.sqrt(math.fsum(w for _, w in pairs)) for layer, pairs in squares.items()}
    ratios = {
        layer: math.sqrt(math.fsum(c for c, _ in pairs)) / max(norms[layer], 1e-12) for layer, pairs in squares.items()
    }
    changed: dict[str, list[tuple[float, int]]] = {}  # per half-precision layer, each parameter's changed share
    for (group, name), share in fetched.scalars.items():
        if group == "changed":
            changed.setdefault(layers.owner[name], []).append((share, layers.numel[name]))
    shares = {layer: sum(s * n for s, n in parts) / sum(n for _, n in parts) for layer, parts in changed.items()}
    return ratios, norms, shares


def pruned_units(leaves: list[tuple[str, nn.Module]]) -> list[tuple[str, torch.Tensor]]:
    """Per leaf pruned by ``torch.nn.utils.prune`` (a ``weight_mask`` buffer, as Lightning's ``ModelPruning`` leaves
    it during the fit), which output units have every weight masked (1.0); masks change as pruning goes on."""
    found = []
    for name, module in leaves:
        mask = getattr(module, "weight_mask", None)
        if isinstance(mask, torch.Tensor) and mask.dim() > 1 and not getattr(module, "transposed", False):
            found.append((name, (mask.reshape(len(mask), -1) == 0).all(1).float()))
    return found


def _rms(sums: list[float]) -> float:
    """The RMS of :func:`~lightning_hooks.stats.state.input_sums` added up."""
    return math.sqrt(sums[0] / max(sums[1], 1))


def watch_batch(recorder: UnitRecorder, batch: StatBatch, data: Any, inputs: bool) -> None:
    """Show ``recorder`` the floating-point tensors of a training batch ``data``: the last one's size, which an output
    layer with as many values gives; with ``inputs``, each one's RMS (added to ``batch``) and, but for the targets (the
    last of several), its address and size, by which the layer that takes it is found; and, where the last of several
    tensors is a vector of integers (class labels), their count, sum and sum of squares, which tell whether they are
    all one class."""
    recorder.batch_tensors, recorder.batch_sizes, recorder.sums = {}, {}, {}  # a previous micro-batch's were freed
    tensors = list(named_tensors(data))
    floats = [(path, t) for path, t in tensors if t.is_floating_point() and t.numel()]
    recorder.target_numel = floats[-1][1].numel() if len(floats) > 1 else None
    if not inputs:
        return
    for i, (path, t) in enumerate(floats):
        batch.add_vector(("input", path), recorder.input_sums(t))
        if t.layout == torch.strided:  # which layer takes it (a sparse tensor has no one address)
            recorder.batch_tensors[t.data_ptr()] = path
            if i < len(floats) - 1 or len(floats) == 1:  # not the targets: no layer takes them
                recorder.batch_sizes.setdefault(t.numel(), path)
    path, last = tensors[-1] if len(tensors) > 1 else ("", None)
    if last is not None and last.dim() == 1 and last.layout == torch.strided and last.dtype in LABELS and last.numel():
        labels = last.double()
        count = labels.new_full((), float(labels.numel()))
        batch.add_vector(("labels", path), torch.stack([count, labels.sum(), labels.square().sum()]))


def ungraded_weights(
    recorder: UnitRecorder, graded: set[str], missing: dict[str, nn.Parameter], owner: dict[str, str]
) -> tuple[list[tuple[str, int]], torch.Tensor | None]:
    """The leaves that ran with gradients enabled before the first leaf to get a gradient (one of the layers
    ``graded``), whose parameters an optimizer stepped without one (``missing``), each with its number of them; and a
    fingerprint (sum and norm) of each of those parameters, to tell at the next logging step whether they changed.
    Not a leaf run under ``torch.no_grad()`` (a teacher: on purpose), nor one that ran after a leaf that learns (a
    module whose output goes unused, as the pooler that transformers' BigBird computes and its classifier never reads):
    a cut from the loss leaves the layers before it without a gradient."""
    ran: set[str] = set()
    for name in recorder.order:
        if (layer := label(name)) in graded:
            break
        if name in recorder.with_grad:
            ran.add(layer)
    layers: dict[str, list[torch.Tensor]] = {}
    for name, p in missing.items():
        if (layer := owner[name]) in ran and layer not in graded:
            layers.setdefault(layer, []).append(p.detach())
    if not layers:
        return [], None
    weights = [w for ws in layers.values() for w in ws]
    sums = torch.stack([torch.stack([w.sum(), torch.linalg.vector_norm(w)]) for w in weights]).float()
    return [(layer, len(ws)) for layer, ws in layers.items()], sums.flatten()


def fingerprints(fetched: Fetched, layers: list[tuple[str, int]]) -> dict[str, tuple[float, ...]]:
    """Per leaf of :func:`ungraded_weights`, its weights' fingerprint as fetched."""
    values = fetched.vectors.get(("ungraded", "weights"), [])
    found, start = {}, 0
    for layer, n in layers:
        found[layer] = tuple(values[start : start + 2 * n])
        start += 2 * n
    return found
