"""The soak's client side: concurrent multi-turn chat sessions against an OpenAI-compatible server.

Each session is a thread with its own seeded RNG, so the same session against two servers sends
the same requests as long as the answers agree: it keeps a few conversations, and each turn
either continues the current one, revisits an older one at random (its prefix has likely left
the engine's own cache by then: the tiers serve it) or starts a new one (a shared system prompt,
then its own text). Some requests are aborted after their first streamed token, their answer
dropped from the history. Every answer (text) is recorded by (session, turn) for the
side-by-side check.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field

from kvtier.bench.chat_model import make_text

SYSTEM = make_text(12345, 120)  # shared by every conversation: a prefix every engine sees often
MAX_TOKENS = 24  # streamed tokens per answer (ignore_eos: the history grows evenly)
MAX_HISTORY_WORDS = 900  # a conversation longer than this starts over (stays under max_model_len)
CONVERSATIONS = 4  # per session
P_REVISIT, P_NEW, P_ABORT = 0.35, 0.15, 0.06
REQUEST_TIMEOUT_S = 120.0


@dataclass
class Turn:
    """One request. ``ttft_ms``: to the first streamed token; ``text``: the answer (None if aborted or failed)."""

    session: int
    turn: int
    start_s: float  # since the load began
    ttft_ms: float | None
    total_ms: float | None
    text: str | None
    aborted: bool
    error: str | None = None


@dataclass
class LoadResult:
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0

    def completed(self) -> list[Turn]:
        return [t for t in self.turns if t.text is not None]

    def errors(self) -> list[Turn]:
        return [t for t in self.turns if t.error is not None]


def run_load(url: str, model: str, sessions: int, duration_s: float, seed: int = 0,
             on_turn=None) -> LoadResult:
    """Drive ``sessions`` sessions against ``url`` for ``duration_s`` seconds (turns in flight then
    finish); ``on_turn(turn)`` is called from the session threads."""
    result = LoadResult()
    lock = threading.Lock()
    start = time.monotonic()
    deadline = start + duration_s

    def record(turn: Turn) -> None:
        with lock:
            result.turns.append(turn)
        if on_turn is not None:
            on_turn(turn)

    threads = [threading.Thread(target=_session, args=(url, model, i, seed, start, deadline, record), daemon=True,
                                name=f"soak-session-{i}") for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.wall_s = time.monotonic() - start
    result.turns.sort(key=lambda t: (t.session, t.turn))
    return result


def _session(url: str, model: str, index: int, seed: int, start: float, deadline: float, record) -> None:
    import httpx

    rng = random.Random(f"kvtier-soak/{seed}/{index}")
    conversations: list[list[dict]] = []
    current = None
    turn = 0
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        while time.monotonic() < deadline:
            roll = rng.random()
            if current is None or roll < P_NEW or _words(conversations[current]) > MAX_HISTORY_WORDS:
                conversations.append([{"role": "system", "content": SYSTEM}])
                if len(conversations) > CONVERSATIONS:
                    conversations.pop(0)
                current = len(conversations) - 1
            elif roll < P_NEW + P_REVISIT:
                current = rng.randrange(len(conversations))
            history = conversations[current]
            history.append({"role": "user", "content": make_text(rng.randrange(1 << 30), rng.randint(20, 60))})
            abort = rng.random() < P_ABORT
            began = time.monotonic()
            got = _chat(client, url, model, history, abort)
            ttft, total, text, error = got
            record(Turn(index, turn, began - start, ttft, total, None if abort or error else text, abort, error))
            if abort or error:
                history.pop()  # the answer never came: the user asks again later, differently
            else:
                history.append({"role": "assistant", "content": text})
            turn += 1


def _words(history: list[dict]) -> int:
    return sum(len(m["content"].split()) for m in history)


def _chat(client, url: str, model: str, messages: list[dict], abort: bool):
    """(ttft ms, total ms, text, error) of one streamed greedy chat completion; ``abort`` closes
    the stream after the first token (the server sees a client gone mid-stream)."""
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    first, parts = None, []
    try:
        with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                return None, None, None, f"HTTP {resp.status_code}: {resp.read()[:300].decode(errors='replace')}"
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return None, None, None, f"streamed error: {event['error']}"
                choices = event.get("choices") or []
                if not choices:
                    continue
                first = first or time.perf_counter()
                parts.append(choices[0].get("delta", {}).get("content") or "")
                if abort:
                    break  # leaving the with-block closes the connection mid-stream
    except Exception as exc:  # noqa: BLE001 - any transport failure is an error of the run
        return None, None, None, f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    if first is None:
        return None, None, None, "no token streamed"
    return (first - start) * 1e3, (end - start) * 1e3, "".join(parts), None
