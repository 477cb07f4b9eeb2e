"""Run every GPU test module at once, each on its own GPUs: the whole GPU suite of a multi-GPU host.

``python tests/gpu/run_shards.py --out DIR [--timeout-s 900] [FILE ...]``

Each module runs as its own ``pytest`` process with ``CUDA_VISIBLE_DEVICES`` set to the GPUs it
needs (:data:`NEEDS`: P/D modules put P and D on two GPUs, the TP module takes every GPU, the
served module two for its TP=2 server; the rest one). Modules wanting more GPUs start first; a
module starts as soon as enough GPUs are free. With fewer GPUs than a module names, it gets
them all (its tests skip what does not fit, and say why). Each module's output goes to
``DIR/<module>.log`` and its results to ``DIR/<module>.xml`` (JUnit); a progress line per start and
end, then a table, and ``DIR/summary.json``. Exit status 1 when a module failed or timed out.
Give it the machine alone: two engines starting on one GPU at once fail vLLM's memory check.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# GPUs per job (default 1). A job is a module, or a module's tests selected by ``-k`` (``FILE:K``).
NEEDS = {"test_gpu_tp.py:tp2": 2, "test_gpu_tp.py:tp4": 4, "test_gpu_served.py": 2, "test_gpu_pd.py": 2,
         "test_gpu_pd_hbm.py": 2, "test_gpu_pd_tp.py": 4, "test_gpu_pd_hybrid.py": 2, "test_gpu_pd_mamba.py": 2,
         "test_gpu_pd_hetero_tp.py": 3}  # 2 will do (D shares a GPU)
# One job per TP size, and per model family of the hybrid module (one after the other they outlast
# a module's time limit on one GPU).
SPLIT = {"test_gpu_tp.py": ("tp2", "tp4"),
         "test_gpu_hybrid.py": ("gemma3", "gpt_oss", "llama4", "granite_hybrid", "nemotron_h")}
INTERRUPT_GRACE_S = 60.0  # a timed-out module's teardown, before its process group is killed


def visible_gpus() -> list[str]:
    """The GPU indices this process may use (``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def _name(job: str) -> str:
    """File stem of a job's log and JUnit file: ``test_gpu_tp.py:tp2`` -> ``test_gpu_tp-tp2``."""
    module, _, k = job.partition(":")
    return module[:-3] + (f"-{k}" if k else "")


def junit_counts(path: Path) -> dict[str, int]:
    """passed / failed / skipped test counts of a JUnit file (all 0 when it is missing)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    if not path.exists():
        return counts
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        key = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        counts[key] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for each module's log and JUnit file")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per module (s)")
    ap.add_argument("files", nargs="*", help="modules under tests/gpu (default: every test_*.py)")
    args = ap.parse_args(argv)
    gpus = visible_gpus()
    if not gpus:
        print("no GPU visible: nothing to run")
        return 1
    files = [Path(f).name for f in args.files] or sorted(p.name for p in HERE.glob("test_*.py"))
    jobs = [job for f in files for job in ([f"{f}:{k}" for k in SPLIT[f]] if f in SPLIT else [f])]
    want = {job: min(NEEDS.get(job, 1), len(gpus)) for job in jobs}
    queue = sorted(jobs, key=lambda job: -want[job])  # wider jobs first
    args.out.mkdir(parents=True, exist_ok=True)
    free, running, results, t0 = list(gpus), {}, {}, time.monotonic()
    while queue or running:
        for f in list(queue):
            if want[f] <= len(free):
                mine, free = free[:want[f]], free[want[f]:]
                env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(mine), PYTHONUNBUFFERED="1")
                module, _, k = f.partition(":")
                name = _name(f)
                log = open(args.out / f"{name}.log", "wb")
                basetemp = Path("/tmp/gpu-shards") / args.out.name / name
                basetemp.parent.mkdir(parents=True, exist_ok=True)
                cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", str(HERE / module),
                       "--junitxml", str(args.out / f"{name}.xml"), "--basetemp", str(basetemp)]
                cmd += ["-k", k] if k else []
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                        start_new_session=True)
                running[f] = (proc, mine, time.monotonic(), log)
                queue.remove(f)
                print(f"[{time.monotonic() - t0:6.0f} s] start {f} on GPU {','.join(mine)}", flush=True)
        time.sleep(1.0)
        for f, (proc, mine, started, log) in list(running.items()):
            late = time.monotonic() - started > args.timeout_s
            if proc.poll() is None and not late:
                continue
            if late and proc.poll() is None:
                # SIGINT first: pytest's teardown ends the engines it started, each in its own group
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(INTERRUPT_GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            log.close()
            counts = junit_counts(args.out / f"{_name(f)}.xml")
            results[f] = dict(counts, gpus=len(mine), seconds=round(time.monotonic() - started),
                              rc="timeout" if late else proc.returncode)
            free += mine
            del running[f]
            print(f"[{time.monotonic() - t0:6.0f} s] end   {f}: {counts['passed']} passed, {counts['failed']} failed, "
                  f"{counts['skipped']} skipped, rc {results[f]['rc']}", flush=True)
    print(f"\n{'job':28} {'GPUs':>4} {'passed':>6} {'failed':>6} {'skipped':>7} {'s':>5}  rc")
    for f, r in sorted(results.items()):
        print(f"{f:28} {r['gpus']:>4} {r['passed']:>6} {r['failed']:>6} {r['skipped']:>7} {r['seconds']:>5}  {r['rc']}")
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r["rc"] in (0, 5) and not r["failed"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
