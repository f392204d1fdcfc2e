"""EAGLE / NEXTN speculative decoding with DeepSeek's MTP layer as the draft (topk 1, greedy).

Tokens and positions (one request; SGLang's semantics). ``t_0 .. t_{L-1}`` have target KV;
``verified_id = t_L`` was sampled and has none. The MTP layer at position ``p`` combines the
target hidden ``h_p`` with the embedding of ``t_{p+1}`` and predicts ``t_{p+2}``.

Prefill (``kind == "prefill"``)::

    target EXTEND   tokens t_0..t_{n-1} at 0..n-1 (hidden FULL) -> sample t_n = verified_id
    draft  EXTEND   tokens t_1..t_n     at 0..n-1, hidden h_0..h_{n-1} (LAST) -> d1, draft hidden

One speculative round (``kind == "decode"``), ``ns = num_steps``, ``ndt = ns + 1``::

    draft  DECODE x (ns-1)   token d_i at position L+i-1, hidden = the MTP's own last output
                             -> d_2 .. d_ns
    target TARGET_VERIFY     [t_L, d_1 .. d_ns] at L .. L+ndt-1 -> predict[j] = argmax
    greedy accept            a = 1 + #leading j with d_{j+1} == predict[j]   (1..ndt, bonus incl.)
                             new tokens predict[0..a-1]; verified_id = predict[a-1]; L += a
    v1 DRAFT_EXTEND          a rows (positions L..L+a-1, tokens predict[0..a-1], hidden rows
                             0..a-1 of the verify), ragged; the last row gives the next d1
    v2 DRAFT_EXTEND_V2       all ndt rows (fixed shape), keep row a-1 (select_last_rows)

Run eagerly, v1 needs ``a`` on the host to shape its batch (one sync between verify and the next
draft); v2 keeps it on the device, every batch of that region built and planned before it
starts. On a GPU both run each whole round as one CUDA graph (``runtime/step_graph``): there v1's
ragged rows are laid out on the device in the batch's capacity, ``bs * ndt`` rows, the rest
padding requests on the scratch row (``kernels.ops.ragged_extend``). KV rows
written for rejected positions are overwritten by the next round before anything attends to them.
Per-request state (``verified_id``, ``draft_token`` d1, ``draft_hidden``) lives on the device,
indexed by request row. Every TP rank executes the same ``StepPlan``; logits are identical on all
ranks, so the greedy decisions agree without extra communication. A round is three phases,
``round_draft`` / ``round_verify`` / ``round_draft_extend``, which a plan of that kind runs one at a
time on every rank (``mla_spec.pipeline.PipelineStepper``) and ``spec_round`` runs in one go.
"""

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from mla_spec.config import SpecConfig
from mla_spec.distributed import rank_device, resolve_backend
from mla_spec.forward_batch import ForwardBatch
from mla_spec.forward_mode import CaptureHiddenMode
from mla_spec.kernels.ops.step_glue import greedy_accept_update, greedy_accept_update_ref
from mla_spec.model_runner import ModelRunner
from mla_spec.runtime.cuda_graph import attach_graphs

__all__ = ["ROUND_PHASES", "EagleWorker", "RoundState", "StepOutput", "build_rank",
           "no_host_sync"]

ROUND_PHASES = ("draft", "verify", "draft_extend")  # plan kinds: one phase of a round

FULL, LAST = CaptureHiddenMode.FULL, CaptureHiddenMode.LAST

logger = logging.getLogger(__name__)


@contextmanager
def no_host_sync(enabled: bool = True):
    """Make any device-to-host synchronization inside the block raise (CUDA only)."""
    if not enabled:
        yield
        return
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


@dataclass
class StepOutput:
    """Device results of one step (rank 0 copies them to the host once per step)."""

    next_ids: torch.Tensor | None = None  # [bs] prefill / plain decode: the new verified id
    predict: torch.Tensor | None = None  # [bs, ndt] spec round: target argmax per verify row
    accept: torch.Tensor | None = None  # [bs] spec round: accept lengths in 1..ndt


@dataclass
class RoundState:
    """A speculative round between its phases: its plan, drafts, planned batches, results."""

    plan: Any
    rpi: torch.Tensor
    drafts: torch.Tensor  # [bs, ns]
    vb: ForwardBatch  # TARGET_VERIFY
    eb: ForwardBatch | None  # v2: DRAFT_EXTEND_V2, planned before the verify
    predict: torch.Tensor | None = None
    accept: Any = None  # step_glue.Accepted: lengths (int64, int32), last accepted rows
    vh: torch.Tensor | None = None  # the verify's hidden rows


