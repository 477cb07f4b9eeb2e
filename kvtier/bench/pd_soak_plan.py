"""``kvtier-bench pd-soak``'s plan and its answer check: pure functions of the seed, no I/O.

Every request gets a prompt of random token ids (some start with one of a few shared prefixes,
so P and D see prefix hits too), a greedy ``max_tokens``, and at most one of the harness's
faults, drawn with ``--seed``:

- ``none``: sent through ``kvtier-proxy``;
- ``lease_race``: the harness sends P's leg, then D's after a random delay of 0.5 to 1.5 times P's
  ``pd_hbm_lease_ms``: D's READ races the lease's end;
- ``replay``: the harness sends both legs, and while D's is in flight it sends P's chunk server a
  forged ``Release`` of the transfer and one ``Hello`` twice (the second a replay);
- ``kill_p`` / ``kill_d``: the harness sends both legs, and a random delay after D's went out
  kills P's (or D's) whole process group, then starts it again.

Kills are placed, not drawn per request: ``kills`` of each side, at random requests between 10%
and 80% of the run, so that later requests show the restarted server answering. A kill request
asks for more tokens (D is still decoding when it strikes).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("none", "lease_race", "replay", "kill_p", "kill_d")
P_LEASE_RACE, P_REPLAY = 0.25, 0.10  # per request; the rest (bar kills) go through the proxy
PREFIXES = 3  # shared prefixes some prompts start with
P_SHARED_PREFIX = 0.3
MIN_TOKENS, MAX_PROMPT_TOKENS = 20, 600  # prompt length range, tokens (a block is 32, a chunk 64)
MAX_TOKENS = (4, 24)  # a request's max_tokens range
KILL_MAX_TOKENS = 96  # a kill request's max_tokens: D still decodes when the kill comes
VOCAB = (3, 1000)  # token ids drawn from this range (the tests' 1024-token tiny model)


@dataclass(frozen=True, slots=True)
class Request:
    """One request of the soak. ``delay_s``: the injected delay (lease_race: before D's leg;
    kills and replay: after D's leg went out, before the fault), s."""

    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    kind: str
    delay_s: float = 0.0


def make_plan(requests: int, seed: int, lease_ms: int, kills: int) -> list[Request]:
    """``requests`` requests drawn from ``seed`` (see the module docstring); ``lease_ms``: P's
    ``pd_hbm_lease_ms``; ``kills``: P kills and D kills each (fewer when the run is too short)."""
    rng = random.Random(f"kvtier-pd-soak/{seed}")
    prefixes = [_ids(rng, rng.randint(64, 256)) for _ in range(PREFIXES)]
    lo, hi = max(1, requests // 10), max(2, (requests * 8) // 10)
    slots = list(range(lo, min(hi, requests - 1)))
    placed = rng.sample(slots, min(len(slots), 2 * kills))
    kill_at = {i: ("kill_p" if k % 2 == 0 else "kill_d") for k, i in enumerate(placed)}
    plan = []
    for index in range(requests):
        length = rng.randint(MIN_TOKENS, MAX_PROMPT_TOKENS)
        head = list(rng.choice(prefixes)) if rng.random() < P_SHARED_PREFIX else []
        prompt = tuple((head + _ids(rng, length))[: max(length, len(head) + MIN_TOKENS)])
        roll = rng.random()
        kind = kill_at.get(index) or ("lease_race" if roll < P_LEASE_RACE else
                                      "replay" if roll < P_LEASE_RACE + P_REPLAY else "none")
        if kind == "lease_race":
            delay_s = lease_ms * rng.uniform(0.5, 1.5) / 1000
        elif kind in ("kill_p", "kill_d"):
            delay_s = rng.uniform(0.0, 2 * lease_ms / 1000)
        elif kind == "replay":
            delay_s = rng.uniform(0.0, lease_ms / 1000)
        else:
            delay_s = 0.0
        max_tokens = KILL_MAX_TOKENS if kind.startswith("kill") else rng.randint(*MAX_TOKENS)
        plan.append(Request(index, prompt, max_tokens, kind, delay_s))
    return plan


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def check_answer(tokens: list[int] | None, reference: list[int]) -> str:
    """``"ok"`` when ``tokens`` (an HTTP 200 answer's generated token ids) equal ``reference``
    (the recompute's), ``"wrong"`` otherwise (None: an answer without token ids is wrong too)."""
    return "ok" if tokens is not None and list(tokens) == list(reference) else "wrong"

