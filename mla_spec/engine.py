"""Engine: requests in, tokens out; continuous batching with MTP speculative decoding.

The request path (rank 0, in the caller's process)::

    Engine.generate(prompts)                      text -> token ids (the model's tokenizer.json)
      -> Scheduler.schedule() -> StepPlan         admission, pages, preemption (host only)
      -> send the plan to ranks 1..N-1            (tensor parallel: they execute the same plan)
      -> EagleWorker.execute(plan)                prefill / decode / one speculative round
           -> ModelRunner.prepare + run           ForwardBatch, out_cache_loc, plan(), forward
      -> one device-to-host copy of the results   new tokens, accept lengths
      -> stop checks, metrics (StepRecord)        eos, stop strings, max_new_tokens

Ranks 1..N-1 (:mod:`mla_spec.runtime.tp_worker`, started with
:func:`mla_spec.runtime.workers.spawn_workers`) each build their shard with
:func:`mla_spec.spec.eagle.build_rank` and loop on plans from a queue.
Their collectives (one all-reduce after attention and after the MLP) pair with rank 0's because
every rank runs the same plan through the same code. A dead rank is seen by the watchdog of
``spawn_workers`` within a fraction of a second (and by collective timeouts otherwise) and
surfaces as ``RankFailedError``.

Greedy sampling only. Speculation is lossless: the tokens equal plain greedy decoding.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mla_spec.config import CacheConfig, SpecConfig
from mla_spec.metrics import EngineMetrics, RequestMetrics, StepRecord
from mla_spec.model_runner import ModelRunner
from mla_spec.runtime import tp_worker
from mla_spec.runtime.cuda_graph import attach_graphs
from mla_spec.runtime.workers import RankFailedError
from mla_spec.scheduler import Req, RequestRejectedError, Scheduler, StepPlan
from mla_spec.spec.eagle import EagleWorker, build_rank

__all__ = ["Engine", "Result", "RequestRejectedError"]

logger = logging.getLogger(__name__)


@dataclass
class Result:
    """One finished request."""

    rid: int
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finished_reason: str | None
    error: str | None = None
    accept_lengths: list[int] = field(default_factory=list)
    metrics: RequestMetrics | None = None


class Engine:
    """Serve greedy generation requests over the paged KV cache (see the module docstring).

    Parameters
    ----------
    model_path : a DeepSeek-V3 checkpoint folder (config.json, safetensors, tokenizer.json)
    tp_size : tensor-parallel ranks (GPUs under NCCL, CPU processes under gloo)
    spec : ``SpecConfig`` (default EAGLE 3 steps / topk 1 / 4 draft tokens, v2), or
        ``SpecConfig.off()``
    cache : ``CacheConfig`` (page size, kv dtype: "auto" | "bfloat16" | "fp8_e4m3" ...)
    attention_backend : "auto" | "torch" | "triton" | "flashinfer" | "trtllm"
    device : rank 0's device (default: the GPU when there is one)
    num_pages, max_reqs, max_context_len : KV pool pages, request rows, context columns
    max_running, max_prefill_tokens : batching limits
    cuda_graph : capture DECODE / TARGET_VERIFY / draft decode / DRAFT_EXTEND_V2 (GPU only)
    runner : an already built ``ModelRunner`` (tests with mock models; TP 1 only)
    tokenizer : a ``tokenizers.Tokenizer`` (default: ``model_path/tokenizer.json`` if present)
    stop_token_ids : token ids that end a request (default: the config's eos_token_id)
    timeout_s : collective timeout of the tensor-parallel group (default
        :func:`mla_spec.distributed.default_timeout_s`: 300 s on CPU / gloo, 30 s on NCCL)
    """

    def __init__(self, model_path: str | Path | None = None, tp_size: int = 1,
                 spec: SpecConfig | None = None, cache: CacheConfig | None = None,
                 attention_backend: str = "auto", device=None, *, dtype=None,
                 num_pages: int | None = None, max_reqs: int = 64, max_context_len: int = 2048,
                 max_running: int | None = None, max_prefill_tokens: int = 8192,
                 cuda_graph: bool | None = None, graph_batch_sizes: Sequence[int] | None = None,
                 runner: ModelRunner | None = None, tokenizer=None,
                 stop_token_ids: Sequence[int] | None = None,
                 timeout_s: float | None = None) -> None:
        self.spec = spec if spec is not None else SpecConfig()
        self.cache = cache if cache is not None else CacheConfig()
        self.tp_size = tp_size
        self.model_path = None if model_path is None else Path(model_path)
        self._timeout_s = timeout_s
        self._threads: int | None = None
        self.workers = None
        self._queues: list = []
        if runner is None:
            if model_path is None:
                raise ValueError("Engine needs model_path (a checkpoint folder) or runner=")
        elif tp_size != 1:
            raise ValueError("runner= is for single-rank engines; use model_path for tp_size > 1")
        try:
            if runner is None:
                runner = self._start(Path(model_path), tp_size, attention_backend, device, dtype,
                                     num_pages, max_reqs, max_context_len, cuda_graph,
                                     graph_batch_sizes)
            self._setup(runner, max_running, max_prefill_tokens, tokenizer, model_path,
                        stop_token_ids, cuda_graph, graph_batch_sizes)
        except BaseException:
            # workers already started must not outlive a failed start (nor wait for the GC)
            self.shutdown()
            raise

    # ---- setup -------------------------------------------------------------------------------
    def _setup(self, runner, max_running, max_prefill_tokens, tokenizer, model_path,
               stop_token_ids, cuda_graph, graph_batch_sizes) -> None:
        self.runner = runner
        self.worker = EagleWorker(runner, self.spec)
        self.page_size = runner.page_size
        self.scheduler = Scheduler(
            num_pages=runner.pools["target"].num_pages, page_size=runner.page_size,
            max_reqs=runner.req_to_token.shape[0], max_context_len=runner.req_to_token.shape[1],
            step_rows=self.spec.num_draft_tokens if self.spec.enabled else 1,
            max_running=max_running or 256, max_prefill_tokens=max_prefill_tokens)
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(model_path)
        cfg = runner.config
        eos = getattr(cfg, "eos_token_id", None) if stop_token_ids is None else None
        self.stop_token_ids = tuple(stop_token_ids or ([] if eos is None else [eos]))
        self.metrics = EngineMetrics()
        self._requests: dict[int, Req] = {}
        logger.info("rank 0: shard loaded on %s", runner.device)
        if self._use_graphs(cuda_graph):
            attach_graphs(runner, self.worker, graph_batch_sizes)

    def _use_graphs(self, cuda_graph: bool | None) -> bool:
        on_gpu = self.runner.device.type == "cuda"
        if cuda_graph and not on_gpu:
            raise ValueError("cuda_graph=True needs a CUDA device; this engine runs on "
                             f"{self.runner.device} (use cuda_graph=False)")
        return on_gpu if cuda_graph is None else bool(cuda_graph)

    def _start(self, path, tp_size, backend, device, dtype, num_pages, max_reqs,
               max_context_len, cuda_graph, graph_batch_sizes) -> ModelRunner:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if num_pages is None:
            tokens = min(max_reqs * max_context_len, 1 << 16)
            num_pages = 1 + -(-tokens // self.cache.page_size)
        kw = dict(path=path, cache=self.cache, attention_backend=backend, dtype=dtype,
                  num_pages=num_pages, max_reqs=max_reqs, max_context_len=max_context_len)
        if tp_size > 1:
            if device.type == "cpu":
                # tp_size CPU ranks share the cores: one thread each (restored at shutdown)
                self._threads = torch.get_num_threads()
                torch.set_num_threads(1)
            # queues first: a failed start still closes them
            self._queues = tp_worker.plan_queues(tp_size)
            worker_kw = dict(kw, device=device)
            if device.type == "cuda" and cuda_graph is not False:  # workers capture on GPU
                worker_kw.update(cuda_graph=True, graph_batch_sizes=graph_batch_sizes)
            self.workers = tp_worker.start_tp_workers(
                self._queues, build_rank, (worker_kw, self.spec), timeout_s=self._timeout_s)
            device = self.workers.device
        return ModelRunner.from_checkpoint(**kw, device=device, tp_rank=0, tp_size=tp_size,
                                           with_draft=self.spec.enabled)

    # ---- requests ----------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (tokenizer.json in the model "
                                 "folder or tokenizer=); or pass token ids")
            return list(self.tokenizer.encode(prompt).ids)
        return [int(t) for t in prompt]

    def decode_text(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def add_request(self, prompt: str | Sequence[int], max_new_tokens: int = 64,
                    stop: Sequence[str] | None = None) -> Req:
        """Queue one request; raises :class:`RequestRejectedError` if it can never fit.

        An empty stop string would end every request at its first token: ValueError.
        """
        if stop is not None and any(s == "" for s in stop):
            raise ValueError(f"stop = {list(stop)!r}: an empty stop string matches at once; "
                             "stop strings must be non-empty")
        req = self.scheduler.add(self.encode(prompt), max_new_tokens, stop=tuple(stop or ()),
                                 stop_token_ids=self.stop_token_ids)
        self._requests[req.rid] = req
        return req

    def generate(self, prompts, max_new_tokens: int = 64, stop: Sequence[str] | None = None,
                 progress: bool = False) -> list[Result]:
        """Generate for every prompt (text or token ids); results in prompt order.

        A request that can never fit the KV pool comes back with ``finished_reason="abort"``
        and ``error`` saying what would fit; the others are served normally.
        """
        single = isinstance(prompts, str) or (
            len(prompts) > 0 and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        reqs: list[Req] = []
        for p in prompts:
            try:
                reqs.append(self.add_request(p, max_new_tokens, stop))
            except RequestRejectedError as e:
                logger.warning("request rejected: %s", e)
                reqs.append(Req(-1, self.encode(p), max_new_tokens, finished_reason="abort",
                                error=str(e)))
        bar = _progress(len(reqs)) if progress else None
        t0 = time.perf_counter()
        done = sum(r.finished for r in reqs)
        while self.scheduler.has_work:
            self.step()
            if bar is not None:
                now = sum(r.finished for r in reqs)
                bar.update(now - done)
                done = now
        self.metrics.add_wall_time(time.perf_counter() - t0)
        if bar is not None:
            bar.close()
        return [self._result(r) for r in reqs]

    def _result(self, r: Req) -> Result:
        self._requests.pop(r.rid, None)
        return Result(r.rid, r.prompt_ids, list(r.output_ids), r.text, r.finished_reason,
                      r.error, list(r.metrics.accept_lengths), r.metrics)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> StepRecord | None:
        """Schedule and run one step (prefill, decode, or one speculative round).

        A dead rank raises :class:`~mla_spec.runtime.workers.RankFailedError` after shutting the
        engine down (workers joined, queues closed); a shut-down TP engine refuses further steps.
        """
        if self.tp_size > 1 and self.workers is None:
            raise RankFailedError("this tensor-parallel engine is shut down (or a rank failed): "
                                  "build a new Engine")
        if self.workers is not None and self.workers.failure is not None:
            err = RankFailedError(self.workers.failure)
            self.shutdown()
            raise err
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        reqs = self._plan_reqs(plan)
        logger.debug("step %d: %s, bs %d", len(self.metrics.steps), plan.kind, plan.batch_size)
        t0 = time.perf_counter()
        tp_worker.broadcast_plan(self._queues, plan)
        try:
            out = self.worker.execute(plan)
            # the first host sync of the step: under NCCL an aborted collective surfaces here
            if out.accept is not None:
                predict, accept = out.predict.tolist(), out.accept.tolist()
                new = [p[:a] for p, a in zip(predict, accept)]
            else:
                accept, new = None, [[t] for t in out.next_ids.tolist()]
        except Exception as e:
            if self.tp_size > 1:
                try:
                    self._raise_if_rank_died(e)
                except RankFailedError:
                    self.shutdown()
                    raise
                self.shutdown()  # the other ranks ran the same plan: they are mid-step too
            raise
        seconds = time.perf_counter() - t0
        n_new = 0
        for i, (req, toks) in enumerate(zip(reqs, new)):
            if plan.kind == "prefill" and plan.known_next_ids[i] >= 0:
                continue  # a resumed request: its next token is already in output_ids
            if accept is not None:
                req.metrics.accept_lengths.append(accept[i])
            n_new += self._append(req, toks)
        kind = "prefill" if plan.kind == "prefill" else ("spec" if accept else "decode")
        rec = StepRecord(len(self.metrics.steps), kind, plan.batch_size, seconds, n_new,
                         self.runner.timer.collect(), accept)
        self.metrics.add_step(rec)
        return rec

    def _plan_reqs(self, plan: StepPlan) -> list[Req]:
        by_row = {r.req_pool_idx: r for r in self.scheduler.running}
        return [by_row[i] for i in plan.req_pool_indices]

    def _append(self, req: Req, toks: list[int]) -> int:
        """Commit new tokens of ``req``; finish it on eos / stop string / max_new_tokens.

        A speculative round brings up to ``num_draft_tokens`` tokens at once. They are committed
        as plain decoding would, one at a time: the request ends at the first token that is eos,
        reaches max_new_tokens, or completes a stop string, and the accepted tokens after it are
        dropped, so output ids, token counts and tokens/s equal those of spec off.
        """
        start = len(req.output_ids)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.perf_counter()
        reason = None
        for t in toks:
            if req.remaining <= 0:
                break
            req.output_ids.append(int(t))
            if t in req.stop_token_ids:
                reason = "eos"
                break
        if reason is None and req.remaining <= 0:
            reason = "length"
        n = len(req.output_ids)
        if req.stop:  # the first new token whose text (as plain decoding saw it) has a stop string
            text = req.text
            for end in range(start + 1, n + 1):
                text = self._text(req, end, reason if end == n else None)
                cut = _stop_at(text, req.stop)
                if cut is not None:
                    del req.output_ids[end:]
                    text, reason = text[:cut], "stop"
                    break
            req.text = text
        elif reason is not None:
            req.text = self._text(req, n, reason)
        req.metrics.completion_tokens = len(req.output_ids)
        if reason is not None:
            self.scheduler.finish(req, reason)
        return len(req.output_ids) - start

    def _text(self, req: Req, end: int, reason: str | None) -> str:
        """Text of ``output_ids[:end]`` (without the eos token when ``reason == "eos"``)."""
        return self.decode_text(req.output_ids[: end - 1 if reason == "eos" else end])

    def _raise_if_rank_died(self, err: Exception) -> None:
        if self.workers is None:
            return
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            dead = [r for r, p in enumerate(self.workers.processes, 1) if not p.is_alive()]
            if dead or self.workers.failure:
                msg = self.workers.failure or f"rank {dead[0]} died"
                raise RankFailedError(f"{msg} during a step ({type(err).__name__}: {err})"
                                      ) from err
            time.sleep(0.1)

    # ---- reports -----------------------------------------------------------------------------
    @property
    def avg_accept_length(self) -> float | None:
        return self.metrics.avg_accept_length

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and release their queues (no-op at TP 1).

        Safe to call twice and after a failure: queues to dead workers are not flushed (nobody
        reads them), every queue is closed and its feeder thread joined, so no semaphore or
        thread outlives the engine.
        """
        workers, self.workers = self.workers, None
        if workers is not None and getattr(self, "runner", None) is not None:
            self.runner.release_graphs()  # before the group: see ModelRunner.release_graphs
        tp_worker.stop_tp_workers(workers, self._queues, StepPlan("stop"))
        self._queues = []
        if self._threads is not None:
            torch.set_num_threads(self._threads)
            self._threads = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.shutdown()


def _load_tokenizer(model_path):
    p = None if model_path is None else Path(model_path) / "tokenizer.json"
    if p is None or not p.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(p))


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req")


def _stop_at(text: str, stop: Sequence[str]) -> int | None:
    """Index of the earliest stop string in ``text`` (None when there is none)."""
    cut = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(cut) if cut else None
