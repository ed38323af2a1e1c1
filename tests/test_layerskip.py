"""The ``layerskip`` drafter: valid proposals, the truncated model's greedy tokens, shared-cache rollback.

Legend: B batch, K draft length, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from _reference import SMOLLM2_NEW_TOKENS as N
from _tiny import save_tiny_checkpoint, tiny_llama

import specdec
from specdec.drafters.layerskip import LayerSkipDrafter
from specdec.protocols import DecodeState, DraftCall, SlotDrafter
from specdec.registry import create_drafter
from specdec.sampling import SamplingParams
from specdec.targets.llama import LlamaTarget
from specdec.verify.noise import PositionNoise

DEPTH, EXIT = 4, 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(hf_model, LlamaTarget) for a 4-layer random Llama with a byte tokenizer."""
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), num_layers=DEPTH, init_std=0.2, seed=5)
    return tiny_llama(num_layers=DEPTH, init_std=0.2, seed=5), LlamaTarget.from_pretrained(path)


def _truncated(hf_model, num_layers: int):
    """A transformers model made of the first ``num_layers`` layers plus the final norm and head."""
    import copy

    config = copy.deepcopy(hf_model.config)
    config.num_hidden_layers = num_layers
    small = type(hf_model)(config).eval()
    missing = small.load_state_dict(hf_model.state_dict(), strict=False)
    assert not missing.missing_keys
    return small


def _state(prompts: list[list[int]], capacity: int, sampling: SamplingParams) -> DecodeState:
    B = len(prompts)
    tokens = torch.zeros(B, capacity, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in prompts])
    return DecodeState(tokens, lengths.clone(), lengths, torch.zeros(B, dtype=torch.bool), sampling)


def _prefill(target: LlamaTarget, state: DecodeState) -> None:
    """What the loop does: cache every committed token but the last."""
    target.reset(state.batch_size, state.tokens_BL.shape[1])
    target.forward(
        state.tokens_BL[:, : int(state.lengths_B.max())], torch.zeros(state.batch_size, dtype=torch.long)
    )
    target.rollback(state.lengths_B - 1)


def _truncated_greedy(small, prefix: list[int], k: int) -> list[int]:
    ids = list(prefix)
    with torch.no_grad():
        for _ in range(k):
            ids.append(int(small(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prefix) :]


def _drafter(target, prompts) -> LayerSkipDrafter:
    """A drafter with one slot per prompt, each added (slot b = the target's cache row b)."""
    drafter = LayerSkipDrafter(target, num_slots=len(prompts), num_layers=EXIT)
    for b, p in enumerate(prompts):
        drafter.add(b, p, None)
    return drafter


def _rows(proposal, B: int) -> list[tuple[list[int], torch.Tensor | None]]:
    """Each row's drafts and their probabilities (None where the proposal has none)."""
    out, at = [], 0
    for n in proposal.counts_B[:B]:
        probs = None if proposal.probs_TV is None else proposal.probs_TV[at : at + n]
        out.append((proposal.tokens_T[at : at + n].tolist(), probs))
        at += n
    return out


def test_registered_and_protocol(tiny):
    _, target = tiny
    drafter = create_drafter("layerskip", target, num_layers=EXIT)
    assert isinstance(drafter, LayerSkipDrafter) and isinstance(drafter, SlotDrafter)
    assert LayerSkipDrafter(target).num_layers == 3  # round(0.8 · 4)


def test_greedy_drafts_equal_truncated_model_on_a_ragged_batch(tiny):
    hf, target = tiny
    small = _truncated(hf, EXIT)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 12, 3)]
    greedy = SamplingParams(temperature=0.0)
    state = _state(prompts, 40, greedy)
    _prefill(target, state)
    drafter = _drafter(target, prompts)
    proposal = drafter.propose(DraftCall([0, 1, 2], [5, 5, 5], state, [greedy] * 3))
    assert proposal.counts_B == [5, 5, 5] and proposal.probs_TV is None  # greedy: point masses
    for (tokens, _), p in zip(_rows(proposal, 3), prompts, strict=True):
        assert tokens == _truncated_greedy(small, p, 5)


