"""P's and D's tensor-parallel sizes in ``kvtier-bench pd-engines``: ``--tp``, the devices they
take, which engine pairs run at them, and what the result says of them.

``--tp 2:1`` starts P at TP=2 and D at TP=1; ``--tp 2`` both at 2. ``--devices`` lists P's GPUs,
then D's. kvtier's pair runs at any sizes (its D ranks gather their KV heads from P's ranks:
:mod:`kvtier.pd.consumer.gather`); where D loaded nothing from P, the table says so. vLLM's
``NixlConnector`` runs where one size divides the other (its ``TransferTopology.tp_ratio``
asserts that); ``NixlPushConnector`` only at equal sizes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

KVTIER_ROWS = ("kvtier pull hbm", "kvtier pull after lease", "kvtier push nixl", "kvtier push nixl read",
               "kvtier push nixl write", "kvtier pull zmq", "kvtier push zmq")


@dataclass(frozen=True, slots=True)
class TpSizes:
    """Tensor-parallel sizes, ranks: ``p`` of the prefill engine, ``d`` of the decode engine."""

    p: int
    d: int

    @property
    def equal(self) -> bool:
        return self.p == self.d

    def as_json(self) -> dict[str, int]:
        """The result's ``"tp"``: ``{"P": p, "D": d}``."""
        return {"P": self.p, "D": self.d}

    def words(self) -> str:
        """``"P at TP=2, D at TP=1"``."""
        return f"P at TP={self.p}, D at TP={self.d}"


def parse_tp(text: str) -> TpSizes:
    """``--tp``: ``"2"`` -> both engines at 2, ``"2:1"`` -> P at 2, D at 1. Anything but one or two
    positive integers (``"0:1"``, ``"a:b"``, ``"1:2:3"``) raises ``argparse.ArgumentTypeError``,
    which argparse reports naming ``--tp``."""
    parts = text.split(":")
    if len(parts) > 2 or not all(p.strip().isdecimal() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected N (P and D at TP=N) or P:D, positive integers like 2:1; "
                                         f"got {text!r}")
    sizes = [int(p) for p in parts]
    return TpSizes(sizes[0], sizes[-1])


def parse_devices(text: str | None, tp: TpSizes | int = 1) -> tuple[str, str] | None:
    """``--devices``: ``"0,1"`` -> ``("0", "1")`` (P's devices, D's; each a ``CUDA_VISIBLE_DEVICES``
    value of indexes or GPU UUIDs); at ``tp`` 2:1, ``"0,1,2"`` -> ``("0,1", "2")``, or ``"0,1,1"`` ->
    ``("0,1", "1")``, D on a GPU of P's (two GPUs for unequal sizes); an int ``tp`` is both sizes.
    None stays None (both on the visible device). Anything but ``tp.p + tp.d`` non-empty items, each
    side's distinct (and all distinct at equal sizes above 1), raises ``ValueError``."""
    if text is None:
        return None
    tp = TpSizes(tp, tp) if isinstance(tp, int) else tp
    total = tp.p + tp.d
    items = [x.strip() for x in text.split(",")]
    p_items, d_items = items[:tp.p], items[tp.p:]
    repeated = (len(set(p_items)) < len(p_items) or len(set(d_items)) < len(d_items)
                or (tp.equal and total > 2 and len(set(items)) < total))
    if len(items) != total or not all(items) or any(" " in x for x in items) or repeated:
        raise ValueError(f"expected {total} devices, P's {tp.p} then D's {tp.d}, like "
                         f"{','.join(map(str, range(total)))}; got {text!r}")
    return ",".join(items[:tp.p]), ",".join(items[tp.p:])


def pair_skipped(pair: str, tp: TpSizes) -> str | None:
    """Why ``pair`` (``kvtier``, ``nixl``, ``nixl-push``) does not run at ``tp``, one line; None
    when it runs."""
    if tp.equal or pair == "kvtier":
        return None
    if pair == "nixl" and max(tp.p, tp.d) % min(tp.p, tp.d):
        return f"{tp.words()}: vLLM's NixlConnector needs one TP size to divide the other"
    if pair == "nixl-push":
        return f"{tp.words()}: NixlPushConnector is run only at equal TP sizes"
    return None


def result_tp(result: dict) -> TpSizes:
    """P's and D's sizes in a result: ``{"P": 2, "D": 1}``, or one int (results written when both
    ran at one size), or none (TP=1)."""
    tp = result.get("tp", 1)
    return TpSizes(tp["P"], tp["D"]) if isinstance(tp, dict) else TpSizes(tp, tp)


def recomputed(result: dict, row: str) -> bool:
    """Whether ``row``'s D loaded nothing from P in every answer (it recomputed each prompt); False
    where the result counts no loads (written before it did)."""
    loaded = [t for ts in result.get("d_loaded_tokens", {}).get(row, {}).values() for t in ts]
    return bool(loaded) and not any(loaded)


def recompute_note(result: dict) -> str | None:
    """The table's line on kvtier's rows whose D loaded nothing from P at unequal TP sizes (D's log says why)."""
    tp = result_tp(result)
    rows = [row for row in KVTIER_ROWS if recomputed(result, row)]
    if tp.equal or not rows:
        return None
    return (f"{tp.words()}: kvtier's D loaded nothing from P and recomputed every prompt in {', '.join(rows)} "
            "(D's log says why); their TTFT is a recompute's")
