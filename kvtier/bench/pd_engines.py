"""``kvtier-bench pd-engines``: P/D between two vLLM engines on one device, kvtier (pull and push,
over NIXL and over ZMQ) against vLLM's own ``NixlConnector``, in one run.

A prefill engine (P) and a decode engine (D) share the device (each a process of its own session,
:mod:`kvtier.bench.pd_child`, ended through its group; on a GPU each takes
``--gpu-memory-utilization`` of it). Pairs, one after the other:

* ``kvtier``: P with kvtier (``pd_transport`` auto) and D with kvtier over NIXL; then D again over
  ZMQ (P stays up). Rows: ``recompute`` (a new prompt on P), ``local hit`` (the same prompt on P
  again), ``pull`` (P prefills with ``max_tokens`` 1 and ``do_remote_decode``; D then answers
  with P's ``kv_transfer_params``: TTFT = P's leg + D's leg) and ``push`` (both legs sent at once
  under one ``transfer_id``: TTFT = D's leg);
* ``nixl``: P and D with ``NixlConnector`` (``kv_both``), pull as above.

Every leg is one ``generate`` call with ``max_tokens`` 1, timed in its engine: D's leg is its time
to first token, which includes waiting for the KV. Each P/D request must show in D's answer that
D loaded all but the prompt's last chunk (``num_cached_tokens``), and D's first token must equal
the one P computed for the same prompt; either failure makes the exit status 1. D's transfer
rate is ``KV bytes / (D's leg - local hit)``: the KV moved, over the time D's leg took beyond a
prefix-cache hit's.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from kvtier.bench.common import (NO_MATPLOTLIB, BenchError, Progress, names_from, positive, pyplot, save_figure,
                                 token_lengths, vllm_version)
from kvtier.bench.engine_model import LLAMA3_8B
from kvtier.bench.servers import start_group, stop_group

PAIRS = ("kvtier", "nixl")
ROWS = ("recompute", "local hit", "kvtier pull nixl", "kvtier push nixl", "kvtier pull zmq", "kvtier push zmq",
        "NixlConnector pull")
CHILD = "kvtier.bench.pd_child"
READY_TIMEOUT_S = 600.0  # one engine's start on a busy host, s
REQUEST_TIMEOUT_S = 180.0  # one request (a 32k-token P/D answer takes seconds on a GPU), s


def add_parser(commands) -> None:
    """Register ``kvtier-bench pd-engines``."""
    p = commands.add_parser(
        "pd-engines", help="P/D between two vLLM engines on one device: kvtier pull/push on NIXL and ZMQ vs vLLM's NixlConnector",
        description="Start a prefill and a decode engine on one device (a CUDA vLLM: both on one GPU) and time P/D "
        "requests: kvtier pull and push over NIXL and over ZMQ, vLLM's NixlConnector, recompute and a local "
        "prefix hit. Checks that D loaded each prompt and that its first token equals P's.")
    p.add_argument("--model", help="model directory (default: a Llama-3-8B config with dummy weights)")
    p.add_argument("--load-format", default="dummy", help="vLLM load_format (default dummy)")
    p.add_argument("--prompt-lens", default="8k,32k", help="comma-separated prompt lengths (default 8k,32k)")
    p.add_argument("--repeats", type=positive, default=3, help="prompts per length and row (default 3; median shown)")
    p.add_argument("--pairs", default=",".join(PAIRS), help=f"which engine pairs to run (default {','.join(PAIRS)})")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35, help="each engine's share of the GPU (default 0.35)")
    p.add_argument("--cpu-gib", type=positive, default=8, help="kvtier's CPU tier in each engine, GiB (default 8)")
    p.add_argument("--chunk-tokens", type=positive, default=256, help="kvtier's chunk_tokens (default 256)")
    p.add_argument("--keep-logs", metavar="DIR", help="write the engines' logs to DIR and keep them")
    p.add_argument("--json", metavar="FILE", help="write every sample to FILE (also after each repeat)")
    p.add_argument("--plot", metavar="FILE.png", help="write a bar chart of TTFT per row and length (needs matplotlib)")
    p.set_defaults(run=_main, parser=p)


class Engine:
    """One engine process (:mod:`kvtier.bench.pd_child`) and its request lines."""

    def __init__(self, name: str, spec: dict, workdir: str, env: dict | None = None):
        self.name = name
        path = os.path.join(workdir, f"{name}.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.proc = start_group([sys.executable, "-m", CHILD, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=open(self.log_path, "ab"), text=True,
                                env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env or {})})
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.start_s = json.loads(self._expect("READY ", READY_TIMEOUT_S))["start_s"]

    def _read(self) -> None:
        with open(self.log_path, "a") as log:  # vLLM and kvtier log to stdout: their lines go beside stderr's
            for line in self.proc.stdout:
                if not line.startswith(("OUT ", "READY ")):
                    log.write(line)
                    log.flush()
                self._lines.put(line)
        self._lines.put(None)

    def _expect(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise BenchError(f"engine {self.name} gave no {prefix.strip()} line in {timeout_s:.0f} s; "
                                 f"log {self.log_path}:\n{self.log_tail()}") from None
            if line is None:
                raise BenchError(f"engine {self.name} exited (status {self.proc.wait()}); log {self.log_path}:\n"
                                 f"{self.log_tail()}")
            if line.startswith(prefix):
                return line[len(prefix):]

    def send(self, prompt: list[int], params: dict | None = None, max_tokens: int = 1, logprobs: int | None = None) -> None:
        """Start one request (``params``: its ``kv_transfer_params``); :meth:`receive` gives the answer."""
        line = {"prompt": prompt, "params": params, "max_tokens": max_tokens, "logprobs": logprobs}
        self.proc.stdin.write(json.dumps(line) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict:
        return json.loads(self._expect("OUT ", REQUEST_TIMEOUT_S))

    def ask(self, prompt: list[int], params: dict | None = None) -> dict:
        self.send(prompt, params)
        return self.receive()

    def log_tail(self, n_chars: int = 3000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n_chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """End the engine's whole process group (EngineCore and workers too)."""
        stop_group(self.proc, grace_s=15)


