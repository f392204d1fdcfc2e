"""Every cell of SGLang's ForwardMode truth table (reference/sglang.md §3), and
CaptureHiddenMode."""

import pytest

from mla_spec import CaptureHiddenMode, ForwardMode

M = ForwardMode
ORDER = [M.EXTEND, M.DECODE, M.MIXED, M.IDLE, M.TARGET_VERIFY, M.DRAFT_EXTEND,
         M.DRAFT_EXTEND_V2, M.SPLIT_PREFILL]

# predicate -> columns EXT DEC MIX IDLE TV DE DE_V2 SPLIT (1 = True)
TABLE = {
    ("is_extend", ()): "10101100",
    ("is_prefill", ()): "10101100",
    ("is_extend", (("include_draft_extend_v2", True),)): "10101110",
    ("is_decode", ()): "01000000",
    ("is_mixed", ()): "00100000",
    ("is_idle", ()): "00010000",
    ("is_decode_or_idle", ()): "01010000",
    ("is_target_verify", ()): "00001000",
    ("is_draft_extend", ()): "00000100",
    ("is_draft_extend", (("include_v2", True),)): "00000110",
    ("is_draft_extend_v2", ()): "00000010",
    ("is_extend_or_draft_extend_or_mixed", ()): "10100101",
    ("is_cuda_graph", ()): "01011000",
    ("is_cpu_graph", ()): "01000000",
    ("is_split_prefill", ()): "00000001",
}


def test_members_in_sglang_order():
    assert list(ForwardMode) == ORDER
    assert [m.value for m in ForwardMode] == list(range(1, 9))


def _key_id(k):
    return k[0] + "".join(f"[{a}]" for a, _ in k[1])


@pytest.mark.parametrize("key", list(TABLE), ids=_key_id)
@pytest.mark.parametrize("col", range(8), ids=[m.name for m in ORDER])
def test_truth_table_cell(key, col):
    name, kwargs = key
    mode = ORDER[col]
    expected = TABLE[key][col] == "1"
    assert getattr(mode, name)(**dict(kwargs)) is expected, f"{mode.name}.{name}{dict(kwargs)}"


def test_keyword_defaults_are_false():
    assert M.DRAFT_EXTEND_V2.is_extend() is False
    assert M.DRAFT_EXTEND_V2.is_extend(include_draft_extend_v2=False) is False
    assert M.DRAFT_EXTEND_V2.is_draft_extend(include_v2=False) is False


def test_capture_hidden_mode():
    C = CaptureHiddenMode
    assert [c.value for c in C] == [0, 1, 2]
    assert not C.NULL.need_capture() and C.LAST.need_capture() and C.FULL.need_capture()
    assert C.FULL.is_full() and not C.LAST.is_full()
    assert C.LAST.is_last() and not C.NULL.is_last()
    assert C.NULL < C.LAST < C.FULL
    assert max(C.LAST, C.FULL) is C.FULL
    assert C.FULL >= C.LAST
