"""MemoryLogger against truth computed independently: bytes counted by hand, tensors autograd saves."""

from __future__ import annotations

import gc
import re
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torch.optim.optimizer as optimizer_hooks
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from examples.encoder import EncoderLM
from examples.transformer import TokenDataModule
from lightning_hooks import MemoryLogger
from lightning_hooks.cli import main
from lightning_hooks.recorders import memory
from tests.support.helpers import CUDA, Probe, TinyNet, hook_state, make_trainer, scalars, texts
from tests.support.pretrained import THIRD_PARTY, Pretrained, language_model_loss, third_party


class Fit(pl.LightningModule):
    """``net`` classifying ``x`` into ``y`` with Adam, in batches of 8."""

    def __init__(self, net: nn.Module, x: torch.Tensor, classes: int = 3) -> None:
        super().__init__()
        self.net, self.x = net, x
        self.y = torch.randint(0, classes, (len(x),), generator=torch.Generator().manual_seed(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=8)


class LastStep(nn.Module):
    """An LSTM read at its last time step."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.head = nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


class Pooled(nn.Module):
    """A transformer encoder, mean-pooled."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


def model(kind: str) -> pl.LightningModule:
    torch.manual_seed(0)
    if kind in THIRD_PARTY:
        return third_party(kind)
    if kind == "mlp":
        return Fit(
            nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3)),
            torch.randn(32, 16),
        )
    if kind == "cnn":
        conv = [
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(inplace=True),
        ]
        return Fit(
            nn.Sequential(*conv, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)), torch.randn(32, 3, 16, 16)
        )
    if kind == "transformer":
        return Fit(Pooled(), torch.randn(32, 12, 32))
    if kind == "lstm":
        return Fit(LastStep(), torch.randn(32, 10, 8))

    class Adam(TinyNet):  # its ReLU is called twice per forward
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return Adam(batch_size=8)


def nbytes(tensors: Any) -> int:
    """Bytes of distinct tensors, counted element by element."""
    distinct = {id(t): t for t in tensors if t is not None}
    return sum(t.nelement() * t.element_size() for t in distinct.values())


def saved_by_module(pl_module: pl.LightningModule, batch: Any) -> dict[str, int]:
    """Replay ``training_step``: bytes autograd saves inside each module's forward, by storage, parameters and
    buffers left out."""
    params = {t.untyped_storage().data_ptr() for t in [*pl_module.parameters(), *pl_module.buffers()]}
    running: list[str] = []
    saved: dict[str, dict[int, int]] = {name: {} for name, _ in pl_module.named_modules()}
    handles = []
    for name, module in pl_module.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: running.append(name)))
        handles.append(module.register_forward_hook(lambda m, a, o: None if running.pop() else None))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            for name in running:
                saved[name][storage.data_ptr()] = storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            pl_module.training_step(batch, 1)
    finally:
        for handle in handles:
            handle.remove()
    return {name: sum(s.values()) for name, s in saved.items()}


def close(got: int, want: int, rel: float) -> bool:
    return got == pytest.approx(want, rel=rel, abs=64)


@pytest.mark.parametrize(
    "kind",
    ["mlp", "cnn", "transformer", "lstm", "called-twice", *THIRD_PARTY],
)
def test_rows_match_bytes_counted_independently(tmp_path: Path, kind: str) -> None:
    pl_module = model(kind)
    logger = MemoryLogger()
    batches = Probe("on_train_batch_start", lambda trainer, m, batch, i: [t.clone() for t in batch])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [logger, batches], logger=False, max_steps=2).fit(pl_module)
    # Frozen parameters broke torch's tracker (Whisper, LoRA); T5's loss module, made in its forward, made it warn.
    assert not [w for w in caught if re.search("could not record|Module is None", str(w.message))]
    optimizer = pl_module.trainer.optimizers[0]
    activations = saved_by_module(pl_module, batches.seen[1])
    assert logger.rows
    assert logger.peak > 0
    for row in logger.rows:
        module = pl_module.get_submodule(row.name)
        params = list(module.parameters())
        state = [t for p in params for t in optimizer.state.get(p, {}).values() if torch.is_tensor(t)]
        truth = {
            "parameters": nbytes(params),
            "gradients": nbytes(p.grad for p in params),
            "optimizer_state": nbytes(state),
            "activations": activations[row.name],
        }
        rel = 0.05 if row.name == "" else 0.10  # the root's row is the model's total
        for column, want in truth.items():
            assert close(getattr(row, column), want, rel), (row.name, column, getattr(row, column), want)
        assert row.peak <= logger.peak
    assert re.fullmatch(r".+ \((forward|backward)\)|optimizer step|training_step, outside any module", logger.peak_at)


