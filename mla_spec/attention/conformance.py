"""``check_backend``: run an attention backend through every case the engine can hand it and
score it against the torch oracle.

    report = check_backend(MyBackend)          # or a registered name, on the default device
    print(report)                              # one row per case: pass / FAIL / ERROR / unsupported
    assert report.ok

Cases (random scenes of :mod:`mla_spec.attention.synthetic`: shuffled pages, irregular lengths,
an empty prefix, a request without new rows): every forward mode, draft extend both ragged (v1)
and padded (v2), over a bf16 and an FP8 pool (scales 0.37 / 0.61: a misplaced scale shows). A case
passes when ``forward`` returns a finite ``[N, H, 512]`` in the query dtype within ``tol`` of the
oracle (max abs error / the oracle's max abs), fills ``out=``, leaves the pool unchanged, and
``plan`` stores its plan in ``batch.extra[name]``. What ``supports`` declares it cannot run is
"unsupported", not a failure; a backend that cannot run on the device is skipped with its reason.
"""

from dataclasses import dataclass, field

import torch

from mla_spec.attention import create_backend, get_backend_class
from mla_spec.attention.base import AttnPlan, MLABackend, UnsupportedError
from mla_spec.attention.synthetic import make_scene
from mla_spec.attention.torch_ref import TorchMLABackend
from mla_spec.device import default_device
from mla_spec.forward_mode import ForwardMode
from mla_spec.quant.fp8 import FP8_DTYPE

__all__ = ["check_backend", "ConformanceReport", "CaseResult", "CASES"]

_PREFIX = [0, 37, 5, 70]
# label, mode, rows per request (accept lengths for the draft extends)
CASES: tuple[tuple[str, ForwardMode, list[int]], ...] = (
    ("DECODE", ForwardMode.DECODE, [1, 1, 1, 1]),
    ("TARGET_VERIFY", ForwardMode.TARGET_VERIFY, [3, 3, 3, 3]),
    ("DRAFT_EXTEND (v1, ragged)", ForwardMode.DRAFT_EXTEND, [1, 3, 2, 1]),
    ("DRAFT_EXTEND_V2 (padded)", ForwardMode.DRAFT_EXTEND_V2, [1, 3, 2, 1]),
    ("EXTEND", ForwardMode.EXTEND, [5, 0, 7, 1]),
    ("MIXED", ForwardMode.MIXED, [1, 4, 1, 2]),
    ("IDLE", ForwardMode.IDLE, []),
)
_SCALES = {torch.bfloat16: (1.0, 1.0), FP8_DTYPE: (0.37, 0.61)}
_KV_NAMES = {torch.bfloat16: "bfloat16", FP8_DTYPE: "fp8_e4m3"}


@dataclass
class CaseResult:
    case: str
    kv_dtype: str
    status: str  # "pass" | "FAIL" | "ERROR" | "unsupported"
    error: float | None = None  # max |out - oracle| / max |oracle|
    detail: str = ""


@dataclass
class ConformanceReport:
    backend: str
    device: str
    tol: float
    results: list[CaseResult] = field(default_factory=list)
    skipped: str | None = None  # why the backend cannot run on this device at all

    @property
    def ok(self) -> bool:
        """Nothing failed (unsupported cases and a skipped backend are not failures)."""
        return all(r.status in ("pass", "unsupported") for r in self.results)

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if r.status in ("FAIL", "ERROR")]

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    def __str__(self) -> str:
        head = (f"backend {self.backend!r} on {self.device}: tol {self.tol:g} "
                "(max |out - oracle| / max |oracle|)")
        if self.skipped is not None:
            return f"{head}\nskipped: {self.skipped}"
        rows = [f"{'case':27s} {'kv':9s} {'status':11s} {'error':>9s}  detail"]
        for r in self.results:
            err = "" if r.error is None else f"{r.error:9.2e}"
            rows.append(f"{r.case:27s} {r.kv_dtype:9s} {r.status:11s} {err:>9s}  {r.detail}"
                        .rstrip())
        tail = ", ".join(f"{self.count(s)} {s.lower()}"
                         for s in ("pass", "FAIL", "ERROR", "unsupported"))
        return "\n".join([head, *rows, tail])


