"""Checkpoints: safetensors, no pickle, atomic writes, a fixed registry (book/training.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
import safetensors.numpy

import npformer as npf
import npformer.checkpoint as ckpt_module
from npformer.checkpoint import generator_states


def tiny_gpt(dropout=0.1, seed=0):
    cfg = npf.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=8,
                        dropout=dropout)
    return npf.GPT(cfg, seed=seed)


def trained(model, steps=3):
    """The model after a few AdamW steps, and its optimiser (non-trivial state)."""
    opt = npf.AdamW(model.named_parameters(), lr=1e-2)
    ids = np.random.default_rng(0).integers(0, 11, size=(2, 8))
    for _ in range(steps):
        model.zero_grad()
        _, dlogits = npf.next_token_loss(model.forward(ids), ids)
        model.backward(dlogits)
        opt.step()
    return model, opt


def test_round_trip_is_bit_exact_for_weights_config_step_and_generators(tmp_path):
    model, opt = trained(tiny_gpt())
    data_rng = np.random.default_rng(5)
    data_rng.random(3)
    path = npf.save(model, tmp_path / "m.safetensors", opt, step=3, rng={"data": data_rng},
                    extra={"note": "hello"})
    ck = npf.load_checkpoint(path)
    assert type(ck.model) is npf.GPT and ck.model.config == model.config
    for (name, p, _), (name2, q, _) in zip(model.named_parameters(), ck.model.named_parameters()):
        assert name == name2 and q.dtype == p.dtype and np.array_equal(p, q), name
    assert ck.step == 3 and ck.extra == {"note": "hello"}
    assert ck.rng["data"] == data_rng.bit_generator.state
    assert generator_states(ck.model) == generator_states(model)  # dropout continues
    for key, value in opt.state_dict().items():
        assert np.array_equal(ck.optimizer_state[key], value), key
        assert ck.optimizer_state[key].shape == value.shape, key
    fresh = npf.AdamW(ck.model.named_parameters(), lr=1e-2)
    fresh.load_state_dict(ck.optimizer_state)
    assert fresh.t == 3


def test_load_returns_the_model_and_tied_weights_stay_one_array(tmp_path):
    model = tiny_gpt()
    npf.save(model, tmp_path / "m.safetensors")
    back = npf.load(tmp_path / "m.safetensors")
    assert back.head_weight is back.wte.W
    names = [n for n, _, _ in back.named_parameters()]
    assert names == [n for n, _, _ in model.named_parameters()]
    ids = np.array([[1, 2, 3]])
    model.eval(), back.eval()
    assert np.array_equal(model.forward(ids), back.forward(ids))


def test_dropout_draws_continue_after_loading(tmp_path):
    model = tiny_gpt(dropout=0.5)
    ids = np.array([[1, 2, 3, 4]])
    model.forward(ids)  # advance the dropout generators
    npf.save(model, tmp_path / "m.safetensors")
    back = npf.load(tmp_path / "m.safetensors")
    assert np.array_equal(model.forward(ids), back.forward(ids))


def test_the_file_is_plain_safetensors_with_json_metadata(tmp_path):
    model = tiny_gpt()
    npf.save(model, tmp_path / "m.safetensors", step=7)
    raw = (tmp_path / "m.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])  # JSON, not a pickle
    meta = header["__metadata__"]
    assert meta["format"] == "npformer.checkpoint" and meta["model"] == "GPT"
    assert meta["step"] == "7"
    assert json.loads(meta["config"])["d_model"] == 8
    tensors = safetensors.numpy.load_file(tmp_path / "m.safetensors")
    assert set(tensors) == {"model." + n for n, _, _ in model.named_parameters()}


def test_an_unknown_model_name_is_rejected_and_nothing_is_imported(tmp_path, monkeypatch):
    imported = []
    monkeypatch.setattr(ckpt_module.importlib, "import_module", imported.append)
    for name in ("os", "npformer.cli", "__import__('os').system('true')"):
        meta = {"format": "npformer.checkpoint", "version": "1", "model": name, "step": "0",
                "config": "{}", "model_rng": "{}", "rng": "{}", "extra": "{}"}
        safetensors.numpy.save_file({"model.W": np.zeros(2)}, tmp_path / "x.safetensors",
                                    metadata=meta)
        with pytest.raises(ValueError, match="model: expected a registered model name"):
            npf.load(tmp_path / "x.safetensors")
    assert imported == []


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="path: expected a checkpoint file, got .*nope"):
        npf.load(tmp_path / "nope.safetensors")


def test_a_file_that_is_not_safetensors_is_a_clear_error(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"\x80\x04\x95 a pickle, say")
    with pytest.raises(ValueError, match="path: expected a safetensors checkpoint"):
        npf.load(tmp_path / "x.safetensors")


def test_safetensors_without_the_format_tag_is_rejected(tmp_path):
    safetensors.numpy.save_file({"W": np.zeros(2)}, tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="path: expected an npformer.checkpoint file of "
                                         "version 1 or 2, got format None"):
        npf.load(tmp_path / "x.safetensors")


def test_mismatched_parameters_are_rejected(tmp_path):
    path = npf.save(tiny_gpt(), tmp_path / "m.safetensors")
    tensors = safetensors.numpy.load_file(path)
    with safetensors.safe_open(str(path), framework="np") as f:
        meta = f.metadata()
    tensors["model.ln_f.gamma"] = np.ones(9, dtype=np.float32)
    meta["sha256"] = ckpt_module.tensors_sha256(tensors)  # consistent: the shapes are checked
    safetensors.numpy.save_file(tensors, path, metadata=meta)
    with pytest.raises(ValueError, match=r"model.ln_f.gamma: expected shape \(8,\) and dtype "
                                         r"float32, got \(9,\) and float32"):
        npf.load(path)
    del tensors["model.ln_f.gamma"]
    meta["sha256"] = ckpt_module.tensors_sha256(tensors)
    safetensors.numpy.save_file(tensors, path, metadata=meta)
    with pytest.raises(ValueError, match=r"expected the parameters of GPT, got missing "
                                         r"\['ln_f.gamma'\]"):
        npf.load(path)


def test_save_refuses_non_finite_weights_and_writes_nothing(tmp_path):
    model = tiny_gpt()
    model.ln_f.beta[0] = np.nan
    with pytest.raises(ValueError, match="model: expected finite values, got NaN or inf in "
                                         "'model.ln_f.beta'"):
        npf.save(model, tmp_path / "m.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_write_leaves_the_old_checkpoint_intact(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    npf.save(tiny_gpt(seed=0), path, step=1)
    old = path.read_bytes()

    def dies_half_way(f, data):
        f.write(data[: len(data) // 2])
        raise OSError("No space left on device")

    monkeypatch.setattr(ckpt_module, "_write_bytes", dies_half_way)
    with pytest.raises(OSError, match="No space left"):
        npf.save(tiny_gpt(seed=1), path, step=2)
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]  # no temporary left
    assert npf.load_checkpoint(path).step == 1


def test_a_failing_rename_leaves_the_old_checkpoint_intact(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    npf.save(tiny_gpt(seed=0), path, step=1)
    old = path.read_bytes()

    def no_rename(src, dst):
        raise KeyboardInterrupt  # Ctrl-C at the worst moment

    monkeypatch.setattr(ckpt_module.os, "replace", no_rename)
    with pytest.raises(KeyboardInterrupt):
        npf.save(tiny_gpt(seed=1), path, step=2)
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def test_saving_an_unregistered_class_is_an_error(tmp_path):
    class Mine(npf.Module):
        config = None

    with pytest.raises(ValueError, match="model: expected an instance of a registered model "
                                         "class, got Mine; call register_model"):
        npf.save(Mine(), tmp_path / "m.safetensors")


@dataclass
class LinearConfig:
    d_in: int
    d_out: int


class LinearModel(npf.Module):
    def __init__(self, config: LinearConfig, seed=None):
        super().__init__()
        self.config = config
        self.child("lin", npf.Linear(config.d_in, config.d_out, seed=seed, dtype="float64"))


def test_a_registered_user_model_round_trips(tmp_path):
    npf.register_model("LinearModel", LinearModel, LinearConfig)
    model = LinearModel(LinearConfig(3, 2), seed=4)
    back = npf.load(npf.save(model, tmp_path / "l.safetensors"))
    assert type(back) is LinearModel and back.config == LinearConfig(3, 2)
    assert np.array_equal(back.lin.W, model.lin.W) and back.lin.W.dtype == np.float64


def test_register_model_validates_its_arguments():
    with pytest.raises(ValueError, match="name: expected a name other than the built-in"):
        npf.register_model("GPT", LinearModel, LinearConfig)
    with pytest.raises(ValueError, match="model_cls: expected a Module subclass"):
        npf.register_model("X", dict, LinearConfig)
    with pytest.raises(ValueError, match="config_cls: expected a dataclass"):
        npf.register_model("X", LinearModel, dict)


def test_save_validates_the_step(tmp_path):
    with pytest.raises(ValueError, match="step: expected an integer >= 0, got -1"):
        npf.save(tiny_gpt(), tmp_path / "m.safetensors", step=-1)


# --------------------------------------------------------------------------- damaged files


def _meta_and_tensors(path):
    with safetensors.safe_open(str(path), framework="np") as f:
        return dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}


def _saved_with_optimizer(tmp_path):
    model = tiny_gpt()
    opt = npf.AdamW(model.named_parameters(), lr=1e-3)
    for _, _, g in model.named_parameters():
        g[...] = 0.01
    opt.step()
    return npf.save(model, tmp_path / "m.safetensors", opt, step=1)


def test_a_checkpoint_altered_by_one_byte_is_refused_by_its_checksum(tmp_path):
    path = npf.save(tiny_gpt(), tmp_path / "m.safetensors")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # one bit of the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="do not match the checksum saved with them"):
        npf.load(path)


def test_a_non_numeric_step_in_the_metadata_is_a_named_error(tmp_path):
    path = _saved_with_optimizer(tmp_path)
    meta, tensors = _meta_and_tensors(path)
    meta["step"] = "abc"
    safetensors.numpy.save_file(tensors, path, metadata=meta)
    with pytest.raises(ValueError, match="step: expected an integer >= 0 in the metadata, "
                                         "got 'abc'"):
        npf.load(path)


def test_a_huge_config_size_is_refused_before_anything_is_allocated(tmp_path):
    path = npf.save(tiny_gpt(), tmp_path / "m.safetensors")
    meta, tensors = _meta_and_tensors(path)
    config = json.loads(meta["config"])
    config["vocab_size"] = 100_000_000_000
    meta["config"] = json.dumps(config)
    safetensors.numpy.save_file(tensors, path, metadata=meta)
    with pytest.raises(ValueError, match="config.vocab_size: expected a size that matches "
                                         "the stored tensors .*got 100000000000"):
        npf.load(path)


def test_non_finite_optimizer_state_is_refused_on_load(tmp_path):
    path = _saved_with_optimizer(tmp_path)
    meta, tensors = _meta_and_tensors(path)
    key = next(k for k in tensors if k.startswith("optimizer.") and tensors[k].ndim)
    tensors[key] = tensors[key].copy()
    tensors[key].flat[0] = np.nan
    meta["sha256"] = ckpt_module.tensors_sha256(tensors)  # consistent, but not finite
    safetensors.numpy.save_file(tensors, path, metadata=meta)
    with pytest.raises(ValueError, match=f"optimizer: expected finite values, got NaN or inf "
                                         f"in '{key[len('optimizer.'):]}'; refusing to load"):
        npf.load_checkpoint(path)


def test_saving_into_a_missing_folder_names_the_path_the_user_gave(tmp_path):
    target = tmp_path / "no" / "dir" / "x.safetensors"
    with pytest.raises(FileNotFoundError, match=r"path: expected a file in an existing folder, "
                                                r"got '.*no/dir/x.safetensors'"):
        npf.save(tiny_gpt(), target)


def test_loading_a_folder_says_it_is_a_folder(tmp_path):
    with pytest.raises(ValueError, match="path: expected a checkpoint file, got the folder"):
        npf.load(tmp_path)


def test_temporaries_of_a_killed_save_are_removed_by_the_next_save_and_load(tmp_path):
    path = npf.save(tiny_gpt(), tmp_path / "ckpt.safetensors")
    stale = tmp_path / ".ckpt.safetensors.abc123.tmp"
    stale.write_bytes(path.read_bytes()[:100])  # what kill -9 mid-write leaves
    npf.load(path)
    assert not stale.exists()
    stale.write_bytes(b"half")
    other = tmp_path / ".other.safetensors.x.tmp"  # another file's temporary is not ours
    other.write_bytes(b"x")
    npf.save(tiny_gpt(), path)
    assert not stale.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.safetensors.x.tmp",
                                                          "ckpt.safetensors"]
