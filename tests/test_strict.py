"""The strict array of ``npformer.strict`` (book/gpu.md) obeys CuPy 14.2's rules, and the
library runs on it: every model family's training step with the NumPy listings and with the
fused kernels (the CUDA path, each launch checked against its C signature), decoding,
checkpoints, LoRA on a model already on the device, and the command line.

A step on the strict device must equal the same step on the host, with the same kernels:
both run the same NumPy calls and the same CPU kernels in float64, so they agree to a few
roundings (RTOL), except where the device takes its own route (the embedding's scatter by
np.add.at, the norms' dgamma summed by NumPy instead of the kernel's partial sums): ATOL
bounds the rounding noise of a gradient that is zero in exact arithmetic.

Where CuPy is installed (it imports without a GPU), every call the strict array saw is made
again on real ``cupy.ndarray`` objects over host memory, through CuPy's own protocol
methods: none may be refused. CuPy's checks that come after its first access to the device
cannot run without one; those calls count as accepted up to the device.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_device import _records as device_records

import npformer as npf
from npformer import kernels
from npformer.device import device_of, to_device, to_host
from npformer.optim import AdamW, train_step
from npformer.seq2seq import beam_search, greedy_decode, seq2seq_objective
from npformer.strict import CUPY, ArrayMethods, Strict, memory, register, strict
from npformer.train import masked_lm_objective, next_token_objective, reconstruction_objective

register()
ROOT = Path(__file__).resolve().parent.parent
MAX_READS = 2  # the loss and the gradient norm
RTOL, ATOL = 1e-12, 1e-11
KINDS = ["numpy", pytest.param("fused", marks=pytest.mark.skipif(
    not kernels.HAVE_NUMBA, reason="the strict device's kernels are computed by Numba's"))]


def _ids(vocab: int, shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape)


def _records(seed: int) -> np.ndarray:
    """Rows of source then target, as seq2seq_objective reads them (test_device's)."""
    return device_records(3, 8, 5, 11, seed)


GPT = dict(vocab_size=13, block_size=8, n_layer=2, n_head=2, d_model=16, dtype="float64")
LLAMA = dict(vocab_size=17, block_size=8, n_layer=2, n_head=4, n_kv_head=2, d_model=16,
             d_ff=24, top_k=2, dtype="float64")
SEQ2SEQ = dict(src_vocab_size=11, tgt_vocab_size=11, block_size=8, n_layer=2, n_head=2,
               d_model=16, d_ff=24, dropout=0.0, dtype="float64")
# family -> (model(kernels), objective, batch(seed), objective's keywords, batch made on host)
FAMILIES = {
    "gpt": (lambda k: npf.GPT(npf.GPTConfig(**GPT), seed=0, kernels=k),
            next_token_objective, lambda s: _ids(13, (2, 8), s), {}, False),
    "bert": (lambda k: npf.BERT(npf.BERTConfig(vocab_size=30, block_size=8, n_layer=2,
                                               n_head=2, d_model=16, d_ff=32, dropout=0.0,
                                               dtype="float64"), seed=0, kernels=k),
             masked_lm_objective, lambda s: np.random.default_rng(s).integers(5, 29, (2, 8)),
             {"mask_id": 29}, True),
    "encoder": (lambda k: npf.Encoder(npf.EncoderConfig(dtype="float64"), seed=0, kernels=k),
                reconstruction_objective,
                lambda s: _ids(npf.EncoderConfig().vocab_size,
                               (2, npf.EncoderConfig().block_size), s), {}, False),
    "transformer": (lambda k: npf.Transformer(npf.TransformerConfig(**SEQ2SEQ), seed=0,
                                              kernels=k),
                    seq2seq_objective, _records, {}, True),
    "llama_gqa": (lambda k: npf.Llama(npf.LlamaConfig(**LLAMA), seed=0, kernels=k),
                  next_token_objective, lambda s: _ids(17, (2, 8), s), {}, False),
    "moe": (lambda k: npf.Llama(npf.LlamaConfig(**LLAMA, n_expert=4), seed=0, kernels=k),
            next_token_objective, lambda s: _ids(17, (2, 8), s), {}, False),
    "lora": (lambda k: npf.add_lora(npf.GPT(npf.GPTConfig(**GPT), seed=0, kernels=k),
                                    rank=2, alpha=4.0),
             next_token_objective, lambda s: _ids(13, (2, 8), s), {}, False),
    "flash": (lambda k: npf.GPT(npf.GPTConfig(**GPT, attention_kernel="flash"), seed=0,
                                kernels=k),
              next_token_objective, lambda s: _ids(13, (2, 8), s), {}, False),
}


def _train(model, family: str, device: str, steps: int = 2):
    """Two AdamW steps with clipping; (losses and norms, reads per step, parameters)."""
    _, objective, batch, kw, host_batch = FAMILIES[family]
    model.to(device)
    opt = AdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1)
    rng = np.random.default_rng(1)
    out, reads = [], []
    for s in range(steps):
        ids = batch(s) if host_batch else to_device(batch(s), device)
        Strict.reads = 0
        out.append(train_step(model, opt, lambda m, b: objective(m, b, rng, **kw), ids,
                              max_norm=0.5))
        reads.append(Strict.reads)
    params = {n: to_host(p) for n, p, _ in model.named_parameters(include_frozen=True)}
    return out, reads, params


