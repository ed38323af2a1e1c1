"""No silent wrong answers: concurrent calls, bad proposals, NaN, context limits, clean CLI errors.

Each test plants one kind of misuse or bad input and checks that it is refused with a clear
``ValueError`` (or a one-line CLI error, exit status 2) instead of a wrong result.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from _tiny import TableTarget, byte_tokenizer, random_table, save_tiny_checkpoint

import specdec
from specdec.protocols import Proposal
from specdec.sampling import logits_to_probs, sample_from_probs
from specdec.targets.llama import LlamaTarget

V = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("robust") / "tiny", seed=2)


@pytest.fixture(scope="module")
def llama(ckpt):
    return LlamaTarget.from_pretrained(ckpt)


# --- one generation per target at a time ---------------------------------------------------------


def test_concurrent_calls_on_one_target_wait_their_turn(llama):
    """Two threads on one target: each gets exactly the tokens it gets alone (the second waits)."""
    tok = byte_tokenizer()
    prompts = [tok("def fib(n):").input_ids, tok("Cities of France:").input_ids]
    kw = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    alone = [specdec.generate(llama, [p], **kw).token_ids[0] for p in prompts]
    got: dict[int, list[int]] = {}
    start = threading.Barrier(2)

    def run(i: int) -> None:
        start.wait()
        got[i] = specdec.generate(llama, [prompts[i]], **kw).token_ids[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == {0: alone[0], 1: alone[1]}


def test_a_generation_inside_a_generation_on_the_same_target_is_refused(llama):
    tok = byte_tokenizer()

    def nested(row, ids):
        specdec.generate(llama, [tok("x").input_ids], max_new_tokens=2)

    with pytest.raises(ValueError, match="already generating in this thread"):
        specdec.generate(llama, [tok("hi").input_ids], max_new_tokens=3, on_commit=nested)
    # the lock was released: the target works again
    assert len(specdec.generate(llama, [tok("hi").input_ids], max_new_tokens=3).token_ids[0]) == 3


# --- every proposal is checked ----------------------------------------------------------------------


class _GoodThenBad:
    """Proposes valid drafts at step 1, then the planted bad proposal from step 2 on."""

    def __init__(self, bad):
        self.bad, self.steps = bad, 0

    def begin(self, state, out):
        pass

    def observe(self, state, n, out):
        pass

    def propose(self, state, gamma, generator=None):
        self.steps += 1
        B = state.batch_size
        tokens = state.last_tokens_B().unsqueeze(1).repeat(1, gamma)
        probs = torch.full((B, gamma, V), 1.0 / V)
        return Proposal(tokens, probs) if self.steps == 1 else self.bad(tokens, probs)


def _negative(tokens, probs):  # still sums to 1: the check that only looked at step 1 missed it
    bad = probs.clone()
    bad[:, :, 0] -= 0.5
    bad[:, :, 1] += 0.5
    return Proposal(tokens, bad)


BAD_PROPOSALS = {
    "negative": (_negative, r"step 2: drafter _GoodThenBad: probs_BKV must be finite and non-negative"),
    "inf": (lambda t, p: Proposal(t, p.index_fill(2, torch.tensor([3]), float("inf"))), "finite"),
    "nan": (lambda t, p: Proposal(t, p.index_fill(2, torch.tensor([3]), float("nan"))), "finite"),
    "unnormalised": (lambda t, p: Proposal(t, p * 1.5), r"normalised over the vocabulary; row 0, position 0"),
    "K+1 positions": (lambda t, p: Proposal(t, torch.cat([p, p[:, :1]], 1)), r"probs_BKV must have shape"),
    "B+1 rows": (lambda t, p: Proposal(t, torch.cat([p, p[:1]], 0)), r"probs_BKV must have shape"),
    "float ids": (lambda t, p: Proposal(t.float(), p), "tokens_BK must be an integer tensor"),
    "1-D ids": (lambda t, p: Proposal(t[:, 0], None), r"tokens_BK must be a \[B=1, K<="),
    "out of vocab": (lambda t, p: Proposal(t + V, None), r"token ids in \[0, V=12\)"),
    "not a Proposal": (lambda t, p: (t, p), "must return a specdec.Proposal"),
}


@pytest.mark.parametrize("name", list(BAD_PROPOSALS))
def test_every_proposal_is_checked_on_every_step(name):
    planted, message = BAD_PROPOSALS[name]
    target = TableTarget(random_table(V, seed=3))
    for temperature in (0.0, 1.0):
        with pytest.raises(ValueError, match=message):
            specdec.generate(
                target,
                [[1, 2, 3]],
                drafter=_GoodThenBad(planted),
                temperature=temperature,
                max_new_tokens=20,
                gamma=3,
                seed=0,
                ignore_eos=True,
            )


# --- NaN and inf are caught where they appear -------------------------------------------------------


def test_sampling_refuses_nan_and_inf():
    logits = torch.randn(2, 3, V)
    logits[1, 2, 4] = float("nan")
    for t in (0.0, 0.7):
        with pytest.raises(ValueError, match=r"first bad row is at index \(1, 2\)"):
            logits_to_probs(logits, t)
    with pytest.raises(ValueError, match="must be finite"):
        logits_to_probs(torch.tensor([0.0, float("inf")]), 1.0)
    with pytest.raises(ValueError, match="must be finite"):
        logits_to_probs(torch.full((V,), float("-inf")), 1.0)  # a row with no finite logit
    assert logits_to_probs(torch.tensor([0.0, float("-inf"), 1.0]), 1.0)[1] == 0  # -inf is a mask
    with pytest.raises(ValueError, match="row 1 is not"):
        sample_from_probs(torch.tensor([[0.5, 0.5], [float("nan"), 1.0]]))
    with pytest.raises(ValueError, match="row 0 is not"):
        sample_from_probs(torch.tensor([[0.0, 0.0]]))


def test_a_tiny_temperature_behaves_as_greedy(llama):
    tok = byte_tokenizer()
    ids = tok("The sky is").input_ids
    logits = torch.tensor([1.0, 3.0, 2.0])
    assert torch.equal(logits_to_probs(logits, 1e-45), torch.tensor([0.0, 1.0, 0.0]))
    kw = {"max_new_tokens": 12, "ignore_eos": True}
    tiny = specdec.generate(llama, [ids], temperature=1e-45, seed=0, **kw).token_ids
    assert tiny == specdec.generate(llama, [ids], temperature=0.0, **kw).token_ids
    assert all(0 <= t < llama.vocab_size for t in tiny[0])


class _NaNTarget(TableTarget):
    """A table target whose logits turn NaN in row 1 from its third forward on."""

    def forward(self, tokens_BT, start_B, *, rows_B=None, logits_index_BN=None):
        out = super().forward(tokens_BT, start_B, rows_B=rows_B, logits_index_BN=logits_index_BN)
        if self.num_forwards >= 3:
            out.logits_BTV[1, 0, 5] = float("nan")
        return out


def test_nan_target_logits_name_the_step_and_the_row():
    target = _NaNTarget(random_table(V, seed=1))
    # the third forward is the engine's step 3 (step 1 prefilled both prompts in one forward); the
    # row is named as the prompt (its logits were then checked alone: row 0 of that check)
    with pytest.raises(
        ValueError, match=r"prompt_ids\[1\]: .*step 3: the target returned non-finite logits .* \(0, 0\)"
    ):
        specdec.generate(target, [[1, 2], [3, 4]], drafter="none", max_new_tokens=8, temperature=0.0)


def test_nan_in_the_draft_head_is_named(llama, tmp_path):
    """Corrupted head weights: the head's logits are checked at each draft position."""
    from specdec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead, save_eagle_head

    parts = llama.parts()
    config = EagleConfig.from_hf_config(llama.config, draft_vocab_size=64)
    head = EagleHead(config).attach(parts)
    with torch.no_grad():
        head.fc.bias.fill_(float("nan"))
    path = tmp_path / "nan-head.safetensors"
    save_eagle_head(head, path, target_name="tiny", embed_VD=parts.embed_VD)
    drafter = EagleDrafter(llama, weights=path)
    with pytest.raises(ValueError, match="draft position 1: the EAGLE head returned non-finite logits"):
        specdec.generate(llama, [[5, 6, 7]], drafter=drafter, max_new_tokens=6, temperature=0.0)


