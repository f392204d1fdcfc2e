"""The paged MLA kernels' measured per-shape winners (names of ``mla_decode_tiles.PAGED_VARIANTS``).

``PAGED_DEFAULTS`` maps a shape class ``(kv dtype, rows per request, batch)`` to the winner of
the last H200 sweep (edit it after a sweep: the sweep's "best" column prints ``NAME/spN``
strings of exactly this form, and it prints a suggested table); ``PAGED_CONTEXT_DEFAULTS``
overrides a class per context length where the winner changes with it. Every entry cites the
measurement it comes from (``docs/bench_mla.md``); ``mla_decode_tiles.paged_choice`` reads
them, and ``tests/kernels/test_mla_decode_paged.py`` checks that every name exists.
"""

from __future__ import annotations

__all__ = ["PAGED_CONTEXT_DEFAULTS", "PAGED_DEFAULTS"]

# Per-shape winners: (kv class, rows class, batch class) -> "NAME" or "NAME/spN" (``spN`` pins
# the split count; omit it to keep the cost model, which adapts to the context length), or
# alternatives "A|B": the first that runs on the device and call wins (``paged_choice``).
# kv: "bf16" (bf16 / fp16 caches) | "fp8"; rows (= q_len * H per request): "r32" (<= 32) |
# "r128" (<= 128) | "big"; batch: "b1" (bs <= 2) | "b48" (<= 48) | "big".
# Values: winners of the H200 sweeps (docs/bench_mla.md, v2 and v3).
PAGED_DEFAULTS: dict[tuple[str, str, str], str] = {
    **{("bf16", "r32", bc): "G" for bc in ("b1", "b48", "big")},
    **{("bf16", rc, bc): "C" for rc in ("r128", "big") for bc in ("b1", "b48", "big")},
    **{("fp8", rc, bc): "CF" for rc in ("r32", "r128", "big") for bc in ("b1", "b48", "big")},
    # H200 sweep of 2026-11-29 (docs/benchmarks.md): the only shape classes whose winner changed
    ("fp8", "r32", "b1"): "G4",  # 14.9 vs 19.3 µs at bs 1, ctx 4k, in a CUDA graph
    # second H200 sweep (swap AB, docs/bench_mla.md v4): bs 1 ctx 4k in a graph 12.1 vs 14.1 µs
    # (G, still faster at ctx 32k: 31.2 vs 34.6); bs 128 ctx 8k 511 vs 581 µs, bs 64 ctx 32k
    # 961 vs 1066 µs
    ("bf16", "r32", "b1"): "S16",
    # ninth session, the warpgroup-MMA CUDA kernel (docs/bench_mla.md v8; graph µs, FlashInfer
    # in the same run): bs 32 ctx 4k W/sp4 61.8 vs S16/sp2 107.6 (FlashInfer 49.0; 51.4 vs
    # 48.7 with the sized combine); bs 128 ctx 8k 303.8 vs S32w4 514 (281-289); bs 64 ctx 32k
    # W/sp2 627.7 vs 984.7 (658.0). Where W cannot run (not sm_90, no nvcc, ragged rows,
    # fp16), the Triton variant after the "|".
    ("bf16", "r32", "b48"): "W|S16",  # S16: bs 32 ctx 4k 152.7 vs G 175.6 µs (eager)
    ("bf16", "r32", "big"): "W|S32w4",
    # 128 rows (H 128 q 1; H 32 q 4 = TARGET_VERIFY at TP4): W64, two 64-row CTAs per request
    # (C: one per 64 rows too, but Triton's per-tile cost). bs 128 ctx 8k H 128: 730 vs C 1105
    # (FlashInfer 574); H 32 q 4: 762 vs 1128 (567); bs 32 ctx 4k q 4: W64/sp2 103.6 vs C/sp2
    # 152.8 (75.1); bs 64 ctx 32k H 128: 1466 vs 2160 (1192)
    # twelfth session: WR (the query rows on the MMA's M side, P V from registers; W64 runs
    # wherever WR does, so it is no alternative: it stays a variant for comparisons; docs/
    # bench_mla.md v10, FlashInfer in the same run): bs 128 ctx 8k H 128 612-635 vs W64 741-753
    # (FlashInfer 547-557), H 32 q 4 632 vs 748 (565); bs 32 ctx 4k WR/sp2 89.4-90.7 vs W64
    # 102-105 (75); bs 64 ctx 32k 1240-1279 vs 1474-1521 (1184-1208)
    ("bf16", "r128", "b48"): "WR|C",
    ("bf16", "r128", "big"): "WR|C",
    # third H200 sweep (sixth session, bs 1 at ctx 1k / 4k / 32k in a graph, after the split
    # model's combine term): S16 within 1.09x of the best over the class (V2: 1.25x), C 1.00x
    ("bf16", "r128", "b1"): "S16",
    ("fp8", "big", "b1"): "C",
    # tenth session, the wgmma kernels on an e4m3 cache (widened to fp16 in shared memory;
    # docs/bench_mla.md v9, graph µs, FlashInfer's fp8 in the same run): bs 128 ctx 8k W 353
    # vs CF 703 (886.7); bs 64 ctx 32k W/sp2 695 vs 1363 (1826); 128 rows bs 128 ctx 8k W64
    # 855-858 vs 1364-1369 (1742-1779)
    # thirteenth session: WE2, the queries rounded to e4m3 per row (as TRT-LLM-gen's FP8 path
    # does) for e4m3 Q K MMAs, V fed to wgmma from registers, the warpgroups taking turns on
    # whole tiles (docs/bench_mla.md v11; graph µs, FlashInfer's bf16 in the same run): bs 128
    # ctx 8k 189.3 vs W 335.1 (FlashInfer bf16 288.0, fp8 876.4); bs 64 ctx 32k 420.0 vs
    # 661.6 (654.0); bs 32 ctx 4k 41.5 vs 54.0 (49.7). paged_choice(e4m3_queries=False) keeps
    # the queries in fp16 (W).
    # seventeenth session: WE8, WE2 with P V as e4m3 MMAs too (P rounded to e4m3 as
    # TRT-LLM-gen's FP8 path does; docs/bench_mla.md v15, graph µs, FlashInfer in the same run):
    # bs 32 ctx 4k 31.40 vs WE2 34.22 (FlashInfer bf16 48.72: 1.55x); bs 128 ctx 8k 153.2 vs
    # 177.1 (282.1); bs 64 ctx 32k 294.9 vs 389.3 (635.0); bs 128 ctx 1k 29.45 vs 31.39.
    # paged_choice(e4m3_probs=False) keeps P in fp16 (WE2).
    ("fp8", "r32", "b48"): "WE8|WE2|W|CF",
    ("fp8", "r32", "big"): "WE8|WE2|W|CF",
    # twelfth session: WR on an e4m3 cache (both warpgroups widen a tile together; v10): bs
    # 128 ctx 8k H 128 653.9 vs W64 846.3 (FlashInfer fp8 1760.6); H 32 q 4 bs 32 ctx 4k
    # WR/sp2 96.8 vs 125.0 (251.9); bs 64 ctx 32k 1278.2 vs 1611.1 (3586.5)
    ("fp8", "r128", "b48"): "WR|CF",
    ("fp8", "r128", "big"): "WR|CF",
    # twelfth session: more than 128 rows (H 128 q 4, TARGET_VERIFY without tensor
    # parallelism) run W64 with one 64-row block per 64 rows, each streaming the request's KV
    # (the blocks of one request run side by side, so the re-reads mostly hit L2; docs/
    # bench_mla.md v10, graph µs, FlashInfer in the same run): bf16 bs 32 ctx 4k 361-380 vs C
    # 545 (FlashInfer 239), bs 128 ctx 8k 2879 vs 4171 (2104); fp8 bs 32 ctx 4k 441-444 vs CF
    # 687-694 (FlashInfer fp8 909-919), bs 128 ctx 8k 3378 vs 5280 (7116)
    # and WR: bf16 bs 32 ctx 4k 295-299 vs W64 366-368 (FlashInfer 241-246), bs 128
    # ctx 8k 2320 vs 2847 (2049)
    # (fp8 bs 32 ctx 4k: WR 342.0 vs W64 443.5, FlashInfer fp8 916.7)
    **{(kv, "big", bc): alts for kv, alts in (("bf16", "WR|C"), ("fp8", "WR|CF"))
       for bc in ("b48", "big")},
}


