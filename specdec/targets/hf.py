"""A ``Target`` adapter for any ``transformers`` causal LM (the generic, slower path).

Legend: B batch, T block length, V vocabulary, D hidden size.

Each row keeps its own ``DynamicCache`` so that rows can sit at different lengths (ragged
acceptance); rollback crops a row's cache. Rows are run one after the other. This is the reference
path: the native Llama target (``specdec.targets.llama``) is the fast one.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch

from specdec.protocols import TargetOutput, TargetParts
from specdec.targets.capture import check_layer_indices, layer_output

__all__ = ["HFTarget", "hf_parts"]


def hf_parts(model: Any) -> TargetParts:
    """The embedding, final norm and LM head of a ``transformers`` Llama-family causal LM."""
    base = getattr(model, "model", None)
    norm = getattr(base, "norm", None)
    if norm is None or model.get_output_embeddings() is None or model.get_input_embeddings() is None:
        raise ValueError(
            f"{type(model).__name__} must have input and output embeddings and model.norm (a Llama-family "
            "causal LM) for a feature-level draft head"
        )
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None)
    if eps is None:
        eps = getattr(model.config, "rms_norm_eps", 1e-5)
    return TargetParts(
        model.get_input_embeddings().weight.detach(),
        norm.weight.detach(),
        float(eps),
        model.get_output_embeddings().weight.detach(),
        model.config,
    )


class HFTarget:
    """Wrap a ``transformers`` ``AutoModelForCausalLM`` as a :class:`specdec.protocols.Target`."""

    def __init__(self, model, tokenizer=None, *, expose_hidden: bool = True) -> None:
        from transformers import DynamicCache  # noqa: F401  (fail early if transformers is missing)

        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        eos = getattr(model.generation_config, "eos_token_id", None)
        eos = eos or getattr(model.config, "eos_token_id", None)
        if tokenizer is not None and tokenizer.eos_token_id is not None and eos is None:
            eos = tokenizer.eos_token_id
        self.eos_token_ids: tuple[int, ...] = (
            tuple(eos) if isinstance(eos, (list, tuple)) else ((int(eos),) if eos is not None else ())
        )
        self.device = next(model.parameters()).device
        self.max_context_length = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        # transformers renamed forward's `past_key_values` to `cache` (the old name warns that it goes
        # away in 5.40); pass the cache under whichever name this version's forward declares.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._caches: list = []
        self._hidden: torch.Tensor | None = None
        self._hook = None
        self._aux_hooks: dict[int, Any] = {}  # layer -> hook (capture_layers)
        self._aux: dict[int, torch.Tensor] = {}
        norm = getattr(getattr(model, "model", None), "norm", None)
        if expose_hidden and isinstance(norm, torch.nn.Module):
            # The final norm's input is the last decoder layer's output (pre-norm features).
            self._hook = norm.register_forward_pre_hook(self._grab_hidden)

    def _grab_hidden(self, module, args) -> None:
        self._hidden = args[0]

    def parts(self) -> TargetParts:
        """The wrapped model's embedding, final norm and LM head (see :func:`hf_parts`)."""
        return hf_parts(self.model)

    def capture_layers(self, layers) -> None:
        """Also return the outputs of decoder ``layers`` from :meth:`forward` (``aux_hidden_BTD``);
        requests add up. Needs a model with ``model.layers`` (Llama family)."""
        blocks = getattr(getattr(self.model, "model", None), "layers", None)
        if blocks is None:
            raise ValueError(f"{type(self.model).__name__} has no model.layers to capture features from")
        for i in check_layer_indices(layers, len(blocks)):
            if i not in self._aux_hooks:
                self._aux_hooks[i] = blocks[i].register_forward_hook(self._grabber(i))

    def _grabber(self, i: int):
        def grab(module, args, output) -> None:
            self._aux[i] = layer_output(output)

        return grab

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        **kwargs,
    ) -> HFTarget:
        """Load a built-in name (``smollm2-135m``) or a local checkpoint directory onto ``device``."""
        from specdec.targets.loading import load_hf_model, load_tokenizer

        model = load_hf_model(name_or_path, dtype=dtype).to(device)
        return cls(model, load_tokenizer(name_or_path), **kwargs)

    def reset(self, batch_size: int, max_len: int) -> None:
        from transformers import DynamicCache

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self._caches = [DynamicCache(config=self.config) for _ in range(batch_size)]

    def _cache_len(self, b: int) -> int:
        return int(self._caches[b].get_seq_length())

    @torch.inference_mode()
    def forward(
        self,
        tokens_BT: torch.Tensor,
        start_B: torch.Tensor,
        *,
        logits_index_BN: torch.Tensor | None = None,
        rows_B: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run each row's block on its own cache; ``rows_B``: the caches (request slots) the B rows
        use, distinct (default: every cache in order)."""
        B, T = tokens_BT.shape
        rows = self._rows(rows_B, B)
        logits_rows, hidden_rows, aux_rows = [], [], []
        for b, r in enumerate(rows):
            start = int(start_B[b])
            have = self._cache_len(r)
            if have > start:
                self._caches[r].crop(start - have)  # transformers >= 5: crop(-k) drops k tokens
            elif have < start:
                raise ValueError(f"row {b}: cache holds {have} tokens, block starts at slot {start}")
            positions = torch.arange(start, start + T, device=self.device).unsqueeze(0)
            self._hidden = None
            self._aux = {}
            out = self.model(
                input_ids=tokens_BT[b : b + 1].to(self.device),
                position_ids=positions,
                use_cache=True,
                **{self._cache_kwarg: self._caches[r]},
            )
            logits_rows.append(out.logits[0].float())
            if self._hidden is not None:
                hidden_rows.append(self._hidden[0])
            aux_rows.append({i: h[0] for i, h in self._aux.items()})
        logits_BTV = torch.stack(logits_rows)
        hidden_BTD = torch.stack(hidden_rows) if len(hidden_rows) == B else None
        aux = (
            {i: torch.stack([row[i] for row in aux_rows]) for i in self._aux_hooks}
            if self._aux_hooks
            else None
        )
        if logits_index_BN is not None:
            idx = logits_index_BN.to(logits_BTV.device)
            logits_BTV = logits_BTV.gather(1, idx.unsqueeze(-1).expand(-1, -1, logits_BTV.shape[-1]))
        return TargetOutput(logits_BTV=logits_BTV, hidden_BTD=hidden_BTD, aux_hidden_BTD=aux)

    def _rows(self, rows_B: torch.Tensor | None, B: int) -> list[int]:
        if rows_B is None:
            if B != len(self._caches):
                raise ValueError(f"tokens_BT has B={B} rows but reset() prepared {len(self._caches)}")
            return list(range(B))
        rows = [int(r) for r in torch.as_tensor(rows_B).reshape(-1).tolist()]
        if len(rows) != B or len(set(rows)) != B or not all(0 <= r < len(self._caches) for r in rows):
            raise ValueError(f"rows_B must hold {B} distinct caches in [0, {len(self._caches)}), got {rows}")
        return rows

    def rollback(self, lengths_B: torch.Tensor, rows_B: torch.Tensor | None = None) -> None:
        """Crop each cache to ``lengths_B``; ``rows_B``: which caches (default: all, in order)."""
        rows = self._rows(rows_B, len(lengths_B) if rows_B is not None else len(self._caches))
        for b, r in enumerate(rows):
            cache = self._caches[r]
            n = int(lengths_B[b])
            have = cache.get_seq_length()
            if have > n:
                cache.crop(n - have)
