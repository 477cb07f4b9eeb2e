"""OpenAI-compatible prefill/decode router, ``kvtier-proxy`` (``kvtier.proxy.app``: ``create_app``, ``main``).

Runs beside vLLM servers, never inside one: it imports nothing from vLLM.
"""
