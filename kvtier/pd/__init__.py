"""P/D disaggregation: a prefill engine's store as one more tier of the decode engine.

The prefill engine (P) publishes a prompt's KV through the ordinary save path into its own CPU
tier (the trailing partial chunk included), frees its engine blocks at once, and pins the
published chunks (:class:`~kvtier.pd.holds.PublishHolds`) until the decode engine (D) has fetched them or they
expire. Each P rank runs a :class:`~kvtier.pd.server.ChunkServer`. D plans a ``REMOTE`` load, parks the request in
vLLM's ``WAITING_FOR_REMOTE_KVS`` like any reload, and its load executor fetches P's chunks
(:func:`~kvtier.pd.fetch.fetch_chunks`), verifies and scatters them through the same path as a tier reload.
"""
