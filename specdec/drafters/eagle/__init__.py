"""EAGLE draft heads (Li et al. 2024, arXiv 2401.15077; EAGLE-3, arXiv 2503.01840): one file each.

- :mod:`~specdec.drafters.eagle.config`: :class:`EagleConfig`, the head's shape;
- :mod:`~specdec.drafters.eagle.model`: :class:`EagleHead`, the plain PyTorch head (training, oracle);
- :mod:`~specdec.drafters.eagle.eagle3`: :class:`Eagle3Head`, EAGLE-3's layer as vLLM / SGLang run it;
- :mod:`~specdec.drafters.eagle.formats`: export to / import from the speculators and SGLang formats;
- :mod:`~specdec.drafters.eagle.packed`: :class:`PackedEagleHead`, the same function in fused kernels;
- :mod:`~specdec.drafters.eagle.cache`: :class:`EagleCache`, the head's KV cache and one head step;
- :mod:`~specdec.drafters.eagle.weights`: head files (load, save, target fingerprint);
- :mod:`~specdec.drafters.eagle.drafter`: :class:`EagleDrafter`, the drafter: every engine slot's
  chains in one call per position, or token trees (``eagle``, ``eagle-tree``);
- :mod:`~specdec.drafters.eagle.tree`: :class:`EagleTrees`, how a row's token tree is drafted;
- :mod:`~specdec.drafters.eagle.train`: training a head for a target (``specdec train-head``).
"""

from specdec.drafters.eagle.cache import EagleCache
from specdec.drafters.eagle.config import EagleConfig
from specdec.drafters.eagle.drafter import EagleDrafter, draft_distribution, eagle_tree
from specdec.drafters.eagle.eagle3 import Eagle3Head
from specdec.drafters.eagle.model import EagleHead, describe
from specdec.drafters.eagle.packed import PackedEagleHead
from specdec.drafters.eagle.tree import EagleTrees, resolve_tree
from specdec.drafters.eagle.weights import (
    DEFAULT_WEIGHTS,
    fingerprint,
    load_eagle_head,
    load_packed_head,
    read_head_file,
    resolve_weights,
    save_eagle_head,
    stored_draft_vocab,
    target_mismatch,
    weight_dtype_of,
)

__all__ = [
    "EagleConfig",
    "EagleHead",
    "Eagle3Head",
    "PackedEagleHead",
    "EagleCache",
    "EagleDrafter",
    "EagleTrees",
    "eagle_tree",
    "draft_distribution",
    "describe",
    "resolve_tree",
    "DEFAULT_WEIGHTS",
    "fingerprint",
    "load_eagle_head",
    "load_packed_head",
    "read_head_file",
    "resolve_weights",
    "save_eagle_head",
    "stored_draft_vocab",
    "target_mismatch",
    "weight_dtype_of",
]