class Run:
    """The rows of one run: samples per row and length, and what was checked."""

    def __init__(self, args: argparse.Namespace, model: str, lengths: list[int], progress: Progress):
        self.args, self.model, self.lengths, self.progress = args, model, lengths, progress
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        dtype_bytes = 4 if (cfg.get("torch_dtype") or cfg.get("dtype")) == "float32" else 2
        self.kv_bytes_per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", 1) * head_dim * dtype_bytes
        self.vocab = cfg["vocab_size"]
        self.ms: dict[str, dict[str, list[float]]] = {row: {str(n): [] for n in lengths} for row in ROWS}
        self.d_leg_ms: dict[str, dict[str, list[float]]] = {row: {str(n): [] for n in lengths} for row in ROWS}
        self.failures: list[str] = []
        self.start_s: dict[str, float] = {}
        self.transport_lines: list[str] = []
        self._seed = 0

    def prompt(self, length: int) -> list[int]:
        self._seed += 1
        rng = random.Random(self._seed)
        return [rng.randrange(100, min(self.vocab, 120_000)) for _ in range(length)]

    def spec(self, connector: str, transport: str = "auto") -> dict:
        # P pins a published prompt until D has it and may hold a whole prefill's chunks in its save
        # backlog: both get half the CPU tier (by default a quarter), so the longest prompt fits.
        cpu = self.args.cpu_gib << 30
        kvtier = {"cpu_bytes": cpu, "pd_hold_bytes": cpu // 2, "save_backlog_bytes": cpu // 2,
                  "chunk_tokens": self.args.chunk_tokens, "pd_transport": transport, "pd_timeout_ms": 30_000}
        return {"model": self.model, "connector": connector, "kvtier": kvtier, "load_format": self.args.load_format,
                "gpu_memory_utilization": self.args.gpu_memory_utilization, "max_model_len": max(self.lengths) + 64}

    def check(self, row: str, n: int, p_out: dict, d_out: dict) -> None:
        """D must have loaded all but the last chunk, and answered P's first token."""
        floor = (n - 1) // self.args.chunk_tokens * self.args.chunk_tokens if row.startswith("kvtier") else n - 64
        if d_out["cached"] < floor:
            self.failures.append(f"{row} {n}: D loaded {d_out['cached']} of {n} tokens (expected >= {floor})")
        if d_out["tokens"][:1] != p_out["tokens"][:1]:
            self.failures.append(f"{row} {n}: D's first token {d_out['tokens'][:1]} != P's {p_out['tokens'][:1]}")

    def pull(self, row: str, p: Engine, d: Engine, n: int) -> None:
        prompt = self.prompt(n)
        p_out = p.ask(prompt, {"do_remote_decode": True, "do_remote_prefill": False})
        if not p_out["params"]:
            raise BenchError(f"{row}: P returned no kv_transfer_params; log {p.log_path}:\n{p.log_tail()}")
        d_out = d.ask(prompt, p_out["params"])
        self.check(row, n, p_out, d_out)
        self.ms[row][str(n)].append((p_out["seconds"] + d_out["seconds"]) * 1e3)
        self.d_leg_ms[row][str(n)].append(d_out["seconds"] * 1e3)

    def push(self, row: str, p: Engine, d: Engine, n: int, endpoints: list[str]) -> None:
        prompt, transfer_id = self.prompt(n), uuid.uuid4().hex
        d.send(prompt, {"do_remote_prefill": True, "transfer_id": transfer_id, "kvtier_endpoints": endpoints,
                        "tp_size": 1})
        p.send(prompt, {"do_remote_decode": True, "transfer_id": transfer_id})
        d_out, p_out = d.receive(), p.receive()
        self.check(row, n, p_out, d_out)
        self.ms[row][str(n)].append(d_out["seconds"] * 1e3)
        self.d_leg_ms[row][str(n)].append(d_out["seconds"] * 1e3)

    def baselines(self, p: Engine, n: int) -> None:
        prompt = self.prompt(n)
        self.ms["recompute"][str(n)].append(p.ask(prompt)["seconds"] * 1e3)
        self.ms["local hit"][str(n)].append(p.ask(prompt)["seconds"] * 1e3)

    def kvtier_pair(self, workdir: str) -> None:
        engines: list[Engine] = []
        try:
            self.progress("starting P (kvtier) ...")
            p = Engine("kvtier-P", self.spec("kvtier"), workdir)
            engines.append(p)
            self.start_s["kvtier P"] = p.start_s
            for transport in ("nixl", "zmq"):
                self.progress(f"starting D (kvtier over {transport}) ...")
                d = Engine(f"kvtier-D-{transport}", self.spec("kvtier", transport), workdir)
                engines.append(d)
                self.start_s[f"kvtier D {transport}"] = d.start_s
                # A short warm-up: the first transfer connects (and on NIXL waits for D's agent).
                warm = self.prompt(2 * self.args.chunk_tokens + 8)
                params = p.ask(warm, {"do_remote_decode": True})["params"]
                d.ask(warm, params)
                endpoints = params["kvtier_endpoints"]
                for n in self.lengths:
                    for r in range(self.args.repeats):
                        self.progress(f"kvtier over {transport}, {n} tokens, repeat {r + 1}/{self.args.repeats}")
                        if transport == "nixl":
                            self.baselines(p, n)
                        self.pull(f"kvtier pull {transport}", p, d, n)
                        self.push(f"kvtier push {transport}", p, d, n, endpoints)
                        self.checkpoint()
                d.stop()
                engines.remove(d)
                self.transport_line(d)
        finally:
            for e in engines:
                e.stop()

    def transport_line(self, d: Engine) -> None:
        """Record D's line saying which transport it used (kvtier logs it once per producer)."""
        lines = [ln.strip() for ln in d.log_tail(1 << 24).splitlines() if "kvtier P/D: fetching from" in ln]
        self.transport_lines.append(f"{d.name}: {lines[0] if lines else 'no transport line in its log'}")

    def nixl_pair(self, workdir: str) -> None:
        engines: list[Engine] = []
        try:
            for role, port in (("P", 5600), ("D", 5700)):
                self.progress(f"starting {role} (NixlConnector) ...")
                e = Engine(f"nixl-{role}", self.spec("nixl"), workdir, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)})
                engines.append(e)
                self.start_s[f"NixlConnector {role}"] = e.start_s
            p, d = engines
            warm = self.prompt(2 * self.args.chunk_tokens + 8)
            d.ask(warm, p.ask(warm, {"do_remote_decode": True, "do_remote_prefill": False})["params"])
            for n in self.lengths:
                for r in range(self.args.repeats):
                    self.progress(f"NixlConnector, {n} tokens, repeat {r + 1}/{self.args.repeats}")
                    self.pull("NixlConnector pull", p, d, n)
                    self.checkpoint()
        finally:
            for e in engines:
                e.stop()

    def checkpoint(self) -> None:
        """Write what is measured so far to ``--json``: a run cut short keeps it."""
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump(self.result(), f, indent=1)

    def result(self) -> dict:
        return {"lengths": self.lengths, "repeats": self.args.repeats, "kv_bytes_per_token": self.kv_bytes_per_token,
                "chunk_tokens": self.args.chunk_tokens, "ttft_ms": self.ms, "d_leg_ms": self.d_leg_ms,
                "start_s": self.start_s, "transport_lines": self.transport_lines, "failures": self.failures,
                "device": _device_name(), "vllm": vllm_version()}


