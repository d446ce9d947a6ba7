"""Issue 21, in one process: nothing outside the given directories is read or written, hostile HF and
checkpoint files are refused in one sentence (exit 2, no traceback, bounded time), and the tools read
checkpoints with the trainer's checks. Each case crafts a directory and calls the reader or the
tool's main(argv) directly; a tiny Llama (GQA: segmented entries) written by the conversion path is
the checkpoint they start from."""

import io
import json
import os
import pickle
import shutil
import struct
import time

import pytest
import torch
from launch_helpers import bounded

from megatron_sp.checkpointing import LATEST, files, paths, safe_dcp
from megatron_sp.checkpointing.full_state import checkpoint_path, read_full_state, write_full_checkpoint
from megatron_sp.config import GPTConfig
from megatron_sp.models.hf import ConversionError, from_hf, to_hf
from megatron_sp.models.reference import ReferenceGPT
from tools import convert_checkpoint, convert_hf, generate

CFG = dict(model="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2)
CFG.update(ffn_hidden_size=48, vocab_size=64, seq_length=16, max_position_embeddings=16)
I0 = "iter_0000000"


def one_sentence(capsys, code, want_code, needle, prog):
    err = capsys.readouterr().err.strip()
    assert code == want_code, err
    assert len(err.splitlines()) == 1 and err.startswith(f"{prog}: error:") and needle in err, err
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def model():
    cfg = GPTConfig(**CFG)
    torch.manual_seed(0)
    return cfg, ReferenceGPT(cfg).state_dict()


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    write_full_checkpoint(model[1], model[0], str(root), "test")
    return root


@pytest.fixture
def ckpt(saved, tmp_path):
    """A fresh copy of the checkpoint, and beside it a directory standing for 'outside'."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    (tmp_path / "outside").mkdir()
    return root


def _meta_path(root):
    return root / I0 / "metadata.json"


def _edit_meta(root, **changes):
    meta = json.loads(_meta_path(root).read_text())
    meta.update(changes)
    _meta_path(root).write_text(json.dumps(meta))
    return meta


def _rewrite_record(root, name):
    meta = json.loads(_meta_path(root).read_text())
    meta["files"][name] = safe_dcp.file_digest(str(root / I0 / name))
    _meta_path(root).write_text(json.dumps(meta))


def _shard(root):
    return next((root / I0).glob("*.distcp"))


# ---- writes stay inside --save -------------------------------------------------------------------


def test_planted_links_in_save_are_replaced_not_followed(model, tmp_path):
    """A `latest...txt(.tmp)` or `iter_N.tmp` link planted in --save: the save replaces the link and
    writes nothing through it."""
    save, victim, victim_dir = tmp_path / "save", tmp_path / "victim.txt", tmp_path / "victim_dir"
    save.mkdir()
    victim.write_text("precious")
    victim_dir.mkdir()
    (victim_dir / "keep").write_text("precious")
    os.symlink(victim, save / (LATEST + ".tmp"))
    os.symlink(victim_dir, save / (I0 + ".tmp"))
    write_full_checkpoint(model[1], model[0], str(save), "test")
    os.symlink(victim, save / f".write_test.{os.uname().nodename}.{os.getpid()}")
    paths.check_save_dir(str(save), 0)
    os.remove(save / LATEST)
    os.symlink(victim, save / LATEST)
    paths.write_latest(str(save), 0)  # the marker itself a link: replaced by a file
    assert victim.read_text() == "precious" and (victim_dir / "keep").read_text() == "precious"
    assert sorted(os.listdir(victim_dir)) == ["keep"]
    assert not os.path.islink(save / LATEST) and paths.read_latest(str(save)) == 0
    assert read_full_state(str(save / I0))[1]["iteration"] == 0


def test_temporary_files_are_exclusive(tmp_path):
    target = tmp_path / "target"
    target.write_text("x")
    os.symlink(target, tmp_path / "link")
    with pytest.raises(FileExistsError):
        files.create_new(str(tmp_path / "link"))
    files.write_atomic(str(tmp_path / "out"), b"data")
    assert (tmp_path / "out").read_bytes() == b"data" and target.read_text() == "x"
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_written_files_follow_the_umask(tmp_path, umask):
    """One rule for every file a save writes (issue 39): 0o666 less the umask, as open() and DCP's shards
    get it; was: the marker 0600 (mkstemp), metadata.json 0644 whatever the umask."""
    previous = os.umask(umask)
    try:
        assert files.current_umask() == umask
        files.write_atomic(str(tmp_path / "marker"), b"4\n")
        with files.create_new(str(tmp_path / "metadata.json")) as f:
            f.write("{}")
        with open(tmp_path / "plain", "w") as f:
            f.write("x")
    finally:
        os.umask(previous)
    modes = {name: os.stat(tmp_path / name).st_mode & 0o777 for name in ("marker", "metadata.json", "plain")}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask), {k: oct(v) for k, v in modes.items()}


# ---- reads stay inside the checkpoint ------------------------------------------------------------


def _record_names(root, name):
    """metadata.json's record naming a file outside: its digest made to match, as an attacker would."""
    meta = json.loads(_meta_path(root).read_text())
    meta["files"][name] = {"size": 6, "sha256": "0" * 64}
    _meta_path(root).write_text(json.dumps(meta))


@pytest.mark.parametrize("name", ["../../outside/secret", "/etc/hostname", "..", "a/../../b"])
def test_record_naming_a_file_outside_is_refused_unread(ckpt, name):
    (ckpt.parent / "outside" / "secret").write_text("secret")
    _record_names(ckpt, name)
    with pytest.raises(paths.CheckpointError, match="outside its directory") as err:
        paths.verified_metadata(str(ckpt / I0))
    assert "bytes" not in str(err.value) and "missing" not in str(err.value)  # says nothing about outside


def test_shard_linked_outside_is_refused(ckpt):
    shard = _shard(ckpt)
    copy = ckpt.parent / "outside" / shard.name
    shutil.copy(shard, copy)  # same bytes: the record's size and sha256 match
    shard.unlink()
    os.symlink(copy, shard)
    with pytest.raises(paths.CheckpointError, match="leads outside"):
        read_full_state(str(ckpt / I0))
    _edit_meta(ckpt, files=None)  # no record: DCP's index names it, refused all the same
    with pytest.raises(safe_dcp.UnsafeCheckpointError, match="leads outside"):
        safe_dcp.read_metadata(str(ckpt / I0))


def test_checkpoint_dir_linked_outside_is_refused(ckpt):
    outside = ckpt.parent / "outside" / I0
    shutil.move(ckpt / I0, outside)
    os.symlink(outside, ckpt / I0)
    with pytest.raises(paths.CheckpointError, match="leads outside"):
        checkpoint_path(str(ckpt))
    with pytest.raises(paths.CheckpointError, match="leads outside"):
        paths.locate(str(ckpt), is_save_dir=False)


# ---- hostile files for the trainer's reader (paths.py, shared by the tools) ----------------------


def test_fifo_marker_does_not_block(ckpt):
    os.remove(ckpt / LATEST)
    os.mkfifo(ckpt / LATEST)
    with bounded(), pytest.raises(paths.CheckpointError, match="regular file"):
        paths.locate(str(ckpt), is_save_dir=True)


def test_deeply_nested_metadata_json_is_one_sentence(ckpt):
    _meta_path(ckpt).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(paths.CheckpointError, match="nested too deeply"):
        paths.read_metadata_json(str(ckpt / I0))


def test_fifo_metadata_json_does_not_block(ckpt):
    os.remove(_meta_path(ckpt))
    os.mkfifo(_meta_path(ckpt))
    with bounded(), pytest.raises(paths.CheckpointError, match="not a regular file"):
        paths.read_metadata_json(str(ckpt / I0))


# ---- the tools read checkpoints as the trainer does ----------------------------------------------


def _forge_size(root, elements):
    """`.metadata` declaring one tensor of `elements` elements, its record rewritten to match."""
    path = root / I0 / ".metadata"
    metadata = safe_dcp._MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    key = next(k for k in metadata.state_dict_metadata if k.endswith("final_ln.weight"))
    entry = metadata.state_dict_metadata[key]
    entry.size = torch.Size([elements])
    entry.chunks[0].sizes = torch.Size([elements])
    path.write_bytes(pickle.dumps(metadata))
    _rewrite_record(root, ".metadata")


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


TOOL_CASES = {
    "distcp truncated": (lambda c: _truncate(_shard(c)), "truncated"),
    "distcp truncated, no record": (lambda c: (_truncate(_shard(c)), _edit_meta(c, files=None)), "which holds"),
    "distcp bit-flipped": (lambda c: _flip(_shard(c)), "does not match the sha256"),
    "metadata.json without config": (lambda c: _edit_meta(c, config=None), "lacks tensor_model_parallel_size/config"),
    "config of 100000 layers": (
        lambda c: _edit_meta(c, config={**_edit_meta(c)["config"], "num_layers": 100_000}),
        "config of 100000 layers but tensors of 2",
    ),
    "config of another width": (
        lambda c: _edit_meta(c, config={**_edit_meta(c)["config"], "ffn_hidden_size": 64}),
        "but its config needs",
    ),
    ".metadata claims 2^40 elements": (lambda c: _forge_size(c, 2**40), "declares tensors of"),
    "marker is a FIFO": (lambda c: (os.remove(c / LATEST), os.mkfifo(c / LATEST)), "regular file"),
    # issue 39: every value checked against the schema before use (was: a TypeError)
    "config num_layers a string": (
        lambda c: _edit_meta(c, config={**_edit_meta(c)["config"], "num_layers": "2"}),
        "metadata.json has config.num_layers = '2', which must be an integer",
    ),
    "iteration null": (lambda c: _edit_meta(c, iteration=None), "lacks iteration/train_state"),
}


@pytest.mark.parametrize("case", sorted(TOOL_CASES))
@pytest.mark.parametrize("tool", ["generate", "convert_checkpoint"])
def test_tools_refuse_damaged_checkpoints(case, tool, ckpt, capsys):
    damage, needle = TOOL_CASES[case]
    damage(ckpt)
    start = time.perf_counter()
    with bounded():
        if tool == "generate":
            code = generate.main(["--load", str(ckpt), "--device", "cpu", "--max-new-tokens", "1"])
        else:
            out = str(ckpt.parent / "out.safetensors")
            code = convert_checkpoint.main(["to-safetensors", "--load", str(ckpt), "--output", out])
    one_sentence(capsys, code, 2, needle, f"{tool}.py")
    assert time.perf_counter() - start < 10


GENERATE_FLAGS = {
    "temperature inf": (["--temperature", "inf"], "--temperature inf is out of range"),
    "temperature nan": (["--temperature", "nan"], "--temperature nan is out of range"),
    "unknown device": (["--device", "tpu"], "--device tpu is not one"),
    "prompt outside the vocabulary": (
        ["--tokenizer-type", "NullTokenizer", "--vocab-size", "63", "--prompt", "1 70"],
        "70",
    ),
}


@pytest.mark.parametrize("case", sorted(GENERATE_FLAGS))
def test_generate_refuses_bad_flags(case, saved, capsys):
    flags, needle = GENERATE_FLAGS[case]
    argv = ["--load", str(saved), "--max-new-tokens", "1"] + (["--device", "cpu"] if "--device" not in flags else [])
    one_sentence(capsys, generate.main(argv + flags), 2, needle, "generate.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_generate_cuda_without_gpu_is_one_sentence(saved, capsys):
    code = generate.main(["--load", str(saved), "--device", "cuda", "--max-new-tokens", "1"])
    one_sentence(capsys, code, 2, "no such CUDA device", "generate.py")


def test_convert_checkpoint_output_exists_needs_overwrite(saved, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    out.write_text("user's file")
    argv = ["to-safetensors", "--load", str(saved), "--output", str(out)]
    one_sentence(capsys, convert_checkpoint.main(argv), 2, "--overwrite", "convert_checkpoint.py")
    assert out.read_text() == "user's file"
    assert convert_checkpoint.main(argv + ["--overwrite"]) == 0
    assert convert_checkpoint.main(["to-safetensors", "--load", str(saved), "--output", str(tmp_path)]) == 2
    capsys.readouterr()
    # from-safetensors into the run it came from: refused, the marker untouched
    argv = ["from-safetensors", "--input", str(out), "--save", str(saved)]
    one_sentence(capsys, convert_checkpoint.main(argv), 2, "already holds a run", "convert_checkpoint.py")


# ---- convert_hf import: the weights against config.json ------------------------------------------


def _hf_dir(model, tmp_path, name="hf", edit_tensors=None, edit_config=None):
    from safetensors.torch import save_file

    cfg, state = model
    tensors, config = to_hf(state, cfg)
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    d = tmp_path / name
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(config))
    return d


def _swap(name):
    return lambda t: t.update({name: t[name].t().contiguous()})


IMPORT_TENSORS = {
    "a [48, 32] stored as [32, 48]": (_swap("model.layers.0.mlp.up_proj.weight"), "has shape [32, 48]"),
    "int weights": (
        lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int64)}),
        "model.norm.weight is torch.int64",
    ),
    "a layer the config lacks": (
        lambda t: t.update({"model.layers.2.input_layernorm.weight": torch.ones(32)}),
        "2 layers but the weights hold 3",
    ),
    "an unknown tensor": (lambda t: t.update({"model.extra.weight": torch.ones(2)}), "model.extra.weight"),
    "a missing tensor": (lambda t: t.pop("model.norm.weight"), "lack model.norm.weight"),
}
IMPORT_CONFIGS = {
    "vocabulary of 10^12": (
        lambda c: c.update(vocab_size=10**12),
        "has shape [64, 32] but config.json needs [1000000000000, 32]",
    ),
    "10^9 layers": (lambda c: c.update(num_hidden_layers=10**9), "1000000000 layers but the weights hold 2"),
    "heads of the wrong kind": (lambda c: c.update(num_attention_heads="4"), "wrong kind"),
}