# ----------------------------------------------------------------------------- the rules


def test_the_table_is_cupy_14_2s():
    assert CUPY["cupy"] == "14.2.0"
    assert CUPY["ufuncs"]["exp"]["call"] == ["out", "casting", "dtype"]
    assert set(CUPY["ufuncs"]["add"]["methods"]) >= {"reduce", "accumulate", "at"}
    assert "reduce" not in CUPY["ufuncs"]["maximum"]["methods"]
    assert CUPY["ufuncs"]["erf"]["cupy"] == "cupyx.scipy.special.erf"
    assert "device=" not in CUPY["functions"]["numpy.ones"]["params"]


x0 = np.random.default_rng(0).standard_normal((2, 3))
REFUSED = {  # call -> (the error CuPy raises, a part of its message)
    "np.exp(x, where=m)": (lambda x, m, i: np.exp(x, where=m), TypeError, "Wrong arguments"),
    "np.exp(x, where=True)": (lambda x, m, i: np.exp(x, where=True), TypeError,
                              "Wrong arguments"),
    "np.maximum.reduce(x)": (lambda x, m, i: np.maximum.reduce(x, axis=0),
                             NotImplementedError, "not supported yet"),
    "np.add.at(x, (i, i), 1.0)": (lambda x, m, i: np.add.at(x, (i, i), 1.0), TypeError,
                                  "arrays and scalars"),
    "np.sum(x, where=m)": (lambda x, m, i: np.sum(x, where=m), TypeError, "'where'"),
    "np.ones(3, like=x)": (lambda x, m, i: np.ones(3, like=x), TypeError, "'device'"),
    "np.full(3, 1.0, like=x)": (lambda x, m, i: np.full(3, 1.0, like=x), TypeError,
                                "'device'"),
    "np.ascontiguousarray(x)": (lambda x, m, i: np.ascontiguousarray(x), TypeError,
                                "Implicit conversion"),
    "np.asarray(x)": (lambda x, m, i: np.asarray(x), TypeError, "Implicit conversion"),
    "np.require(x)": (lambda x, m, i: np.require(x), TypeError, "Implicit conversion"),
    "np.block([[x]])": (lambda x, m, i: np.block([[x]]), TypeError, "no implementation"),
    "np.exp([x])": (lambda x, m, i: np.exp([x]), TypeError, "Implicit conversion"),
    "np.divmod(x, 2.0, out=(x, x))": (lambda x, m, i: np.divmod(x, 2.0, out=(x, x)),
                                      ValueError, "exactly one"),
    "x.max(axis=0, initial=0.0)": (lambda x, m, i: x.max(axis=0, initial=0.0), TypeError,
                                   "'initial'"),
    "x + host array": (lambda x, m, i: x + np.ones(3), TypeError, "numpy.ndarray"),
}
ACCEPTED = {  # call -> the same call's NumPy result
    "np.exp(x, out=(y,))": lambda x, m, i: np.exp(x, out=(np.empty_like(x),)),
    "np.add.reduce(x, axis=0)": lambda x, m, i: np.add.reduce(x, axis=0),
    "np.multiply.accumulate(x)": lambda x, m, i: np.multiply.accumulate(x),
    "np.maximum.at(x, i, 0.5)": lambda x, m, i: (np.maximum.at(x, i, 0.5), x)[1],
    "np.sum(x, axis=1, keepdims=True)": lambda x, m, i: np.sum(x, axis=1, keepdims=True),
    "np.zeros(3, like=x)": lambda x, m, i: np.zeros(3, like=x),
    "np.full_like(x, 2.0, shape=(3,))": lambda x, m, i: np.full_like(x, 2.0, shape=(3,)),
    "np.ascontiguousarray(x.T, like=x)": lambda x, m, i: np.ascontiguousarray(x.T, like=x),
    "np.where(m, x, 0.0)": lambda x, m, i: np.where(m, x, 0.0),
    "x > np.float64(0)": lambda x, m, i: x > np.float64(0),
    "x.max(axis=0, keepdims=True)": lambda x, m, i: x.max(axis=0, keepdims=True),
    "np.linalg.norm(x)": lambda x, m, i: np.linalg.norm(x),
}


