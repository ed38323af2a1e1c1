"""Does the draft head copy from the context? Teacher-forced agreement split by what prompt lookup says.

At each position t of a window, the head's first draft step sees the target's feature ``f_t`` and
the next token ``x_{t+1}`` and predicts ``x_{t+2}``; it agrees when its top-1 equals the target's
top-1 there. Positions fall into three kinds by an n-gram lookup in the window so far (the most
recent earlier occurrence of ``x_{t-n+2..t+1}``, as prompt lookup does):

- ``copy``: the token after that occurrence is the target's top-1 (copying would be right);
- ``lookup_wrong``: there is an occurrence, followed by another token;
- ``no_match``: the n-gram has not occurred yet.

A head that has learned to copy agrees at ``copy`` positions about as well on held-out windows as
on training windows; one that memorised its training text does not. ``--lessons N`` adds a third
split: N fresh copy lessons (:func:`specdec.drafters.eagle.train.sources.repeat_sequences` with another seed
than training's), each scored once: spans in a word order no head has seen, where only copying can agree.

    python -m experiments copy-agreement                       # the shipped head, the recipe's cache
    python -m experiments copy-agreement --weights my_head.safetensors --batches 24
    python -m experiments copy-agreement --lessons 48       # also on fresh copy lessons (~30 s more)
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import torch

__all__ = ["KINDS", "lookup_kinds", "copy_agreement", "lesson_data", "main"]

KINDS = ("copy", "lookup_wrong", "no_match")


def lookup_kinds(tokens: Sequence[int], top1: Sequence[int], n: int = 2) -> list[str]:
    """The kind of each position t (``len(tokens) - 1`` of them) for predicting ``x_{t+2}``.

    ``tokens``: the window ``x_0..x_T``; ``top1[t]``: the target's top-1 for ``x_{t+2}`` (it has
    ``len(tokens) - 1`` entries, the last ones unused where ``x_{t+2}`` is past the window). The
    n-gram ends at ``x_{t+1}``; positions whose n-gram would start before ``x_0`` are ``no_match``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if len(top1) != len(tokens) - 1:
        raise ValueError(f"top1 must hold len(tokens) - 1 = {len(tokens) - 1} entries, got {len(top1)}")
    last_next: dict[tuple[int, ...], int] = {}  # n-gram -> the token after its latest occurrence
    kinds = []
    for t in range(len(tokens) - 1):
        start = t + 2 - n
        gram = tuple(tokens[start : t + 2]) if start >= 0 else None
        follow = last_next.get(gram) if gram is not None else None
        if follow is None:
            kinds.append("no_match")
        elif follow == int(top1[t]):
            kinds.append("copy")
        else:
            kinds.append("lookup_wrong")
        if gram is not None and t + 2 < len(tokens):
            last_next[gram] = int(tokens[t + 2])
    return kinds


@torch.no_grad()
def copy_agreement(
    head,
    data,
    seqs: list[int],
    *,
    batches: int | None,
    seq_len: int = 256,
    n: int = 2,
    seed: int = 777,
):
    """Step-1 agreement of ``head`` with the target on ``batches`` × 8 seeded windows of ``seqs``
    (``batches=None``: every window of ``seqs`` once, in order), by kind:
    ``{kind: {"positions": int, "agreement": float}}``."""
    from specdec.drafters.eagle.train.objective import Batches, step1_input, unrolled_features

    if batches is not None and batches < 1:
        raise ValueError(f"batches must be >= 1, got {batches}")
    vocab_N = head.draft_vocab_N
    windows = Batches(data, seqs, seq_len, 8, seed=seed)
    if batches is None:
        every = range(len(windows.windows))
        picks = [list(every[i : i + 8]) for i in range(0, len(every), 8)]
    else:
        picks = [None] * batches
    hits = dict.fromkeys(KINDS, 0)
    counts = dict.fromkeys(KINDS, 0)
    for i, pick in enumerate(picks):
        b = windows.batch(i) if pick is None else windows.take(pick)
        feats, tokens = b["features"], b["tokens"]
        T = feats.shape[1] - 1
        pred_BTD = unrolled_features(
            head, step1_input(head, feats[:, :T], b), tokens[:, 1:], 1, tokens[:, :T]
        )[0]
        guess_BT = vocab_N[head.logits(pred_BTD).argmax(-1)]
        top1_BT = b["topk_ids"][:, 1:, 0]
        for r in range(tokens.shape[0]):
            length = int(b["valid"][r].sum())  # x_0..x_{length-1}
            kinds = lookup_kinds(tokens[r, :length].tolist(), top1_BT[r, : length - 1].tolist(), n)
            for t, kind in enumerate(kinds[: length - 2]):  # x_{t+2} inside the window
                counts[kind] += 1
                hits[kind] += int(guess_BT[r, t] == top1_BT[r, t])
    return {k: {"positions": counts[k], "agreement": round(hits[k] / max(1, counts[k]), 4)} for k in KINDS}