@pytest.mark.parametrize("case", sorted(IMPORT_TENSORS) + sorted(IMPORT_CONFIGS))
def test_import_checks_every_tensor_against_the_config(case, model, tmp_path, capsys):
    edit_tensors, needle = IMPORT_TENSORS.get(case, (None, None))
    edit_config, needle = IMPORT_CONFIGS.get(case, (None, needle))
    hf = _hf_dir(model, tmp_path, edit_tensors=edit_tensors, edit_config=edit_config)
    with bounded():
        code = convert_hf.main(["import", "--input", str(hf), "--save", str(tmp_path / "c")])
    one_sentence(capsys, code, 2, needle, "convert_hf.py")
    assert not (tmp_path / "c").exists()


def test_import_accepts_buffers_and_a_tied_head_equal_to_the_embedding():
    cfg = GPTConfig(**dict(CFG, untie_embeddings_and_output_weights=False))
    ours = ReferenceGPT(cfg).state_dict()
    tensors, config = to_hf(ours, cfg)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # some exports save both
    state, _ = from_hf(tensors, config)
    assert state.keys() == ours.keys() and all(torch.equal(state[k], ours[k]) for k in ours)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    with pytest.raises(ConversionError, match="lm_head.weight differs"):
        from_hf(tensors, config)


