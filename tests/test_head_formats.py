"""EAGLE-3 heads in vLLM's speculators format and SGLang's: export, import, parity.

A random ``"eagle3"``-layout head on a tiny 8-layer Llama: export then import gives bitwise the
same weights and drafts; the speculators package's own ``Eagle3DraftModel`` (optional extra
``[speculators]``, marker ``speculators``) computes the same draft logits from the exported
directory; a head that a format cannot express, or that belongs to another target, is refused.
"""

from __future__ import annotations

import json

import pytest
import torch

import specdec
from specdec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from specdec.drafters.eagle.eagle3 import Eagle3Head
from specdec.drafters.eagle.formats import FORMATS, detect_format, export_head, import_head, unexportable
from specdec.drafters.eagle.weights import fingerprint, load_eagle_head, save_eagle_head
from specdec.targets.llama import LlamaTarget
from tests._tiny import save_tiny_checkpoint, tiny_llama

AUX = (1, 3, 5)  # layer outputs of the tiny 8-layer target (vLLM ids 2, 4, 6)


def _random_head(config: EagleConfig, parts, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    vocab = torch.randperm(config.vocab_size)[: config.draft_vocab_size]
    head = Eagle3Head(config).attach(parts, vocab, init_output=True)
    with torch.no_grad():  # norms away from 1 so that a swapped norm shows; bf16 values, as heads ship
        for name in ("input_norm", "hidden_norm", "post_norm", "norm"):
            getattr(head, name).mul_(torch.rand(config.hidden_size) + 0.5)
        for p in head.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny8"), seed=3, num_layers=8)
    target = LlamaTarget.from_pretrained(path)
    config = EagleConfig.from_hf_config(
        tiny_llama(seed=3, num_layers=8).config,
        draft_vocab_size=180,
        aux_layers=AUX,
        aux_scales=(1.0, 1.0, 1.0),
        layout="eagle3",
    )
    head = _random_head(config, target.parts())
    file = tmp_path_factory.mktemp("head") / "head.safetensors"
    save_eagle_head(head, file, target_name="tiny8", embed_VD=target.parts().embed_VD)
    target.checkpoint = str(path)
    return target, head, file


def _features(target, T: int = 12, seed: int = 1):
    torch.manual_seed(seed)
    tokens = torch.randint(0, 256, (1, T + 1))
    target.capture_layers(AUX)
    target.reset(1, T + 8)
    out = target.forward(tokens[:, :T], torch.zeros(1, dtype=torch.long))
    aux_BTAD = torch.stack([out.aux_hidden_BTD[i] for i in AUX], dim=2)
    return out.hidden_BTD, aux_BTAD, tokens[:, 1:]


def _recording(drafter):
    """``drafter`` with its proposals appended to a list (returned beside it)."""
    proposals, propose = [], drafter.propose

    def record(*args, **kwargs):
        proposals.append(propose(*args, **kwargs))
        return proposals[-1]

    drafter.propose = record
    return drafter, proposals


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_then_import_gives_the_same_weights_and_drafts(setup, tmp_path, fmt):
    target, head, file = setup
    parts = target.parts()
    out = export_head(
        head, fmt, tmp_path / fmt, target_name="tiny8", target_fingerprint=fingerprint(parts.embed_VD)
    )
    assert detect_format(out) == fmt
    config = json.loads((out / "config.json").read_text())
    if fmt == "speculators":
        assert config["speculators_model_type"] == "eagle3"
        assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]  # the residual entering a layer
        assert (
            config["norm_before_residual"] is False
            and config["transformer_layer_config"]["vocab_size"] == 259
        )
    else:
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    assert tensors["lm_head.weight"].shape == (180, 64) and tensors["fc.weight"].shape == (64, 192)
    assert tensors[prefix + "self_attn.q_proj.weight"].shape == (64, 128)  # q over [embed; hidden]
    assert torch.equal(torch.arange(180) + tensors["d2t"], torch.nonzero(tensors["t2d"]).flatten())
    back, meta = import_head(out, parts)
    assert meta["format"] == fmt and back.config == head.config
    for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # the drafts, through the engine: a head object, the head file, and the directory
    drafts = {}
    for label, options in (
        ("module", {"head": head}),
        ("file", {"weights": str(file)}),
        ("dir", {"head": str(out)}),
    ):
        drafter, proposals = _recording(EagleDrafter(target, **options))
        res = specdec.generate(
            target,
            [[5, 9, 17, 33, 65, 129]],
            drafter=drafter,
            max_new_tokens=24,
            gamma=4,
            temperature=0.9,
            seed=0,
        )
        drafts[label] = (res.token_ids, [(p.tokens_T, p.probs_TV) for p in proposals])
    for label in ("file", "dir"):
        assert drafts[label][0] == drafts["module"][0]
        assert len(drafts[label][1]) == len(drafts["module"][1]) > 3
        for (tokens, probs), (tokens0, probs0) in zip(drafts[label][1], drafts["module"][1], strict=True):
            assert torch.equal(tokens, tokens0) and torch.equal(probs, probs0)