class Checkpointed(EncoderLM):
    """EncoderLM whose layers run under ``torch.utils.checkpoint``."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return self.head(self.norm(x))


MIB = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def estimate_and_freed(
    fits: list[tuple[pl.LightningModule, Any]], root: Path, blocks: str, n: int
) -> tuple[float, int]:
    """The advice's estimate for the ``n`` ``blocks`` in the first fit, and how much lower the second fit's peak
    really was."""
    peaks, summaries = [], []
    for i, (pl_module, data) in enumerate(fits):
        logger = MemoryLogger()
        make_trainer(root / str(i), [logger], logger=False, max_steps=2).fit(pl_module, datamodule=data)
        peaks.append(logger.peak)
        summaries.append(logger.summary)
    advice = rf"activation checkpointing of `{re.escape(blocks)}` \({n} blocks\) would free about ([\d.]+) (\w+) of"
    found = re.search(advice, summaries[0])
    assert found, summaries[0]
    freed = peaks[0] - peaks[1]
    assert freed > 0.2 * peaks[0]
    return float(found[1]) * MIB[found[2]], freed


def test_checkpointing_advice_is_what_checkpointing_frees(tmp_path: Path) -> None:
    fits = []
    for cls in (EncoderLM, Checkpointed):
        torch.manual_seed(0)
        data = TokenDataModule(seq_len=64, n=64, batch_size=32)
        fits.append((cls(width=64, heads=4, layers=6, seq_len=64), data))
    estimate, freed = estimate_and_freed(fits, tmp_path, "layers.*", 6)
    assert estimate == pytest.approx(freed, rel=0.2)


def test_checkpointing_advice_is_what_transformers_gradient_checkpointing_frees(tmp_path: Path) -> None:
    # transformers' own checkpointing of GPT-2's blocks, whose peak moves from the forward to the backward's recompute.
    transformers = pytest.importorskip("transformers")
    fits = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=64, n_embd=64, n_layer=4, n_head=4, n_positions=64)
        net = transformers.GPT2LMHeadModel(config)
        if checkpointed:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        tokens = torch.randint(0, 64, (64, 64), generator=torch.Generator().manual_seed(1))
        fits.append((Pretrained(net, tokens, language_model_loss), None))
    estimate, freed = estimate_and_freed(fits, tmp_path, "net.transformer.h.*", 4)
    assert estimate == pytest.approx(freed, rel=0.2)


def test_the_advice_is_the_larger_lever(tmp_path: Path) -> None:
    # LoRA trains its adapters only: their optimizer state is 2 % of the peak. With the blocks in the table the advice
    # is to checkpoint them; without (max_depth=1) it names the activations, not a sharded optimizer.
    summaries = []
    for max_depth in (None, 1):
        logger = MemoryLogger(max_depth=max_depth)
        make_trainer(tmp_path / str(max_depth), [logger], logger=False, max_steps=2).fit(model("lora"))
        summaries.append(logger.summary)
    assert "activation checkpointing of `net.base_model.model.transformer.h.*` (2 blocks)" in summaries[0]
    assert re.search(r"; activations kept for backward are \d+ % of the peak$", summaries[1]), summaries[1]


def test_logs_the_table_and_scalars_at_the_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logger = MemoryLogger(at_step=2)
    make_trainer(tmp_path, [logger], max_steps=4).fit(model("called-twice"))
    out = capsys.readouterr().out
    assert out.count("MemoryLogger: Adam · step 2 · peak ") == 1
    assert re.search(r"^fc1\s+Linear\s+160 B\s+160 B\s+328 B\s", out, re.MULTILINE)
    table = texts(tmp_path, "memory/train")
    assert list(table) == [2]
    assert "| Layer | Type | Params | Grads | Optimizer | Activations | Temporaries | Peak |" in table[2]
    assert scalars(tmp_path, "memory/peak_bytes") == {2: float(logger.peak)}
    assert scalars(tmp_path, "memory/optimizer_state_bytes")[2] == float(logger.rows[0].optimizer_state)
    assert scalars(tmp_path, "memory/activations_bytes")[2] >= logger.rows[0].activations > 0


def trackers_alive() -> int:
    return sum(isinstance(o, MemTracker) for o in gc.get_objects())


def test_hooks_only_on_the_recorded_step_and_none_after(tmp_path: Path) -> None:
    pl_module = model("called-twice")
    before = hook_state(pl_module)
    during = Probe("on_before_backward", lambda trainer, m, loss: (trainer.global_step, hook_state(m), gc.isenabled()))
    after = Probe("on_train_batch_start", lambda trainer, *args: (trainer.global_step, trackers_alive()))
    make_trainer(tmp_path, [MemoryLogger(at_step=1), during, after], logger=False, max_steps=3).fit(pl_module)
    assert [step for step, state, _ in during.seen if state != before] == [1]
    # Python's collector waits during the recorded step only, and the tracker's cycles are collected as it ends.
    assert [step for step, _, collecting in during.seen if not collecting] == [1]
    assert gc.isenabled()
    assert after.seen == [(0, 0), (1, 1), (2, 0)]  # the recorded step's own tracker, entered just before
    assert hook_state(pl_module) == before
    assert not optimizer_hooks._global_optimizer_pre_hooks
    assert not optimizer_hooks._global_optimizer_post_hooks
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None


def test_hooks_go_when_the_recorded_step_raises(tmp_path: Path) -> None:
    pl_module = TinyNet(fail_at=1)
    before = hook_state(pl_module)

    class Fails(pl.Callback):
        def on_before_backward(self, trainer: pl.Trainer, m: pl.LightningModule, loss: torch.Tensor) -> None:
            raise RuntimeError("planned failure in backward")

    with pytest.raises(RuntimeError, match="planned failure"):
        make_trainer(tmp_path, [MemoryLogger(at_step=1)], logger=False, max_steps=3).fit(pl_module)
    assert hook_state(pl_module) == before
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None
    with pytest.raises(RuntimeError, match="planned failure in backward"):
        make_trainer(tmp_path, [MemoryLogger(at_step=0), Fails()], logger=False, max_steps=3).fit(TinyNet())
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None
    assert gc.isenabled()


def test_a_collector_turned_off_by_the_user_stays_off(tmp_path: Path) -> None:
    gc.disable()
    try:
        make_trainer(tmp_path, [MemoryLogger(at_step=1)], logger=False, max_steps=3).fit(TinyNet())
        assert not gc.isenabled()
    finally:
        gc.enable()


class TwoViews(TinyNet):
    """A training step that runs the whole model twice (two views of a batch), which MemTracker cannot track."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y) + F.cross_entropy(self(x.flip(0)), y.flip(0))


