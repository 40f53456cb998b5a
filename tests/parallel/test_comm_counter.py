"""The byte counter's bookkeeping, without processes."""

import pytest

from parallel.comm import SENT_FRACTION, CommCounter, record


def test_nothing_counted_unless_active():
    c = CommCounter()
    record("dp", "all_reduce", 100, 4)
    assert c.calls() == 0
    with c:
        record("dp", "all_reduce", 100, 4)
    record("dp", "all_reduce", 100, 4)
    assert c.calls() == 1 and c.sent_bytes("dp") == pytest.approx(150)


def test_nested_counters_both_see_inner_traffic():
    outer, inner = CommCounter(), CommCounter()
    with outer:
        record("tp", "all_gather", 80, 2)
        with inner:
            record("tp", "reduce_scatter", 80, 2)
    assert outer.calls() == 2 and inner.calls() == 1
    assert inner.sent_bytes("tp", "reduce_scatter") == 40


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_ring_fractions(n):
    assert SENT_FRACTION["all_reduce"](n) == pytest.approx(2 * (n - 1) / n)
    # reduce-scatter + all-gather moves exactly what one all-reduce does
    assert SENT_FRACTION["reduce_scatter"](n) + SENT_FRACTION["all_gather"](n) == pytest.approx(
        SENT_FRACTION["all_reduce"](n)
    )


def test_summary_is_plain_data_and_reset_clears():
    c = CommCounter()
    with c:
        record("pp", "send", 10, 2)
        record("pp", "recv", 10, 2)
    s = c.summary()
    assert s == {
        "pp": {
            "recv": {"calls": 1, "payload_bytes": 10, "sent_bytes": 0.0, "recv_bytes": 10, "wait_s": 0.0},
            "send": {"calls": 1, "payload_bytes": 10, "sent_bytes": 10.0, "recv_bytes": 0, "wait_s": 0.0},
        }
    }
    c.reset()
    assert c.summary() == {}
