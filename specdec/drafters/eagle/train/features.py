"""The target's features, read from its forward pass: what the draft head learns from.

Legend: T tokens, D hidden size, A aux layers, k top-k.

Per token, :func:`extract_features` takes the feature (last decoder layer output before the final
norm, fp16) and the target's top-k next-token probabilities (T=1); with aux layers, also the outputs
of those decoder layers (EAGLE-3's low and middle features, arXiv 2503.01840) from the same forward.
:func:`extract_layer_features` takes the layer outputs alone, stopping the forward after the deepest.
"""

from __future__ import annotations

import torch

__all__ = ["extract_features", "extract_layer_features"]


def _padded_batches(seqs: list[list[int]], max_batch_tokens: int):
    """Yield ``(rows, input_ids, attention_mask)``: sequences by length, right-padded, at most
    ``max_batch_tokens`` (padded) per batch; ``rows`` are the batch's indices into ``seqs``."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    i = 0
    while i < len(order):
        j = i
        while j < len(order) and (j - i + 1) * len(seqs[order[j]]) <= max_batch_tokens:
            j += 1
        j = max(j, i + 1)
        rows = order[i:j]
        x = torch.zeros(len(rows), len(seqs[rows[-1]]), dtype=torch.long)
        mask = torch.zeros_like(x)
        for r, k in enumerate(rows):
            x[r, : len(seqs[k])] = torch.tensor(seqs[k])
            mask[r, : len(seqs[k])] = 1
        yield rows, x, mask
        i = j


@torch.inference_mode()
def extract_features(
    model, seqs: list[list[int]], topk: int, max_batch_tokens: int = 4096, aux_layers: tuple[int, ...] = ()
):
    """Per token: the pre-norm feature (fp16), top-k next-token ids and probs (T=1); with
    ``aux_layers``, also per sequence ``[T, A, D]`` (fp16) outputs of those decoder layers from the
    same forward (else None): what :func:`extract_layer_features` computes, bit for bit, without a
    second pass. Returns ``(feats, ids, probs, aux)``."""
    captured: dict = {}
    hooks = _capture_layers(model, aux_layers, captured, stop=False)
    hooks.append(model.model.norm.register_forward_pre_hook(lambda m, a: captured.__setitem__("h", a[0])))
    try:
        n_seqs = len(seqs)
        feats, ids, probs = [None] * n_seqs, [None] * n_seqs, [None] * n_seqs
        aux = [None] * n_seqs if aux_layers else None
        for rows, x, mask in _padded_batches(seqs, max_batch_tokens):
            post = model.model(input_ids=x, attention_mask=mask).last_hidden_state
            pre = captured["h"]
            stacked = torch.stack([captured[i] for i in aux_layers], dim=2) if aux else None  # [b, T, A, D]
            for r, k in enumerate(rows):
                n = len(seqs[k])
                logits = model.lm_head(post[r, :n])
                p, t = torch.softmax(logits.float(), dim=-1).topk(topk, dim=-1)
                feats[k], ids[k] = pre[r, :n].to(torch.float16), t.to(torch.int32)
                probs[k] = p.to(torch.float16)
                if aux is not None:
                    aux[k] = stacked[r, :n].to(torch.float16)
        return feats, ids, probs, aux
    finally:
        for h in hooks:
            h.remove()


class _Enough(Exception):
    """Raised by the hook on the deepest layer that :func:`extract_layer_features` needs."""


def _capture_layers(model, layers: tuple[int, ...], captured: dict, *, stop: bool) -> list:
    """Forward hooks that put the outputs of decoder layers ``layers`` into ``captured`` (by index);
    with ``stop``, the deepest one then raises :class:`_Enough` to end the forward there. Returns the
    hook handles; ``ValueError`` for an index that is not a decoder layer."""
    from specdec.targets.capture import check_layer_indices, layer_output

    blocks = model.model.layers
    layers = check_layer_indices(layers, len(blocks))
    deepest = max(layers, default=-1)

    def grab(i):
        def hook(module, args, output):
            captured[i] = layer_output(output)
            if stop and i == deepest:
                raise _Enough

        return hook

    return [blocks[i].register_forward_hook(grab(i)) for i in sorted(set(layers))]


@torch.inference_mode()
def extract_layer_features(
    model, seqs: list[list[int]], layers: tuple[int, ...], max_batch_tokens: int = 4096
) -> list[torch.Tensor]:
    """Per sequence ``[T, A, D]`` (fp16): the outputs of decoder layers ``layers`` (0-based), the
    low and middle features that EAGLE-3 fuses with the last one. The forward stops after the
    deepest of them, so layers (1, 14) of 30 cost half a target pass."""
    if not layers:
        raise ValueError("layers must name at least one decoder layer, got none")
    captured: dict[int, torch.Tensor] = {}
    hooks = _capture_layers(model, layers, captured, stop=True)
    try:
        results: list[torch.Tensor | None] = [None] * len(seqs)
        for rows, x, mask in _padded_batches(seqs, max_batch_tokens):
            try:
                model.model(input_ids=x, attention_mask=mask)
            except _Enough:
                pass
            stacked = torch.stack([captured[layer] for layer in layers], dim=2)  # [b, T, A, D]
            for r, k in enumerate(rows):
                results[k] = stacked[r, : len(seqs[k])].to(torch.float16)
        return results  # type: ignore[return-value]
    finally:
        for h in hooks:
            h.remove()
