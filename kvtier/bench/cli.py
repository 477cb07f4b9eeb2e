"""``kvtier-bench``: command-line front end of kvtier's benchmarks.

``kvtier-bench reload --prompt-len 32k`` saves a 32k-token prompt's KV (Llama-3-8B geometry by
default) through kvtier's tiers, reloads it into other blocks, checks the bytes, and prints one
table next to a raw memcpy and the naive per-block copy. ``kvtier-bench pd`` times the first token
of the same prompts recomputed, hit in the engine's prefix cache, and served P/D through
kvtier-proxy (pull and push). ``kvtier-bench ttft`` times the first token recomputed, hit
locally and reloaded from the CPU and disk tiers; ``kvtier-bench engine`` does that and more in a
real CUDA vLLM beside vLLM's own ``OffloadingConnector``; ``kvtier-bench overhead`` compares a mixed
batch's throughput with and without kvtier when nothing hits; ``kvtier-bench pd-soak`` sends P/D
requests while faults strike at random and checks every answer against a recompute; ``kvtier-bench
disk-read`` compares the disk tier's O_DIRECT chunk reads with the disk's sequential read speed. Exit status: 0
measured and verified, 1 the bench failed (verification included), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys

from kvtier.bench.common import Progress, parse_tokens, positive

DTYPES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32",
    "fp8": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier-bench", description="Benchmarks of kvtier's KV offload and reload path.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    reload = commands.add_parser(
        "reload", help="save a prompt's KV to the tiers and reload it into other blocks",
        description="Save a prompt's KV from engine blocks into kvtier's CPU tier (and disk with --disk), reload it "
        "into other blocks, verify the bytes, and compare with a raw memcpy and naive per-block copies.",
    )
    reload.add_argument("--prompt-len", type=parse_tokens, default=32 << 10, metavar="TOKENS",
                        help="prompt length in tokens: 32k, 32K, 32768, 4k ... (default 32k)")
    reload.add_argument("--layers", type=positive, default=32, help="layers (default 32, Llama-3-8B)")
    reload.add_argument("--kv-heads", type=positive, default=8, help="KV heads per layer (default 8)")
    reload.add_argument("--head-dim", type=positive, default=128, help="head dimension (default 128)")
    reload.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="KV dtype (default bfloat16)")
    reload.add_argument("--block-size", type=positive, default=16, help="tokens per engine block (default 16)")
    reload.add_argument("--chunk-tokens", type=positive, default=256, help="tokens per stored chunk (default 256)")
    reload.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    reload.add_argument("--backend", default="auto", help="ops backend: auto, cpu, torch, triton (CUDA), reference")
    reload.add_argument("--no-checksum-rows", dest="checksum_rows", action="store_false",
                        help="on a CPU, skip the whole-path rows of the other chunk-checksum candidates "
                        "(torch copy + xxh3-128 / crc32c / blake3)")
    reload.add_argument("--disk", metavar="PATH", help="add a disk tier in PATH and also measure a cold disk reload")
    reload.add_argument("--shared", "--remote", dest="shared", metavar="URL",
                        help="also reload through the shared tier on this Redis/Valkey server (redis://host:port), "
                             "against raw GETs of the same bytes from it")
    reload.add_argument("--beside-gemm", action="store_true",
                        help="CUDA: also save and reload in a loop beside a bf16 GEMM loop; reports the GEMMs' "
                             "slowdown and kvtier's GB/s meanwhile")
    reload.add_argument("--repeats", type=positive, default=3, help="samples per path (default 3)")
    reload.add_argument("--stat", choices=("best", "median"), default="best",
                        help="which repeat the table shows: best (fastest; default, as interference on a shared "
                        "machine only ever slows a run down) or median; the JSON keeps every sample")
    reload.add_argument("--seed", type=int, default=0, help="seed of the random KV bytes and block shuffle")
    reload.add_argument("--json", metavar="FILE", help="write every number, the device and the geometry to FILE")
    reload.add_argument("--plot", metavar="FILE.png", help="write a bar chart (needs matplotlib)")
    reload.set_defaults(run=_reload, parser=reload)
    from kvtier.bench import (disk_read, engine, executors, lookup, overhead, pd, pd_engines, pd_soak,  # noqa: E402 - light
                              pd_transfer, soak, ttft_tiers)

    disk_read.add_parser(commands)
    engine.add_parser(commands)
    executors.add_parser(commands)
    lookup.add_parser(commands)
    pd.add_parser(commands)
    pd_engines.add_parser(commands)
    pd_soak.add_parser(commands)
    pd_transfer.add_parser(commands)
    soak.add_parser(commands)
    ttft_tiers.add_parser(commands)
    overhead.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.run(args.parser, args)  # the subcommand's parser: its errors show its usage line


def _reload(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.chunk_tokens % args.block_size:
        parser.error(f"argument --chunk-tokens: {args.chunk_tokens} is not a multiple of --block-size {args.block_size}.")
    if args.prompt_len % args.chunk_tokens:
        parser.error(f"argument --prompt-len: {args.prompt_len} tokens is not a whole number of chunks of "
                     f"--chunk-tokens {args.chunk_tokens} (kvtier stores full chunks only).")

    import psutil  # noqa: E402 - heavy imports only once the arguments are known to be good
    import torch

    from kvtier.bench import reload, report
    from kvtier.bench.common import BenchError, VerifyError
    from kvtier.bench.engine_kv import Geometry
    from kvtier.bench.reload_spec import ReloadSpec
    from kvtier.layout import LayoutError
    from kvtier.ops import backend_names
    from kvtier.storage import StorageError

    device = _device(parser, args.device, torch)
    if args.backend != "auto" and args.backend not in backend_names():
        parser.error(f"argument --backend: {args.backend!r} is not available here; choose auto or one of {', '.join(backend_names())}.")
    geometry = Geometry(args.layers, args.kv_heads, args.head_dim, getattr(torch, DTYPES[args.dtype]), args.block_size)
    if args.shared is not None:
        from kvtier.urls import shared_url_problem

        problem = shared_url_problem(args.shared)
        if problem:
            parser.error(f"--shared {problem}")
    spec = ReloadSpec(geometry, args.prompt_len, args.chunk_tokens, device, args.backend, args.disk, args.repeats,
                      args.seed, args.shared, args.checksum_rows, args.beside_gemm)
    if args.beside_gemm and device.type != "cuda":
        parser.error("argument --beside-gemm: needs a CUDA device (it measures what kvtier costs a model's GEMMs).")
    device_bytes, host_bytes = spec.memory_needed()
    available = psutil.virtual_memory().available
    if host_bytes > 0.9 * available:
        parser.error(f"argument --prompt-len: {args.prompt_len} tokens needs about {host_bytes / 2**30:.1f} GiB of host "
                     f"memory (engine KV twice plus the CPU tier); {available / 2**30:.1f} GiB is available.")
    if device_bytes and device_bytes > torch.cuda.mem_get_info(device)[0]:
        parser.error(f"argument --prompt-len: {args.prompt_len} tokens needs {device_bytes / 2**30:.1f} GiB on {device}.")

    progress = Progress()
    try:
        result = reload.run(spec, progress)
    except VerifyError as exc:
        print(f"\nkvtier-bench: VERIFICATION FAILED: {exc}\n", file=sys.stderr)
        return 1
    except (BenchError, StorageError, LayoutError) as exc:
        print(f"kvtier-bench: error: {exc}", file=sys.stderr)
        return 1
    print(report.format_table(result, args.stat), flush=True)
    if args.json:
        report.write_json(result, args.json, args.stat)
        progress(f"wrote {args.json}")
    if args.plot:
        skipped = report.write_plot(result, args.plot, args.stat)
        progress(skipped or f"wrote {args.plot}")
    return 0


def _device(parser: argparse.ArgumentParser, name: str, torch):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        parser.error(f"argument --device: {name!r} is not a device; use auto, cpu, cuda or cuda:N.")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"argument --device: {name!r}: only cpu and cuda are supported.")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("argument --device: CUDA is not available on this machine.")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            parser.error(f"argument --device: {name!r}, but only {torch.cuda.device_count()} CUDA devices exist.")
    return device


if __name__ == "__main__":
    sys.exit(main())
