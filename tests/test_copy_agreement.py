"""`experiments.copy_agreement`: the lookup that classifies positions, and the command's wiring."""

from __future__ import annotations

import pytest

from experiments import copy_agreement
from experiments.cli import COMMANDS
from experiments.copy_agreement import lookup_kinds


def test_lookup_kinds_by_hand():
    #        x0 x1 x2 x3 x4 x5 x6
    tokens = [5, 6, 7, 5, 6, 9, 5]
    # position t predicts x_{t+2} from the 2-gram (x_t, x_{t+1}); top1[t] is the target's top-1 there
    top1 = [7, 5, 6, 7, 5, 1]
    kinds = lookup_kinds(tokens, top1)
    # t=0..2: (5,6), (6,7), (7,5) are new; t=3: (5,6) was followed by 7 = top1 -> copy;
    # t=4: (6,9) new; t=5: (9,5) new
    assert kinds == ["no_match", "no_match", "no_match", "copy", "no_match", "no_match"]
    assert lookup_kinds(tokens, [7, 5, 6, 8, 5, 1])[3] == "lookup_wrong"  # the lookup says 7


def test_lookup_kinds_uses_the_latest_occurrence_and_n():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 9]
    top1 = [0] * 7 + [0]
    kinds = lookup_kinds(tokens, [3, 0, 0, 3, 0, 0, 4, 0])
    assert kinds[6] == "copy"  # (1, 2) last followed by 4, not by 3
    assert kinds[3] == "copy"  # at t=3 only the first occurrence exists: 3
    # with n = 1 the gram is x_{t+1} alone: x_2 = 3 at t=1 is new, x_4 = 2 at t=3 follows x_1 = 2 -> 3
    assert lookup_kinds(tokens, top1, n=1)[3] == "lookup_wrong"
    assert lookup_kinds(tokens, [3] + [0] * 7, n=3)[0] == "no_match"  # the 3-gram starts before x_0


def test_lookup_kinds_checks_its_arguments():
    with pytest.raises(ValueError, match="n must be >= 1"):
        lookup_kinds([1, 2, 3], [1, 2], n=0)
    with pytest.raises(ValueError, match="top1 must hold len\\(tokens\\) - 1 = 2 entries, got 3"):
        lookup_kinds([1, 2, 3], [1, 2, 3])


def test_command_is_registered_and_validates():
    assert COMMANDS.get("copy-agreement") is copy_agreement.main
    with pytest.raises(ValueError, match="--batches must be >= 1"):
        copy_agreement.main(["--batches", "0"])
    with pytest.raises(ValueError, match="--ngram must be >= 1"):
        copy_agreement.main(["--ngram", "0"])


def test_lesson_data_runs_fresh_lessons_through_the_target():
    import torch
    from _tiny import byte_tokenizer, tiny_llama, token_data

    from specdec.drafters.eagle.train.features import extract_features
    from specdec.drafters.eagle.train.sources import repeat_sequences

    tok = byte_tokenizer()
    hf = tiny_llama(seed=4, num_layers=3)
    texts = [f"Item {i:02d}: the plot was terrible and the cast could not save it." for i in range(6)]
    seqs = [tok(t).input_ids for t in texts] + [list(range(40, 80))]
    names = [f"s/{i}" for i in range(6)] + ["repeat/0"]  # an earlier lesson: never a source
    data = token_data(seqs, names, [False, False, False, False, False, True, False])
    lessons = copy_agreement.lesson_data(hf, tok, data, 3, aux_layers=(1,), seed=1)
    natural = [(n, False, s) for n, s in zip(names[:5], seqs[:5], strict=True)]
    expected = [ids for _, _, ids in repeat_sequences(tok, natural, 3, seed=1)]
    assert lessons.names == ["repeat/0", "repeat/1", "repeat/2"]
    assert lessons.sequences(True) == [0, 1, 2]
    for i, ids in enumerate(expected):
        a, b = int(lessons.offsets[i]), int(lessons.offsets[i + 1])
        assert lessons.tokens[a:b].tolist() == ids
    feats, ids, probs, aux = extract_features(hf, expected, 4, aux_layers=(1,))
    assert torch.equal(lessons.features, torch.cat(feats))
    assert torch.equal(lessons.topk_ids, torch.cat(ids).long())
    assert torch.equal(lessons.aux, torch.cat(aux))


def test_command_validates_lessons():
    with pytest.raises(ValueError, match="--lessons must be >= 0"):
        copy_agreement.main(["--lessons", "-1"])