def lesson_data(model, tokenizer, data, n: int, *, aux_layers: tuple[int, ...] = (), seed: int = 1):
    """``n`` copy lessons built from ``data``'s training sequences (earlier lessons excluded), run
    through the target ``model`` (a transformers causal LM): a :class:`FeatureData` whose sequences
    are ``repeat/<i>``, all marked held out. Training builds its lessons with the data seed (0 in the
    recipe), so the default ``seed=1`` gives spans that no recipe head has trained on."""
    from specdec.drafters.eagle.train.dataset import FeatureData
    from specdec.drafters.eagle.train.features import extract_features
    from specdec.drafters.eagle.train.sources import repeat_sequences

    natural = [
        (data.names[s], False, data.tokens[data.offsets[s] : data.offsets[s + 1]].tolist())
        for s in data.natural(False)
    ]
    lessons = repeat_sequences(tokenizer, natural, n, seed=seed)
    seqs = [ids for _, _, ids in lessons]
    feats, ids, probs, aux = extract_features(model, seqs, data.topk_ids.shape[1], aux_layers=aux_layers)
    return FeatureData.join(
        tokens=torch.tensor([t for s in seqs for t in s]),
        features=torch.cat(feats),
        topk_ids=torch.cat(ids),
        topk_probs=torch.cat(probs),
        lengths=torch.tensor([len(s) for s in seqs]),
        heldout=torch.ones(len(seqs), dtype=torch.bool),
        names=[name for name, _, _ in lessons],
        aux=torch.cat(aux) if aux is not None else None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments copy-agreement", description=__doc__.splitlines()[0]
    )
    p.add_argument("--weights", default=None, help="head weights (default: the shipped head)")
    p.add_argument("--batches", type=int, default=12, help="batches of 8 windows per split")
    p.add_argument("--ngram", type=int, default=2, help="n of the lookup that defines a copy position")
    p.add_argument(
        "--lessons",
        type=int,
        default=0,
        help="also score this many fresh copy lessons (spans no head trained on; default: none)",
    )
    p.add_argument("--json", default=None, help="also write the result here")
    a = p.parse_args(argv)
    if a.lessons < 0:
        raise ValueError(f"--lessons must be >= 0, got {a.lessons}")
    if a.batches < 1:
        raise ValueError(f"--batches must be >= 1, got {a.batches}")
    if a.ngram < 1:
        raise ValueError(f"--ngram must be >= 1, got {a.ngram}")

    from specdec.drafters.eagle import load_eagle_head
    from specdec.drafters.eagle.train.config import TrainConfig
    from specdec.drafters.eagle.train.dataset import dataset_dir, load_dataset
    from specdec.targets.hf import hf_parts
    from specdec.targets.loading import load_hf_model, load_tokenizer

    cfg = TrainConfig()
    root = dataset_dir(cfg.data)
    if not (root / "manifest.json").exists():
        raise ValueError(f"no drafter data cache at {root}: build it with specdec train-head")
    model = load_hf_model(cfg.data.target)
    head, _ = load_eagle_head(a.weights, hf_parts(model))
    data = load_dataset(root, head.config.aux_layers)
    out = {  # the natural text: the training split without its copy lessons, and the held-out split
        split: copy_agreement(head, data, data.natural(held), batches=a.batches, n=a.ngram)
        for split, held in (("train", False), ("heldout", True))
    }
    if a.lessons:
        lessons = lesson_data(
            model, load_tokenizer(cfg.data.target), data, a.lessons, aux_layers=head.config.aux_layers
        )
        out["lessons"] = copy_agreement(head, lessons, lessons.sequences(True), batches=None, n=a.ngram)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"weights": a.weights, "batches": a.batches, "ngram": a.ngram, "num_lessons": a.lessons}
                | out,
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