def test_sampled_drafts_are_valid_and_seeded(tiny):
    _, target = tiny
    prompts = [[5, 6, 7, 8], [9, 10]]
    sampling = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    outs = []
    for _ in range(2):
        state = _state(prompts, 24, sampling)
        _prefill(target, state)
        drafter = _drafter(target, prompts)
        outs.append(drafter.propose(DraftCall([0, 1], [4, 4], state, [sampling] * 2, PositionNoise([3, 4]))))
    a, b = outs
    assert torch.equal(a.tokens_T, b.tokens_T) and a.counts_B == [4, 4]
    probs = a.probs_TV
    torch.testing.assert_close(probs.sum(-1), torch.ones(8))
    assert (probs >= 0).all() and ((probs > 0).sum(-1) <= 50).all()
    picked = probs.gather(-1, a.tokens_T[:, None])
    assert (picked > 0).all()  # every draft token has mass under its own draft distribution
    none = drafter.propose(DraftCall([0, 1], [0, 0], state, [sampling] * 2, PositionNoise([3, 4])))
    assert none.counts_B == [0, 0] and none.tokens_T.numel() == 0


def test_shared_cache_survives_verify_and_rollback(tiny):
    """Drafts after a verify + partial rollback equal the truncated model on the committed sequence."""
    hf, target = tiny
    small = _truncated(hf, EXIT)
    prompt = [1, 2, 3, 4, 5, 6]
    greedy = SamplingParams(temperature=0.0)
    state = _state([prompt], 40, greedy)
    _prefill(target, state)
    drafter = _drafter(target, [prompt])
    seq = list(prompt)
    for step, keep in enumerate([1, 0, 3, 2]):
        proposal = drafter.propose(DraftCall([0], [4], state, [greedy]))
        assert proposal.tokens_T.tolist() == _truncated_greedy(small, seq, 4), f"step {step}"
        # Verify: the full target overwrites the draft slots; commit `keep` drafts + one other token.
        start = state.lengths_B - 1
        block = torch.cat([state.last_tokens_B()[:, None], proposal.tokens_T[None]], dim=1)
        out = target.forward(block, start)
        committed = proposal.tokens_T[:keep].tolist() + [
            (int(out.logits_BTV[0, keep].argmax()) + 1) % target.vocab_size
        ]
        n = int(state.lengths_B[0])
        state.tokens_BL[0, n : n + len(committed)] = torch.tensor(committed)
        state.lengths_B = state.lengths_B + len(committed)
        target.rollback(state.lengths_B - 1)
        drafter.observe([0], [keep], out, state=state)
        seq += committed


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_generate_with_layerskip_matches_plain_decoding_distribution_seeded(tiny, temperature):
    """Greedy: identical to plain decoding. Sampled: same seed, same tokens (exactness is the verifier's)."""
    _, target = tiny
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11]]
    kw = dict(temperature=temperature, max_new_tokens=20, seed=11)
    out = specdec.generate(target, prompts, drafter="layerskip", drafter_options={"num_layers": EXIT}, **kw)
    again = specdec.generate(target, prompts, drafter="layerskip", drafter_options={"num_layers": EXIT}, **kw)
    assert out.token_ids == again.token_ids
    assert all(len(t) == 20 or r == "eos" for t, r in zip(out.token_ids, out.finish_reasons, strict=True))
    if temperature == 0.0:
        plain = specdec.generate(target, prompts, drafter="none", **kw)
        assert out.token_ids == plain.token_ids
        assert out.metrics.num_proposed > 0


def test_bad_options_and_targets(tiny):
    _, target = tiny
    for bad in (0, DEPTH, -1, 2.5, True):
        with pytest.raises(ValueError, match="num_layers"):
            LayerSkipDrafter(target, num_layers=bad)

    class NotNative:
        vocab_size = 10
        eos_token_ids = ()

    with pytest.raises(ValueError, match="forward_layers"):
        LayerSkipDrafter(NotNative())


@pytest.mark.model
def test_smollm2_layerskip_greedy_equals_transformers(smollm2_greedy):
    target = LlamaTarget.from_pretrained("smollm2-135m", weights="gguf")  # equal to transformers
    prompts = smollm2_greedy.prompts()[:2]
    out = specdec.generate(target, prompts, drafter="layerskip", temperature=0.0, max_new_tokens=N, gamma=3)
    for ids, ours in zip(prompts, out.token_ids, strict=True):
        assert ours == smollm2_greedy(ids, N)