def test_a_tracker_failure_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    logger = MemoryLogger()
    trainer = make_trainer(tmp_path, [logger], logger=False, max_steps=4)
    failure = r"`MemoryLogger` could not record step 1: .*NotImplementedError.*iterative"
    with pytest.warns(UserWarning, match=failure) as seen:
        trainer.fit(TwoViews())
    assert sum("MemoryLogger` could not record" in str(w.message) for w in seen) == 1
    assert trainer.global_step == 4
    assert logger.rows == []


def test_a_failure_of_the_bookkeeping_after_an_operation_warns_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What torch before 2.13 did to every operation (its tracker lacked an attribute read there), planted here.
    def broken() -> None:
        raise AttributeError("planted: no fake mode recorded on entry")

    monkeypatch.setattr(memory, "active_fake_mode", broken)
    logger = MemoryLogger()
    trainer = make_trainer(tmp_path, [logger], logger=False, max_steps=3)
    with pytest.warns(UserWarning, match=r"`MemoryLogger` could not record step 1: .*planted"):
        trainer.fit(TinyNet())
    assert trainer.global_step == 3
    assert logger.rows == []


def tracked_step(tracker_type: type[MemTracker], kind: str) -> tuple[Any, ...]:
    """One training step of ``model(kind)``'s network under a fresh ``tracker_type``, after a step that made the
    optimizer's state: the step's peak and current snapshots, and every module's snapshots (by name and state) and
    bytes of parameters, buffers, inputs and outputs."""
    fit = model(kind)
    net, optimizer = fit.net if hasattr(fit, "net") else fit, torch.optim.Adam(fit.parameters(), lr=1e-3)
    x = fit.x[:8] if hasattr(fit, "x") else torch.randn(8, 32)

    def step() -> None:
        optimizer.zero_grad()
        net(x).square().mean().backward()
        optimizer.step()

    step()
    tracker = tracker_type()
    tracker.track_external(net, optimizer, x)
    gc.disable()  # a storage freed by a collection frees at a moment of its own: the same for both trackers
    try:
        with tracker:
            step()
    finally:
        gc.enable()
    modules = {
        stats.mod_fqn: (
            {str(state): calls for state, calls in stats.snapshots.items()},
            [getattr(stats, f"{kind}_mem") for kind in ("parameter", "buffer", "input", "output")],
        )
        for stats in tracker.memory_tracking.values()
    }
    return tracker.get_tracker_snapshot("peak"), tracker.get_tracker_snapshot(), modules