def _device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - a name for the table only
        return "?"


def _med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def transfer_gbps(result: dict, row: str, n: str) -> float | None:
    """KV bytes of the loaded prompt over the time D's leg took beyond a local hit's, GB/s; pull
    rows only (a push D leg includes P's prefill)."""
    if "pull" not in row:
        return None
    d_leg, local = _med(result["d_leg_ms"][row][n]), _med(result["ttft_ms"]["local hit"][n])
    if d_leg is None or local is None or d_leg <= local:
        return None
    return int(n) * result["kv_bytes_per_token"] / ((d_leg - local) / 1e3) / 1e9


def format_table(result: dict) -> str:
    lines = [f"kvtier-bench pd-engines: vLLM {result['vllm']} on {result['device']}, P and D on one device; "
             f"TTFT ms, median of {result['repeats']}; KV {result['kv_bytes_per_token'] >> 10} KiB/token"]
    head = f"{'row':<20} " + " ".join(f"{n + ' tok':>10} {'D leg':>7} {'GB/s':>5}" for n in map(str, result["lengths"]))
    lines += [head, "-" * len(head)]
    for row in ROWS:
        cells = []
        for n in map(str, result["lengths"]):
            ttft, d_leg, gbps = _med(result["ttft_ms"][row][n]), _med(result["d_leg_ms"][row][n]), transfer_gbps(result, row, n)
            cells.append(f"{ttft:>10.0f} " if ttft is not None else f"{'-':>10} ")
            cells.append(f"{d_leg:>7.0f} " if d_leg is not None else f"{'-':>7} ")
            cells.append(f"{gbps:>5.1f}" if gbps is not None else f"{'-':>5}")
        if any(result["ttft_ms"][row][n] for n in map(str, result["lengths"])):
            lines.append(f"{row:<20} " + "".join(cells))
    lines.append("engine start (s): " + ", ".join(f"{k} {v:.1f}" for k, v in result["start_s"].items()))
    lines += [f"transport: {line}" for line in result["transport_lines"]]
    lines.append("every P/D answer loaded the prompt and matched P's first token: "
                 + ("yes" if not result["failures"] else "NO: " + "; ".join(result["failures"][:5])))
    lines.append("pull TTFT = P's prefill leg + D's leg; push TTFT = D's leg (both sent at once); "
                 "GB/s (pull) = KV bytes / (D's leg - local hit)")
    return "\n".join(lines)