class EagleWorker:
    """Executes step plans on one rank's ``runner``: prefill, decode, or a speculative round."""

    def __init__(self, runner, spec: SpecConfig) -> None:
        if spec.enabled and not runner.has_draft:
            raise ValueError("speculative decoding needs the MTP draft model; the checkpoint "
                             "has none (num_nextn_predict_layers = 0): use spec off")
        self.runner, self.spec = runner, spec
        dev, max_reqs = runner.device, runner.req_to_token.shape[0]
        self.verified_id = torch.zeros(max_reqs, dtype=torch.int64, device=dev)
        self.draft_token = torch.zeros(max_reqs, dtype=torch.int64, device=dev)
        self.draft_hidden: torch.Tensor | None = None  # [max_reqs, hidden], made on first use
        self.last_drafts: torch.Tensor | None = None  # [bs, ns] of the last round (tests)
        self.round: RoundState | None = None  # between the phases of a round
        # v2 on a GPU: raise if anything between verify and the next draft syncs with the host
        self.check_no_sync = False

    @torch.no_grad()
    def execute(self, plan) -> StepOutput | None:
        self.runner.apply_slot_updates(plan.slot_updates)
        if plan.kind == "prefill":
            return self.prefill(plan)
        if plan.kind == "decode":
            return self.spec_round(plan) if self.spec.enabled else self.decode(plan)
        if plan.kind in ROUND_PHASES:
            return getattr(self, f"round_{plan.kind}")(plan)
        if plan.kind == "stop":
            return None
        raise ValueError(f"unknown step kind {plan.kind!r}: expected prefill, decode, stop or "
                         f"a round phase {ROUND_PHASES}")

    def after_step(self) -> None:
        """Collect the step's forward timings (a worker rank; rank 0's ``Engine.step`` does it)."""
        self.runner.timer.collect()

    def close(self) -> None:
        """Drop the CUDA graphs, before the process group goes (``ModelRunner.release_graphs``)."""
        self.runner.release_graphs()

    def _rows(self, plan, rows_per_req) -> list[int]:
        return [r for r, q in zip(plan.req_pool_indices, rows_per_req) for _ in range(q)]

    def _index(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.runner.device)

    def prefill(self, plan) -> StepOutput:
        """Target EXTEND (+ draft EXTEND when speculating); returns the sampled verified ids."""
        run, bs = self.runner, plan.batch_size
        lens = list(plan.seq_lens)
        ids = self._index([t for f in plan.fill_ids for t in f])
        row_req = self._rows(plan, lens)
        batch = ForwardBatch.extend([0] * bs, lens, req_pool_indices=plan.req_pool_indices,
                                    device=run.device,
                                    capture_hidden_mode=FULL if self.spec.enabled else LAST)
        run.prepare("target", batch, row_req)
        known = self._index(plan.known_next_ids)
        rpi = self._index(plan.req_pool_indices)
        dbatch = None
        if self.spec.enabled:
            dbatch = ForwardBatch.extend([0] * bs, lens, req_pool_indices=plan.req_pool_indices,
                                         device=run.device, capture_hidden_mode=LAST)
            run.prepare("draft", dbatch, row_req)
        hidden = run.run("target", batch, ids)
        last = batch.select_last_rows()
        sampled = torch.argmax(run.logits("target", hidden[last]), dim=-1)
        next_ids = torch.where(known >= 0, known, sampled)
        self.verified_id[rpi] = next_ids
        if dbatch is not None:
            draft_ids = torch.empty_like(ids)
            draft_ids[:-1] = ids[1:]  # t_1 .. t_{n-1} per request (row n-1 is overwritten)
            draft_ids[last] = next_ids  # ... then t_n
            dh = run.run("draft", dbatch, draft_ids, hidden)
            self._keep_draft(rpi, dh[dbatch.select_last_rows()])
        return StepOutput(next_ids=next_ids)

    def _keep_draft(self, rpi: torch.Tensor, hidden_last: torch.Tensor) -> None:
        """Store d1 = argmax of the draft logits and the draft hidden of each request row."""
        self.ensure_draft_state(hidden_last.shape[1], hidden_last.dtype)
        self.draft_token[rpi] = torch.argmax(self.runner.logits("draft", hidden_last), dim=-1)
        self.draft_hidden[rpi] = hidden_last

    def decode(self, plan) -> StepOutput:
        run = self.runner
        steps = run.step_graphs
        if steps is not None and steps.can_run("decode", plan.batch_size):
            (next_ids,) = steps.replay("decode", plan)
            return StepOutput(next_ids=next_ids)
        batch = ForwardBatch.decode([L + 1 for L in plan.seq_lens],
                                    req_pool_indices=plan.req_pool_indices, device=run.device)
        run.prepare("target", batch, list(plan.req_pool_indices))
        return StepOutput(next_ids=self.decode_body(batch, self._index(plan.req_pool_indices)))

    def decode_body(self, batch: ForwardBatch, rpi: torch.Tensor) -> torch.Tensor:
        """Target DECODE on a prepared batch, greedy next ids, kept as ``verified_id`` (device
        work only: a step graph captures it)."""
        run = self.runner
        hidden = run.run("target", batch, self.verified_id[rpi])
        next_ids = torch.argmax(run.logits("target", hidden), dim=-1)
        self.verified_id[rpi] = next_ids
        return next_ids

    def draft_batches(self, plan) -> list[ForwardBatch]:
        """The ``num_steps - 1`` draft DECODE batches of a round, prepared (host work)."""
        run, out = self.runner, []
        for i in range(self.spec.num_steps - 1):
            b = ForwardBatch.decode([L + 1 + i for L in plan.seq_lens],
                                    req_pool_indices=plan.req_pool_indices, device=run.device,
                                    capture_hidden_mode=LAST)
            out.append(run.prepare("draft", b, list(plan.req_pool_indices)))
        return out

    def draft(self, batches: list[ForwardBatch], rpi: torch.Tensor) -> torch.Tensor:
        """Draft DECODE forwards from (d1, draft hidden) on prepared batches -> drafts [bs, ns]."""
        run = self.runner
        tok, h = self.draft_token[rpi], self.draft_hidden[rpi]
        drafts = [tok]
        for b in batches:
            h = run.run("draft", b, tok, h)
            tok = torch.argmax(run.logits("draft", h), dim=-1)
            drafts.append(tok)
        return torch.stack(drafts, dim=1)

    def round_body(self, dbs: list[ForwardBatch], vb: ForwardBatch, eb: ForwardBatch,
                   rpi: torch.Tensor, layout=None):
        """A whole round on prepared batches, device work only (a step graph captures it):
        drafts, verify, greedy accept, draft extend -> (drafts, predict, accept). v2: ``eb`` is
        DRAFT_EXTEND_V2; v1: ``eb`` is DRAFT_EXTEND at capacity and ``layout(accept)`` lays out
        its rows and returns (the verify row of each row, each request's last row)."""
        drafts = self.draft(dbs, rpi)
        predict, acc, vh = self.verify(vb, rpi, drafts)
        if layout is None:
            self.draft_extend_v2(eb, rpi, predict, acc, vh)
        else:
            src, last = layout(acc.accept)
            dh = self.runner.run("draft", eb, predict.reshape(-1)[src], vh[src])
            self._keep_draft(rpi, dh[last])
        return drafts, predict, acc.accept

    def ensure_draft_state(self, hidden_size: int, dtype: torch.dtype) -> None:
        """Allocate ``draft_hidden`` now (a step graph must not allocate the state it updates)."""
        if self.draft_hidden is None or self.draft_hidden.shape[1] != hidden_size:
            self.draft_hidden = torch.zeros((self.verified_id.shape[0], hidden_size),
                                            dtype=dtype, device=self.runner.device)

    def spec_round(self, plan) -> StepOutput:
        steps = self.runner.step_graphs
        if steps is not None and steps.can_run("round", plan.batch_size):
            self.last_drafts, predict, accept = steps.replay("round", plan)
            return StepOutput(predict=predict, accept=accept)
        self.round_draft(plan)
        v2_on_gpu = self.spec.version == "v2" and self.runner.device.type == "cuda"
        with no_host_sync(self.check_no_sync and v2_on_gpu):
            r = self.round  # round_verify, one frame less on the decode chain
            r.predict, r.accept, r.vh = self.verify(r.vb, r.rpi, r.drafts)
            return self.round_draft_extend(plan)

    def round_draft(self, plan) -> StepOutput:
        """Draft DECODEs, then the verify (and v2's draft-extend) batches built and planned."""
        run, bs, ndt = self.runner, plan.batch_size, self.spec.num_draft_tokens
        rpi = self._index(plan.req_pool_indices)
        drafts = self.draft(self.draft_batches(plan), rpi)  # [bs, ns]
        self.last_drafts = drafts
        # every batch of the sync-free region is built and planned here, before it
        vb = ForwardBatch.target_verify(plan.seq_lens, ndt, req_pool_indices=plan.req_pool_indices,
                                        device=run.device)
        run.prepare("target", vb, self._rows(plan, [ndt] * bs))
        eb = None
        if self.spec.version == "v2":
            eb = ForwardBatch.draft_extend_v2(plan.seq_lens, ndt, [1] * bs,
                                              req_pool_indices=plan.req_pool_indices,
                                              device=run.device)
            eb.out_cache_loc = vb.out_cache_loc
            run.prepare("draft", eb)
        self.round = RoundState(plan, rpi, drafts, vb, eb)
        return StepOutput()

    def round_verify(self, plan=None) -> StepOutput:
        """TARGET_VERIFY and greedy accept, on the device."""
        r = self.round
        r.predict, r.accept, r.vh = self.verify(r.vb, r.rpi, r.drafts)
        return StepOutput(predict=r.predict, accept=r.accept.accept)

    def round_draft_extend(self, plan=None) -> StepOutput:
        """The draft extend (v1 ragged, v2 fixed shape) that gives the next round's d1."""
        r, self.round = self.round, None
        if r.eb is not None:
            self.draft_extend_v2(r.eb, r.rpi, r.predict, r.accept, r.vh)
        else:
            self.draft_extend_v1(r.plan, r.rpi, r.predict, r.accept.accept, r.vh)
        return StepOutput(predict=r.predict, accept=r.accept.accept)

    def verify(self, vb: ForwardBatch, rpi: torch.Tensor, drafts: torch.Tensor):
        """TARGET_VERIFY + greedy accept -> (predict [bs, ndt], ``Accepted``, verify hidden);
        ``verified_id`` advanced (``step_glue``: one launch on a GPU, the twin on CPU)."""
        run, ndt = self.runner, self.spec.num_draft_tokens
        ids = torch.cat([self.verified_id[rpi][:, None], drafts], dim=1).reshape(-1)
        vh = run.run("target", vb, ids)
        predict = torch.argmax(run.logits("target", vh), dim=-1).view(-1, ndt)
        update = greedy_accept_update if predict.is_cuda else greedy_accept_update_ref
        return predict, update(predict, drafts, rpi, self.verified_id), vh

    def draft_extend_v2(self, eb: ForwardBatch, rpi, predict, acc, vh) -> None:
        """DRAFT_EXTEND_V2: all ndt rows; keep each request's last accepted row ``acc.last_row``
        (= ``eb.select_last_rows()``; the accept lengths stay on the device)."""
        eb.accept_length = acc.accept_i32
        eb.accept_length_cpu = None
        dh = self.runner.run("draft", eb, predict.reshape(-1), vh)
        self._keep_draft(rpi, dh[acc.last_row])

    def draft_extend_v1(self, plan, rpi, predict, accept, vh) -> None:
        """DRAFT_EXTEND (v1): accept rows per request (ragged; the host needs ``accept``)."""
        run, ndt = self.runner, self.spec.num_draft_tokens
        acc = accept.tolist()  # the device-to-host sync v2 avoids
        rows = self._index([b * ndt + j for b, a in enumerate(acc) for j in range(a)])
        eb = ForwardBatch.draft_extend([L + a for L, a in zip(plan.seq_lens, acc)], acc, ndt,
                                       req_pool_indices=plan.req_pool_indices, device=run.device)
        run.prepare("draft", eb, self._rows(plan, acc))
        dh = run.run("draft", eb, predict.reshape(-1)[rows], vh[rows])
        self._keep_draft(rpi, dh[eb.select_last_rows()])


def build_rank(rank: int, world_size: int, runner_kw: dict, spec: SpecConfig) -> EagleWorker:
    """Ranks 1..N-1: this rank's shard and the worker that runs rank 0's plans on it
    (``runner_kw``: ``ModelRunner.from_checkpoint``'s arguments, plus the CUDA-graph options)."""
    kw = dict(runner_kw)
    device = kw.pop("device")
    if device.type == "cpu":
        torch.set_num_threads(1)  # N CPU ranks share the cores: one thread each
    graphs, sizes = kw.pop("cuda_graph", False), kw.pop("graph_batch_sizes", None)
    if device.type == "cuda":
        device = rank_device(rank, resolve_backend("auto", world_size))
    runner = ModelRunner.from_checkpoint(**kw, device=device, tp_rank=rank,
                                         tp_size=world_size, with_draft=spec.enabled)
    logger.info("rank %d: shard loaded on %s", rank, device)
    worker = EagleWorker(runner, spec)
    if graphs:
        attach_graphs(runner, worker, sizes)
    return worker
