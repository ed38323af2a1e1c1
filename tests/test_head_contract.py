"""Head folders (``head=DIR``) are checked against their format's contract at load (docs/formats.md).

One small ``"eagle3"`` head for a tiny 8-layer Llama's tensors (made here, in memory) is exported
once per format; each test copies
the folder, breaks one thing, and expects a ``ValueError`` naming the folder, the file and the
tensor or field, or, where the break must change nothing (a stray file), bitwise the same head.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specdec.drafters.eagle import EagleConfig
from specdec.drafters.eagle.formats import FORMATS, export_head, import_head
from specdec.drafters.eagle.weights import fingerprint, load_eagle_head, save_eagle_head
from specdec.protocols import TargetParts
from tests.test_head_formats import _random_head

N, V = 180, 259  # draft vocabulary, the tiny target's vocabulary


def _target_parts(seed: int = 3) -> TargetParts:
    """Random target tensors of a tiny 8-layer Llama (hidden 64, vocabulary 259): all a head import
    reads from its target."""
    g = torch.Generator().manual_seed(seed)
    config = SimpleNamespace(hidden_size=64, vocab_size=V, num_hidden_layers=8)
    return TargetParts(
        embed_VD=torch.randn(V, 64, generator=g) * 0.02,
        norm_D=torch.rand(64, generator=g) + 0.5,
        norm_eps=1e-5,
        lm_head_VD=torch.randn(V, 64, generator=g) * 0.02,
        config=config,
    )


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """The target's tensors, the head module, its head file, and one exported folder per format."""
    root = tmp_path_factory.mktemp("contract")
    parts = _target_parts()
    config = EagleConfig(
        layout="eagle3",
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        vocab_size=V,
        draft_vocab_size=N,
        aux_layers=(1, 3, 5),
        aux_scales=(1.0, 1.0, 1.0),
    )
    head = _random_head(config, parts)
    file = root / "head.safetensors"
    save_eagle_head(head, file, target_name="tiny8", embed_VD=parts.embed_VD)
    dirs = {
        fmt: export_head(
            head, fmt, root / fmt, target_name="tiny8", target_fingerprint=fingerprint(parts.embed_VD)
        )
        for fmt in FORMATS
    }
    return {"parts": parts, "head": head, "file": file, "dirs": dirs}


def _copy(heads, tmp_path: Path, fmt: str = "speculators") -> Path:
    return Path(shutil.copytree(heads["dirs"][fmt], tmp_path / f"{fmt}-copy"))


def _edit_tensors(folder: Path, change, name: str = "model.safetensors") -> None:
    """Rewrite ``folder/name`` with ``change(tensors)`` applied, keeping its metadata."""
    with safe_open(str(folder / name), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(folder / name))
    change(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / name), metadata=meta)


def _edit_config(folder: Path, change) -> None:
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


def _refused(folder: Path, parts, *pieces: str) -> str:
    """Import ``folder``; expect a ``ValueError`` whose message names the folder and each piece."""
    with pytest.raises(ValueError) as err:
        import_head(folder, parts)
    message = str(err.value)
    for piece in (str(folder), *pieces):
        assert piece in message, (piece, message)
    return message


def _same_head(a, b) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("fmt", FORMATS)
def test_d2t_must_hold_one_integer_offset_per_draft_id(heads, tmp_path, fmt):
    folder = _copy(heads, tmp_path, fmt)
    _edit_tensors(folder, lambda t: t.update(d2t=t["d2t"][:1].clone()))  # broadcast before
    _refused(folder, heads["parts"], "d2t in model.safetensors", "shape [1]", f"expected [{N}]")
    folder = _copy(heads, tmp_path / "float", fmt)
    _edit_tensors(folder, lambda t: t.update(d2t=t["d2t"].float()))
    _refused(folder, heads["parts"], "d2t in model.safetensors", "torch.float32", "integer offsets")


def test_d2t_must_map_one_to_one_inside_the_target_vocabulary(heads, tmp_path):
    parts = heads["parts"]
    folder = _copy(heads, tmp_path / "dup")
    d2t = load_file(str(folder / "model.safetensors"))["d2t"]
    on_zero = int(d2t[0])  # draft id 0's target id; draft id 1 moved onto it

    def duplicate(t):
        t["d2t"][1] = on_zero - 1

    _edit_tensors(folder, duplicate)
    message = _refused(
        folder, parts, "d2t in model.safetensors", f"draft ids [0, 1] all to target id {on_zero}"
    )
    assert f"{N - 1} distinct target ids for {N} draft ids" in message
    for label, last in (("above", V - (N - 1)), ("below", -(N - 1) - 1)):  # target ids V and -1
        folder = _copy(heads, tmp_path / label)

        def outside(t, last=last):
            t["d2t"][N - 1] = last

        _edit_tensors(folder, outside)
        _refused(
            folder,
            parts,
            "d2t in model.safetensors",
            f"draft id {N - 1} to target id {N - 1 + last}",
            f"outside the target vocabulary [0, {V})",
        )


