"""Shared helpers for the PyTorch parity tests (the ``oracle`` extra).

Each test module starts with ``torch = pytest.importorskip("torch", reason=REASON)``
so that, without torch, it is reported as skipped with that reason. CI installs
the extra (``torch==2.13.0``, a CPU build) and runs them all.

Both sides compute in float64 on the same weights and inputs, so differences
are pure rounding: outputs and gradients must agree to ``RTOL = 1e-10``
(with ``ATOL = 1e-12`` for entries that are zero up to rounding).
"""

from __future__ import annotations

import math

import numpy as np

REASON = "PyTorch is not installed: pip install -e '.[oracle]' to run the parity tests"
RTOL = 1e-10
ATOL = 1e-12


def t(x: np.ndarray, grad: bool = False):
    """A float64 torch tensor holding a copy of ``x``, optionally requiring grad."""
    import torch

    return torch.tensor(np.array(x), dtype=torch.float64, requires_grad=grad)


def assert_close(actual, expected, name: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Assert ``actual`` (NumPy) equals ``expected`` (NumPy or torch) within the bounds."""
    if hasattr(expected, "detach"):
        expected = expected.detach().numpy()
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=name)


def float32_error(actual, truth) -> float:
    """Largest error of a float32 result against a float64 ``truth``, relative to
    ``max(1, |truth|)``: absolute near zero, relative where float32's spacing grows."""
    actual = np.asarray(actual.detach().numpy() if hasattr(actual, "detach") else actual)
    truth = np.asarray(truth.detach().numpy() if hasattr(truth, "detach") else truth)
    diff = np.abs(actual.astype(np.float64) - truth)
    return float(np.max(diff / np.maximum(1.0, np.abs(truth))))


def assert_float32_no_worse(ours, theirs, truth, name: str, margin: float) -> None:
    """npformer's float32 result is no further from the float64 ``truth`` than PyTorch's
    float32 result is, plus ``margin``.

    PyTorch's float32 kernels differ between CPUs (an AVX-512 machine rounds its GELU
    differently from an AVX2 one), so neither float32 result is the reference: both are
    measured against float64, and only their errors are compared.
    """
    e_ours, e_theirs = float32_error(ours, truth), float32_error(theirs, truth)
    print(f"\n{name}: float32 error npformer {e_ours:.2e}, PyTorch {e_theirs:.2e}")
    assert e_ours <= e_theirs + margin, (
        f"{name}: npformer's float32 error {e_ours:.2e} exceeds PyTorch's {e_theirs:.2e} "
        f"+ margin {margin:.0e}")


def hf_to_ours(name: str) -> str:
    """A GPT-2 parameter's Hugging Face name -> this book's:
    'transformer.h.0.attn.c_attn.weight' -> 'h.0.attn.qkv.W' (the GPT chapter's table)."""
    name = name.removeprefix("transformer.")
    for theirs, ours in (("attn.c_attn", "attn.qkv"), ("attn.c_proj", "attn.proj"),
                         ("mlp.c_fc", "mlp.fc"), ("mlp.c_proj", "mlp.proj")):
        name = name.replace(theirs, ours)
    prefix, leaf = name.rsplit(".", 1)
    if prefix.split(".")[-1].startswith("ln_"):
        return prefix + "." + {"weight": "gamma", "bias": "beta"}[leaf]
    return prefix + "." + {"weight": "W", "bias": "b"}[leaf]


def save_random_gpt2(path, seed: int, *, vocab_size: int, n_positions: int, n_embd: int,
                     n_layer: int, n_head: int, std: float = 0.3):
    """A GPT2LMHeadModel with every parameter drawn N(0, std^2), LayerNorms included, saved
    as safetensors in path; returns path. Needs torch and transformers."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=vocab_size, n_positions=n_positions,
                                  n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    model.save_pretrained(path, safe_serialization=True)
    return path



def torch_gpt_logprobs(P, ids, *, n_layer: int, n_head: int, pos=None, allowed=None):
    """Token log-probabilities (B, T-1) of a GPT (LayerNorm, exact GELU) in torch.

    P maps the library's parameter names to tensors; ids (B, T) are token ids. pos (B, T)
    gives each token's position (default 0 .. T-1) and allowed (B, T, T) which keys each
    query may see (default the causal rule): the packed rows of supervised fine-tuning
    restart both.
    """
    import torch

    ids = torch.as_tensor(ids)
    x_ids, y = ids[:, :-1], ids[:, 1:]
    B, T = x_ids.shape
    where = torch.arange(T) if pos is None else torch.as_tensor(pos)[:, :-1]
    keep = (torch.tril(torch.ones(T, T, dtype=torch.bool)) if allowed is None
            else torch.as_tensor(allowed)[:, None, :T, :T])  # (T, T) or (B, 1, T, T)
    x = P["wte.W"][x_ids] + P["wpe.W"][where]
    d = x.shape[-1]
    dh = d // n_head

    def ln(h, pre):
        mu = h.mean(-1, keepdim=True)
        var = ((h - mu) ** 2).mean(-1, keepdim=True)
        return (h - mu) / torch.sqrt(var + 1e-5) * P[pre + ".gamma"] + P[pre + ".beta"]

    def lin(h, pre):
        return h @ P[pre + ".W"] + P[pre + ".b"]

    for k in range(n_layer):
        pre = f"h.{k}"
        q, kk, v = lin(ln(x, pre + ".ln_1"), pre + ".attn.qkv").split(d, dim=-1)
        q, kk, v = (a.reshape(B, T, n_head, dh).transpose(1, 2) for a in (q, kk, v))
        s = (q @ kk.transpose(-1, -2) / math.sqrt(dh)).masked_fill(~keep, float("-inf"))
        a = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, d)
        x = x + lin(a, pre + ".attn.proj")
        h = torch.nn.functional.gelu(lin(ln(x, pre + ".ln_2"), pre + ".mlp.fc"))
        x = x + lin(h, pre + ".mlp.proj")
    logits = ln(x, "ln_f") @ P["wte.W"].T
    return torch.log_softmax(logits, -1).gather(-1, y[..., None])[..., 0]
