"""kvtier as a vLLM v1 KV connector: ``kv_connector="kvtier"``."""
