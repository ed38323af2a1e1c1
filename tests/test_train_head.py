"""The drafter-training recipe end to end (`specdec train-head`: `specdec.drafters.eagle.train.loop.train`)
on a small synthetic cache.

The recipe's promise is that a run is a pure function of its config: the same config gives the same
weights, and a run interrupted and resumed from its checkpoint gives the weights of an uninterrupted run
(batches and noise are seeded by step). The shipped head was checked the same way at full size (two
3,000-step runs, bitwise identical weights; see the model card).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.drafters.eagle.train.command import main
from specdec.drafters.eagle.train.config import DataConfig, TrainConfig, resolve_for_target
from specdec.drafters.eagle.train.dataset import FeatureData, aux_shard_name, dataset_dir
from specdec.drafters.eagle.train.loop import _key_fields, build_draft_vocab, train

# the recipe loads the real SmolLM2-135M for its embedding and LM head; five training runs: ~15 s
pytestmark = [pytest.mark.model, pytest.mark.slow]

DIM, TOPK = 576, 8  # SmolLM2-135M's width; the top-k the cache stores


class Interrupted(Exception):
    pass


def _fake_cache(root, data: DataConfig, aux_layers: tuple[int, ...] = ()) -> None:
    """A finished feature cache with random features: 10 training and 2 held-out sequences (and
    random ``aux_layers`` features beside the shard, as ``build_aux_features`` writes them)."""
    g = torch.Generator().manual_seed(0)
    lengths = [40, 33, 50, 21, 64, 45, 38, 29, 57, 48, 30, 36]
    n = sum(lengths)
    tokens = torch.randint(0, 300, (n,), generator=g)
    probs = torch.rand(n, TOPK, generator=g).sort(dim=-1, descending=True).values
    # the target's top-k next tokens: the next token first, then others
    others = torch.randint(0, 300, (n, TOPK - 1), generator=g)
    topk_ids = torch.cat([tokens.roll(-1)[:, None], others], dim=1)
    out = dataset_dir(data, root)
    out.mkdir(parents=True)
    save_file(
        {
            "tokens": tokens.to(torch.int32),
            "features": (torch.randn(n, DIM, generator=g) * 30).half(),
            "topk_ids": topk_ids.to(torch.int32),
            "topk_probs": (probs / probs.sum(-1, keepdim=True)).half(),
            "lengths": torch.tensor(lengths),
            "heldout": torch.tensor([i >= 10 for i in range(len(lengths))]),
        },
        str(out / "shard.safetensors"),
        metadata={"names": json.dumps([f"seq/{i}" for i in range(len(lengths))])},
    )
    if aux_layers:
        aux = (torch.randn(n, len(aux_layers), DIM, generator=g) * 5).half()
        save_file({"aux": aux}, str(out / aux_shard_name("shard.safetensors", aux_layers)))
    (out / "manifest.json").write_text(json.dumps({"shards": ["shard.safetensors"], "complete": True}))


def _run(tmp_path, name: str, cfg: TrainConfig, log=lambda s: None) -> dict:
    return train(
        cfg,
        out=tmp_path / f"{name}.safetensors",
        work=tmp_path / f"work-{name}",
        data_root=tmp_path / "data",
        evaluate=False,
        log=log,
    )


@pytest.fixture(scope="module")
def shared_model(smollm2_greedy):
    """Every run of this module loads SmolLM2 for its embedding and LM head: load it once."""
    from specdec.targets import loading

    real = loading.load_hf_model
    model = smollm2_greedy.model  # loaded before the patch: its lazy load goes through load_hf_model
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            loading,
            "load_hf_model",
            lambda name, **kw: model if name == "smollm2-135m" and not kw else real(name, **kw),
        )
        yield


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_model):
    tmp_path = tmp_path_factory.mktemp("recipe")
    cfg = TrainConfig(  # with EAGLE-3's fused input: the recipe's fullest path
        steps=20,
        seq_len=16,
        batch_size=3,
        draft_vocab_size=64,
        unroll=2,
        eval_every=10,
        ckpt_every=4,
        aux_layers=(1, 14),
        autocast_bf16=False,  # PyTorch's CPU bf16 GEMM without AVX512-BF16 is its slow reference path
    )
    _fake_cache(tmp_path / "data", cfg.data, cfg.aux_layers)
    summaries = {"straight": _run(tmp_path, "straight", cfg), "again": _run(tmp_path, "again", cfg)}

    def stop_at_step_10(line: str) -> None:  # the log line of step 10 comes before its checkpoint
        if line.startswith("[train] step 10/"):
            raise Interrupted

    with pytest.raises(Interrupted):
        _run(tmp_path, "resumed", cfg, log=stop_at_step_10)
    lines: list[str] = []
    summaries["resumed"] = _run(tmp_path, "resumed", cfg, log=lines.append)
    summaries["other_seed"] = _run(tmp_path, "other_seed", replace(cfg, seed=1))
    weights = {name: load_file(str(tmp_path / f"{name}.safetensors")) for name in summaries}
    return {"summaries": summaries, "weights": weights, "resume_log": lines, "tmp": tmp_path, "cfg": cfg}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_same_config_gives_bitwise_the_same_head(runs):
    w, s = runs["weights"], runs["summaries"]
    assert _same(w["straight"], w["again"])
    assert w["straight"]["fc_aux.weight"].shape == (DIM, 3 * DIM)  # the fused input was trained
    assert s["straight"]["heldout_curve"] == s["again"]["heldout_curve"]
    assert not _same(w["straight"], w["other_seed"])  # the comparison can fail


def test_interrupted_run_resumes_to_the_uninterrupted_head(runs):
    assert any("resumed at step 8" in line for line in runs["resume_log"])  # last checkpoint before 10
    assert _same(runs["weights"]["straight"], runs["weights"]["resumed"])
    assert runs["summaries"]["resumed"]["heldout_curve"] == runs["summaries"]["straight"]["heldout_curve"]


def test_init_from_starts_at_the_given_weights(runs):
    """Fine-tuning starts from the file: at learning rate 0 the run writes the file's weights back
    bit for bit (its draft vocabulary in stored order, too); a token-loss-only run moves them."""
    tmp, cfg = runs["tmp"], runs["cfg"]
    start = str(tmp / "straight.safetensors")
    lines: list[str] = []
    still = _run(tmp, "still", replace(cfg, init_from=start, steps=2, lr=0.0), log=lines.append)
    assert any("starting from the weights" in line for line in lines)
    assert still["config"]["init_from"] == start
    w = load_file(str(tmp / "still.safetensors"))
    assert _same(w, runs["weights"]["straight"])
    tuned = _run(tmp, "tuned", replace(cfg, init_from=start, steps=4, reg_weight=0.0, ce_weight=1.0))
    w_tuned = load_file(str(tmp / "tuned.safetensors"))
    assert torch.equal(w_tuned["draft_vocab_N"], w["draft_vocab_N"])
    assert not torch.equal(w_tuned["fc.weight"], w["fc.weight"])
    assert len(tuned["heldout_curve"]) == 1  # evaluated at its last step


def test_draft_vocab_ranks_top1_then_topk_frequency():
    """Top-1 predictions first by frequency (ties by id, as the shipped head's vocabulary was built);
    then tokens that are never top-1, by how often they appear in the top-k; held-out rows ignored."""
    ids = torch.tensor(
        [[4, 9, 7], [4, 7, 9], [2, 7, 8], [2, 9, 8], [6, 8, 3], [4, 5, 8]]  # train rows
        + [[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]]  # held-out rows: 1 would lead if counted
    )
    n = ids.shape[0]
    data = FeatureData(
        tokens=torch.zeros(n, dtype=torch.long),
        features=torch.zeros(n, 1).half(),
        topk_ids=ids,
        topk_probs=torch.ones(n, 3).half(),
        offsets=torch.tensor([0, 6, n]),
        heldout=torch.tensor([False, True]),
        names=["train", "held"],
    )
    order, coverage = build_draft_vocab(data, data.sequences(False), 9)
    # top-1: 4 (3×), 2 (2×), 6 (1×); then by top-k appearances: 8 (4×), 7 and 9 (3×, by id), 3, 5, 0
    assert order.tolist() == [4, 2, 6, 8, 7, 9, 3, 5, 0]
    assert coverage[1024] == 1.0
    assert build_draft_vocab(data, data.sequences(False), 2)[0].tolist() == [4, 2]


def test_init_from_keys_checkpoints_by_content(runs, tmp_path):
    cfg = runs["cfg"]
    a, b = runs["tmp"] / "straight.safetensors", runs["tmp"] / "other_seed.safetensors"
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(a.read_bytes())
    key = _key_fields(replace(cfg, init_from=str(a)))
    assert key == _key_fields(replace(cfg, init_from=str(copy)))  # same contents, other path
    assert key != _key_fields(replace(cfg, init_from=str(b)))
    assert _key_fields(cfg)["init_from"] is None


def test_init_from_rejects_weights_that_do_not_fit(runs):
    cfg, start = runs["cfg"], str(runs["tmp"] / "straight.safetensors")
    with pytest.raises(ValueError, match=r"\(\(1, 14\), 64, True\), this run asks for \(\(\), 64, True\)"):
        _run(runs["tmp"], "no_aux", replace(cfg, init_from=start, aux_layers=()))
    with pytest.raises(ValueError, match="fine-tuning keeps the head's shape"):
        _run(runs["tmp"], "vocab", replace(cfg, init_from=start, draft_vocab_size=32))
    with pytest.raises(ValueError, match="fine-tuning keeps the head's shape"):
        _run(runs["tmp"], "no_prev", replace(cfg, init_from=start, prev_token_input=False))
    with pytest.raises(ValueError, match="no such file"):
        _run(runs["tmp"], "missing", replace(cfg, init_from=str(runs["tmp"] / "nope.safetensors")))
    with pytest.raises(ValueError, match="no such file"):  # the CLI flag reaches the config
        main(["--init-from", str(runs["tmp"] / "nope.safetensors"), "--data-root", str(runs["tmp"] / "data")])


def test_prev_token_input_trains_the_third_fc_block(runs):
    """--prev-token-input (the recipe's default): fc takes [embed(x_{t+1}); f_t; embed(x_t)] and
    trains; --no-prev-token-input gives the EAGLE-1 pair; the flag keys the checkpoint."""
    tmp = runs["tmp"]
    assert runs["cfg"].prev_token_input
    assert load_file(str(tmp / "straight.safetensors"))["fc.weight"].shape == (DIM, 3 * DIM)
    cfg = replace(runs["cfg"], prev_token_input=False, steps=3)
    _run(tmp, "no_prev", cfg)
    assert load_file(str(tmp / "no_prev.safetensors"))["fc.weight"].shape == (DIM, 2 * DIM)
    assert _key_fields(cfg) != _key_fields(runs["cfg"])


def test_cli_is_generated_from_the_config(runs, capsys):
    """Every TrainConfig field has its flag with the dataclass's default; bad values are ValueErrors."""
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for flag in (
        "--steps",
        "--text-tokens",
        "--aux-layers",
        "--prev-token-input",
        "--no-prev-token-input",
        "--init-from",
        "--draft-vocab-size",
        "--data-seed",
        "--target",
    ):
        assert flag in text
    assert "(default: 4000)" in text and "(default: 1,14)" in text
    with pytest.raises(ValueError, match="TrainConfig.steps must be an int >= 1"):
        main(["--steps", "0", "--data-root", str(runs["tmp"] / "data")])
    with pytest.raises(SystemExit):  # NaN is refused by the flag's type
        main(["--lr", "nan"])


def test_compat_speculators_trains_an_exportable_eagle3_head(runs, tmp_path):
    """--compat speculators: EAGLE-3's layer over the aux layers only (its own norms and LM head),
    no previous-token input, token loss only; the file exports with `specdec export-head` and
    imports back to the same weights."""
    from specdec.cli import main as specdec_main
    from specdec.drafters.eagle import Eagle3Head, load_eagle_head
    from specdec.targets import load_target

    cfg = replace(runs["cfg"], compat="speculators", steps=4, prev_token_input=True, reg_weight=1.0)
    assert (cfg.prev_token_input, cfg.reg_weight, cfg.feature_noise) == (False, 0.0, 0.0)
    assert resolve_for_target(cfg).aux_layers == (1, 14, 26)  # the engines' default for 30 layers
    _fake_cache(tmp_path / "data", cfg.data, (1, 14, 26))
    file = tmp_path / "compat.safetensors"
    summary = train(
        cfg, out=file, work=tmp_path / "work", data_root=tmp_path / "data", evaluate=False, log=print
    )
    assert summary["config"]["compat"] == "speculators"
    parts = load_target("smollm2-135m").parts()
    head, _ = load_eagle_head(file, parts)
    assert (
        isinstance(head, Eagle3Head)
        and head.config.layout == "eagle3"
        and head.config.aux_layers == (1, 14, 26)
    )
    assert head.fc.weight.shape == (DIM, 3 * DIM) and head.lm_head.shape == (64, DIM)
    start = Eagle3Head(head.config).attach(parts, head.draft_vocab_N, init_output=True)
    assert not torch.equal(head.qkv_proj.weight, start.qkv_proj.weight)  # it trained
    out = tmp_path / "spec"
    assert specdec_main(["export-head", str(file), "--format", "speculators", "--out", str(out)]) == 0
    back, meta = load_eagle_head(out, parts)
    assert meta["format"] == "speculators"
    for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert specdec_main(["export-head", str(file), "--format", "sglang", "--out", str(tmp_path / "s")]) == 0
    assert load_eagle_head(tmp_path / "s", parts)[1]["format"] == "sglang"
    assert (
        specdec_main(
            [
                "export-head",
                str(runs["tmp"] / "straight.safetensors"),
                "--format",
                "speculators",
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