def _operands():
    return x0.copy(), x0 > 0, np.array([1, 0, 1])


@pytest.mark.parametrize("call", sorted(REFUSED))
def test_a_call_cupy_refuses_is_refused_with_cupys_error(call):
    f, error, words = REFUSED[call]
    with pytest.raises(error, match=words.replace("(", r"\(")):
        f(*strict(_operands()))


@pytest.mark.parametrize("call", sorted(ACCEPTED))
def test_a_call_cupy_takes_gives_numpys_result(call):
    got = ACCEPTED[call](*strict(_operands()))
    np.testing.assert_array_equal(to_host(got), ACCEPTED[call](*_operands()))


def test_the_strict_arrays_attributes_are_cupys():
    """Every public name a strict array answers to is a cupy.ndarray attribute or method, or
    the stand-in's own bookkeeping."""
    own = {"reads", "calls", "trace", "reset", "log", "a"}
    names = {n for n in dir(Strict) if not n.startswith("_")} - own
    assert names <= set(CUPY["methods"]) | set(CUPY["attributes"]), \
        names - set(CUPY["methods"]) - set(CUPY["attributes"])
    x = strict(x0)
    assert x.flags.c_contiguous and not x.T.flags.c_contiguous and x.strides == x0.strides
    with pytest.raises(AttributeError):
        x.flags.writeable = False  # CuPy's flags cannot be set


def test_the_table_is_written_by_its_script_from_cupy(tmp_path):
    pytest.importorskip("cupy", reason="the table is checked against CuPy where it is installed")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "cupy_rules.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------------ every family on the device


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_training_step_on_the_strict_device_equals_the_host_and_reads_twice(family, kind):
    make = FAMILIES[family][0]
    host, _, p0 = _train(make(kind), family, "cpu")
    Strict.reset(log=True)
    dev, reads, p1 = _train(make(kind), family, "strict")
    launches = [c for c in Strict.calls if c.endswith("<<<>>>")]
    Strict.reset()
    np.testing.assert_allclose(np.array(dev), np.array(host), rtol=RTOL)
    for name in p0:
        np.testing.assert_allclose(p1[name], p0[name], rtol=1e-10, atol=ATOL, err_msg=name)
    assert max(reads) <= MAX_READS, f"host reads per step: {reads}"
    if kind == "fused":  # the CUDA path ran: the norms, attention's softmax, AdamW
        want = {"adamw_update", "layernorm_forward" if family in ("gpt", "bert", "encoder",
                "transformer", "lora", "flash") else "rmsnorm_forward"}
        want |= set() if family == "flash" else {"attention_softmax_backward"}
        assert {f"{k}<<<>>>" for k in want} <= set(launches), set(launches)
    else:
        assert not launches


