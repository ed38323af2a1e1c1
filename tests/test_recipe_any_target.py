"""The drafter recipe for a target other than SmolLM2, end to end: ``specdec train-head
--target PATH`` on a tiny random Llama checkpoint this module writes (its own byte
tokenizer and chat template), from an empty cache through the data, the training, held-out decoding
with the head and export to vLLM's format.

To stay small the benchmark prompt sets are cut to their first 12 entries and every data source to a
few sequences; the code path is the full recipe's.
"""

from __future__ import annotations

import json

import pytest
import torch
from _tiny import save_tiny_checkpoint

from specdec.drafters.eagle.train.command import main
from specdec.drafters.eagle.train.config import DataConfig, TrainConfig, resolve_for_target
from specdec.drafters.eagle.train.dataset import load_dataset, target_cache_name
from specdec.drafters.eagle.train.loop import build_draft_vocab

pytestmark = pytest.mark.slow

PER_SET = 8  # HumanEval tasks and MT-Bench questions used
VOCAB, LAYERS, DIM = 259, 8, 64  # the tiny checkpoint: byte tokenizer, 8 decoder layers
DRAFT_VOCAB = 96
FLAGS = [
    "--greedy-tokens", "10", "--sample-tokens", "0",
    "--function-prompts", "3", "--self-instruct", "4", "--self-instruct-tokens", "24",
    "--text-tokens", "2000", "--repeat-sequences", "2", "--seq-len", "48", "--batch-size", "4",
    "--draft-vocab-size", str(DRAFT_VOCAB), "--no-autocast-bf16", "--eval-prompts", "2",
    "--eval-new-tokens", "16", "--eval-every", "20", "--ckpt-every", "20",
]  # fmt: skip


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """Train a head for the tiny checkpoint with the recipe's CLI (default layout), then an
    exportable one (``--compat speculators``) on the same data cache."""
    from specdec import prompt_sets

    root = tmp_path_factory.mktemp("any-target")
    ckpt = save_tiny_checkpoint(root / "tiny-llama", seed=2, num_layers=LAYERS, init_std=0.2)
    he, mt = prompt_sets.humaneval_tasks(), prompt_sets.mtbench_questions()
    common = ["--target", str(ckpt), "--data-root", str(root / "data"), *FLAGS]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prompt_sets, "humaneval_tasks", lambda: he[:PER_SET])
        mp.setattr(prompt_sets, "mtbench_questions", lambda: mt[:PER_SET])
        assert main([*common, "--out", str(root / "head.safetensors"), "--steps", "40"]) == 0
        compat = ["--out", str(root / "compat.safetensors"), "--steps", "4", "--compat", "speculators"]
        assert main([*common, *compat]) == 0
    (data_dir,) = [p for p in (root / "data").glob("tiny-llama-*") if p.is_dir()]
    return {"root": root, "ckpt": ckpt, "data_dir": data_dir}


def _hf(ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def test_the_data_is_the_targets_own(recipe):
    """Its cache sits under the data root (named by the checkpoint, not its path), its tokens are the
    target tokenizer's, chat prompts are in the target's chat template, and a greedy continuation
    is what transformers' greedy decoding of the target gives."""
    from transformers import AutoTokenizer

    from specdec.prompt_sets import humaneval_tasks, mtbench_questions

    ckpt, data_dir = recipe["ckpt"], recipe["data_dir"]
    assert data_dir.parent == recipe["root"] / "data"
    assert json.loads((data_dir / "config.json").read_text())["target"] == str(ckpt)
    assert data_dir.name.startswith(f"{target_cache_name(str(ckpt))}-")
    data = load_dataset(data_dir)
    assert int(data.tokens.max()) < VOCAB and int(data.topk_ids.max()) < VOCAB
    assert data.features.shape[1] == DIM
    tok = AutoTokenizer.from_pretrained(ckpt)
    seqs = {name: i for i, name in enumerate(data.names)}

    def tokens(name):
        i = seqs[name]
        return data.tokens[int(data.offsets[i]) : int(data.offsets[i + 1])].tolist()

    question = mtbench_questions()[1]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": question["turns"][0]}], add_generation_prompt=True, tokenize=False
    )
    chat_ids = tok(chat, add_special_tokens=False).input_ids
    assert tokens(f"mtbench/{question['question_id']}/0/chat/greedy0")[: len(chat_ids)] == chat_ids
    task = humaneval_tasks()[1]  # a training task (task 0 is held out)
    prompt = tok(task["prompt"]).input_ids
    ours = tokens(f"{task['task_id']}/greedy0")
    assert ours[: len(prompt)] == prompt and len(ours) > len(prompt)
    with torch.no_grad():
        ref = _hf(ckpt).generate(
            torch.tensor([prompt]), max_new_tokens=len(ours) - len(prompt), do_sample=False
        )
    assert ours == ref[0].tolist()