def test_our_layout_and_inexpressible_options_are_refused(setup, tmp_path):
    target, head, _ = setup
    ours = EagleConfig.from_hf_config(
        tiny_llama(seed=3, num_layers=8).config,
        draft_vocab_size=180,
        aux_layers=(1,),
        aux_scales=(1.0,),
        prev_token_input=True,
    )
    reasons = unexportable(ours, "speculators")
    assert any("cannot capture" in r for r in reasons) and any("previous-token" in r for r in reasons)
    module = EagleHead(ours).attach(target.parts())
    with pytest.raises(ValueError, match="cannot be exported to the speculators format"):
        export_head(
            module,
            "speculators",
            tmp_path / "x",
            target_name="t",
            target_fingerprint=fingerprint(target.parts().embed_VD),
        )
    two = EagleConfig(**{**head.config.__dict__, "aux_layers": (1, 3), "aux_scales": (1.0, 1.0)})
    assert unexportable(two, "sglang") == ["2 aux layers: SGLang's fc reads exactly 3"]
    assert unexportable(two, "speculators") == []
    nbr = EagleConfig(**{**head.config.__dict__, "norm_before_residual": True})
    assert any("norm_before_residual" in r for r in unexportable(nbr, "sglang"))
    with pytest.raises(ValueError, match="format must be one of"):
        unexportable(nbr, "onnx")


def test_a_head_for_another_target_is_refused_saying_why(setup, tmp_path):
    target, head, _ = setup
    out = export_head(
        head,
        "speculators",
        tmp_path / "h",
        target_name="tiny8",
        target_fingerprint=fingerprint(target.parts().embed_VD),
    )
    other = LlamaTarget.from_pretrained(save_tiny_checkpoint(tmp_path / "other", seed=9, num_layers=8))
    with pytest.raises(ValueError, match="trained for target 'tiny8'"):
        import_head(out, other.parts())
    wide = LlamaTarget.from_pretrained(
        save_tiny_checkpoint(tmp_path / "wide", seed=3, num_layers=8, hidden_size=32)
    )
    with pytest.raises(ValueError, match="hidden_size 64 \\(the target's is 32\\)"):
        import_head(out, wide.parts())
    shallow = LlamaTarget.from_pretrained(save_tiny_checkpoint(tmp_path / "shallow", seed=3, num_layers=4))
    with pytest.raises(ValueError, match="the target has 4 layers"):
        import_head(out, shallow.parts())
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match="neither a speculators EAGLE-3 config"):
        load_eagle_head(tmp_path / "bad", target.parts())


