"""The prefill engine's (P's) side of P/D: its chunk server (:mod:`.server`) and what it keeps for
decode engines: published chunks (:mod:`.holds`), finished requests' engine blocks (:mod:`.leases`)
and their checksums (:mod:`.sums`), CPU-tier buffers lent over NIXL (:mod:`.lending`), WRITEs into
consumers (:mod:`.writes`, :mod:`.hbm_serve`) and fetches waiting for their chunk (:mod:`.waiting`).

Imports the shared modules of :mod:`kvtier.pd`, never :mod:`kvtier.pd.consumer`.
"""
