"""P/D disaggregation: a prefill engine's store as one more tier of the decode engine.

The prefill engine (P) publishes a prompt's KV through the ordinary save path into its own CPU
tier (the trailing partial chunk included), frees its engine blocks at once, and pins the
published chunks (:class:`~kvtier.pd.producer.holds.PublishHolds`) until the decode engine (D) has fetched them or they
expire. Each P rank runs a :class:`~kvtier.pd.producer.server.ChunkServer`. D plans a ``REMOTE`` load, parks the request in
vLLM's ``WAITING_FOR_REMOTE_KVS`` like any reload, and its load executor fetches P's chunks
(:func:`~kvtier.pd.consumer.fetch.fetch_chunks`), verifies and scatters them through the same path as a tier reload.

Layout: :mod:`kvtier.pd.producer` is P's side, :mod:`kvtier.pd.consumer` D's; the modules here are
what both speak (:mod:`.protocol`, :mod:`.channel`, :mod:`.nixl`, block descriptors :mod:`.hbm`,
:mod:`.faults`, :mod:`.params`) and the wiring of an engine that is either (:mod:`.engine_kv`,
:mod:`.nixl_start`).
"""
