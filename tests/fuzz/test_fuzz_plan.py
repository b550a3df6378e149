"""Fuzz plan files: random edits of a saved plan's bytes load the plan unchanged or fail with a
ValueError; arbitrary JSON documents are refused with a ValueError, never another error."""

from __future__ import annotations

import json

import pytest
from fuzzing import count_case, examples
from hypothesis import given
from hypothesis import strategies as st

from vidsparse.search import load_plan, save_plan
from vidsparse.search.plan import Plan

pytest.importorskip("search.test_plan", reason="needs the plan tests' builder")
from search.test_plan import make_plan  # noqa: E402

PLAN = make_plan()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    save_plan(PLAN, path)
    return path, path.read_bytes()


edits = st.lists(
    st.tuples(st.sampled_from(["flip", "set", "delete", "insert", "truncate"]),
              st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
    min_size=1, max_size=4,
)  # fmt: skip


def _apply(data: bytes, edit) -> bytes:
    how, where, byte = edit
    i = int(where * len(data)) if data else 0
    if how == "flip" and data:
        return data[:i] + bytes([data[i] ^ (byte or 1)]) + data[i + 1 :]
    if how == "set" and data:
        return data[:i] + bytes([byte]) + data[i + 1 :]
    if how == "delete" and data:
        return data[:i] + data[i + 1 :]
    if how == "insert":
        return data[:i] + bytes([byte]) + data[i:]
    return data[:i]


@examples(150)
@given(edits)
def test_edited_plan_bytes_load_unchanged_or_fail_cleanly(saved, tmp_path_factory, edit_list):
    count_case()
    path, original = saved
    data = original
    for edit in edit_list:
        data = _apply(data, edit)
    target = tmp_path_factory.mktemp("edited") / "plan.json"
    target.write_bytes(data)
    try:
        loaded = load_plan(target)
    except ValueError:
        return
    assert loaded == PLAN and loaded.to_dict() == PLAN.to_dict()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)  # fmt: skip


@st.composite
def documents(draw):
    """A plan with one random field replaced by a random JSON value (or a random document)."""
    data = PLAN.to_dict()
    if draw(st.booleans()):
        return draw(json_values)
    parent, key = None, None
    node = data
    for _ in range(draw(st.integers(1, 6))):
        if isinstance(node, dict) and node:
            k = draw(st.sampled_from(sorted(node)))
        elif isinstance(node, list) and node:
            k = draw(st.integers(0, len(node) - 1))
        else:
            break
        parent, key, node = node, k, node[k]
    if parent is not None:
        parent[key] = draw(json_values)
    return data


@examples(150)
@given(documents())
def test_arbitrary_json_is_a_plan_or_a_value_error(document):
    count_case()
    text = json.dumps(document)
    try:
        plan = Plan.from_dict(json.loads(text))
    except ValueError as exc:
        assert "plan field" in str(exc) and len(str(exc)) < 2000
        return
    assert isinstance(plan, Plan)