def test_t2d_must_mark_exactly_the_ids_d2t_maps_to(heads, tmp_path):
    parts = heads["parts"]
    folder = _copy(heads, tmp_path / "swap")
    t2d = load_file(str(folder / "model.safetensors"))["t2d"]
    marked, unmarked = int(torch.nonzero(t2d)[0]), int(torch.nonzero(~t2d)[0])

    def swap(t):  # same count, two ids disagree
        t["t2d"][marked], t["t2d"][unmarked] = False, True

    _edit_tensors(folder, swap)
    _refused(
        folder,
        parts,
        "t2d in model.safetensors",
        "disagrees with d2t at 2 target ids",
        f"first {min(marked, unmarked)}",
    )
    folder = _copy(heads, tmp_path / "int")
    _edit_tensors(folder, lambda t: t.update(t2d=t["t2d"].to(torch.int64)))
    _refused(folder, parts, "t2d in model.safetensors", f"expected a bool mask [{V}]")
    folder = _copy(heads, tmp_path / "short")
    _edit_tensors(folder, lambda t: t.update(t2d=t["t2d"][: V - 1].clone()))
    _refused(folder, parts, f"is torch.bool [{V - 1}]; expected a bool mask [{V}]")
    folder = _copy(heads, tmp_path / "none")  # t2d is optional: the engines do not read it
    _edit_tensors(folder, lambda t: t.pop("t2d"))
    _same_head(import_head(folder, parts)[0], heads["head"])


def test_a_stray_safetensors_file_is_not_read(heads, tmp_path):
    parts = heads["parts"]
    folder = _copy(heads, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    stale = {k: torch.zeros_like(v) for k, v in tensors.items()}  # an old export: zeros, d2t all 0
    for name in ("zz-old.safetensors", "a-old.safetensors"):  # sorted after and before the real file
        save_file(stale, str(folder / name))
    _same_head(import_head(folder, parts)[0], heads["head"])
    (folder / "model.safetensors").rename(folder / "head.safetensors")
    _refused(folder, parts, "no model.safetensors", "head.safetensors", "zz-old.safetensors")


def _shard(folder: Path, weight_map_change=None) -> None:
    """Split ``model.safetensors`` into two shards plus ``model.safetensors.index.json``."""
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(folder / shard), metadata=meta)
    (folder / "model.safetensors").unlink()
    weight_map = {k: shard for shard, keys in halves.items() for k in keys}
    if weight_map_change is not None:
        weight_map_change(weight_map)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_a_sharded_head_reads_exactly_the_shards_its_index_names(heads, tmp_path):
    parts = heads["parts"]
    folder = _copy(heads, tmp_path / "sharded")
    _shard(folder)
    stale = {"fc.weight": torch.zeros(64, 192), "d2t": torch.zeros(N, dtype=torch.int64)}
    save_file(stale, str(folder / "model-00003-of-00003.safetensors"))  # not in the index
    _same_head(import_head(folder, parts)[0], heads["head"])

    folder = _copy(heads, tmp_path / "missing")
    _shard(folder, lambda m: m.update({"fc.weight": "model-00009-of-00009.safetensors"}))
    _refused(
        folder, parts, "model.safetensors.index.json", "'model-00009-of-00009.safetensors'", "'fc.weight'"
    )
    folder = _copy(heads, tmp_path / "outside")
    _shard(folder, lambda m: m.update({"fc.weight": "../model-00001-of-00002.safetensors"}))
    _refused(folder, parts, "is not a file in")
    folder = _copy(heads, tmp_path / "wrong")
    moved = {}

    def move(m):  # point a tensor at the shard that does not hold it
        name = next(k for k, v in m.items() if v == "model-00001-of-00002.safetensors")
        m[name] = "model-00002-of-00002.safetensors"
        moved["name"] = name

    _shard(folder, move)
    _refused(folder, parts, f"maps tensor {moved['name']!r} to model-00002-of-00002.safetensors")
    folder = _copy(heads, tmp_path / "empty")
    _shard(folder, lambda m: m.clear())
    _refused(folder, parts, "non-empty 'weight_map'")


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_off_by_one_draft_vocab_size_names_the_field_and_both_sizes(heads, tmp_path, fmt):
    parts = heads["parts"]
    for size in (N - 1, N + 1):
        folder = _copy(heads, tmp_path / str(size), fmt)
        _edit_config(folder, lambda c, size=size: c.update(draft_vocab_size=size))
        _refused(
            folder, parts, f"draft_vocab_size {size}", f"lm_head.weight in model.safetensors has {N} rows"
        )
    folder = _copy(heads, tmp_path / "zero", fmt)
    _edit_config(folder, lambda c: c.update(draft_vocab_size=0))
    _refused(
        folder, parts, "config.json", f"draft_vocab_size must be an integer in [1, vocab_size={V}], got 0"
    )