# Per-context winners where they differ from the class's: (kv, rows, batch, context) -> choice;
# context: "c2k" (longest KV <= 2048) | "c8k" (<= 8192) | "long". Seventh-session H200 sweeps,
# two runs (docs/bench_mla.md v6; batch 1 in a graph, 128 rows = TARGET_VERIFY at H 32 / DECODE
# at H 128):
PAGED_CONTEXT_DEFAULTS: dict[tuple[str, str, str, str], str] = {
    # 32k: CF 61.9 / 62.5 vs S16 91.8 / 91.1 µs (S16's 8 row blocks each re-read the KV from
    # L2); ninth session: W64/sp64 41.2 vs CF 51.8 (FlashInfer 39.8)
    ("bf16", "r128", "b1", "long"): "WR/sp64|CF",  # twelfth: WR 36.7-36.8 (FI 39.8-40.0)
    # sixteenth session, once WR released a stage before its next Q K (docs/bench_mla.md v14):
    # 4k WR/sp32 16.48-16.50 vs S16/sp16 17.43-17.77 (FlashInfer 19.7-20.2); at 1k S16 stays
    # (9.21 vs WR/sp16 13.27)
    ("bf16", "r128", "b1", "c8k"): "WR/sp32|S16",
    ("fp8", "r128", "b1", "c2k"): "G4",    # 1k: 14.1 vs V2 16.7, CF 20.4 µs
    # 4k: 26.2 / 26.4 vs CF 28.6 / 28.5 µs (32k: CF, 70); tenth session: W64/sp64 21.4 vs G4
    # 25.2 (FlashInfer fp8 43.6)
    ("fp8", "r128", "b1", "c8k"): "WR/sp64|G4",  # twelfth: 4k 18.5 vs W64 19.9
    # eighth session, after the one-round combine (docs/bench_mla.md v7): 64 one-tile splits at
    # 4k, 9.57 vs 11.41 µs at the model's 32 (at 1k the model's 16 stays: 7.44 vs 8.20 at 64)
    ("bf16", "r32", "b1", "c8k"): "S16/sp64",
    # the CUDA kernel's 128 splits at 32k: 28.8 vs S16/sp64 31.0 µs (its split phase 25.0-25.5
    # µs in three runs; the one-round combine of 128 splits measured once); ninth session: the
    # wgmma kernel W/sp128 24.8 vs K 28.2 at 32k (16k: 19.6 vs 18.5)
    ("bf16", "r32", "b1", "long"): "W/sp128|K/sp128",
    # tenth session, an e4m3 cache at 32k (docs/bench_mla.md v9): W/sp128 23.2 vs G4/sp64 43.8
    # (FlashInfer fp8 76.4, bf16 48.2); 128 rows: W64/sp64 44.9 vs CF 60.2 (87.4). The
    # widening of tile i + 1 overlaps tile i's P V: bs 128 ctx 8k 356.6 -> 338.8 µs
    # seventeenth session (v15): WE8/sp128 18.1-18.8 vs W/sp128 22.50 (FlashInfer fp8 76.6);
    # at 4k WE8/sp32 12.2 vs G4/sp32 13.9 (FlashInfer fp8 32.5; at 2k and less G4 stays, not
    # measured)
    ("fp8", "r32", "b1", "long"): "WE8/sp128|WE2/sp128|W/sp128|G4",
    ("fp8", "r32", "b1", "c8k"): "WE8/sp32|G4",
    ("fp8", "r128", "b1", "long"): "WR/sp64|CF",  # twelfth: H 32 q 4 36.8 vs 44.4
    # twelfth session, 512 rows at batch 1 (v10): 32k WR/sp16 101.3 vs W64/sp16 120.3-122.4
    # vs C/sp16 148.1 (FlashInfer 73.9-74.6); at 4k C stays (31.8-32.3 vs WR/sp16 41.9, W64/sp8
    # 39.2-39.6; fp8 CF 37.4 vs W64 44.9)
    ("bf16", "big", "b1", "long"): "WR/sp16|C",
    # thirteenth session (v11), 512 rows at batch 1 ctx 4k: bf16 WR/sp16 28.8 vs C 32.0
    # (FlashInfer 25.4), fp8 30.3 vs C 37.3 (FlashInfer fp8 52.9); fourteenth (v12), with bf16
    # partials and the combine's new shapes: bf16 24.0, fp8 25.9 (mla_decode_wgmma.PART_BF16)
    ("bf16", "big", "b1", "c8k"): "WR/sp16|C",
    ("fp8", "big", "b1", "c8k"): "WR/sp16|C",
    # nineteenth session (v17), 512 rows at batch 1 on an e4m3 cache, which had fallen to the
    # class's CF: 32k WR/sp16 90.3 vs CF/sp16 175.4 µs (WR/sp32 102.8; FlashInfer fp8 241.9),
    # 16k 51.2 vs 95.5
    ("fp8", "big", "b1", "long"): "WR/sp16|CF",
    # nineteenth session (v17), contexts up to 2k at batch 1 (the cost model's splits: 16 at 1k
    # and 2k, 1 below 512), FlashInfer in the same run: 512 rows bf16 1k WR/sp16 13.2 vs C 17.5
    # (20.8), 2k 15.2 vs 21.3 (22.3); fp8 1k 14.0 vs 19.7 (FlashInfer fp8 43.9), 2k 16.6 vs 24.5
    # (50.0); at 256, WR/sp1 14.5 vs C 21.7 (bf16, FlashInfer 15.2), 17.5 vs 27.3 (fp8); 32 rows
    # fp8 1k WE8/sp16 8.1-8.3 vs G4/sp16 9.5 (26.3), 2k 8.8 vs G4 13.4 (26.1), but at 256
    # WE8/sp1 9.3 vs G4/sp4 8.9
    ("bf16", "big", "b1", "c2k"): "WR|C",
    ("fp8", "big", "b1", "c2k"): "WR|C",
    ("fp8", "r32", "b1", "c2k"): "WE8|G4",
}