def test_draft_vocab_is_ranked_on_the_targets_outputs(recipe):
    from specdec.drafters.eagle.weights import stored_draft_vocab

    data = load_dataset(recipe["data_dir"], (1, 3))
    expected, _ = build_draft_vocab(data, data.sequences(False), DRAFT_VOCAB, VOCAB)
    stored = stored_draft_vocab(recipe["root"] / "head.safetensors")
    assert torch.equal(stored, expected)
    top1 = torch.cat(
        [data.topk_ids[int(data.offsets[s]) : int(data.offsets[s + 1]), 0] for s in data.sequences(False)]
    )
    assert int(stored[0]) == int(torch.bincount(top1.long()).argmax())  # the most frequent prediction


def test_the_head_fingerprints_its_target_and_decodes_exactly(recipe, tmp_path):
    """The head loads on its own checkpoint (aux layers fitted to 8 layers: (1, 3)), its greedy
    speculative decoding is the target's greedy output, and another checkpoint of the same shape is
    refused by fingerprint; the recipe's own held-out decoding ran with it."""
    import specdec
    from specdec.drafters.eagle import load_eagle_head
    from specdec.targets.llama import LlamaTarget

    root, ckpt = recipe["root"], recipe["ckpt"]
    head_file = root / "head.safetensors"
    target = LlamaTarget.from_pretrained(ckpt)
    head, meta = load_eagle_head(head_file, target.parts())
    assert head.config.aux_layers == (1, 3) and head.config.hidden_size == DIM
    assert meta["target"] == str(ckpt)
    summary = json.loads(head_file.with_suffix(".json").read_text())
    assert summary["heldout_decode"]["prompts"] == 2 and summary["heldout_decode"]["eagle"]["tau"] >= 1.0
    curve = summary["heldout_curve"]
    assert curve[-1]["loss"] < curve[0]["loss"]  # it learned on the held-out split
    prompt = [[60, 61, 62, 40, 41, 10, 32, 32]]
    plain = specdec.generate(target, prompt, drafter="none", max_new_tokens=24, temperature=0.0)
    spec = specdec.generate(
        target,
        prompt,
        drafter="eagle",
        drafter_options={"weights": str(head_file)},
        gamma=4,
        max_new_tokens=24,
        temperature=0.0,
    )
    assert spec.token_ids == plain.token_ids
    other = LlamaTarget.from_pretrained(save_tiny_checkpoint(tmp_path / "other", seed=9, num_layers=LAYERS))
    with pytest.raises(ValueError, match="not this target .its embedding differs"):
        load_eagle_head(head_file, other.parts())


def test_compat_head_of_any_target_exports_to_vllms_format(recipe, tmp_path):
    """--compat speculators on an 8-layer target: the engines' default aux layers (outputs of 1, 3,
    4; vLLM numbers them 2, 4, 5), exported with the target's vocabulary and width."""
    from specdec.cli import main as specdec_main

    out = tmp_path / "spec"
    assert specdec_main(["export-head", str(recipe["root"] / "compat.safetensors"), "--format", "speculators",
                         "--out", str(out)]) == 0  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["target_hidden_size"] == DIM and config["transformer_layer_config"]["vocab_size"] == VOCAB
    assert config["draft_vocab_size"] == DRAFT_VOCAB


def test_target_dependent_defaults_and_refusals(tmp_path):
    """Aux layers left at the default become (1, L/2−1) of the target's depth (only layers below the
    last; SmolLM2's 30 keep (1, 14)); the compat preset refuses a target too shallow for three
    distinct layers; a draft vocabulary beyond the target's, or a target that does not exist, is a
    ValueError naming the field."""
    shallow = save_tiny_checkpoint(tmp_path / "four", num_layers=4)
    two = save_tiny_checkpoint(tmp_path / "two", num_layers=2)
    cfg = lambda path, **kw: TrainConfig(data=DataConfig(target=str(path)), **kw)
    assert resolve_for_target(cfg(shallow, draft_vocab_size=64)).aux_layers == (1,)
    assert resolve_for_target(cfg(two, draft_vocab_size=64)).aux_layers == (0,)
    assert resolve_for_target(cfg(shallow, draft_vocab_size=64, aux_layers=(0, 2))).aux_layers == (0, 2)
    with pytest.raises(ValueError, match="aux_layers: the engines' default"):
        resolve_for_target(cfg(shallow, draft_vocab_size=64, compat="speculators"))
    with pytest.raises(ValueError, match="aux_layers must be decoder layers below the last"):
        resolve_for_target(cfg(shallow, draft_vocab_size=64, aux_layers=(3,)))
    with pytest.raises(ValueError, match=r"draft_vocab_size must be at most the target's vocabulary \(259\)"):
        resolve_for_target(cfg(shallow))  # the recipe's 8192
    with pytest.raises(ValueError, match="DataConfig.target"):
        target_cache_name(str(tmp_path / "missing"))
    assert target_cache_name("smollm2-135m") == "smollm2-135m"
    name = target_cache_name(str(shallow))
    assert name.startswith("four-") and "/" not in name
    save_tiny_checkpoint(tmp_path / "four", num_layers=4, seed=5)  # another checkpoint at the same path
    assert target_cache_name(str(shallow)) != name
