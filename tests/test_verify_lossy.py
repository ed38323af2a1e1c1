"""Verification rules: the registry, the ``lenient`` rule (Leviathan et al. 2023, A.5), loop and CLI."""

from __future__ import annotations

import json

import pytest
import torch
from _stat_checks import assert_tokens_follow
from _tiny import TableTarget, random_table, save_tiny_checkpoint

import specdec
from specdec.cli import main
from specdec.sampling import SamplingParams
from specdec.testing import keyed_randomness
from specdec.verify import rejection_sample
from specdec.verify.exact import ExactVerify
from specdec.verify.lenient import LenientVerify, lenient_sample
from specdec.verify.registry import VERIFY_RULES, make_verify_rule


def _probs(V: int, seed: int, sharp: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * sharp, dim=-1)


def _one_step_law(target: torch.Tensor, draft: torch.Tensor, lenience: float) -> torch.Tensor:
    """Law of the first emitted token when x ~ draft is verified leniently (closed form, A.5)."""
    accepted = torch.minimum(draft, target / lenience)  # P(draft x and accept)
    residual = (target - lenience * draft).clamp(min=0)
    return accepted + (1 - accepted.sum()) * residual / residual.sum()


def test_registry_builds_rules_by_name():
    assert {"exact", "lenient"} <= set(VERIFY_RULES.names())
    assert isinstance(make_verify_rule("exact"), ExactVerify) and make_verify_rule("exact").lossless
    rule = make_verify_rule("lenient", {"lenience": 0.25})
    assert isinstance(rule, LenientVerify) and rule.lenience == 0.25 and not rule.lossless
    assert make_verify_rule("lenient", {"lenience": 1}).lossless
    assert make_verify_rule(rule) is rule
    with pytest.raises(ValueError, match="known verification rules: exact, gumbel, lenient"):
        make_verify_rule("typical-ish")
    with pytest.raises(ValueError, match="verify_options only apply"):
        make_verify_rule(rule, {"lenience": 0.5})
    with pytest.raises(ValueError, match="VerifyRule"):
        make_verify_rule(42)
    for bad in (0.0, -0.5, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match="lenience"):
            LenientVerify(lenience=bad)
    with pytest.raises(ValueError, match="takes no options"):
        ExactVerify(lenience=0.5)


def test_lenience_one_is_exact_rejection_sampling():
    B, K, V = 64, 4, 11
    target = torch.stack(
        [torch.stack([_probs(V, 10 * b + k) for k in range(K + 1)]) for b in range(B)]
    ).float()
    draft = torch.stack(
        [torch.stack([_probs(V, 1000 + 10 * b + k) for k in range(K)]) for b in range(B)]
    ).float()
    tokens = torch.multinomial(draft.reshape(-1, V), 1, generator=torch.Generator().manual_seed(0)).reshape(
        B, K
    )
    positions = torch.arange(K + 1).expand(B, -1)
    exact = rejection_sample(
        target, tokens, draft, **keyed_randomness(torch.Generator().manual_seed(5), positions)
    )
    rule = make_verify_rule("lenient", {"lenience": 1.0})
    lenient = rule(
        target,
        tokens,
        draft,
        target_logits_BKV=target.log(),
        sampling=SamplingParams(),
        **keyed_randomness(torch.Generator().manual_seed(5), positions),
    )
    assert torch.equal(exact.tokens, lenient.tokens) and torch.equal(exact.num_accepted, lenient.num_accepted)


@pytest.mark.statistical
@pytest.mark.parametrize("lenience", [0.5, 0.1])
def test_lenient_one_step_law_matches_appendix_a5(lenience):
    """Monte-Carlo through the rule against the closed form; acceptance rate Σ min(p/l, q); the
    guarantee P(x) ≤ p(x)/l. G-test with false-alarm rate 1e-6."""
    V, N = 6, 200_000
    target, draft = _probs(V, 1), _probs(V, 2, sharp=2.5)
    g = torch.Generator().manual_seed(int(lenience * 100))
    tokens_N1 = torch.multinomial(draft.float().expand(N, V), 1, replacement=True, generator=g)
    out = lenient_sample(
        target.float().expand(N, 2, V),
        tokens_N1,
        draft.float().expand(N, 1, V),
        lenience=lenience,
        **keyed_randomness(g, torch.arange(2).expand(N, -1)),
    )
    law = _one_step_law(target, draft, lenience)
    assert torch.all(law <= target / lenience + 1e-12)  # rare tokens stay rare
    assert not torch.allclose(law, target, atol=1e-3)  # and the rule is lossy
    assert_tokens_follow(out.tokens[:, 0], law, f"lenience={lenience}")
    alpha = float(torch.minimum(target / lenience, draft).sum())
    accepted = int(out.num_accepted.sum())
    assert abs(accepted / N - alpha) < 5.3 * (alpha * (1 - alpha) / N) ** 0.5  # two-sided, ~1e-7