VARIANTS = {  # float32, dropout (a device's own mask stream), dropped expert choices, ...
    "gpt_f32_dropout": (lambda k: npf.GPT(npf.GPTConfig(**{**GPT, "dtype": "float32",
                                                          "dropout": 0.1}), seed=0, kernels=k),
                        "gpt"),
    "llama_f32_tied_dropout": (lambda k: npf.Llama(npf.LlamaConfig(
        **{**LLAMA, "dtype": "float32", "tie_embeddings": True, "dropout": 0.1}), seed=0,
        kernels=k), "llama_gqa"),
    "moe_capacity": (lambda k: npf.Llama(npf.LlamaConfig(**LLAMA, n_expert=4,
                                                         capacity_factor=0.75), seed=0,
                                         kernels=k), "moe"),
    "bert_dropout": (lambda k: npf.BERT(npf.BERTConfig(vocab_size=30, block_size=8, n_layer=2,
                                                       n_head=2, d_model=16, d_ff=32,
                                                       dropout=0.1), seed=0, kernels=k),
                     "bert"),
    "transformer_dropout": (lambda k: npf.Transformer(npf.TransformerConfig(
        **{**SEQ2SEQ, "dropout": 0.1}), seed=0, kernels=k), "transformer"),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_train_on_the_strict_device_reading_twice(variant, kind):
    """Runs that cannot equal the host's (a device draws its own dropout masks) or that the
    families above leave out: each step trains, with a finite loss, and reads twice."""
    make, family = VARIANTS[variant]
    out, reads, params = _train(make(kind), family, "strict")
    assert all(math.isfinite(loss) and math.isfinite(norm) for loss, norm in out)
    assert max(reads) <= MAX_READS, f"host reads per step: {reads}"
    assert all(np.isfinite(p).all() for p in params.values())


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_on_the_strict_device_gives_the_host_tokens(kind):
    gpt, gdev = (npf.GPT(npf.GPTConfig(**GPT), seed=0, kernels=kind) for _ in range(2))
    prompt = _ids(13, (2, 3))
    np.testing.assert_array_equal(npf.generate(gdev.to("strict"), prompt, 4, seed=5),
                                  npf.generate(gpt, prompt, 4, seed=5))
    llama, ldev = (npf.Llama(npf.LlamaConfig(**LLAMA), seed=0, kernels=kind) for _ in range(2))
    np.testing.assert_array_equal(
        npf.generate(ldev.to("strict"), prompt, 4, seed=5, top_k=3, temperature=0.8),
        npf.generate(llama, prompt, 4, seed=5, top_k=3, temperature=0.8))
    ref, dev = (npf.Transformer(npf.TransformerConfig(**SEQ2SEQ), seed=0, kernels=kind)
                for _ in range(2))
    dev.to("strict")
    src = _ids(11, (2, 6))
    (ids0, s0), (ids1, s1) = (beam_search(m, src, beam_size=3, max_new_tokens=5)
                              for m in (ref, dev))
    np.testing.assert_array_equal(ids1, ids0)
    np.testing.assert_allclose(s1, s0, rtol=RTOL)
    np.testing.assert_array_equal(greedy_decode(dev, src, max_new_tokens=5),
                                  greedy_decode(ref, src, max_new_tokens=5))


@pytest.mark.parametrize("kind", KINDS)
def test_lora_added_and_merged_on_the_device_equals_the_host(kind, tmp_path):
    models = {}
    for device in ("cpu", "strict"):
        model = npf.GPT(npf.GPTConfig(**GPT), seed=0, kernels=kind).to(device)
        npf.add_lora(model, rank=2, alpha=4.0)  # on a model already there
        assert all(device_of(p) == device for _, p, _ in model.named_parameters())
        out, reads, _ = _train(model, "gpt", device)
        npf.save(model, tmp_path / f"{device}.safetensors")
        npf.merge_lora(model)
        models[device] = (out, reads, {n: to_host(p) for n, p, _ in model.named_parameters()})
    (host, _, p0), (dev, reads, p1) = models["cpu"], models["strict"]
    np.testing.assert_allclose(np.array(dev), np.array(host), rtol=RTOL)
    assert max(reads) <= MAX_READS
    for name in p0:
        np.testing.assert_allclose(p1[name], p0[name], rtol=1e-10, atol=ATOL, err_msg=name)
    back = npf.load(tmp_path / "strict.safetensors", device="strict")
    assert back.device == "strict" and back.lora is not None
    ids = _ids(13, (2, 8))
    np.testing.assert_allclose(
        to_host(back.forward(to_device(ids, "strict"))),
        npf.load(tmp_path / "cpu.safetensors").forward(ids), rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="fused on the strict device needs Numba")
def test_the_command_line_trains_and_samples_with_fused_kernels_on_a_device(tmp_path):
    from npformer.cli import main
    args = ["train", "gpt", "--data", "pydoc", "--out", str(tmp_path / "run"), "--steps", "3",
            "--n-layer", "1", "--d-model", "16", "--n-head", "2", "--block-size", "16",
            "--batch-size", "2", "--quiet", "--device", "strict", "--kernels", "fused"]
    Strict.reset(log=True)
    assert main(args) == 0
    assert "layernorm_forward<<<>>>" in Strict.calls
    assert main(["sample", str(tmp_path / "run"), "--max-new-tokens", "5", "--device", "strict",
                 "--kernels", "fused"]) == 0
    Strict.reset()


def test_fused_without_numba_is_refused_on_the_host_but_not_on_a_gpu(monkeypatch):
    monkeypatch.setattr(kernels, "HAVE_NUMBA", False)
    model = npf.GPT(npf.GPTConfig(**GPT), seed=0, kernels="numpy")
    with pytest.raises(RuntimeError, match="needs Numba off a GPU"):
        model.use_kernels("fused")
    assert model.use_kernels(None).kernels == "numpy"  # the default: what the host has
    monkeypatch.setattr(type(model), "device", property(lambda self: "cuda"))
    assert model.use_kernels("fused").kernels == "fused"  # CuPy alone launches them
    assert model.use_kernels("numpy").use_kernels(None).kernels == "fused"


# ------------------------------------------------------------------ the checked launches


@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="the checked launch computes with Numba")
def test_a_launch_is_checked_against_the_kernels_c_signature():
    x = strict(np.linspace(-2, 2, 12).reshape(3, 4))
    y = strict(np.zeros((3, 4)))
    launch = kernels.cuda_function("gelu_forward", np.float64, "strict")
    assert launch.params == [("const T*", "x"), ("T*", "y"), ("long long", "n")]
    launch((1,), (256,), (x.reshape(-1), y.reshape(-1), np.int64(12)))
    np.testing.assert_allclose(y.get(), npf.activations.GELU(dtype="float64").forward(x.get()),
                               rtol=1e-15)
    bad = {
        "arguments": (x, y),  # n missing
        "x: expected a strict array of float32": None,
        "n: expected int64 (long long)": (x.reshape(-1), y.reshape(-1), 12),
        "x: expected a C-contiguous array": (x.T, y.T, np.int64(12)),
        "x: expected a strict array of float64": (x.get().reshape(-1), y.reshape(-1),
                                                  np.int64(12)),
    }
    for words, args in bad.items():
        if args is None:  # a float64 array where the module was compiled for float
            f = kernels.cuda_function("gelu_forward", np.float32, "strict")
            args = (x.reshape(-1), y.reshape(-1), np.int64(12))
        else:
            f = launch
        with pytest.raises(TypeError, match=words.replace("(", r"\(").replace(")", r"\)")):
            f((1,), (256,), args)
    rows = kernels.cuda_function("rmsnorm_forward", np.float64, "strict")
    gamma, rrms = strict(np.ones(4)), strict(np.zeros(3))
    args = (x, gamma, np.float64(1e-6), y, rrms, np.int64(4))
    with pytest.raises(TypeError, match="launch: expected grid \\(rows,\\) = \\(3,\\)"):
        rows((1,), (256,), args)
    with pytest.raises(TypeError, match="eps: expected float64 \\(double\\)"):
        rows((3,), (256,), (x, gamma, np.float32(1e-6), y, rrms, np.int64(4)))
    rows((3,), (256,), args)
    np.testing.assert_allclose(rrms.get(), 1 / np.sqrt((x.get() ** 2).mean(-1) + 1e-6))


