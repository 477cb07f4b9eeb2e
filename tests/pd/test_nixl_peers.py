"""Which NIXL peers an agent keeps: a peer is dropped only once every user let go of it and it
stayed unused for the idle time, never while a connection or transfer still holds it.

NIXL itself is replaced by a stand-in that records the remote agents it holds (this checks
kvtier's bookkeeping in :class:`kvtier.pd.nixl.Agent`, not NIXL); ``tests/pd/test_pd_hbm_push.py``
runs the same through real NIXL over UCX."""

from __future__ import annotations

import threading

from hypothesis import example, given, settings, strategies as st

from kvtier.pd import nixl


class _Nixl:
    """The remote agents a NIXL agent holds (names from metadata: ``b"md-x"`` -> ``"x"``)."""

    def __init__(self):
        self.remote: set[str] = set()

    def add_remote_agent(self, metadata: bytes) -> str:
        name = metadata.decode()[3:]
        assert name not in self.remote, f"{name} added twice"
        self.remote.add(name)
        return name

    def remove_remote_agent(self, name: str) -> None:
        self.remote.remove(name)


def _agent(clock: list[float], monkeypatch) -> nixl.Agent:
    agent = nixl.Agent.__new__(nixl.Agent)  # no NIXL: only the bookkeeping runs
    agent._nixl, agent._lock, agent._peers, agent._users, agent._let_go = _Nixl(), threading.Lock(), {}, {}, {}
    agent._endpoints = {}
    agent.device = None
    monkeypatch.setattr(nixl.time, "monotonic", lambda: clock[0])
    return agent


# users: None holds a peer until it is forgotten (a connect without a user)
# peer "b" is reached by a fetch (at its chunk server's endpoint): never dropped as idle, only when
# kvtier.pd.consumer.peer_watch sees that server go ("gone")
OPS = st.lists(st.tuples(st.sampled_from(["connect", "disconnect", "tick", "forget_idle", "gone"]),
                         st.sampled_from(["a", "b"]), st.sampled_from([None, 0, 1, 2])), max_size=40)


@settings(max_examples=300, deadline=None)
@given(OPS)
@example([("connect", "a", None), ("disconnect", "a", None), ("tick", "a", 0), ("tick", "a", 0), ("forget_idle", "a", 0)])
@example([("connect", "a", 1), ("connect", "a", 2), ("disconnect", "a", 1), ("tick", "a", 0), ("tick", "a", 0),
          ("forget_idle", "a", 0), ("disconnect", "a", 2), ("tick", "a", 0), ("forget_idle", "a", 0),
          ("tick", "a", 0), ("forget_idle", "a", 0), ("connect", "a", 1)])
@example([("connect", "b", 1), ("disconnect", "b", 1), ("tick", "b", 0), ("tick", "b", 0), ("forget_idle", "b", 0),
          ("gone", "b", 0), ("connect", "b", None)])
def test_a_peer_is_dropped_only_when_idle_and_every_user_let_go_or_when_its_watched_server_goes(ops):
    import pytest

    with pytest.MonkeyPatch.context() as monkeypatch:
        clock = [0.0]
        agent = _agent(clock, monkeypatch)
        users: dict[str, set] = {}  # the model: who holds each known peer
        let_go: dict[str, float] = {}
        for op, peer, user in ops:
            if op == "connect":
                agent.connect(f"md-{peer}".encode(), user, "tcp://b" if peer == "b" else None)
                users.setdefault(peer, set()).add(user)
                let_go.pop(peer, None)
            elif op == "disconnect":
                agent.disconnect(peer if peer in users else None, user)
                if user is not None and peer in users and user in users[peer]:
                    users[peer].discard(user)
                    if not users[peer]:
                        let_go[peer] = clock[0]
            elif op == "tick":
                clock[0] += 3.0
            elif op == "gone":
                agent.forget(name=peer)
                users.pop(peer, None)
                let_go.pop(peer, None)
            else:
                agent.forget_idle(5.0)
                for gone in [p for p, since in let_go.items() if clock[0] - since >= 5.0 and p != "b"]:
                    del users[gone], let_go[gone]
            assert agent.peer_names == set(users) == agent._nixl.remote, (op, peer, user)


def test_the_start_line_says_whether_a_peers_gpu_memory_stays_mapped(monkeypatch):
    monkeypatch.delenv("UCX_CUDA_IPC_CACHE", raising=False)
    assert "mapped per transfer (UCX_CUDA_IPC_CACHE=n)" in nixl.gpu_mapping()  # kvtier's default
    monkeypatch.setenv("UCX_CUDA_IPC_CACHE", "y")
    assert "stays held" in nixl.gpu_mapping()
