"""Training programs of kinds no check was written from: a physics-informed network that differentiates through the
model, policy gradients, flows and likelihoods whose loss goes below zero, distillation from a frozen teacher, a
mixture of experts. Every callback runs through them, and HealthMonitor, where they learn, finds nothing."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits, make_moons
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import ActivationStats, GradStats, HealthMonitor, NonFiniteGuard, ShapeLogger
from tests.support.helpers import hook_state, make_trainer, scalars

Step = Callable[["Program", Any], torch.Tensor]


class Program(pl.LightningModule):
    """``net`` trained on ``data`` by ``loss(program, batch)`` under Adam at ``lr`` (``optimizer`` overrides)."""

    def __init__(
        self,
        net: nn.Module,
        data: TensorDataset,
        loss: Step,
        batch_size: int = 64,
        lr: float = 1e-3,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    ) -> None:
        super().__init__()
        self.net, self.data, self.loss = net, data, loss
        self.batch_size, self.lr, self.optimizer = batch_size, lr, optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(self, batch)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.net.parameters() if p.requires_grad]
        return self.optimizer(params) if self.optimizer else torch.optim.Adam(params, lr=self.lr)


def mlp(*sizes: int, act: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:], strict=False):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers[:-1])


def digits() -> TensorDataset:
    data = load_digits()
    return TensorDataset(torch.tensor(data.data, dtype=torch.float32) / 16, torch.tensor(data.target))


def ode_residual(program: Program, batch: Any) -> torch.Tensor:
    """u'(x) = cos(x) with u(0) = 0, the derivative taken through the model (a second backward in the step's)."""
    x = batch[0].clone().requires_grad_(True)
    (du,) = torch.autograd.grad(program.net(x).sum(), x, create_graph=True)
    return (du - torch.cos(x)).square().mean() + program.net(torch.zeros(1, 1)).square().mean()


def physics_informed(lbfgs: bool = False) -> Program:
    """A tanh MLP fitted to the ODE at 256 points, under Adam or L-BFGS (whose step evaluates the closure 5 times)."""
    points = TensorDataset(torch.linspace(0, 2 * math.pi, 256).unsqueeze(1))
    optimizer = (lambda params: torch.optim.LBFGS(params, lr=0.5, max_iter=5)) if lbfgs else None
    return Program(mlp(1, 32, 32, 1, act=nn.Tanh), points, ode_residual, batch_size=256, optimizer=optimizer)


class Bandit(Program):
    """REINFORCE on digits as a contextual bandit: guess the digit, reward 1 when right, the batch's mean as baseline.
    The loss is negative and does not fall as a supervised one does; the reward rises."""

    def __init__(self) -> None:
        super().__init__(mlp(64, 64, 10), digits(), self.policy_gradient)
        self.rewards: list[float] = []

    def policy_gradient(self, program: Program, batch: Any) -> torch.Tensor:
        x, y = batch
        policy = torch.distributions.Categorical(logits=self.net(x))
        action = policy.sample()
        reward = (action == y).float()
        self.rewards.append(reward.mean().item())
        return -(policy.log_prob(action) * (reward - reward.mean())).mean() - 0.01 * policy.entropy().mean()


class Coupling(nn.Module):
    """An affine coupling of RealNVP on 2-D points: one coordinate scales and shifts the other."""

    def __init__(self, flip: bool) -> None:
        super().__init__()
        self.flip, self.net = flip, mlp(1, 64, 64, 2)

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = (z[:, 1:], z[:, :1]) if self.flip else (z[:, :1], z[:, 1:])
        scale, shift = self.net(a).chunk(2, 1)
        scale = torch.tanh(scale)
        b = b * scale.exp() + shift
        return (torch.cat([b, a], 1) if self.flip else torch.cat([a, b], 1)), scale.sum(1)


def negative_log_likelihood(program: Program, batch: Any) -> torch.Tensor:
    z, log_det = batch[0], 0.0
    for layer in program.net:
        z, d = layer(z)
        log_det = log_det + d
    return (0.5 * z.square().sum(1) + math.log(2 * math.pi) - log_det).mean()


def flow() -> Program:
    moons = torch.tensor(make_moons(4000, noise=0.05, random_state=0)[0], dtype=torch.float32)
    layers = nn.ModuleList(Coupling(i % 2 == 1) for i in range(6))
    return Program(layers, TensorDataset(moons), negative_log_likelihood, batch_size=128)


def gaussian_likelihood(program: Program, batch: Any) -> torch.Tensor:
    x, y = batch
    mean, var = program.net(x).chunk(2, 1)
    return F.gaussian_nll_loss(mean, y, F.softplus(var) + 1e-6)


def heteroscedastic() -> Program:
    """A regression that learns its own variance: the loss goes below zero as the variance shrinks."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3000, 1, generator=g) * 6 - 3
    y = torch.sin(x) + torch.randn(3000, 1, generator=g) * (0.05 + 0.1 * x.abs())
    return Program(mlp(1, 64, 64, 2), TensorDataset(x, y), gaussian_likelihood, batch_size=128, lr=3e-3)