def check_backend(backend: str | type[MLABackend], device=None, *, tol: float = 2e-2,
                  backend_kwargs: dict | None = None, kv_dtypes=(torch.bfloat16, FP8_DTYPE),
                  num_heads: int = 3, kv_lora_rank: int = 512, qk_rope_head_dim: int = 64,
                  page_size: int = 32, num_draft_tokens: int = 3,
                  seed: int = 0) -> ConformanceReport:
    """Score ``backend`` (a registered name, ``"module:Class"`` or a class) against the oracle
    in every case (see the module docstring); ``backend_kwargs`` go to its constructor."""
    cls = get_backend_class(backend)
    dev = torch.device(device) if device is not None else default_device()
    report = ConformanceReport(cls.name, str(dev), tol)
    for kvd in kv_dtypes:
        k_scale, v_scale = _SCALES.get(kvd, (1.0, 1.0))
        for label, mode, q_lens in CASES:
            sc = make_scene(mode, _PREFIX if q_lens else [], q_lens, num_heads=num_heads,
                            num_draft_tokens=num_draft_tokens, kv_dtype=kvd,
                            q_dtype=torch.bfloat16, page_size=page_size,
                            kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                            k_scale=k_scale, v_scale=v_scale, device=dev, seed=seed)
            kw = dict(num_heads=num_heads, softmax_scale=0.3, kv_pool=sc.pool,
                      req_to_token=sc.req_pool)
            try:
                be = create_backend(cls, **kw, **(backend_kwargs or {}))
            except UnsupportedError as e:
                report.skipped = str(e)
                report.results.clear()
                return report
            res = CaseResult(label, _KV_NAMES.get(kvd, str(kvd)), "pass")
            try:
                _run_case(be, TorchMLABackend(**kw), sc, tol, res)
            except Exception as e:  # noqa: BLE001 - the report says what broke
                res.status, res.detail = "ERROR", f"{type(e).__name__}: {e}"
            report.results.append(res)
    return report


def _run_case(be: MLABackend, oracle: MLABackend, sc, tol: float, res: CaseResult) -> None:
    batch, pool, n = sc.batch, sc.pool, sc.batch.total_q
    why = be.supports(batch.forward_mode, pool.dtype)
    if why is not None:
        res.status, res.detail = "unsupported", why
        return
    problems = []
    plan = be.plan(batch)
    if not isinstance(plan, AttnPlan) or batch.extra.get(be.name) is not plan:
        problems.append(f"plan() must return an AttnPlan stored in batch.extra[{be.name!r}]")
    kv_before = pool.get_kv(sc.layer_id).clone()
    out = be.forward(sc.q_nope, sc.q_pe, sc.layer_id, batch)
    want = (n, be.num_heads, pool.kv_lora_rank)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want \
            or out.dtype != sc.q_nope.dtype:
        got = (tuple(out.shape), out.dtype) if isinstance(out, torch.Tensor) else type(out)
        res.status, res.detail = "FAIL", f"returned {got}, expected {want} {sc.q_nope.dtype}"
        return
    if not torch.equal(pool.get_kv(sc.layer_id), kv_before):
        problems.append("forward wrote the KV pool")
    if n:
        ref = oracle.forward(sc.q_nope, sc.q_pe, sc.layer_id, batch).float()
        if not torch.isfinite(out).all():
            problems.append("non-finite output")
        res.error = float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        if not res.error <= tol:
            problems.append(f"error {res.error:.3g} > tol {tol:g}")
    buf = torch.full_like(sc.q_nope, float("nan"))
    got = be.forward(sc.q_nope, sc.q_pe, sc.layer_id, batch, out=buf)
    if got.data_ptr() != buf.data_ptr() or not torch.allclose(buf.float(), out.float()):
        problems.append("out= was not filled with the result")
    if problems:
        res.status, res.detail = "FAIL", "; ".join(problems)