def write_plot(result: dict, path: str) -> str | None:
    """A grouped bar chart, TTFT per row and length; a message instead when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    rows = [r for r in ROWS if any(result["ttft_ms"][r][str(n)] for n in result["lengths"])]
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(rows), 4))
    width = 0.8 / len(result["lengths"])
    for i, n in enumerate(result["lengths"]):
        values = [_med(result["ttft_ms"][r][str(n)]) or 0.0 for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], values, width, label=f"{n} tokens")
    ax.set_xticks([x + width * (len(result["lengths"]) - 1) / 2 for x in range(len(rows))], rows, rotation=20, ha="right")
    ax.set_ylabel("TTFT, ms (median)")
    ax.set_title(f"P/D on one {result['device']} (vLLM {result['vllm']})")
    ax.legend()
    save_figure(fig, path)
    return None


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    lengths = token_lengths(parser, args.prompt_lens)
    pairs = names_from(parser, args.pairs, PAIRS, flag="--pairs")
    progress = Progress("pd-engines")
    with tempfile.TemporaryDirectory(prefix="kvtier-pd-engines-") as tmp:
        model = args.model
        if model is None:
            model = os.path.join(tmp, "llama-3-8b")
            os.makedirs(model)
            with open(os.path.join(model, "config.json"), "w") as f:
                json.dump(LLAMA3_8B, f)
        run = Run(args, model, lengths, progress)
        logs = args.keep_logs or tmp
        os.makedirs(logs, exist_ok=True)
        for name, pair in (("kvtier", run.kvtier_pair), ("nixl", run.nixl_pair)):
            if name in pairs:
                try:
                    pair(logs)
                except BenchError as exc:  # the other pair still runs; the exit status says it failed
                    print(f"kvtier-bench pd-engines: error: {exc}", file=sys.stderr)
                    run.failures.append(f"{name} pair: {str(exc).splitlines()[0]}")
    result = run.result()
    result["elapsed_s"] = progress.elapsed()
    print(format_table(result), flush=True)
    if args.json:
        run.checkpoint()
        progress(f"wrote {args.json}")
    if args.plot:
        progress(write_plot(result, args.plot) or f"wrote {args.plot}")
    return 0 if not result["failures"] else 1
