"""Engine: requests in, tokens out; continuous batching with MTP speculative decoding.

The request path (rank 0, in the caller's process)::

    Engine.generate(prompts)                      text -> token ids (the model's tokenizer.json)
      -> Scheduler.schedule() -> StepPlan         admission, pages, preemption (host only)
      -> send the plan to ranks 1..N-1            (tensor parallel: they execute the same plan)
      -> EagleWorker.execute(plan)                prefill / decode / one speculative round
           -> ModelRunner.prepare + run           ForwardBatch, out_cache_loc, plan(), forward
      -> one device-to-host copy of the results   new tokens, accept lengths
      -> stop checks, metrics (StepRecord)        eos, stop strings, max_new_tokens

Ranks 1..N-1 are started with :func:`mla_spec.parallel.spawn_workers`; each builds its shard with
:meth:`ModelRunner.from_checkpoint` and loops on plans from a queue. Their collectives (one
all-reduce after attention and after the MLP) pair with rank 0's because every rank runs the same
plan through the same code. A dead rank is seen by the watchdog of ``spawn_workers`` within a
fraction of a second (and by collective timeouts otherwise) and surfaces as ``RankFailedError``.

Greedy sampling only. Speculation is lossless: the tokens equal plain greedy decoding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mla_spec.config import CacheConfig, SpecConfig
from mla_spec.metrics import EngineMetrics, RequestMetrics, StepRecord
from mla_spec.model_runner import ModelRunner
from mla_spec.scheduler import Req, RequestRejectedError, Scheduler, StepPlan
from mla_spec.spec.eagle import EagleWorker

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


def _tp_worker(rank: int, world_size: int, queue, runner_kw: dict, spec: SpecConfig) -> None:
    """Ranks 1..N-1: build this rank's shard, then execute every plan rank 0 sends."""
    from mla_spec.parallel import rank_device, resolve_backend

    device = runner_kw.pop("device")
    if device.type == "cpu":
        torch.set_num_threads(1)  # N CPU ranks share the cores: one thread each
    graphs = runner_kw.pop("cuda_graph", False)
    sizes = runner_kw.pop("graph_batch_sizes", None)
    if device.type == "cuda":
        device = rank_device(rank, resolve_backend("auto", world_size))
    runner = ModelRunner.from_checkpoint(**runner_kw, device=device, tp_rank=rank,
                                         tp_size=world_size, with_draft=spec.enabled)
    worker = EagleWorker(runner, spec)
    if graphs:
        _attach_graphs(runner, worker, {"graph_batch_sizes": sizes})
    while True:
        plan = queue.get()
        worker.execute(plan)
        runner.timer.collect()
        if plan.kind == "stop":
            return


def _attach_graphs(runner, worker, kw) -> None:
    from mla_spec.cuda_graph import CudaGraphRunner

    runner.graphs = CudaGraphRunner.capture(runner, worker, kw.get("graph_batch_sizes"))


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
    timeout_s : collective timeout of the tensor-parallel group
    """

    def __init__(self, model_path: str | Path | None = None, tp_size: int = 1,
                 spec: SpecConfig | None = None, cache: CacheConfig | None = None,
                 attention_backend: str = "auto", device=None, *, dtype=None,
                 num_pages: int | None = None, max_reqs: int = 64, max_context_len: int = 2048,
                 max_running: int | None = None, max_prefill_tokens: int = 8192,
                 cuda_graph: bool | None = None, graph_batch_sizes: Sequence[int] | None = None,
                 runner: ModelRunner | None = None, tokenizer=None,
                 stop_token_ids: Sequence[int] | None = None, timeout_s: float = 30.0) -> None:
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
            runner = self._start(Path(model_path), tp_size, attention_backend, device, dtype,
                                 num_pages, max_reqs, max_context_len, cuda_graph,
                                 graph_batch_sizes)
        elif tp_size != 1:
            raise ValueError("runner= is for single-rank engines; use model_path for tp_size > 1")
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
        if self._use_graphs(cuda_graph):
            _attach_graphs(runner, self.worker, {"graph_batch_sizes": graph_batch_sizes})

    # ---- setup -------------------------------------------------------------------------------
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
            import torch.multiprocessing as mp

            from mla_spec.parallel import spawn_workers

            if device.type == "cpu":
                # tp_size CPU ranks share the cores: one thread each (restored at shutdown)
                self._threads = torch.get_num_threads()
                torch.set_num_threads(1)
            ctx = mp.get_context("spawn")
            self._queues = [ctx.Queue() for _ in range(tp_size - 1)]
            worker_kw = dict(kw, device=device)
            if device.type == "cuda" and cuda_graph is not False:
                worker_kw.update(cuda_graph=True, graph_batch_sizes=graph_batch_sizes)
            # every worker gets its own queue: start them one by one through a shared list
            self.workers = spawn_workers(tp_size, _tp_worker_dispatch,
                                         (self._queues, worker_kw, self.spec),
                                         timeout_s=self._timeout_s, interrupt_main=False)
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
        """Queue one request; raises :class:`RequestRejectedError` if it can never fit."""
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
        """Schedule and run one step (prefill, decode, or one speculative round)."""
        if self.workers is not None:
            self.workers.check()
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        reqs = self._plan_reqs(plan)
        t0 = time.perf_counter()
        for q in self._queues:
            q.put(plan)
        try:
            out = self.worker.execute(plan)
        except RuntimeError as e:
            self._raise_if_rank_died(e)
            raise
        if out.accept is not None:
            predict, accept = out.predict.tolist(), out.accept.tolist()
            new = [p[:a] for p, a in zip(predict, accept)]
        else:
            accept, new = None, [[t] for t in out.next_ids.tolist()]
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
        """Commit new tokens of ``req``; finish it on eos / stop string / max_new_tokens."""
        n = 0
        now = time.perf_counter()
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        reason = None
        for t in toks:
            if req.remaining <= 0:
                break
            req.output_ids.append(int(t))
            n += 1
            if t in req.stop_token_ids:
                reason = "eos"
                break
        req.metrics.completion_tokens = len(req.output_ids)
        if reason is None and req.remaining <= 0:
            reason = "length"
        if req.stop or reason is not None:
            ids = req.output_ids[:-1] if reason == "eos" else req.output_ids
            req.text = self.decode_text(ids)
            cut = [req.text.find(s) for s in req.stop if s in req.text]
            if cut:
                req.text = req.text[: min(cut)]
                reason = "stop"
        if reason is not None:
            self.scheduler.finish(req, reason)
        return n

    def _raise_if_rank_died(self, err: Exception) -> None:
        if self.workers is None:
            return
        from mla_spec.parallel import RankFailedError

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
        """Stop the tensor-parallel workers (no-op at TP 1)."""
        if self.workers is None:
            return
        for q in self._queues:
            q.put(StepPlan("stop"))
        self.workers.shutdown()
        self.workers = None
        for q in self._queues:
            q.close()
            q.join_thread()
        self._queues = []
        if self._threads is not None:
            torch.set_num_threads(self._threads)
            self._threads = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _tp_worker_dispatch(rank: int, world_size: int, queues, runner_kw: dict,
                        spec: SpecConfig) -> None:
    _tp_worker(rank, world_size, queues[rank - 1], dict(runner_kw), spec)


def _load_tokenizer(model_path):
    if model_path is None:
        return None
    p = Path(model_path) / "tokenizer.json"
    if not p.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(p))


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req")
