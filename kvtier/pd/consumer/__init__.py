"""The decode engine's (D's) side of P/D: a transfer's fetch loop (:mod:`.fetch`), its handshake
(:mod:`.hello`), the chunks that land in its engine blocks (:mod:`.landing`), each READ's deadline
(:mod:`.fence`), the probe of the HBM path (:mod:`.probe`) and the watch on producers' agents
(:mod:`.peer_watch`).

Imports the shared modules of :mod:`kvtier.pd`, never :mod:`kvtier.pd.producer`.
"""
