"""The MTP draft of every spec round equals a teacher-forced dense forward of the MTP layer.

The embedded model serves a few held-out questions (TP 1, KV cache in the model's dtype so only
rounding separates the two paths). Before each round of a request with tokens ``t_0 .. t_L``
(``t_L`` the verified id) the reference runs the dense causal path (``forward_train``, no paged
cache): the target over ``t_0 .. t_{L-1}`` gives ``h_0 .. h_{L-1}``; the MTP layer at column
``p`` takes ``(t_{p+1}, h_p)``, so its column ``L - 1`` gives ``d_1`` and the draft hidden; then
column ``L + i - 1`` takes the served ``d_i`` and the MTP's own output of the column before,
and gives ``d_{i+1}``. Served ``d_1 .. d_ns`` and the draft hidden of ``d_1`` must match.
"""

from __future__ import annotations

import pytest
import torch

from mla_spec.config import CacheConfig, SpecConfig
from mla_spec.engine import Engine
from mla_spec.eval import STOP, build_prompts, heldout_problems
from mla_spec.eval.sweep import EMBEDDED_MODEL

pytestmark = pytest.mark.skipif(not (EMBEDDED_MODEL / "model.safetensors").exists(),
                                reason=f"embedded model missing at {EMBEDDED_MODEL}")

TIE = 1e-3  # a dense top-2 logit gap below this may flip under rounding: not compared


@torch.no_grad()
def dense_drafts(target, mtp, ids: list[int], served: list[int]):
    """``(d_1 .. d_ns, top-2 logit gaps, draft hidden of d_1)`` of the dense teacher-forced path."""
    t = torch.tensor([ids])
    toks, hid = t[:, 1:], target.forward_train(t[:, :-1])
    drafts, gaps, first = [], [], None
    for d in served:
        g = mtp.forward_train(toks, hid)[:, -1:]
        top = torch.topk(mtp.compute_logits(g[0, 0]), 2)
        drafts.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        first = g[0, 0] if first is None else first
        toks, hid = torch.cat([toks, torch.tensor([[d]])], 1), torch.cat([hid, g], 1)
    return drafts, gaps, first


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_draft_tokens_equal_dense_mtp(version, monkeypatch):
    monkeypatch.setenv("MLA_SPEC_TRITON_ON_CPU", "0")  # the torch twins: serving speed on CPU
    eng = Engine(EMBEDDED_MODEL, spec=SpecConfig(version=version),
                 cache=CacheConfig(kv_dtype="auto"), attention_backend="torch", device="cpu",
                 max_reqs=4, max_context_len=512)
    for p in build_prompts(heldout_problems(4), k_shots=1):
        eng.add_request(p, max_new_tokens=48, stop=list(STOP))
    w, target, mtp = eng.worker, eng.runner.target, eng.runner.draft
    compared = tied = 0
    while eng.scheduler.has_work:
        state = [(list(r.all_ids), w.draft_hidden[r.req_pool_idx].clone())
                 for r in eng.scheduler.running if w.draft_hidden is not None]
        if eng.step().kind != "spec":
            continue
        for (ids, hidden), served in zip(state, w.last_drafts.tolist(), strict=True):
            ref, gaps, ref_hidden = dense_drafts(target, mtp, ids, served)
            torch.testing.assert_close(hidden, ref_hidden, rtol=1e-3, atol=1e-3)
            for i, (s, r, gap) in enumerate(zip(served, ref, gaps)):
                if gap < TIE:
                    tied += 1
                    continue
                compared += 1
                assert s == r, f"kv_len {len(ids) - 1}: d_{i + 1} served {s}, dense {r}"
    print(f"{version}: {compared} draft tokens compared, {tied} near-ties skipped")
    assert compared > 100 and tied <= compared // 20, (compared, tied)