class Distillation(nn.Module):
    def __init__(self, teacher: nn.Module) -> None:
        super().__init__()
        self.teacher, self.student = teacher, mlp(64, 16, 10)


def distilled(program: Program, batch: Any) -> torch.Tensor:
    x, y = batch
    with torch.no_grad():
        taught = program.net.teacher(x)
    logits = program.net.student(x)
    soft = F.kl_div(F.log_softmax(logits / 4, 1), F.softmax(taught / 4, 1), reduction="batchmean") * 16
    return 0.5 * soft + 0.5 * F.cross_entropy(logits, y)


def distillation() -> Program:
    """A small student taught by a frozen teacher that runs, in eval mode and without gradients, in every step."""
    data = digits()
    teacher = mlp(64, 128, 128, 10)
    optimizer = torch.optim.Adam(teacher.parameters(), lr=1e-3)
    for _ in range(300):
        i = torch.randint(0, len(data), (64,))
        optimizer.zero_grad()
        F.cross_entropy(teacher(data.tensors[0][i]), data.tensors[1][i]).backward()
        optimizer.step()
    return Program(Distillation(teacher.eval().requires_grad_(False)), data, distilled)


class Experts(nn.Module):
    """Top-1 routing over four expert MLPs; an expert no sample of a batch picks gets no gradient in that step."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.router, self.head = nn.Linear(64, 32), nn.Linear(32, 4), nn.Linear(32, 10)
        self.experts = nn.ModuleList(mlp(32, 64, 32) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.inp(x))
        weights = self.router(h).softmax(1)
        chosen = weights.argmax(1)
        mixed = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            if (picked := chosen == i).any():
                mixed[picked] = expert(h[picked]) * weights[picked, i : i + 1]
        return self.head(h + mixed)


def classified(program: Program, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(program.net(x), y)


def experts() -> Program:
    return Program(Experts(), digits(), classified)


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def train(tmp_path: Path, program: Program, steps: int, *callbacks: pl.Callback) -> Losses:
    losses = Losses()
    trainer = make_trainer(tmp_path, [*callbacks, losses], max_steps=steps, log_every_n_steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(program)
    return losses


class Gradients(pl.Callback):
    """The first-layer weight's gradient norm at the first evaluation of each optimizer step (Lightning calls this
    hook after each run of the step's closure, which L-BFGS runs several times), by step."""

    def __init__(self) -> None:
        self.norms: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.norms.setdefault(trainer.global_step, pl_module.net[0].weight.grad.norm().item())


@pytest.mark.parametrize("lbfgs", [False, True], ids=["adam", "lbfgs"])
def test_a_physics_informed_fit_differentiating_through_the_model_is_observed_as_it_is(
    tmp_path: Path, lbfgs: bool
) -> None:
    # The residual's derivative is a backward inside the forward (create_graph), whose own gradient flows back
    # through the hooked layers in the step's backward. Under L-BFGS a step's gradient is the one at the weights it
    # starts from, its closure's first evaluation.
    pl.seed_everything(0, verbose=False)
    program, truth, monitor = physics_informed(lbfgs), Gradients(), HealthMonitor(log_every_n_steps=5)
    before = hook_state(program)
    observers = [ShapeLogger(), GradStats(log_every_n_steps=5), ActivationStats(log_every_n_steps=5), NonFiniteGuard()]
    losses = train(tmp_path, program, 40 if lbfgs else 60, monitor, truth, *observers)
    logged = scalars(tmp_path, "grad_norm/net.0.weight")
    assert sorted(logged) == list(range(0, 40 if lbfgs else 60, 5))
    assert all(logged[step] == pytest.approx(truth.norms[step], rel=1e-5) for step in logged)
    assert losses.losses[-1] < losses.losses[0] / 2
    assert monitor.findings == []
    assert hook_state(program) == before