# --- prompts and the context limit ----------------------------------------------------------------


def test_boolean_token_ids_are_refused(llama):
    with pytest.raises(ValueError, match="row 0 holds True"):
        specdec.generate(llama, [[True, False, 5]], max_new_tokens=2)
    with pytest.raises(ValueError, match="integer tensor"):
        specdec.generate(llama, torch.tensor([[True, False]]), max_new_tokens=2)


def test_the_context_limit_bounds_prompt_plus_new_tokens(llama):
    limit = llama.max_context_length
    assert limit == 2048  # the tiny checkpoint's max_position_embeddings
    with pytest.raises(
        ValueError, match=r"\(2000 tokens\) \+ max_new_tokens \(100\) .* max_context_length=2048"
    ):
        specdec.generate(llama, [[1] * 2000], max_new_tokens=100, gamma=4)
    with pytest.raises(ValueError, match="max_context_length=2048"):
        llama.reset(1, 100_000)  # would allocate the whole cache first


def test_chunked_prefill_equals_one_block_and_needs_no_square_mask(llama, monkeypatch):
    """A long prompt runs in chunks (no [T, T] mask): the logits equal one block's."""
    import specdec.targets.llama as native

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 300), generator=g)
    start = torch.zeros(2, dtype=torch.long)
    llama.reset(2, 301)
    whole = llama.forward(ids, start).logits_BTV
    monkeypatch.setattr(native, "PREFILL_CHUNK", 64)
    llama.reset(2, 301)
    chunked = llama.forward(ids, start)
    torch.testing.assert_close(chunked.logits_BTV, whole, atol=1e-4, rtol=1e-4)
    assert chunked.hidden_BTD.shape == (2, 300, llama.config.hidden_size)