@pytest.mark.speculators
@pytest.mark.slow  # imports the speculators package (~5 s)
def test_speculators_eagle3_model_computes_our_draft_logits(setup, tmp_path):
    speculators_eagle3 = pytest.importorskip(
        "speculators.models.eagle3",
        reason="the speculators package is not installed (pip install -e '.[speculators]')",
    )
    from specdec.drafters.eagle.train.objective import unrolled_features

    target, head, _ = setup
    parts = target.parts()
    out = export_head(
        head,
        "speculators",
        tmp_path / "spec",
        target_name="tiny8",
        target_fingerprint=fingerprint(parts.embed_VD),
        verifier=target.checkpoint,
    )
    config = speculators_eagle3.Eagle3SpeculatorConfig.from_pretrained(str(out), local_files_only=True)
    config.transformer_layer_config._attn_implementation = "eager"
    model = speculators_eagle3.Eagle3DraftModel.from_pretrained(
        str(out), config=config, dtype=torch.float32, local_files_only=True
    )
    with torch.no_grad():  # the target's embedding, as vLLM shares it (the file holds none)
        model.embed_tokens.weight.copy_(parts.embed_VD)
    model.eval()
    feature_BTD, aux_BTAD, next_BT = _features(target)
    T = next_BT.shape[1]
    captured = []
    model.lm_head.register_forward_hook(lambda mod, args, output: captured.append(output.detach()))
    with torch.no_grad():
        model(
            hidden_states=aux_BTAD.flatten(-2),
            input_ids=next_BT,
            document_ids=torch.zeros(1, T, dtype=torch.long),
            position_ids=torch.arange(T).unsqueeze(0),
            ttt_steps=2,
        )
        g_BTD = head.project(feature_BTD, aux_BTAD)
        ours = [head.logits(f) for f in unrolled_features(head, g_BTD, next_BT, steps=2)]
    assert len(captured) == 2
    torch.testing.assert_close(captured[0], ours[0], rtol=1e-4, atol=1e-4)
    # step 2: their query at t drafts x_{t+3} from the step-1 state at t; ours at t + 1 does
    torch.testing.assert_close(captured[1][:, : T - 1], ours[1][:, 1:], rtol=1e-4, atol=1e-4)


def test_a_smaller_draft_vocabulary_keeps_the_heads_rows(setup):
    """``draft_vocab_size=n`` scores the n most frequent stored tokens with their own LM-head rows."""
    target, head, file = setup
    parts = target.parts()
    small, _ = load_eagle_head(file, parts, draft_vocab_size=50)
    stored, _ = load_eagle_head(file, parts)
    assert small.draft_vocab_N.numel() == 50 and bool(
        (small.draft_vocab_N[1:] > small.draft_vocab_N[:-1]).all()
    )
    rows = torch.searchsorted(stored.draft_vocab_N, small.draft_vocab_N)
    assert torch.equal(stored.draft_vocab_N[rows], small.draft_vocab_N)
    assert torch.equal(small.lm_head, stored.lm_head[rows]) and torch.equal(stored.lm_head, head.lm_head)
    with pytest.raises(ValueError, match="subset of the head's stored draft vocabulary"):
        Eagle3Head(head.config).attach(parts, torch.tensor([0, 1, 2])).attach(parts, torch.tensor([3]))


@pytest.mark.model
def test_the_shipped_exportable_head_decodes_exactly_and_exports(smollm2_greedy, tmp_path):
    """``eagle3-smollm2-135m.safetensors`` (the ``--compat speculators`` recipe): EAGLE-3's layer over
    the engines' default aux layers of SmolLM2, greedy output equal to transformers', and an export
    to vLLM's format whose aux ids are vLLM's own default for 30 layers."""
    from specdec.targets import load_target

    target = load_target("smollm2-135m", weights="gguf")  # the format equal to transformers
    head, meta = load_eagle_head("eagle3-smollm2-135m.safetensors", target.parts())
    assert isinstance(head, Eagle3Head) and head.config.aux_layers == (1, 14, 26)
    assert json.loads(meta["extra"])["config"]["compat"] == "speculators"
    prompts = smollm2_greedy.prompts()[:2]
    out = specdec.generate(
        target,
        prompts,
        drafter="eagle",
        drafter_options={"weights": "eagle3-smollm2-135m.safetensors"},
        max_new_tokens=24,
        temperature=0.0,
        gamma=4,
        ignore_eos=True,
    )
    for p, got in zip(prompts, out.token_ids, strict=True):
        assert got == smollm2_greedy(p, 24, stop_at_eos=False)
    assert out.metrics.mean_accepted_tokens > 1.2  # it drafts: more than one token per target call
    from specdec.cli import main as specdec_main

    spec = tmp_path / "spec"
    assert specdec_main(["export-head", "eagle3-smollm2-135m.safetensors", "--format", "speculators",
                         "--out", str(spec)]) == 0  # fmt: skip
    assert json.loads((spec / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