def test_every_kernel_has_parameters_in_the_cuda_source():
    for name in kernels.CPU_KERNELS:
        if name == "embedding_backward":  # a host kernel only: the GPU uses np.add.at
            continue
        params = kernels.cuda_parameters(name)
        assert params and all(len(p) == 2 for p in params), name
        for ctype, _ in params:
            base = ctype.removeprefix("const ").rstrip("*").strip()
            assert base == "T" or base in kernels.C_SCALARS, (name, ctype)


# -------------------------------------------------------- the same calls on CuPy's arrays


def _exercise() -> list[tuple]:
    """Every family's step (listings, and fused kernels with Numba), decoding, LoRA, saving
    and loading, on the strict device; the calls the strict array received."""
    Strict.reset(trace=True)
    for family, (make, *_) in FAMILIES.items():
        for kind in ("numpy", "fused") if kernels.HAVE_NUMBA else ("numpy",):
            _train(make(kind), family, "strict", steps=1)
    for make, family in VARIANTS.values():
        _train(make("fused" if kernels.HAVE_NUMBA else "numpy"), family, "strict", steps=1)
    gpt = npf.GPT(npf.GPTConfig(**GPT), seed=0).to("strict")
    npf.generate(gpt, _ids(13, (2, 3)), 3, seed=1, top_k=3)
    npf.merge_lora(npf.add_lora(gpt, rank=2, alpha=4.0))
    seq = npf.Transformer(npf.TransformerConfig(**SEQ2SEQ), seed=0).to("strict")
    beam_search(seq, _ids(11, (2, 6)), beam_size=3, max_new_tokens=3)
    greedy_decode(seq, _ids(11, (2, 6)), max_new_tokens=3)
    trace, Strict.trace = Strict.trace, None
    return trace