# --- clean errors at the command line --------------------------------------------------------------


def _cli(argv, capsys) -> tuple[int, str]:
    from specdec.cli import main

    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    return code, capsys.readouterr().err


def _one_line(err: str, *needles: str) -> bool:
    lines = err.strip().splitlines()
    return len(lines) == 1 and "Traceback" not in err and all(n in lines[0] for n in needles)


def test_cli_user_errors_are_one_line_and_exit_2(ckpt, tmp_path, capsys):
    base = ["generate", "--target", str(ckpt), "--max-new-tokens", "2"]
    code, err = _cli([*base, "--prompt", "caf\udce9"], capsys)  # undecodable bytes from the shell
    assert code == 2 and _one_line(err, "--prompt is not valid UTF-8")
    code, err = _cli(
        [*base, "--prompt", "hi", "--drafter", "ngram", "--drafter-option", "max_ngarm=3"], capsys
    )
    assert code == 2 and _one_line(err, "drafter 'ngram' has no option 'max_ngarm'", "max_ngram")
    for flag in ("--temperature", "--top-p"):
        code, err = _cli([*base, "--prompt", "hi", flag, "nan"], capsys)
        assert code == 2 and _one_line(err, flag, "finite")
    code, err = _cli([*base, "--prompt", "hi", "--drafter-option", "x=nan"], capsys)
    assert code == 2 and _one_line(err, "--drafter-option x", "finite")
    code, err = _cli(["bench", "--temperatures", "0,nan", "--out", str(tmp_path)], capsys)
    assert code == 2 and _one_line(err, "--temperatures", "finite")


def test_cli_names_the_broken_file(ckpt, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    base = ["generate", "--prompt", "hi", "--max-new-tokens", "2", "--target", str(broken)]
    code, err = _cli(base, capsys)
    assert code == 2 and _one_line(err, "model.safetensors", "not a readable safetensors file")
    (broken / "model.safetensors").write_bytes(data)
    (broken / "config.json").write_text('{"model_type": "llama", ')
    code, err = _cli(base, capsys)
    assert code == 2 and _one_line(err, "config.json")
    (broken / "config.json").unlink()
    code, err = _cli(base, capsys)
    assert code == 2 and _one_line(err, "config.json")
    not_a_head = tmp_path / "head.safetensors"
    not_a_head.write_bytes(b"garbage")
    head = [
        "generate",
        "--prompt",
        "hi",
        "--max-new-tokens",
        "2",
        "--target",
        str(ckpt),
        "--drafter",
        "eagle",
    ]
    code, err = _cli([*head, "--drafter-option", f"weights={not_a_head}"], capsys)
    assert code == 2 and _one_line(err, str(not_a_head), "not a readable safetensors file")


def test_a_head_file_of_the_wrong_shape_is_named(llama, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from specdec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead, save_eagle_head

    parts = llama.parts()
    head = EagleHead(EagleConfig.from_hf_config(llama.config, draft_vocab_size=32)).attach(parts)
    good = tmp_path / "good.safetensors"
    save_eagle_head(head, good, target_name="tiny", embed_VD=parts.embed_VD)
    state = load_file(str(good))
    with safe_open(str(good), framework="pt") as f:
        meta = f.metadata()
    state["qkv_proj.weight"] = state["qkv_proj.weight"][:, :10].contiguous()
    bad = tmp_path / "bad.safetensors"
    save_file(state, str(bad), metadata=meta)
    with pytest.raises(ValueError, match=r"bad.safetensors does not fit its own config: .*qkv_proj.weight"):
        EagleDrafter(llama, weights=bad)
    assert json.loads(meta["config"])["draft_vocab_size"] == 32
