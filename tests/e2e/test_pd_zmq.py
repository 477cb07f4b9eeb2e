"""P/D over kvtier's own ZMQ chunk transport (``pd_transport: "zmq"`` on both engines, though NIXL
is installed), through ``kvtier-proxy``. Every greedy answer must equal a connector-less
server's, as in ``test_pd.py``, whose helpers and prompts this module uses: that module's
reference server answers this module's prompts too (``zmq_...``); run alone, this module starts
one of its own.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from servers import metric
from test_pd import (KVTIER, MAX_TOKENS, ZMQ_LENGTHS, ZMQ_PUSH, ZMQ_TRANSPORT, _leg,
                     assert_identical_and_transferred, complete, external_tokens, pd_servers, push_params)

pytestmark = pytest.mark.e2e

ZMQ = {**KVTIER, "pd_transport": "zmq"}


@pytest.fixture(scope="module")
def pd(tmp_path_factory, chat_model, pd_expected):
    """P and D over ZMQ behind ``kvtier-proxy``, up for the whole module."""
    with pd_servers(tmp_path_factory.mktemp("pd_zmq"), chat_model, ZMQ, pd_expected) as servers:
        yield servers


@pytest.mark.parametrize("name", list(ZMQ_LENGTHS))
def test_completion_over_zmq_is_identical_and_transferred(pd, name):
    """Through ``kvtier-proxy``: the answer is the reference's, and D loaded all but at most the
    last prompt token from P (none for a prompt shorter than a block)."""
    assert_identical_and_transferred(pd, f"zmq_{name}", ZMQ_LENGTHS[name])


def test_push_over_zmq_with_d_first_is_identical(pd):
    """Push: D's leg (same ``transfer_id``) is in D's scheduler before P's leg is sent, and waits
    for P's chunks."""
    d_params, p_params = push_params(pd)
    out: dict = {}
    before = external_tokens(pd["d"].url)
    d_leg = threading.Thread(target=_leg, args=(pd["d"].url, ZMQ_PUSH, d_params, MAX_TOKENS, out, "d"))
    d_leg.start()
    deadline = time.monotonic() + 60
    while metric(pd["d"].url, "vllm:num_requests_waiting") + metric(pd["d"].url, "vllm:num_requests_running") < 1:
        assert d_leg.is_alive() and time.monotonic() < deadline, f"D did not take the leg: {out}"
        time.sleep(0.05)
    _leg(pd["p"].url, ZMQ_PUSH, p_params, 1, out, "p")
    d_leg.join(120)
    assert out["d"]["choices"][0]["text"] == pd["expected"]["zmq_push"]
    assert external_tokens(pd["d"].url) - before >= len(ZMQ_PUSH) - 1


def test_the_chunks_moved_over_zmq(pd):
    """D loads a prompt from P, and the only transport D ever logged for P is ZMQ: NIXL is
    installed here (``pd_transport: "auto"`` would pick it, as ``test_pd.py`` checks), yet neither
    engine started a NIXL agent nor fetched over NIXL."""
    before = external_tokens(pd["d"].url)
    assert complete(pd["client"], ZMQ_TRANSPORT) == pd["expected"]["zmq_transport"]
    assert external_tokens(pd["d"].url) - before >= len(ZMQ_TRANSPORT) - 1
    d_log = (pd["tmp"] / "d.log").read_text(errors="replace")
    assert re.search(r"kvtier P/D: fetching from tcp://\S+ over ZMQ\.", d_log), d_log[-3000:]
    for role in ("p", "d"):
        lines = (pd["tmp"] / f"{role}.log").read_text(errors="replace").splitlines()
        assert [ln for ln in lines if "kvtier" in ln and "NIXL" in ln] == []