@pytest.mark.parametrize(
    ("build", "steps"),
    [
        (Bandit, 400),
        (flow, 300),
        (heteroscedastic, 300),
        (distillation, 300),
        (experts, 300),
    ],
    ids=["reinforce", "realnvp", "gaussian-nll", "distillation", "mixture-of-experts"],
)
def test_programs_of_kinds_no_check_was_written_from_make_no_finding(
    tmp_path: Path, build: Callable[[], Program], steps: int
) -> None:
    # Expected before any was run: each learns, and nothing is named (session 29, all passed on first run).
    pl.seed_everything(0, verbose=False)
    program, monitor = build(), HealthMonitor(log_every_n_steps=5)
    losses = train(tmp_path, program, steps, monitor).losses
    if isinstance(program, Bandit):
        assert sum(program.rewards[-20:]) / 20 > 2 * sum(program.rewards[:20]) / 20
    else:
        assert sum(losses[-5:]) < sum(losses[:5]) - 0.1 * abs(sum(losses[:5]))
    assert monitor.findings == []


class Transfer(pl.LightningModule):
    """A batch-norm CNN backbone and a new head on digits, the head alone given to Adam, as Lightning's
    ``BackboneFinetuning`` recipe does (the callback adds the backbone when it unfreezes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten()
        )
        self.head = nn.Linear(128, 10)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x.view(-1, 1, 8, 8))), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(digits(), batch_size=64, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.head.parameters(), lr=1e-3)


@pytest.mark.parametrize("train_bn", [True, False, None], ids=["train_bn", "frozen bn", "no finetuning callback"])
def test_lightning_backbone_finetuning_leaves_batch_norms_outside_the_optimizer_unnamed(
    tmp_path: Path, train_bn: bool | None
) -> None:
    # `BackboneFinetuning` leaves a frozen backbone's batch norms trainable (`train_bn=True`), or makes them so when it
    # unfreezes the backbone without adding them (`train_bn=False`): they get gradients outside the optimizer, by the
    # callback's design. Before, they were named as left out of the optimizer. A backbone left out with no such
    # callback is still named.
    from lightning.pytorch.callbacks import BackboneFinetuning

    pl.seed_everything(0, verbose=False)
    monitor = HealthMonitor(log_every_n_steps=5)
    also = [] if train_bn is None else [BackboneFinetuning(unfreeze_backbone_at_epoch=1, train_bn=train_bn)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(tmp_path, [monitor, *also], max_steps=60, logger=False).fit(Transfer())
    found = [(f.check, f.layers) for f in monitor.findings]
    assert found == ([] if train_bn is not None else [("update_ratio", ("backbone.0", "backbone.1"))])


class OneValueBatches(pl.LightningModule):
    """Batches whose last tensor holds one value each, by design: sequences bucketed by length (``(tokens, label,
    length)``: is token 7 commoner than token 8?), or two digits tasks taken in turn (``(x, label, task)``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.EmbeddingBag(30, 32)  # mean over a sequence
        self.trunk = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
        self.heads = nn.ModuleList([nn.Linear(64, 10), nn.Linear(64, 2)])
        self.head = nn.Linear(32, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, last = batch
        if self.kind == "lengths":
            return F.cross_entropy(self.head(self.embed(x)), y)
        return F.cross_entropy(self.heads[int(last[0])](self.trunk(x)), y)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        if self.kind == "lengths":
            batches = []
            for length in range(8, 25):
                tokens = torch.randint(0, 30, (96, length), generator=g)
                label = ((tokens == 7).sum(1) > (tokens == 8).sum(1)).long()
                batches += [
                    (t, y, torch.full((len(y),), length))
                    for t, y in zip(tokens.split(32), label.split(32), strict=True)
                ]
        else:
            x, y = digits().tensors
            batches = [
                (xs, ys % 2 if task else ys, torch.full((len(ys),), task))
                for xs, ys in zip(x.split(32), y.split(32), strict=True)
                for task in (0, 1)
            ]
        order = torch.randperm(len(batches), generator=g).tolist() if self.kind == "lengths" else range(len(batches))
        return DataLoader([batches[i] for i in order], batch_size=None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)


@pytest.mark.parametrize("kind", ["lengths", "tasks"])
def test_batches_of_one_length_or_one_task_each_are_not_a_training_set_sorted_by_class(
    tmp_path: Path, kind: str
) -> None:
    # Length bucketing (torchtext's BucketIterator) puts one length in each batch, and its lengths come last; a
    # round-robin over tasks puts one task id in each. Before, either was "every batch held a single class: the
    # training set is sorted by class". Lengths are no index of the model's 2 outputs, and tasks taken in turn do not
    # lie in blocks in the loader's order, as a sorted training set's classes do.
    pl.seed_everything(0, verbose=False)
    monitor = HealthMonitor(log_every_n_steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(tmp_path, [monitor], max_steps=150, logger=False).fit(OneValueBatches(kind))
    assert monitor.findings == []


def is_nine(program: Program, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.binary_cross_entropy(program.net(x).squeeze(1), (y == 9).float())


def test_a_sigmoid_under_binary_cross_entropy_one_sample_a_step_is_not_taken_for_logits(tmp_path: Path) -> None:
    # Attention-based multiple-instance learning (Ilse et al.) trains one bag a step: a sigmoid's single output under
    # `binary_cross_entropy`. The check that the loss took the sigmoid's output for logits fits the loss's scale to the
    # gradient, and a scale fits one value exactly: before, this was "squashed twice". Fewer than 8 values are not
    # judged.
    pl.seed_everything(0, verbose=False)
    net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1), nn.Sigmoid())
    monitor = HealthMonitor(log_every_n_steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(tmp_path, [monitor], max_steps=100, logger=False).fit(Program(net, digits(), is_nine, 1))
    assert monitor.findings == []


def two_views(x: torch.Tensor) -> torch.Tensor:
    """A digit shifted by up to a pixel, 10 % of its pixels dropped and noise added: one of SimCLR's views."""
    dx, dy = torch.randint(-1, 2, (2,)).tolist()
    x = torch.roll(x, (dx, dy), (2, 3))
    return x * (torch.rand_like(x) > 0.1) + 0.1 * torch.randn_like(x)


def nt_xent(program: Program, batch: Any) -> torch.Tensor:
    """SimCLR's loss at temperature 0.5: each view's other view among the batch's 2N."""
    x = batch[0].view(-1, 1, 8, 8)
    z = F.normalize(program.net(torch.cat([two_views(x), two_views(x)])), dim=1)
    n = len(x)
    similar = (z @ z.T / 0.5).masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    return F.cross_entropy(similar, torch.cat([torch.arange(n, 2 * n), torch.arange(n)]))


def test_a_contrastive_gradient_that_starts_far_below_its_working_level_is_not_exploding(tmp_path: Path) -> None:
    # SimCLR's embeddings start almost alike (mean cosine 0.998), so its softmax starts near uniform and its gradient
    # tiny: 0.03 at step 0, 1.7 at step 50, then within 1.6-6.2 (3.1 at step 150) while the loss falls from 5.5 to
    # 4.3. Before, logging every 50 steps, that was a 107-fold growth over 3 logging steps: the rise is now counted
    # from the first logging step after step 0.
    pl.seed_everything(0, verbose=False)
    encoder = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 16, 64),
    )
    net = nn.Sequential(encoder, nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    images = TensorDataset(digits().tensors[0][:1400])
    monitor = HealthMonitor()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trainer(tmp_path, [monitor], max_steps=250, log_every_n_steps=50, logger=False)
        trainer.fit(Program(net, images, nt_xent, batch_size=128))
    assert monitor.findings == []


class RareTask(pl.LightningModule):
    """A multi-task fit with one task per batch: digits' parity on the shared trunk's first head, and, on its own rare
    batches (steps 25, 27, 32, 73, 91 and 153 of 200), the digit itself on a second head."""

    RARE = (25, 27, 32, 73, 91, 153)

    def __init__(self) -> None:
        super().__init__()
        self.trunk = mlp(64, 64, 64)
        self.heads = nn.ModuleList([nn.Linear(64, 2), nn.Linear(64, 10)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        task, x, y = batch
        return F.cross_entropy(self.heads[int(task[0])](self.trunk(x)), y)

    def train_dataloader(self) -> DataLoader:
        x, y = digits().tensors
        g = torch.Generator().manual_seed(0)
        batches = []
        for step in range(200):
            i = torch.randint(0, len(y), (32,), generator=g)
            task = int(step in self.RARE)
            batches.append((torch.full((32,), task), x[i], y[i] if task else y[i] % 2))
        return DataLoader(batches, batch_size=None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_a_rare_task_batch_of_a_multi_task_fit_is_not_a_loss_spike(tmp_path: Path) -> None:
    # A BERT encoder with a classification head on 97 % of the batches and a tagging head on the others, one task a
    # batch: each tagging batch's loss (about 2) stood 20-25 robust deviations above the classification's, and was
    # called a loss spike "in the tagging head (inf× its recent median)". That head had no gradient at the steps
    # before: the batch ran a part of the model theirs did not, and is another kind of batch, not a bad one.
    pl.seed_everything(0, verbose=False)
    monitor = HealthMonitor(log_every_n_steps=5)
    losses = train(tmp_path, RareTask(), 200, monitor).losses  # type: ignore[arg-type]
    assert monitor.findings == []
    assert max(losses[-20:]) < 0.3 * losses[0]  # it learnt (0.70 -> 0.05-0.20)