def test_a_head_file_with_a_wrong_draft_vocabulary_is_named(heads, tmp_path):
    """Our own head files: ``draft_vocab_N`` has ``draft_vocab_size`` distinct ids in [0, V)."""
    parts, file = heads["parts"], heads["file"]
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(file))
    config = json.loads(meta["config"])
    cases = {
        "off_by_one": ({**config, "draft_vocab_size": N - 1}, tensors["draft_vocab_N"]),
        "repeated": (config, torch.cat([tensors["draft_vocab_N"][:1], tensors["draft_vocab_N"][:-1]])),
        "outside": (config, torch.cat([tensors["draft_vocab_N"][:-1], torch.tensor([V])])),
    }
    expected = {
        "off_by_one": f"draft_vocab_size is {N - 1}, but draft_vocab_N has shape [{N}]",
        "repeated": f"draft_vocab_N repeats token ids ({N - 1} distinct of {N})",
        "outside": f"outside the target vocabulary [0, {V})",
    }
    for label, (cfg, vocab_N) in cases.items():
        bad = tmp_path / f"{label}.safetensors"
        save_file(
            {**tensors, "draft_vocab_N": vocab_N}, str(bad), metadata={**meta, "config": json.dumps(cfg)}
        )
        with pytest.raises(ValueError, match=re.escape(expected[label])) as err:
            load_eagle_head(bad, parts)
        assert str(bad) in str(err.value)


def test_a_tensor_or_field_of_the_wrong_shape_or_missing_is_named(heads, tmp_path):
    parts = heads["parts"]
    folder = _copy(heads, tmp_path / "rows")
    q = "layers.0.self_attn.q_proj.weight"
    _edit_tensors(folder, lambda t: t.update({q: t[q][:32].clone()}))
    _refused(folder, parts, f"{q} in model.safetensors has shape [32, 128]; config.json gives [64, 128]")
    folder = _copy(heads, tmp_path / "gone", "sglang")
    _edit_tensors(folder, lambda t: t.pop("norm.weight"))
    _refused(folder, parts, "model.safetensors lacks the format's tensor(s) ['norm.weight']")
    folder = _copy(heads, tmp_path / "int")
    _edit_tensors(folder, lambda t: t.update({"fc.weight": t["fc.weight"].to(torch.int32)}))
    _refused(folder, parts, "fc.weight in model.safetensors is torch.int32; expected floating point")
    folder = _copy(heads, tmp_path / "field")
    _edit_config(folder, lambda c: c["transformer_layer_config"].pop("intermediate_size"))
    _refused(folder, parts, "config.json", "no field 'intermediate_size'")


def test_a_folder_that_is_not_a_head_says_what_it_lacks(heads, tmp_path):
    parts = heads["parts"]
    etc = tmp_path / "etc"  # like head=/etc: a folder that exists, with no config.json
    etc.mkdir()
    (etc / "hosts").write_text("127.0.0.1 localhost\n")
    with pytest.raises(ValueError) as err:  # what head=DIR / weights=DIR of every EAGLE drafter calls
        load_eagle_head(etc, parts)
    message = str(err.value)
    assert str(etc) in message and "no such file" not in message
    assert "the folder has no config.json" in message and "model.safetensors" in message
    with pytest.raises(ValueError, match="no such file"):  # a path that does not exist still says so
        load_eagle_head(tmp_path / "absent", parts)
    folder = _copy(heads, tmp_path)
    (folder / "model.safetensors").unlink()
    message = _refused(folder, parts, "no model.safetensors (nor model.safetensors.index.json")
    assert "it holds" not in message  # nothing else there to list


def test_export_head_out_must_name_a_directory(heads, tmp_path, capsys):
    from specdec.cli import main as specdec_main

    existing = tmp_path / "taken.txt"
    existing.write_text("keep me\n")
    base = ["export-head", str(heads["file"]), "--format", "speculators", "--out"]
    for out, what in ((existing, "is an existing file"), (existing / "sub", "lies under")):
        assert specdec_main([*base, str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("specdec: error: --out ")
        assert str(out) in err and what in err, err
    assert existing.read_text() == "keep me\n"
    with pytest.raises(ValueError, match=r"^out .* is an existing file"):
        export_head(heads["head"], "sglang", existing, target_name="t", target_fingerprint="")
    assert specdec_main([*base, str(tmp_path / "new" / "dir")]) == 0  # a new folder is made
    _same_head(import_head(tmp_path / "new" / "dir", heads["parts"])[0], heads["head"])
