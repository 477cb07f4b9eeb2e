"""The rows of ``kvtier-bench pd-engines``: its engine pairs, how each row drives P and D, what is
checked, and the result (see :mod:`kvtier.bench.pd_engines` for the rows and
:mod:`kvtier.bench.pd_engines_report` for the table).

Times are milliseconds in the result (seconds in engine answers); sizes bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import uuid

from kvtier import timeline
from kvtier.bench.common import BenchError, Progress, vllm_version
from kvtier.bench.pd_engine_proc import RELEASE_SLACK_MIB, Engine, gpu_used_mib, wait_released
from kvtier.bench.pd_engines_report import ROWS, merge_protocols, row_transport, ucx_protocols, ucx_transport
from kvtier.bench.pd_profile import profile_d, profile_dir
from kvtier.bench.pd_spy import Spy, summary
from kvtier.bench.pd_tp import TpSizes, pair_skipped

# NIXL side-channel ports of the vLLM connector pairs (each pair runs alone; ports differ anyway).
NIXL_PORTS = {"nixl": (5600, 5700), "nixl-push": (5800, 5900)}
PUSH_P_ENGINE_ID = "kvtier-bench-nixl-push-P"  # D must name P's engine before P answers
LEASE_MARGIN_MS = 500  # the wait beyond P's lease before D asks in "kvtier pull after lease", ms
_HAS_PUSH = ("from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F; "
             "print('NixlPushConnector' in F._registry)")


def engine_env(role: str, devices: tuple[str, str] | None, extra: dict | None = None) -> dict:
    """The environment one engine gets beyond this process's: ``CUDA_VISIBLE_DEVICES`` set to its
    device (``role`` "P" takes ``devices[0]``, "D" ``devices[1]``; none when ``devices`` is None:
    both on the visible device), and ``extra``."""
    env = dict(extra or {})
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices[0 if role == "P" else 1]
    return env


def push_connector_missing() -> str | None:
    """Why this vLLM cannot run ``NixlPushConnector`` (its connector factory lacks it), or None."""
    try:
        out = subprocess.run([sys.executable, "-c", _HAS_PUSH], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "importing vLLM's connector factory took over 300 s"
    if out.returncode != 0:
        return f"vLLM's connector factory did not import: {(out.stderr.strip().splitlines() or ['?'])[-1]}"
    if out.stdout.strip().splitlines()[-1:] != ["True"]:
        return f"vLLM {vllm_version()} registers no NixlPushConnector"
    return None


def hbm_lease_missing() -> str | None:
    """Why this kvtier has no ``pd_hbm_lease_ms`` setting, or None."""
    import dataclasses

    from kvtier.config import KvtierConfig

    if "pd_hbm_lease_ms" in {f.name for f in dataclasses.fields(KvtierConfig)}:
        return None
    return "this kvtier has no pd_hbm_lease_ms setting (P keeps no engine blocks)"


class Run:
    """The rows of one run: samples per row and length, transports, and what was checked."""

    def __init__(self, args: argparse.Namespace, model: str, lengths: list[int], progress: Progress):
        self.args, self.model, self.lengths, self.progress = args, model, lengths, progress
        self.tp = args.tp if isinstance(args.tp, TpSizes) else TpSizes(args.tp, args.tp)  # P's and D's (--tp)
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        dtype_bytes = 4 if (cfg.get("torch_dtype") or cfg.get("dtype")) == "float32" else 2
        self.kv_bytes_per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", 1) * head_dim * dtype_bytes
        self.vocab = cfg["vocab_size"]
        self.ms: dict[str, dict[str, list[float]]] = {row: {str(n): [] for n in lengths} for row in ROWS}
        self.d_leg_ms: dict[str, dict[str, list[float]]] = {row: {str(n): [] for n in lengths} for row in ROWS}
        self.loaded: dict[str, dict[str, list[int]]] = {row: {str(n): [] for n in lengths} for row in ROWS}  # D's, tokens
        self.failures: list[str] = []
        self.start_s: dict[str, float] = {}
        self.transport_lines: list[str] = []
        self.transport: dict[str, str] = {}
        self.ucx: dict[str, dict[str, list[str]]] = {}
        self.skipped: dict[str, str] = {}
        self.released: dict[str, dict] = {}  # a stopped D -> how long its GPU memory took to come back
        self.stages: dict[str, dict[str, dict[str, list[float]]]] = {}  # kvtier row -> tokens -> stage -> ms
        self.lease_missing = hbm_lease_missing()
        self.profiles: dict[str, list[str]] = {}  # engine -> where its threads' time went (--py-spy)
        self.d_profile: dict = {}  # D's step after a push against after a pull (--profile)
        self._seed = 0

    def prompt(self, length: int) -> list[int]:
        self._seed += 1
        rng = random.Random(self._seed)
        return [rng.randrange(100, min(self.vocab, 120_000)) for _ in range(length)]

    def spec(self, connector: str, transport: str = "auto", role: str = "D", push: str = "") -> dict:
        # P pins a published prompt until D has it and may hold a whole prefill's chunks in its save
        # backlog: both get half the CPU tier (the hold by default a quarter), so the longest prompt fits.
        cpu = self.args.cpu_gib << 30
        kvtier = {"cpu_bytes": cpu, "pd_hold_bytes": cpu // 2, "save_backlog_bytes": cpu // 2,
                  "chunk_tokens": self.args.chunk_tokens, "pd_transport": transport, "pd_timeout_ms": 30_000}
        if role == "P" and not self.lease_missing:
            kvtier["pd_hbm_lease_ms"] = self.args.hbm_lease_ms
        if push:
            kvtier["pd_hbm_push"] = push
        return {"model": self.model, "connector": connector, "kvtier": kvtier, "load_format": self.args.load_format,
                "gpu_memory_utilization": self.args.gpu_memory_utilization, "max_model_len": max(self.lengths) + 64,
                "engine_args": ({"tensor_parallel_size": tp} if (tp := self.tp.p if role == "P" else self.tp.d) > 1 else {})
                | ({"enforce_eager": False} if self.args.cuda_graphs else {})}

    def engine(self, name: str, role: str, spec: dict, workdir: str, extra_env: dict | None = None) -> Engine:
        """Start one engine on its device (``--devices``), UCX printing the protocols it selects."""
        env = engine_env(role, self.args.devices, {"UCX_PROTO_INFO": "y", **(extra_env or {})})
        return Engine(name, spec, workdir, env=env)

    def check(self, row: str, n: int, p_out: dict, d_out: dict) -> None:
        """D must have loaded all but the last chunk, and answered P's first token. A kvtier D at
        a TP size other than P's loading nothing recomputed, as kvtier does there: the table says
        so (:func:`kvtier.bench.pd_tp.recompute_note`), no failure."""
        floor = (n - 1) // self.args.chunk_tokens * self.args.chunk_tokens if row.startswith("kvtier") else n - 64
        recomputes = row.startswith("kvtier") and not self.tp.equal and d_out["cached"] == 0
        if d_out["cached"] < floor and not recomputes:
            self.failures.append(f"{row} {n}: D loaded {d_out['cached']} of {n} tokens (expected >= {floor})")
        if d_out["tokens"][:1] != p_out["tokens"][:1]:
            self.failures.append(f"{row} {n}: D's first token {d_out['tokens'][:1]} != P's {p_out['tokens'][:1]}")

    def record(self, row: str, n: int, ttft_s: float, d_leg_s: float, loaded: int) -> None:
        """One answer: TTFT and D's leg, s; ``loaded``: the prompt's tokens D did not compute."""
        self.ms[row][str(n)].append(ttft_s * 1e3)
        self.d_leg_ms[row][str(n)].append(d_leg_s * 1e3)
        self.loaded[row][str(n)].append(loaded)

    def watch(self, row: str, d: Engine, start: int) -> None:
        """The first time ``row`` runs on a kvtier D: its transport, from the lines D logged
        since byte ``start`` of its log (or before)."""
        if row not in self.transport:
            self.transport[row] = row_transport(row, d.transport_lines(start), d.transport_lines())

    def timeline(self, row: str, n: int, p: Engine, p_start: int, d: Engine, d_start: int) -> None:
        """Where D's leg went, from the kvtier timeline marks P and D logged since those offsets
        (engines logging at DEBUG: ``KVTIER_LOG_LEVEL=DEBUG``)."""
        lines = (p.log_text(p_start) + d.log_text(d_start)).splitlines()
        for stage, ms, _ in timeline.stages(*timeline.read(lines)):
            self.stages.setdefault(row, {}).setdefault(str(n), {}).setdefault(stage, []).append(ms)

    def pull(self, row: str, p: Engine, d: Engine, n: int, wait_s: float = 0.0, profile: str | None = None) -> dict:
        """P prefills, then (``wait_s`` later, not counted) D answers with P's kv_transfer_params;
        D's answer. ``profile``: D's request runs under its profiler, tagged so, and is not timed."""
        prompt, p_start = self.prompt(n), p.log_size()
        p_out = p.ask(prompt, {"do_remote_decode": True, "do_remote_prefill": False})
        if not p_out["params"]:
            raise BenchError(f"{row}: P returned no kv_transfer_params; log {p.log_path}:\n{p.log_tail()}")
        if wait_s:
            time.sleep(wait_s)
        start = d.log_size()
        d_out = d.ask(prompt, p_out["params"], profile=profile)
        self.check(row, n, p_out, d_out)
        if profile:
            return d_out
        if row.startswith("kvtier"):
            self.watch(row, d, start)
            self.timeline(row, n, p, p_start, d, start)
        self.record(row, n, p_out["seconds"] + d_out["seconds"], d_out["seconds"], d_out["cached"])
        return d_out

    def push(self, row: str, p: Engine, d: Engine, n: int, endpoints: list[str], profile: str | None = None) -> dict:
        """Both legs at once under one ``transfer_id``; D's answer (``profile``: as for :meth:`pull`)."""
        prompt, transfer_id, start, p_start = self.prompt(n), uuid.uuid4().hex, d.log_size(), p.log_size()
        params = {"do_remote_prefill": True, "transfer_id": transfer_id, "kvtier_endpoints": endpoints,
                  "tp_size": self.tp.p}
        d.send(prompt, params, profile=profile)
        p.send(prompt, {"do_remote_decode": True, "transfer_id": transfer_id})
        d_out, p_out = d.receive(), p.receive()
        self.check(row, n, p_out, d_out)
        if profile:
            return d_out
        self.watch(row, d, start)
        self.timeline(row, n, p, p_start, d, start)
        self.record(row, n, d_out["seconds"], d_out["seconds"], d_out["cached"])
        return d_out

    def spy(self, engines: tuple[Engine, ...]) -> list[tuple[Engine, Spy]]:
        """With ``--py-spy DIR``: py-spy recording each of ``engines`` (its process and children)."""
        if not self.args.py_spy:
            return []
        os.makedirs(self.args.py_spy, exist_ok=True)
        self.progress(f"py-spy recording {', '.join(e.name for e in engines)}")
        return [(e, Spy(e.proc.pid, os.path.join(self.args.py_spy, f"{e.name}.speedscope.json"))) for e in engines]

    def spied(self, spies: list[tuple[Engine, Spy]]) -> None:
        """Stop :meth:`spy`'s recordings; their summaries go in the result and ``DIR/summary.txt``."""
        for engine, spy in spies:
            problem = spy.stop()
            self.profiles[engine.name] = [problem] if problem else summary(spy.path, spy.seconds)
        if spies:
            path = os.path.join(self.args.py_spy, "summary.txt")
            with open(path, "w") as f:
                f.writelines(f"== {name}\n" + "".join(f"{line}\n" for line in lines)
                             for name, lines in self.profiles.items())
            self.progress(f"wrote {path}")

    def baselines(self, p: Engine, n: int) -> None:
        prompt = self.prompt(n)
        self.ms["recompute"][str(n)].append(p.ask(prompt)["seconds"] * 1e3)
        self.ms["local hit"][str(n)].append(p.ask(prompt)["seconds"] * 1e3)

    def kvtier_pair(self, workdir: str) -> None:
        engines: list[Engine] = []
        logs: list[Engine] = []  # every engine of the pair, for UCX's protocol lines
        wait_s = (self.args.hbm_lease_ms + LEASE_MARGIN_MS) / 1e3
        if self.lease_missing:
            self.skipped["kvtier pull after lease"] = self.lease_missing
            self.progress(f"skipping kvtier pull after lease: {self.lease_missing}")
        try:
            self.progress("starting P (kvtier) ...")
            p = self.engine("kvtier-P", "P", self.spec("kvtier", role="P"), workdir)
            engines.append(p)
            logs.append(p)
            self.start_s["kvtier P"] = p.start_s
            d_gpu = self.args.devices[1] if self.args.devices else None
            # one D per pd_hbm_push over NIXL (the first labelled "nixl", the others "nixl <mode>"), then ZMQ
            pushes = [("nixl", m, f"nixl {m}" if i else "nixl") for i, m in enumerate(self.args.hbm_push)]
            if self.args.zmq:
                pushes.append(("zmq", "", "zmq"))
            else:
                self.skipped["kvtier pull zmq"] = self.skipped["kvtier push zmq"] = "--no-zmq"
            for transport, push, label in pushes:
                before = gpu_used_mib(d_gpu) if d_gpu is not None else None
                self.progress(f"starting D (kvtier over {transport}{f', pd_hbm_push {push}' if push else ''}) ...")
                spec = self.spec("kvtier", transport, push=push)
                profiled = label == "nixl" and bool(getattr(self.args, "profile", None))  # --profile: this D
                if profiled:
                    spec["profile_dir"] = profile_dir(self.args.profile)
                d = self.engine(f"kvtier-D-{label.replace(' ', '-')}", "D", spec, workdir)
                engines.append(d)
                logs.append(d)
                self.start_s[f"kvtier D {label}"] = d.start_s
                # A short warm-up: the first transfer connects (and on NIXL waits for D's agent).
                warm = self.prompt(2 * self.args.chunk_tokens + 8)
                params = p.ask(warm, {"do_remote_decode": True})["params"]
                d.ask(warm, params)
                endpoints = params["kvtier_endpoints"]
                for n in self.lengths:
                    spies = self.spy((p, d)) if n == max(self.lengths) and label == "nixl" else []
                    for r in range(self.args.repeats):
                        self.progress(f"kvtier over {transport}, {n} tokens, repeat {r + 1}/{self.args.repeats}")
                        if label == "nixl":
                            self.baselines(p, n)
                            self.pull("kvtier pull hbm", p, d, n)
                            if not self.lease_missing:
                                self.pull("kvtier pull after lease", p, d, n, wait_s)
                        elif transport == "zmq":
                            self.pull("kvtier pull zmq", p, d, n)
                        self.push(f"kvtier push {label}", p, d, n, endpoints)
                        self.checkpoint()
                    self.spied(spies)
                    if profiled and n == max(self.lengths):
                        self.d_profile = profile_d(self, p, d, n, endpoints)
                d.stop()
                engines.remove(d)
                if before is not None:  # P may still hold what it wrote into: the next D would not start
                    released = self.released[d.name] = wait_released(d_gpu, before)
                    self.progress(f"GPU {d_gpu} after {d.name} stopped: {released['held_mib']} MiB "
                                  f"still held after {released['s']} s")
                    if released["held_mib"] > RELEASE_SLACK_MIB and transport != "zmq":  # P's exit frees it
                        self.progress("restarting P (kvtier) so that the next D can start ...")
                        p.stop()
                        engines.remove(p)
                        p = self.engine("kvtier-P", "P", self.spec("kvtier", role="P"), workdir)
                        engines.append(p)
                        logs.append(p)
                        self.start_s["kvtier P, restarted"] = p.start_s
                self.transport_lines += [f"{d.name}: {line}" for line in d.transport_lines()] or [
                    f"{d.name}: no transport line in its log"]
            self.ucx["kvtier"] = merge_protocols(*(ucx_protocols(e.log_text()) for e in logs))
        finally:
            for e in engines:
                e.stop()

    def nixl_pair(self, workdir: str, connector: str = "nixl") -> None:
        """vLLM's ``NixlConnector`` (pull) or ``NixlPushConnector`` (push) on P and D."""
        row = "NixlConnector pull" if connector == "nixl" else "NixlPushConnector push"
        if (why := pair_skipped(connector, self.tp)) or (connector == "nixl-push" and (why := push_connector_missing())):
            self.skipped[row] = why
            self.progress(f"skipping {row}: {why}")
            return
        engines: list[Engine] = []
        try:
            for role, port in zip("PD", NIXL_PORTS[connector]):
                self.progress(f"starting {role} ({row.split()[0]}) ...")
                spec = {**self.spec(connector, role=role), "engine_id": PUSH_P_ENGINE_ID if role == "P" and connector == "nixl-push"
                        else None}
                e = self.engine(f"{connector}-{role}", role, spec, workdir, {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)})
                engines.append(e)
                self.start_s[f"{row.split()[0]} {role}"] = e.start_s
            p, d = engines
            warm = self.prompt(2 * self.args.chunk_tokens + 8)
            if connector == "nixl":
                d.ask(warm, p.ask(warm, {"do_remote_decode": True, "do_remote_prefill": False})["params"])
            else:
                self.push_warm_up(p, d, warm)
            for n in self.lengths:
                for r in range(self.args.repeats):
                    self.progress(f"{row.split()[0]}, {n} tokens, repeat {r + 1}/{self.args.repeats}")
                    if connector == "nixl":
                        self.pull(row, p, d, n)
                    else:
                        self.nixl_push(row, p, d, n)
                    self.checkpoint()
            self.ucx[connector] = merge_protocols(*(ucx_protocols(e.log_text()) for e in engines))
            self.transport[row] = ucx_transport(self.ucx[connector])
        finally:
            for e in engines:
                e.stop()

    # ---- NixlPushConnector, driven as vLLM's push proxies drive it ------------------------------
    @staticmethod
    def push_legs(request_id: str, transfer_id: str, p_port: int, tp_size: int = 1) -> tuple[dict, dict]:
        """P's and D's ``kv_transfer_params`` for one push, both legs sent at once (vLLM's
        examples/disaggregated/disaggregated_serving/disagg_proxy_pushconnector_demo.py): D names
        P's engine and side channel up front, registers its blocks with P, and P WRITEs the KV
        into them once its prefill is done. Both legs carry ``request_id``, by which P pairs them;
        ``tp_size`` is P's, as P's own answer gives it."""
        p_params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                    "remote_block_ids": None, "remote_host": None, "remote_port": None, "transfer_id": transfer_id}
        d_params = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": PUSH_P_ENGINE_ID,
                    "remote_request_id": request_id, "remote_host": "localhost", "remote_port": p_port,
                    "tp_size": tp_size, "pp_size": 1, "transfer_id": transfer_id}
        return p_params, d_params

    def push_warm_up(self, p: Engine, d: Engine, prompt: list[int]) -> None:
        """One push in sequence (vLLM's tests/v1/kv_connector/nixl_integration/toy_push_proxy_server.py):
        P prefills, then D gets P's coordinates from P's answer; checks that P is the engine the
        timed pushes name."""
        request_id = str(random.randrange(10**15, 10**16))
        p_params, _ = self.push_legs(request_id, uuid.uuid4().hex, NIXL_PORTS["nixl-push"][0])
        out = p.ask(prompt, p_params, request_id=request_id)["params"] or {}
        if out.get("remote_engine_id") != PUSH_P_ENGINE_ID or out.get("transfer_mode", "push") != "push":
            raise BenchError(f"NixlPushConnector P answered {out}; expected engine {PUSH_P_ENGINE_ID}, push mode")
        keys = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")
        d.ask(prompt, {"do_remote_prefill": True, "do_remote_decode": False, **{k: out.get(k) for k in keys}},
              request_id=request_id)

    def nixl_push(self, row: str, p: Engine, d: Engine, n: int) -> None:
        """D's leg first, then P's, at once under one request id: TTFT = D's leg."""
        prompt, request_id = self.prompt(n), str(random.randrange(10**15, 10**16))
        p_params, d_params = self.push_legs(request_id, uuid.uuid4().hex, NIXL_PORTS["nixl-push"][0], self.tp.p)
        d.send(prompt, d_params, request_id=request_id)
        p.send(prompt, p_params, request_id=request_id)
        d_out, p_out = d.receive(), p.receive()
        self.check(row, n, p_out, d_out)
        self.record(row, n, d_out["seconds"], d_out["seconds"], d_out["cached"])

    # ---- the result ------------------------------------------------------------------------------
    def checkpoint(self) -> None:
        """Write what is measured so far to ``--json``: a run cut short keeps it."""
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump(self.result(), f, indent=1)

    def result(self) -> dict:
        devices = self.args.devices
        return {"lengths": self.lengths, "repeats": self.args.repeats, "kv_bytes_per_token": self.kv_bytes_per_token,
                "chunk_tokens": self.args.chunk_tokens, "ttft_ms": self.ms, "d_leg_ms": self.d_leg_ms,
                "start_s": self.start_s, "transport": self.transport, "transport_lines": self.transport_lines,
                "ucx": self.ucx, "skipped": self.skipped, "failures": self.failures, "d_gpu_released": self.released,
                "d_stages_ms": self.stages, "d_loaded_tokens": self.loaded,
                "devices": {"P": devices[0], "D": devices[1]} if devices else None, "tp": self.tp.as_json(),
                "gpu_memory_utilization": self.args.gpu_memory_utilization, "hbm_lease_ms": self.args.hbm_lease_ms,
                "hbm_push": self.args.hbm_push, "device": _device_name(), "vllm": vllm_version(),
                "cuda_graphs": bool(self.args.cuda_graphs), "py_spy": self.profiles, "d_profile": self.d_profile,
                "ucx_cuda_ipc_cache": os.environ.get("UCX_CUDA_IPC_CACHE", "n (kvtier's default)")}


def _device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - a name for the table only
        return "?"
