"""Engine: requests in, tokens out; continuous batching with MTP speculative decoding.

Rank 0, in the caller's process::

    Engine.generate(prompts)                      text -> token ids (the model's tokenizer.json)
      -> Scheduler.schedule() -> StepPlan         admission, pages, preemption (host only)
      -> send the plan to ranks 1..N-1            (tensor parallel: they execute the same plan)
      -> EagleWorker.execute(plan)                prefill / decode / one speculative round
      -> one device-to-host copy of the results   new tokens, accept lengths
      -> stop checks, metrics (StepRecord)        eos, stop strings, max_new_tokens

Ranks 1..N-1 (:mod:`mla_spec.runtime.tp_worker`) run the same plans, so collectives pair up. A
malformed request is refused when added (:mod:`mla_spec.request_checks`); a step that raises
fails at TP 1 only the requests it can blame (:meth:`Scheduler.step_failed`), at TP > 1 shuts the
engine down with ``RankFailedError`` naming the rank that died or hung (docs/architecture.md).
Greedy only; speculation is lossless.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mla_spec.attention import get_backend_class
from mla_spec.config import CacheConfig, SpecConfig
from mla_spec.distributed import note_progress
from mla_spec.metrics import EngineMetrics, RequestMetrics, StepRecord
from mla_spec.model_runner import ModelRunner
from mla_spec.request_checks import check_max_new_tokens as _check_max_new
from mla_spec.request_checks import check_stop, commit_tokens, prompt_token_ids
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

    ``model_path``: a DeepSeek-V3 checkpoint folder; ``spec``: ``SpecConfig`` (default EAGLE 3
    steps / topk 1 / 4 draft tokens, v2) or ``SpecConfig.off()``; ``attention_backend``: "auto" |
    "torch" | "triton" | "flashinfer" | "trtllm", a registered name, ``"module.path:ClassName"`` or
    an ``MLABackend`` subclass; ``cuda_graph``: capture the decode-side modes (GPU only);
    ``runner``: a prebuilt ``ModelRunner`` (tests; TP 1 only); ``stop_token_ids`` default to the
    config's eos; ``timeout_s``: TP > 1 seconds without progress before the hung rank is named
    (first step of each kind: max(300, 10x)); ``check_finite``: scan for NaN / inf;
    ``deterministic``: batch-invariant forwards (a row at a time through the row-mixing ops, one
    attention kernel and one KV split for every mode), so that at TP 1 speculation (v1, v2)
    gives greedy decoding's tokens exactly, on the GPU too; slower."""

    def __init__(self, model_path: str | Path | None = None, tp_size: int = 1,
                 spec: SpecConfig | None = None, cache: CacheConfig | None = None,
                 attention_backend: str = "auto", device=None, *, dtype=None,
                 num_pages: int | None = None, max_reqs: int = 64, max_context_len: int = 2048,
                 max_running: int | None = None, max_prefill_tokens: int = 8192,
                 cuda_graph: bool | None = None, graph_batch_sizes: Sequence[int] | None = None,
                 runner: ModelRunner | None = None, tokenizer=None,
                 stop_token_ids: Sequence[int] | None = None,
                 timeout_s: float | None = None, check_finite: bool = True,
                 deterministic: bool = False) -> None:
        self.spec = spec if spec is not None else SpecConfig()
        self.cache = cache if cache is not None else CacheConfig()
        self.tp_size = tp_size
        self.model_path = None if model_path is None else Path(model_path)
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s {timeout_s}: must be > 0 seconds")
        self.timeout_s = 30.0 if timeout_s is None else float(timeout_s)
        self.first_step_timeout_s = max(300.0, 10 * self.timeout_s)
        self._warm: set[str] = set()  # step kinds run once (their first step may compile)
        self._check_finite = check_finite
        self.deterministic = bool(deterministic)
        self._threads: int | None = None
        self.workers = None
        self._queues: list = []
        if runner is None:
            if model_path is None:
                raise ValueError("Engine needs model_path (a checkpoint folder) or runner=")
        elif tp_size != 1:
            raise ValueError("runner= is for single-rank engines; use model_path for tp_size > 1")
        elif deterministic and not getattr(runner, "deterministic", False):
            raise ValueError("deterministic=True with runner=: build the runner with "
                             "ModelRunner.from_checkpoint(..., deterministic=True)")
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
        self._vocab_size = getattr(cfg if cfg is not None else runner.target, "vocab_size", None)
        self._max_positions = getattr(cfg, "max_position_embeddings", None)
        self.metrics = EngineMetrics()
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
            tokens = max(min(max_reqs * max_context_len, 1 << 16), max_context_len)
            num_pages = 1 + -(-tokens // self.cache.page_size)
        if backend != "auto":  # the class travels to the ranks (by value from a notebook)
            backend = get_backend_class(backend)
        kw = dict(path=path, cache=self.cache, attention_backend=backend, dtype=dtype,
                  num_pages=num_pages, max_reqs=max_reqs, max_context_len=max_context_len,
                  check_finite=self._check_finite, deterministic=self.deterministic)
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
                self._queues, build_rank, (worker_kw, self.spec),
                timeout_s=self.first_step_timeout_s + 30)  # a backstop: the watchdog acts first
            device = self.workers.device
        return ModelRunner.from_checkpoint(**kw, device=device, tp_rank=0, tp_size=tp_size,
                                           with_draft=self.spec.enabled)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return prompt_token_ids(prompt, self.tokenizer, None, None, 1)  # not checked for range

    def decode_text(self, ids: Sequence[int]) -> str:
        tok = self.tokenizer
        return "" if tok is None else tok.decode(list(ids), skip_special_tokens=True)

    def add_request(self, prompt: str | Sequence[int], max_new_tokens: int = 64,
                    stop: str | Sequence[str] | None = None) -> Req:
        """Queue one request; refused at once if malformed or if it can never fit
        (:class:`RequestRejectedError`, TypeError, ValueError: :mod:`mla_spec.request_checks`)."""
        max_new_tokens, stop = _check_max_new(max_new_tokens), check_stop(stop)
        ids = prompt_token_ids(prompt, self.tokenizer, self._vocab_size, self._max_positions,
                               max_new_tokens)
        return self.scheduler.add(ids, max_new_tokens, stop=stop,
                                  stop_token_ids=self.stop_token_ids)

    def generate(self, prompts, max_new_tokens: int = 64, stop: str | Sequence[str] | None = None,
                 progress: bool = False) -> list[Result]:
        """Generate for every prompt (text or token ids); results in prompt order.

        A refused prompt ends ``"abort"`` with ``error`` saying why; a request whose step
        failed ends ``"error"``. An exception leaving this call leaves none of them queued."""
        max_new_tokens, stop = _check_max_new(max_new_tokens), check_stop(stop)
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        if len(texts) > 1 and hasattr(self.tokenizer, "encode_batch"):  # one call, in parallel
            for i, enc in zip(texts, self.tokenizer.encode_batch([prompts[i] for i in texts])):
                prompts[i] = enc.ids
        reqs: list[Req] = []
        for p in prompts:
            try:
                reqs.append(self.add_request(p, max_new_tokens, stop))
            except RequestRejectedError as e:
                logger.warning("request rejected: %s", e)
                ids = []
                with contextlib.suppress(RequestRejectedError):
                    ids = self.encode(p)
                reqs.append(Req(-1, ids, max_new_tokens, finished_reason="abort", error=str(e)))
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(reqs), desc="requests", unit="req")
        t0 = time.perf_counter()
        done = sum(r.finished for r in reqs)
        try:
            while self.scheduler.has_work:
                self.step()
                if bar is not None:
                    now = sum(r.finished for r in reqs)
                    bar.update(now - done)
                    done = now
        except BaseException as e:
            for r in reqs:
                if not r.finished:
                    self.scheduler.finish(r, "error", f"{type(e).__name__}: {e}")
            raise
        finally:
            if bar is not None:
                bar.close()
        self.metrics.add_wall_time(time.perf_counter() - t0)
        return [self._result(r) for r in reqs]

    def _result(self, r: Req) -> Result:
        return Result(r.rid, r.prompt_ids, list(r.output_ids), r.text, r.finished_reason,
                      r.error, list(r.metrics.accept_lengths), r.metrics)

    def step(self, plan: StepPlan | None = None) -> StepRecord | None:
        """Schedule and run one step (or run ``plan``, as ``mla_spec.pipeline`` does for a phase).
        On failure: at TP 1 see :meth:`Scheduler.step_failed` (an ``"error"`` record); at TP > 1 the
        engine shuts down and raises."""
        if self.tp_size > 1 and self.workers is None:
            raise RankFailedError("this tensor-parallel engine is shut down (or a rank failed): "
                                  "build a new Engine")
        if self.workers is not None and self.workers.failure is not None:
            err = RankFailedError(self.workers.failure)
            self.shutdown()
            raise err
        plan = self.scheduler.schedule() if plan is None else plan
        if plan is None:
            return None
        reqs = self._plan_reqs(plan)
        logger.debug("step %d: %s, bs %d", len(self.metrics.steps), plan.kind, plan.batch_size)
        t0 = time.perf_counter()
        try:
            accept, new = self._run_plan(plan)
        except BaseException as e:
            if self.tp_size > 1:
                raise  # _run_plan shut the engine down
            msg = f"{plan.kind} step failed: {type(e).__name__}: {e}"
            with contextlib.suppress(Exception):
                self.runner.timer.collect()  # drop the failed step's forward records
            if not isinstance(e, Exception):  # Ctrl-C: its requests are recomputed later
                self.scheduler.step_failed(reqs, None)
                raise
            logger.warning("%s (requests %s)", msg, [r.rid for r in reqs])
            self.scheduler.step_failed(reqs, msg)
            return StepRecord(len(self.metrics.steps), "error", plan.batch_size,
                              time.perf_counter() - t0, 0)
        seconds = time.perf_counter() - t0
        self._warm.add(plan.kind)
        n_new = 0
        for i, (req, toks) in enumerate(zip(reqs, new)):
            req.suspect = req.suspect and plan.kind == "prefill"  # cleared by a decode step
            if plan.kind == "prefill" and plan.known_next_ids[i] >= 0:
                continue  # a resumed request: its next token is already in output_ids
            if accept is not None:
                req.metrics.accept_lengths.append(accept[i])
            n, reason = commit_tokens(req, toks, self.decode_text)
            n_new += n
            if reason is not None:
                self.scheduler.finish(req, reason)
        kind = "prefill" if plan.kind == "prefill" else ("spec" if accept else "decode")
        rec = StepRecord(len(self.metrics.steps), kind, plan.batch_size, seconds, n_new,
                         self.runner.timer.collect(), accept)
        self.metrics.add_step(rec)
        return rec

    def _run_plan(self, plan: StepPlan) -> tuple[list[int] | None, list[list[int]]]:
        """Execute ``plan`` on every rank -> (accept lengths or None, new tokens per request)."""
        workers = self.workers
        if workers is not None:  # the watchdog names a rank that hangs in this step
            workers.arm(self.timeout_s if plan.kind in self._warm else self.first_step_timeout_s)
            note_progress()
        tp_worker.broadcast_plan(self._queues, plan)
        try:
            out = self.worker.execute(plan)
            # the first host sync of the step: under NCCL an aborted collective surfaces here
            if out.accept is not None:
                predict, accept = out.predict.tolist(), out.accept.tolist()
                return accept, [p[:a] for p, a in zip(predict, accept)]
            return None, [[t] for t in out.next_ids.tolist()]
        except BaseException as e:
            if workers is not None:  # the other ranks are mid-step: shut down, name the culprit
                cause = workers.blame(e)
                self.shutdown()
                if cause is not None:
                    raise RankFailedError(f"{cause} (during a step; then rank 0 saw "
                                          f"{type(e).__name__})") from e
            raise
        finally:
            if workers is not None:
                workers.disarm()

    def _plan_reqs(self, plan: StepPlan) -> list[Req]:
        by_row = {r.req_pool_idx: r for r in self.scheduler.running}
        return [by_row[i] for i in plan.req_pool_indices]

    @property
    def avg_accept_length(self) -> float | None:
        return self.metrics.avg_accept_length

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and release their queues (no-op at TP 1). Safe twice and
        after a failure: queues to dead workers are closed unflushed, feeder threads joined."""
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

