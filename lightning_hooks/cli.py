"""The ``lightning-hooks`` command: ``LightningCLI`` for any model and data module, by class path.

lightning-hooks fit --config configs/digits.yaml
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import ArgsType, LightningCLI


def main(args: ArgsType = None) -> None:
    """``LightningCLI`` in subclass mode for the model and the data module runs ``args`` (default: the command line),
    with the working directory first on ``sys.path``, so that ``examples.digits.DigitsCNN`` imports from a project."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    LightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