def _header(n):
    return struct.pack("<Q", n)


HOSTILE_FILES = {
    "garbage safetensors": (lambda d: (d / "model.safetensors").write_bytes(os.urandom(64)), "not a readable"),
    "truncated safetensors": (
        lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:200]),
        "not a readable",
    ),
    "huge header": (lambda d: (d / "model.safetensors").write_bytes(_header(2**62) + b"{}"), "not a readable"),
    "config.json a list": (lambda d: (d / "config.json").write_text("[1, 2]"), "not an object"),
    "config.json nested 10^5 deep": (
        lambda d: (d / "config.json").write_text("[" * 100_000 + "]" * 100_000),
        "not a readable config.json",
    ),
    "symlink loop": (lambda d: os.symlink(d / "loop.safetensors", d / "loop.safetensors"), "cannot be read"),
    "FIFO": (lambda d: os.mkfifo(d / "pipe.safetensors"), "not a regular file"),
    "weights linked outside": (
        lambda d: (
            shutil.move(d / "model.safetensors", d.parent / "elsewhere.safetensors"),
            os.symlink(d.parent / "elsewhere.safetensors", d / "model.safetensors"),
        ),
        "leads outside",
    ),
    "two models' shards": (
        lambda d: shutil.copy(d / "model.safetensors", d / "model-00001-of-00002.safetensors"),
        "two models in one directory",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_FILES))