@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer", "lstm", "called-twice"])
def test_the_recorders_tracker_sees_what_torchs_own_sees(kind: str) -> None:
    # MemoryLogger's tracker does torch's bookkeeping with less Python after each operation; torch's MemTracker, run
    # on the same step, is the reference, snapshot for snapshot (every module, every state, every call).
    from lightning_hooks.recorders.memory import _Guarded

    want = tracked_step(MemTracker, kind)
    assert want[2]  # modules were tracked
    assert tracked_step(_Guarded, kind) == want


def test_the_tracker_methods_the_guard_wraps_still_exist_in_torch() -> None:
    # The guard overrides these MemTracker internals to catch its bookkeeping errors: a rename in torch must fail here,
    # not turn the guard off in silence.
    from torch.distributed._tools.mem_tracker import MemTracker

    from lightning_hooks.recorders.memory import _Guarded

    wrapped = ["_pre_fw_hook", "_post_fw_hook", "_pre_bw_hook", "_post_bw_hook", "_track", "_update_peak_stats"]
    assert [name for name in wrapped if name in vars(_Guarded)] == wrapped
    assert [name for name in wrapped if not callable(getattr(MemTracker, name, None))] == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"at_step": -1}, ValueError, r"`MemoryLogger` got `at_step=-1`; `at_step` must be an integer of 0 or more"),
        ({"at_step": 1.5}, TypeError, r"`MemoryLogger` got `at_step=1.5`; `at_step` must be an integer of 0 or more"),
        ({"at_step": True}, TypeError, r"`MemoryLogger` got `at_step=True`"),
        ({"snapshot_on_oom": "yes"}, TypeError, r"`MemoryLogger` got `snapshot_on_oom='yes'`; .* True or False"),
        ({"include": "fc1"}, TypeError, r"`MemoryLogger` got `include='fc1'`"),
    ],
)
def test_bad_arguments_name_the_argument_and_value(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        MemoryLogger(**kwargs)


def test_snapshot_on_oom_does_nothing_on_cpu(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", category=UserWarning)
        warnings.filterwarnings("ignore", message=".*(never ran|does not have many workers|litlogger).*")
        pl_module = TinyNet(fail_at=2, fail_with=torch.OutOfMemoryError)
        with pytest.raises(torch.OutOfMemoryError):
            make_trainer(tmp_path, [MemoryLogger(snapshot_on_oom=True)], logger=False, max_steps=4).fit(pl_module)
    assert not list(tmp_path.rglob("memory_snapshot.pickle"))


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_out_of_memory_writes_the_snapshot_next_to_the_logs(
    tmp_path: Path, device: str, capsys: pytest.CaptureFixture[str]
) -> None:
    class Greedy(TinyNet):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_step == 2:
                torch.empty(2**50, device=self.device)  # a petabyte: out of memory on any GPU
            return super().training_step(batch, batch_idx)

    with pytest.raises(torch.OutOfMemoryError):
        make_trainer(tmp_path, [MemoryLogger(snapshot_on_oom=True)], accelerator=device, max_steps=4).fit(Greedy())
    snapshot = tmp_path / "tb" / "version_0" / "memory_snapshot.pickle"
    assert snapshot.stat().st_size > 0
    out = capsys.readouterr().err
    assert f"MemoryLogger: the fit ran out of GPU memory; the allocator's history is in {snapshot}" in out
    assert "The last table recorded (step 1)" in out
    assert not torch.cuda.memory._snapshot()["device_traces"][0], "history recording was stopped"


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_by_default_no_allocator_history_is_recorded(tmp_path: Path, device: str) -> None:
    # The history costs 1.07-1.40x a step on a GPU (docs/performance.md): recorded only with `snapshot_on_oom=True`.
    events: list[int] = []

    class Look(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            events.append(len(torch.cuda.memory._snapshot()["device_traces"][0]))

    make_trainer(tmp_path, [MemoryLogger(), Look()], accelerator=device, max_steps=3).fit(TinyNet())
    assert events == [0, 0, 0]


def test_printed_table_of_the_24_layer_encoder_matches_golden(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], update_golden: bool
) -> None:
    torch.manual_seed(0)
    data = TokenDataModule(seq_len=16, n=32, batch_size=8)
    make_trainer(tmp_path, [MemoryLogger()], logger=False, max_steps=2).fit(EncoderLM(layers=24), datamodule=data)
    out = capsys.readouterr().out
    table = out[out.index("MemoryLogger:") :]
    assert len(table.splitlines()) <= 40
    golden = Path(__file__).parents[1] / "support" / "golden" / "memory_encoder24.txt"
    if update_golden:
        golden.write_text(table)
    assert golden.exists(), f"{golden} is missing: run `pytest --update-golden` once and review it"
    assert table == golden.read_text()


def test_lightning_cli_builds_it_from_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "memory.yaml"
    config.write_text(
        "trainer:\n"
        "  callbacks:\n"
        "    - class_path: lightning_hooks.MemoryLogger\n"
        "      init_args: {at_step: 1, max_depth: 1}\n"
        "  max_steps: 2\n"
        "  logger: false\n"
        "  enable_progress_bar: false\n"
        "  enable_checkpointing: false\n"
        "model: {class_path: examples.numnet.NumNet}\n"
        "data: {class_path: examples.numnet.NumDataModule}\n"
    )
    main(["fit", f"--config={config}", f"--trainer.default_root_dir={tmp_path}"])
    assert "MemoryLogger: NumNet · step 1 · peak " in capsys.readouterr().out