def test_point_mass_drafts_are_accepted_with_probability_target_over_l():
    V, N, lenience = 5, 100_000, 0.4
    target = torch.tensor([0.05, 0.3, 0.5, 0.1, 0.05])
    tokens = torch.full((N, 1), 1)  # target(1) = 0.3 < l: accepted with probability 0.75
    out = lenient_sample(
        target.expand(N, 2, V),
        tokens,
        None,
        lenience=lenience,
        **keyed_randomness(torch.Generator().manual_seed(0), torch.arange(2).expand(N, -1)),
    )
    assert abs(out.num_accepted.float().mean().item() - 0.75) < 0.01
    rejected = out.tokens[out.num_accepted == 0, 0]
    assert not (rejected == 1).any()  # residual target − l·δ_x has no mass at x = 1 (0.3 − 0.4 < 0)
    sure = lenient_sample(
        target.expand(8, 2, V),
        torch.full((8, 1), 2),
        None,
        lenience=lenience,
        **keyed_randomness(None, torch.arange(2).expand(8, -1)),
    )
    assert sure.num_accepted.tolist() == [1] * 8  # target(2) = 0.5 ≥ l


def test_greedy_lenience_accepts_tokens_within_l_of_the_argmax():
    # raw target p = softmax(logits); argmax token 0 with p = 0.5, token 1 has 0.3, token 2 has 0.2.
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    logits_BKV = logits.expand(3, 2, 3)
    one_hot = torch.zeros(3, 2, 3)
    one_hot[..., 0] = 1.0  # the processed (T = 0) target
    tokens = torch.tensor([[0], [1], [2]])
    for lenience, expected in ((0.7, [1, 0, 0]), (0.5, [1, 1, 0]), (0.35, [1, 1, 1])):
        out = LenientVerify(lenience=lenience)(
            one_hot, tokens, None, target_logits_BKV=logits_BKV, sampling=SamplingParams(temperature=0.0)
        )
        assert out.num_accepted.tolist() == expected, lenience
        # the recovered / bonus token is always the argmax (0)
        assert out.tokens[torch.arange(3), out.num_accepted].tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="target_logits_BKV"):
        lenient_sample(one_hot, tokens, None, lenience=0.5, greedy=True)


def _toy_target() -> TableTarget:
    return TableTarget(random_table(13, seed=4))


def test_loop_takes_verify_by_name():
    target, prompt = _toy_target(), [[1, 2, 3]]
    kw = dict(drafter="ngram", gamma=3, max_new_tokens=24, temperature=0.8, seed=11)
    # l = 1 is the exact rule token for token (both draw the same keyed noise)
    exact = specdec.generate(target, prompt, verify=ExactVerify(), **kw)
    same = specdec.generate(target, prompt, verify="lenient", verify_options={"lenience": 1.0}, **kw)
    assert same.token_ids == exact.token_ids
    greedy = dict(kw, temperature=0.0)
    plain = specdec.generate(target, prompt, **greedy)
    loose = specdec.generate(target, prompt, verify=LenientVerify(lenience=0.01), **greedy)
    assert len(loose.token_ids[0]) == 24
    # At l = 0.01 nearly every draft is accepted: more than under exact greedy verification.
    assert loose.metrics.acceptance_rate > plain.metrics.acceptance_rate
    with pytest.raises(ValueError, match="known verification rules"):
        specdec.generate(target, prompt, verify="nope", **kw)


def test_cli_verify_flag(tmp_path, capsys):
    ckpt = str(save_tiny_checkpoint(tmp_path / "tiny", seed=1))
    args = [
        "generate",
        "--target",
        ckpt,
        "--backend",
        "hf",
        "--drafter",
        "ngram",
        "--prompt",
        "abc abc abc",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    ]
    assert main([*args, "--verify", "lenient", "--verify-option", "lenience=0.5"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["verify"] == "lenient" and len(res["token_ids"]) == 8
    assert main([*args, "--verify", "lenient", "--verify-option", "lenience=2"]) == 2
    assert "lenience" in capsys.readouterr().err