def test_import_refuses_hostile_files(case, model, tmp_path, capsys):
    damage, needle = HOSTILE_FILES[case]
    hf = _hf_dir(model, tmp_path)
    damage(hf)
    with bounded():
        code = convert_hf.main(["import", "--input", str(hf), "--save", str(tmp_path / "c")])
    one_sentence(capsys, code, 2, needle, "convert_hf.py")


def test_import_into_an_existing_run_keeps_its_marker(model, ckpt, tmp_path, capsys):
    (ckpt / LATEST).write_text("7\n")
    hf = _hf_dir(model, tmp_path)
    code = convert_hf.main(["import", "--input", str(hf), "--save", str(ckpt)])
    one_sentence(capsys, code, 2, "already holds a run", "convert_hf.py")
    assert (ckpt / LATEST).read_text() == "7\n"


# ---- convert_hf export: never over the user's files, never two models in one directory -----------


def test_export_refuses_a_model_directory_unless_overwrite(saved, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model-00001-of-00002.safetensors").write_text("another model")
    (out / "tokenizer.json").write_text("{}")
    argv = ["export", "--load", str(saved), "--output", str(out)]
    one_sentence(capsys, convert_hf.main(argv), 2, "--overwrite", "convert_hf.py")
    assert (out / "config.json").read_text() == "{}"
    assert convert_hf.main(argv + ["--overwrite"]) == 0
    capsys.readouterr()
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    tensors, config = convert_hf.read_hf(str(out))
    assert config["num_hidden_layers"] == 2 and "model.norm.weight" in tensors
    (tmp_path / "file").write_text("x")
    argv = ["export", "--load", str(saved), "--output", str(tmp_path / "file")]
    one_sentence(capsys, convert_hf.main(argv), 2, "is a file", "convert_hf.py")


def test_from_safetensors_checks_the_tensors_against_the_config(model, tmp_path, capsys):
    from safetensors.torch import save_file

    cfg, state = model
    meta = {"megatron_sp_config": json.dumps(CFG)}
    bad = dict(state, **{"layers.1.mlp.fc2.weight": state["layers.1.mlp.fc2.weight"].t().contiguous()})
    save_file(bad, str(tmp_path / "bad.safetensors"), metadata=meta)
    argv = ["from-safetensors", "--input", str(tmp_path / "bad.safetensors"), "--save", str(tmp_path / "c")]
    one_sentence(
        capsys, convert_checkpoint.main(argv), 2, "layers.1.mlp.fc2.weight as [48, 32]", "convert_checkpoint.py"
    )
    os.mkfifo(tmp_path / "pipe.safetensors")
    argv = ["from-safetensors", "--input", str(tmp_path / "pipe.safetensors"), "--save", str(tmp_path / "c")]
    with bounded():
        one_sentence(capsys, convert_checkpoint.main(argv), 2, "not a regular file", "convert_checkpoint.py")
    assert not (tmp_path / "c").exists()


def test_huge_index_files_are_refused_unread(ckpt, monkeypatch):
    """A `.metadata` or metadata.json larger than any index is refused by its size, before reading."""
    monkeypatch.setattr(safe_dcp, "METADATA_LIMIT", 1000)
    _edit_meta(ckpt, files=None)
    with pytest.raises(safe_dcp.UnsafeCheckpointError, match="bytes, far more than"):
        safe_dcp.read_metadata(str(ckpt / I0))
    with open(_meta_path(ckpt), "a") as f:
        f.truncate(paths.METADATA_JSON_LIMIT + 1)  # sparse: 64 MiB of nothing
    with pytest.raises(paths.CheckpointError, match="bytes, far more than"):
        paths.read_metadata_json(str(ckpt / I0))
