"""Training the EAGLE draft head (``specdec train-head``): one concept per file.

- :mod:`~specdec.drafters.eagle.train.config`: :class:`DataConfig` and :class:`TrainConfig`;
- :mod:`~specdec.drafters.eagle.train.sources`: the training text (prompts, continuations, offline
  text, copy lessons) and the held-out split;
- :mod:`~specdec.drafters.eagle.train.features`: the target's features from its forward pass;
- :mod:`~specdec.drafters.eagle.train.dataset`: the data cache on disk and :class:`FeatureData`;
- :mod:`~specdec.drafters.eagle.train.objective`: batches, the unrolled draft steps and the loss;
- :mod:`~specdec.drafters.eagle.train.loop`: the draft vocabulary, the optimisation loop, :func:`train`;
- :mod:`~specdec.drafters.eagle.train.evaluation`: held-out agreement and held-out α and τ;
- :mod:`~specdec.drafters.eagle.train.options`: command-line options generated from a config;
- :mod:`~specdec.drafters.eagle.train.command`: the ``specdec train-head`` command.
"""

from specdec.drafters.eagle.train.config import DataConfig, TrainConfig
from specdec.drafters.eagle.train.loop import train

__all__ = ["DataConfig", "TrainConfig", "train"]
