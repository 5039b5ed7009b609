"""The supervisor's batching of pipe output (``agent/coalesce.py``): order, bounds, timing."""

from __future__ import annotations

from mcp_code_sandbox.agent.coalesce import FLUSH_BYTES, Pending


def test_neighbours_of_one_stream_merge_and_order_is_kept() -> None:
    pending = Pending()
    assert pending.due is None
    for name, text in [("stdout", "a"), ("stdout", "b"), ("stderr", "c"), ("stdout", "d")]:
        assert pending.add(name, text) is False
    assert pending.due is not None
    assert pending.take() == [("stdout", "ab"), ("stderr", "c"), ("stdout", "d")]
    assert pending.due is None and pending.size == 0 and pending.take() == []


def test_a_full_batch_asks_to_be_sent_and_messages_stay_within_the_bound() -> None:
    pending = Pending()
    assert pending.add("stdout", "") is False and pending.due is None
    assert pending.add("stdout", "x" * (FLUSH_BYTES - 1)) is False
    assert pending.add("stdout", "yz") is True
    messages = pending.take()
    assert [len(text) for _, text in messages] == [FLUSH_BYTES, 1]
    assert "".join(text for _, text in messages) == "x" * (FLUSH_BYTES - 1) + "yz"
