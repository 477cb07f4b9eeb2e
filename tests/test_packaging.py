"""Installing kvtier into an existing serving environment changes none of its pinned packages.

The GPU machines run vLLM 0.26 on torch 2.11; kvtier is a vLLM plugin installed beside it. If
kvtier (or a dependency such as lmcache) pinned another torch, `pip install kvtier` would replace
torch and break vLLM. The CPU torch pin of the development set-up belongs to the Makefile.

The test asks pip for a dry-run report of installing this project into a throw-away venv (no pip
in it) whose site-packages holds fake installed distributions, and checks that the report installs
none of them again (no upgrade, downgrade or reinstall). pip resolves the whole dependency tree, so
a pin on torch in kvtier's own dependencies or in lmcache's makes it fail.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What the serving environment already has: name -> version. torch 2.11.0 is vLLM 0.26's torch.
INSTALLED = {"torch": "2.11.0"}

# pip's output when it could not reach an index: skip, since that is no verdict on the packaging.
NETWORK_ERRORS = re.compile(
    r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution"
    r"|Name or service not known|Failed to establish a new connection|Network is unreachable"
    r"|Connection refused|ConnectTimeoutError|ReadTimeoutError|timed out|Could not fetch URL"
    r"|ProxyError|RemoteDisconnected|ConnectionResetError"
)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _fake_dist(site_packages: Path, name: str, version: str) -> None:
    info = site_packages / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("")
    (info / "INSTALLER").write_text("")


def test_build_backend_needs_no_torch():
    """The dry run builds kvtier's metadata in an isolated build env: only setuptools goes there."""
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
    assert all(not _canonical(r).startswith("torch") for r in build["requires"]), build["requires"]


def test_install_keeps_installed_torch(tmp_path):
    pip_version = importlib.metadata.version("pip")
    if tuple(int(p) for p in re.findall(r"\d+", pip_version)[:2]) < (22, 3):
        pytest.skip(f"pip {pip_version} has no --python (needs pip >= 22.3)")

    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    env_python = env / "bin" / "python"
    site_packages = Path(
        subprocess.run(
            [str(env_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )
    for name, version in INSTALLED.items():
        _fake_dist(site_packages, name, version)

    report = tmp_path / "report.json"
    cmd = [
        sys.executable, "-m", "pip", "--python", str(env_python),
        "install", "--dry-run", "--quiet", "--report", str(report),
        "--timeout", "30", "--retries", "2",
        str(ROOT),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip("pip's dry run took over 300 s: the package index is too slow to reach")
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        if NETWORK_ERRORS.search(output):
            pytest.skip("package index unreachable: " + NETWORK_ERRORS.search(output).group(0))
        pytest.fail(f"pip's dry run failed (exit {proc.returncode}):\n{output[-4000:]}")

    install = json.loads(report.read_text())["install"]
    planned = {_canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in install}
    assert "kvtier" in planned, sorted(planned)
    changed = {
        name: f"{version} -> {planned[_canonical(name)]}"
        for name, version in INSTALLED.items()
        if _canonical(name) in planned
    }
    assert not changed, f"installing kvtier would replace installed distributions: {changed}"
