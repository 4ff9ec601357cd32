"""Merging attention states by their log-sum-exp (FlashInfer's cascade functions).

A state over a set of KV entries is (V, S): V the attention output [num_tokens, num_heads,
head_dim] and S its LSE [num_tokens, num_heads] float32 in base 2. Two states over disjoint
sets merge to the state over their union; an S of -inf contributes nothing."""

from __future__ import annotations

from typing import Any, Optional, Tuple

from . import _arrays as A
from . import _flashkv as _C
from ._flashkv import Error


def merge_state(v_a: Any, s_a: Any, v_b: Any, s_b: Any) -> Tuple[Any, Any]:
    """Merges two states: v_a, v_b [T, H, D], s_a, s_b [T, H] float32 -> (V [T, H, D], S [T, H])."""
    v = A.empty(v_a, tuple(v_a.shape))
    s = A.empty(v_a, tuple(s_a.shape), A.F32)
    s_a, s_b = A.contiguous(s_a), A.contiguous(s_b)
    _C.merge_state(v_a=A.dl(v_a), s_a=A.dl(s_a), v_b=A.dl(v_b), s_b=A.dl(s_b), v_out=A.dl(v), s_out=A.dl(s),
                   stream=A.stream_of(v_a))
    return v, s


def merge_state_in_place(v: Any, s: Any, v_other: Any, s_other: Any, mask: Optional[Any] = None) -> None:
    """v, s <- merge((v, s), (v_other, s_other)) in place. mask (bool [T], optional): only rows
    where it is true are merged."""
    if mask is None:
        _C.merge_state(v_a=A.dl(v), s_a=A.dl(s), v_b=A.dl(v_other), s_b=A.dl(s_other), v_out=A.dl(v),
                       s_out=A.dl(s), stream=A.stream_of(v))
        return
    if len(mask.shape) != 1 or int(mask.shape[0]) != int(v.shape[0]):
        raise Error(f"mask: expected [{int(v.shape[0])}] booleans, got shape {tuple(mask.shape)}")
    merged_v, merged_s = merge_state(v, s, v_other, s_other)
    v[mask] = merged_v[mask]
    s[mask] = merged_s[mask]


def merge_states(v: Any, s: Any) -> Tuple[Any, Any]:
    """Folds N states: v [T, N, H, D], s [T, N, H] float32 -> (V [T, H, D], S [T, H])."""
    if len(v.shape) != 4:
        raise Error(f"v: expected [num_tokens, num_states, num_heads, head_dim], got shape {tuple(v.shape)}")
    t, _, h, d = (int(x) for x in v.shape)
    out_v = A.empty(v, (t, h, d))
    out_s = A.empty(v, (t, h), A.F32)
    s = A.contiguous(s)
    _C.merge_states(v=A.dl(v), s=A.dl(s), v_out=A.dl(out_v), s_out=A.dl(out_s), stream=A.stream_of(v))
    return out_v, out_s