def _cupy_array(cupy, x):
    """A cupy.ndarray over the memory of strict array x: CuPy's dispatch runs on it up to
    its first access to a device."""
    a = memory(x)
    if any(s < 0 for s in a.strides):
        a = a.copy()
    span = sum((n - 1) * s for n, s in zip(a.shape, a.strides)) + a.itemsize if a.size else 1
    mem = cupy.cuda.UnownedMemory(a.ctypes.data, span, a, device_id=0)
    return cupy.ndarray(a.shape, a.dtype, cupy.cuda.MemoryPointer(mem, 0), strides=a.strides)


def _on_cupy(cupy, obj):
    if isinstance(obj, ArrayMethods):
        return _cupy_array(cupy, obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_cupy(cupy, o) for o in obj)
    if isinstance(obj, dict):
        return {k: _on_cupy(cupy, v) for k, v in obj.items()}
    return obj


def _has_host_array(*objs) -> bool:
    return any(isinstance(o, np.ndarray) or (isinstance(o, (list, tuple, dict)) and
               _has_host_array(*(o.values() if isinstance(o, dict) else o))) for o in objs)


def _reissue(cupy, call) -> str:
    """Make a traced call on CuPy's arrays: "ran", "device" (it got as far as the device), or
    the refusal."""
    kind, target, args, kwargs, receiver = call
    args, kwargs, receiver = (_on_cupy(cupy, o) for o in (args, kwargs, receiver))
    try:
        if kind == "ufunc":
            result = receiver.__array_ufunc__(target[0], target[1], *args, **kwargs)
        elif kind == "function":  # NumPy's types: those that define __array_function__
            types = (cupy.ndarray,) + ((np.ndarray,) * _has_host_array(args, kwargs))
            result = receiver.__array_function__(target, types, args, kwargs)
        elif kind == "method":
            result = getattr(receiver, target)(*args, **kwargs)
        elif kind == "getitem":
            result = receiver[args[0]]
        else:  # setitem
            receiver[args[0]] = args[1]
            result = None
    except Exception as err:  # every exception is an outcome here
        text = f"{type(err).__module__}.{type(err).__name__}: {err}"
        if re.search(r"cuda|nvrtc|cublas|curand|libcu", text, re.I):
            return "device"  # the CUDA runtime, or a CUDA library CuPy loads on first use
        return text
    return "refused: NotImplemented" if result is NotImplemented else "ran"


