"""What bfloat16 weights do to AdamW's steps: a 2-layer BERT (``benchmarks.health_cases``' token groups) trained
1,000 steps with float32 and with bfloat16 weights (``precision="bf16-true"``) at several learning rates. Printed per
run: the share of the weights of the median linear layer that a step changed (every 150 steps) and the mean loss of
the first and last 50 steps. The independent measure behind ``update_ratio``'s rounding finding
(docs/troubleshooting.md).

    .venv/bin/python benchmarks/bf16_rounding.py [LR ...]     # default: 1e-5 3e-5 1e-4 1e-3
"""

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.health_cases import VOCAB, token_groups  # noqa: E402

STEPS, BATCH = 1000, 32


def run(dtype: torch.dtype, lr: float) -> str:
    import transformers

    transformers.logging.set_verbosity_error()
    x, y = token_groups()
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=40, num_labels=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    linear = {n: p for n, p in model.named_parameters() if p.dim() == 2 and "embeddings" not in n}
    generator = torch.Generator().manual_seed(0)
    shares, losses = [], []
    for step in range(STEPS):
        pick = torch.randint(0, len(x), (BATCH,), generator=generator)
        loss = model(input_ids=x[pick], labels=y[pick]).loss
        loss.backward()
        before = {n: p.detach().clone() for n, p in linear.items()} if step % 150 == 10 else None
        optimizer.step()
        optimizer.zero_grad()
        if before is not None:
            shares.append(statistics.median(float((linear[n] != b).float().mean()) for n, b in before.items()))
        losses.append(float(loss.detach()))
    first, last = statistics.fmean(losses[:50]), statistics.fmean(losses[-50:])
    changed = " ".join(f"{s:.2f}" for s in shares)
    return f"| {str(dtype).removeprefix('torch.')} | {lr:.0e} | {changed} | {first:.2f} → {last:.2f} |"


def main() -> None:
    torch.set_num_threads(1)
    rates = [float(a) for a in sys.argv[1:]] or [1e-5, 3e-5, 1e-4, 1e-3]
    print("| weights | learning rate | share of weights a step changed | loss |\n|---|---:|---|---|")
    for lr in rates:
        for dtype in (torch.float32, torch.bfloat16):
            print(run(dtype, lr), flush=True)


if __name__ == "__main__":
    main()