def _key(call) -> str:
    def skeleton(o):
        if isinstance(o, ArrayMethods):
            return f"a{o.shape}{o.dtype}{'' if o.flags.c_contiguous else 'nc'}"
        if isinstance(o, (list, tuple)):
            return "(" + ",".join(skeleton(v) for v in o) + ")"
        if isinstance(o, dict):
            return "{" + ",".join(f"{k}={skeleton(v)}" for k, v in sorted(o.items())) + "}"
        return type(o).__name__
    kind, target, args, kwargs, _ = call
    name = getattr(target, "__name__", None) or str(target)
    return f"{kind} {name} {skeleton(args)} {skeleton(kwargs)}"


def test_every_call_the_library_makes_is_taken_by_cupys_own_dispatch():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (it needs no GPU here)")
    calls = {}
    for call in _exercise():
        if call[0] != "kernel":  # launches are checked against their C signatures instead
            calls.setdefault(_key(call), call)
    outcomes = {key: _reissue(cupy, call) for key, call in calls.items()}
    refused = {k: v for k, v in outcomes.items() if v not in ("ran", "device")}
    assert not refused, json.dumps(refused, indent=1)
    assert sum(v == "ran" for v in outcomes.values()) > 0 and len(outcomes) > 100


@pytest.mark.parametrize("call", sorted(REFUSED))
def test_what_the_strict_array_refuses_cupy_refuses(call):
    """The same refusals from CuPy's own objects: each raises the same error, or returns
    NotImplemented where NumPy then raises TypeError."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (it needs no GPU here)")
    later = {"x + host array": "CuPy refuses a host operand after its first device access",
             "np.exp(x, where=m)": "CuPy's message prints the mask, which reads the device"}
    if call in later:
        pytest.skip(later[call])
    f, error, _ = REFUSED[call]
    Strict.reset(trace=True)
    with pytest.raises(error):
        f(*strict(_operands()))
    traced, Strict.trace = Strict.trace, None
    if not traced:  # np.asarray and its kind: NumPy asks __array__, which CuPy refuses
        with pytest.raises(TypeError, match="Implicit conversion"):
            np.asarray(_cupy_array(cupy, strict(x0)))
        return
    outcome = _reissue(cupy, traced[-1])
    assert outcome.startswith(f"builtins.{error.__name__}") or (
        error is TypeError and outcome == "refused: NotImplemented"), outcome


def test_the_trace_holds_the_calls_numpy_handed_over():
    Strict.reset(trace=True)
    x = strict(x0)
    np.exp(x, out=(x,))
    np.sum(x, axis=0)
    x.reshape(3, 2)[0]
    trace, Strict.trace = Strict.trace, None
    assert [(c[0], c[1] if c[0] != "ufunc" else c[1][1]) for c in trace] == [
        ("ufunc", "__call__"), ("function", np.sum), ("method", "reshape"), ("getitem", None)]
    assert trace[0][3]["out"][0] is x and trace[1][3] == {"axis": 0}
    assert trace[0][4] is x and trace[2][2] == (3, 2) and trace[3][2] == (0,)
    assert math.isfinite(float(np.sum(x)))
