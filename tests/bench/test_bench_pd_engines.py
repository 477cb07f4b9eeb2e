"""``kvtier-bench pd-engines`` without engines: its table, rates, plot and argument errors on a
result of the shape a run writes; ``--devices`` and the environment each engine gets; the
transports read from UCX's and kvtier's log lines; and whole pairs driven against stand-in engines
(what each row sends P and D, what it records); ``--tp`` in test_bench_pd_engines_tp.py,
``--py-spy`` and ``--profile`` in test_bench_pd_engines_profiles.py. The engines themselves run on a GPU:
tests/gpu/test_gpu_pd.py drives the same engine processes."""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvtier.bench import pd_child, pd_engines, pd_engines_report, pd_engines_rows
from pd_engines_fakes import (CPU_LINE, EITHER_LINE, HBM_LINE, ROOT, UCX_CMA, UCX_IPC, UCX_RC, ZMQ_LINE, FakeEngine,
                              fabricated_result, stand_in_run)


def test_pull_rate_is_kv_bytes_over_the_d_leg_beyond_a_local_hit():
    result = fabricated_result()
    assert abs(pd_engines.transfer_gbps(result, "kvtier pull hbm", "8192") - 8192 * (128 << 10) / 0.2 / 1e9) < 1e-6
    assert abs(pd_engines.transfer_gbps(result, "kvtier pull after lease", "8192") - 8192 * (128 << 10) / 0.3 / 1e9) < 1e-6
    assert pd_engines.transfer_gbps(result, "kvtier push nixl", "8192") is None  # its D leg includes P's prefill
    assert pd_engines.transfer_gbps(result, "kvtier pull zmq", "8192") is None  # not run


def test_table_shows_rows_run_their_transport_and_whether_every_answer_loaded(tmp_path):
    table = pd_engines.format_table(fabricated_result())
    rows = {line.split("  ")[0].strip(): line for line in table.splitlines()}
    assert rows["kvtier pull hbm"].endswith("NIXL HBM to HBM") and "550" in rows["kvtier pull hbm"]
    assert rows["kvtier pull after lease"].endswith("NIXL to CPU tier") and "650" in rows["kvtier pull after lease"]
    assert re.search(r"\nNixlPushConnector push +skipped: vLLM 0.24.0 registers no NixlPushConnector\n", table)
    assert "NixlConnector pull" not in table and "kvtier pull zmq" not in table and ": yes" in table
    assert "P on device 0, D on device 1 (gpu_memory_utilization 0.8 each; eager)" in table
    assert "UCX (kvtier): intra-node: remote memory read by ucp_get* from cuda memory: cuda_ipc" in table
    assert "self: remote memory" not in table
    assert "P's lease (2000 ms) + 500 ms" in table
    assert ("P's prefill leg of each pull (TTFT - D's leg, median ms; 8192 tok): kvtier pull hbm 250, "
            "kvtier pull after lease 250\n") in table  # not the push row: its D leg is its TTFT
    assert "P and D on one device" in pd_engines.format_table({**fabricated_result(), "devices": None})
    assert "NO: kvtier pull hbm 8192: D loaded 0" in pd_engines.format_table(
        fabricated_result(["kvtier pull hbm 8192: D loaded 0 of 8192 tokens (expected >= 7936)"]))
    if importlib.util.find_spec("matplotlib") is not None:
        png = tmp_path / "pd.png"
        assert pd_engines.write_plot(fabricated_result(), str(png)) is None and png.stat().st_size > 0


def test_unknown_pair_or_bad_devices_are_refused_naming_the_flag():
    for flag, value in (("--pairs", "kvtier,lmcache"), ("--devices", "0"), ("--devices", "0,1,2")):
        run = subprocess.run([sys.executable, "-m", "kvtier.bench.cli", "pd-engines", flag, value],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and flag in run.stderr, (flag, value, run.stderr)


# ---- --devices and each engine's environment ------------------------------------------------------
def test_devices_are_p_then_d_and_set_the_default_memory_share():
    assert pd_engines.parse_devices(None) is None
    assert pd_engines.parse_devices("0,1") == ("0", "1")
    assert pd_engines.parse_devices(" 2, GPU-4a5b ") == ("2", "GPU-4a5b")
    for bad in ("0", "0,1,2", "0,", ",1", ""):
        with pytest.raises(ValueError):
            pd_engines.parse_devices(bad)
    assert pd_engines.memory_share(("0", "1"), None) == 0.8  # a GPU each
    assert pd_engines.memory_share(("0", "0"), None) == 0.35  # both on one
    assert pd_engines.memory_share(None, None) == 0.35
    assert pd_engines.memory_share(("0", "1"), 0.5) == 0.5


def test_each_engine_gets_its_own_device():
    assert pd_engines.engine_env("P", ("0", "1")) == {"CUDA_VISIBLE_DEVICES": "0"}
    assert pd_engines.engine_env("D", ("0", "1"), {"UCX_PROTO_INFO": "y"}) == {"CUDA_VISIBLE_DEVICES": "1",
                                                                              "UCX_PROTO_INFO": "y"}
    assert pd_engines.engine_env("D", None, {"UCX_PROTO_INFO": "y"}) == {"UCX_PROTO_INFO": "y"}


# ---- the engine process: connectors and request ids ---------------------------------------------
def test_vllm_nixl_connectors_are_configured_by_name_with_an_engine_id(monkeypatch):
    config = types.ModuleType("vllm.config")
    config.KVTransferConfig = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.config", config)
    assert pd_child._transfer_config({"connector": "nixl-push", "engine_id": "P-1"}) == {
        "kv_connector": "NixlPushConnector", "kv_role": "kv_both", "engine_id": "P-1"}
    assert pd_child._transfer_config({"connector": "nixl"}) == {
        "kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": None}


def test_a_request_id_names_the_next_request_then_the_counter_comes_back():
    llm = types.SimpleNamespace(request_counter=itertools.count())
    with pd_child.request_named(llm, "4242"):
        assert str(next(llm.request_counter)) == "4242"  # as LLM names the request it adds
    assert next(llm.request_counter) == 0
    with pd_child.request_named(llm, None):
        assert next(llm.request_counter) == 1


def test_this_vllm_names_offline_requests_by_its_counter():
    """The hook :func:`pd_child.request_named` relies on (and LLM sorts answers by int(id))."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    root = Path(list(spec.submodule_search_locations)[0]) / "entrypoints"
    src = "".join(p.read_text() for p in (root / "llm.py", root / "common" / "offline.py") if p.exists())
    assert "str(next(self.request_counter))" in src


# ---- transports ------------------------------------------------------------------------------------
def test_kvtier_transport_lines_are_named():
    assert pd_engines_report.kvtier_paths(HBM_LINE) == ["NIXL HBM to HBM"]
    assert pd_engines_report.kvtier_paths(CPU_LINE) == ["NIXL to CPU tier"]
    assert pd_engines_report.kvtier_paths(EITHER_LINE) == ["NIXL HBM to HBM", "NIXL to CPU tier"]
    assert pd_engines_report.kvtier_paths(ZMQ_LINE) == ["ZMQ"]
    assert pd_engines_report.kvtier_paths("kvtier P/D: fetching from tcp://h:1 over UCX-foo.") == ["UCX-foo"]
    assert pd_engines_report.kvtier_paths("kvtier P/D: fetching from tcp://h:1") == ["?"]


def test_a_row_takes_the_line_logged_during_it_else_the_earlier_one_that_fits():
    rt = pd_engines_report.row_transport
    assert rt("kvtier pull after lease", [CPU_LINE], [HBM_LINE, CPU_LINE]) == "NIXL to CPU tier"
    assert rt("kvtier pull hbm", [], [HBM_LINE]) == "NIXL HBM to HBM"  # logged at the warm-up
    assert rt("kvtier push nixl", [], [HBM_LINE]) == "NIXL HBM to HBM"
    assert rt("kvtier push nixl", [], [CPU_LINE, "kvtier P/D: fetching from tcp://h:1 over NIXL."]) == (
        "NIXL to CPU tier or NIXL")
    # One line offering both paths serves both rows.
    assert rt("kvtier pull hbm", [], [EITHER_LINE]) == "NIXL HBM to HBM"
    assert rt("kvtier pull after lease", [], [EITHER_LINE]) == "NIXL to CPU tier"
    assert rt("kvtier pull hbm", [], [CPU_LINE]) == "? (D logged: NIXL to CPU tier)"  # no HBM path
    assert rt("kvtier pull after lease", [HBM_LINE], [CPU_LINE, HBM_LINE]) == (  # the lease never ended
        "? (D logged: NIXL to CPU tier, NIXL HBM to HBM)")
    assert rt("kvtier pull after lease", [], [HBM_LINE]) == "? (D logged: NIXL HBM to HBM)"
    assert rt("kvtier pull zmq", [], []) == "? (D logged no transport line)"


def test_ucx_protocol_tables_give_the_transport_per_endpoint_and_operation():
    rc = pd_engines_report.ucx_protocols(UCX_RC)
    assert rc == {"intra-node: remote memory write by ucp_put*(fast-completion) from host memory to cuda/dev[0]":
                  ["rc_mlx5"]}
    cma = pd_engines_report.ucx_protocols(UCX_CMA)
    assert cma == {"self: remote memory write by ucp_put* from host memory to host": ["cma"],
                   "intra-node: remote memory write by ucp_put* from host memory to host": ["cma"],
                   "intra-node: active message by ucp_am_send* from host memory": ["posix", "tcp"]}
    assert pd_engines_report.ucx_transport(cma) == "UCX cma"  # the WRITE's, not the messages'
    # GPU memory's protocols where UCX printed any; an agent's loopback (self) never counts.
    assert pd_engines_report.ucx_transport(pd_engines_report.merge_protocols(rc, cma)) == "UCX rc_mlx5"
    both = pd_engines_report.merge_protocols(rc, cma, pd_engines_report.ucx_protocols(UCX_IPC))
    assert pd_engines_report.ucx_transport(both) == "UCX cuda_ipc+rc_mlx5"
    assert pd_engines_report.ucx_transport({"self: remote memory write by ucp_put*": ["cma"]}).startswith(
        "? (UCX printed no remote-memory protocol")
    assert pd_engines_report.ucx_transport({}).startswith("? (no UCX protocol lines")


# ---- whole pairs against stand-in engines ---------------------------------------------------------
@pytest.fixture
def run(tmp_path, monkeypatch):
    """A :class:`Run` over stand-in engines, P and D on devices 0 and 1, P's lease 2000 ms."""
    return stand_in_run(tmp_path, monkeypatch)


def test_kvtier_pair_rows_lease_wait_and_transports(run, tmp_path):
    run.kvtier_pair(str(tmp_path))
    p, d_nixl, d_zmq = FakeEngine.started
    assert p.spec["kvtier"]["pd_hbm_lease_ms"] == 2000 and "pd_hbm_lease_ms" not in d_nixl.spec["kvtier"]
    assert (p.env["CUDA_VISIBLE_DEVICES"], d_nixl.env["CUDA_VISIBLE_DEVICES"]) == ("0", "1")
    assert run.waits == [2.5, 2.5]  # lease + 500 ms, once per repeat
    result = json.loads((tmp_path / "pd.json").read_text())
    assert result["ttft_ms"]["kvtier pull after lease"]["600"] == pytest.approx([150.0, 150.0])  # the wait not counted
    assert result["ttft_ms"]["kvtier pull hbm"]["600"] == pytest.approx([150.0, 150.0])
    assert result["d_leg_ms"]["kvtier push zmq"]["600"] == pytest.approx([50.0, 50.0])
    assert result["transport"] == {"kvtier pull hbm": "NIXL HBM to HBM", "kvtier pull after lease": "NIXL to CPU tier",
                                   "kvtier push nixl": "NIXL HBM to HBM or NIXL to CPU tier", "kvtier pull zmq": "ZMQ",
                                   "kvtier push zmq": "ZMQ"}
    assert result["devices"] == {"P": "0", "D": "1"} and result["hbm_lease_ms"] == 2000 and not result["failures"]
    assert len(run.result()["transport_lines"]) == 3  # D over NIXL: HBM and CPU tier; D over ZMQ: ZMQ


def test_a_second_pd_hbm_push_gets_a_d_of_its_own_for_its_push_row(run, tmp_path):
    run.args.hbm_push = ["read", "write"]
    run.kvtier_pair(str(tmp_path))
    p, d_read, d_write, d_zmq = FakeEngine.started
    assert (d_read.spec["kvtier"]["pd_hbm_push"], d_write.spec["kvtier"]["pd_hbm_push"]) == ("read", "write")
    assert "pd_hbm_push" not in p.spec["kvtier"] and "pd_hbm_push" not in d_zmq.spec["kvtier"]
    result = run.result()
    assert result["d_leg_ms"]["kvtier push nixl write"]["600"] == pytest.approx([50.0, 50.0])
    assert len(result["ttft_ms"]["kvtier pull hbm"]["600"]) == 2  # the pulls ran on the first D only
    assert result["hbm_push"] == ["read", "write"]
    assert "'kvtier push nixl': D's pd_hbm_push read" in pd_engines.format_table(result)


def test_without_zmq_the_pair_starts_no_d_over_zmq_and_says_its_rows_were_skipped(run, tmp_path):
    run.args.zmq = False
    run.kvtier_pair(str(tmp_path))
    p, d_nixl = FakeEngine.started
    result = run.result()
    assert result["skipped"]["kvtier push zmq"] == "--no-zmq" and not result["ttft_ms"]["kvtier push zmq"]["600"]
    assert len(result["ttft_ms"]["kvtier push nixl"]["600"]) == 2


def test_without_the_lease_setting_the_after_lease_row_is_skipped(run, tmp_path, monkeypatch):
    monkeypatch.setattr(pd_engines_rows, "hbm_lease_missing", lambda: "no pd_hbm_lease_ms here")
    run = pd_engines_rows.Run(run.args, run.model, run.lengths, run.progress)
    run.kvtier_pair(str(tmp_path))
    assert "pd_hbm_lease_ms" not in FakeEngine.started[0].spec["kvtier"]
    result = run.result()
    assert result["skipped"] == {"kvtier pull after lease": "no pd_hbm_lease_ms here"}
    assert re.search(r"\nkvtier pull after lease +skipped: no pd_hbm_lease_ms here\n", pd_engines.format_table(result))


def test_nixl_push_pair_sends_both_legs_at_once_under_one_request_id(run, tmp_path):
    run.nixl_pair(str(tmp_path), "nixl-push")
    p, d = FakeEngine.started
    assert p.spec["connector"] == d.spec["connector"] == "nixl-push"
    assert p.spec["engine_id"] == pd_engines_rows.PUSH_P_ENGINE_ID and d.spec["engine_id"] is None
    assert (p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"], d.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ("5800", "5900")
    assert p.env["UCX_PROTO_INFO"] == d.env["UCX_PROTO_INFO"] == "y" and d.env["CUDA_VISIBLE_DEVICES"] == "1"
    # The warm-up gives D what P answered (the test proxy's way); the timed pushes name P up front.
    (warm_p, warm_id), (warm_d, warm_d_id) = p.sent[0], d.sent[0]
    assert warm_d_id == warm_id and warm_d["remote_request_id"] == f"{warm_id}-0123abcd"
    for (p_params, p_id), (d_params, d_id) in zip(p.sent[1:], d.sent[1:]):
        assert p_id == d_id and p_id.isdigit() and p_params["transfer_id"] == d_params["transfer_id"]
        assert p_params["do_remote_decode"] and not p_params["do_remote_prefill"]
        assert d_params["do_remote_prefill"] and d_params["remote_engine_id"] == pd_engines_rows.PUSH_P_ENGINE_ID
        assert (d_params["remote_port"], d_params["remote_request_id"], d_params["tp_size"]) == (5800, d_id, 1)
    assert len(p.sent) == len(d.sent) == 3
    result = run.result()
    assert result["ttft_ms"]["NixlPushConnector push"]["600"] == pytest.approx([50.0, 50.0])  # D's leg
    assert result["transport"]["NixlPushConnector push"] == "UCX cma" and not result["failures"]
    assert "NixlPushConnector push" in pd_engines.format_table(result)


def test_nixl_pull_pair_reads_ucx_and_a_vllm_without_push_skips_its_row(run, tmp_path, monkeypatch):
    run.nixl_pair(str(tmp_path))
    assert run.result()["transport"]["NixlConnector pull"] == "UCX cuda_ipc"
    assert run.ms["NixlConnector pull"]["600"] == pytest.approx([150.0, 150.0])
    FakeEngine.started = []
    monkeypatch.setattr(pd_engines_rows, "push_connector_missing", lambda: "vLLM 0.24.0 registers no NixlPushConnector")
    run.nixl_pair(str(tmp_path), "nixl-push")
    assert FakeEngine.started == [] and run.skipped["NixlPushConnector push"].endswith("no NixlPushConnector")


def test_a_stopped_engines_gpu_memory_is_waited_for_and_what_stays_held_is_reported(monkeypatch):
    """A peer still mapping a stopped D's KV cache keeps it held, and the next D there fails to start."""
    from kvtier.bench import pd_engine_proc

    monkeypatch.setattr(pd_engine_proc.time, "sleep", lambda s: None)
    used = iter([97_000.0, 97_000.0, 10.0])
    monkeypatch.setattr(pd_engine_proc, "gpu_used_mib", lambda device: next(used))
    assert pd_engine_proc.wait_released("1", 4.0)["held_mib"] == 6  # back, within the slack
    monkeypatch.setattr(pd_engine_proc, "gpu_used_mib", lambda device: 97_000.0)
    assert pd_engine_proc.wait_released("1", 4.0, timeout_s=0.0) == {"s": 0.0, "held_mib": 96_996}


def test_kvtier_pair_records_how_long_each_ds_gpu_memory_took_to_come_back(run, tmp_path, monkeypatch):
    monkeypatch.setattr(pd_engines_rows, "gpu_used_mib", lambda device: 4.0)
    asked = []
    monkeypatch.setattr(pd_engines_rows, "wait_released",
                        lambda device, before: asked.append((device, before)) or {"s": 5.5, "held_mib": 0})
    run.kvtier_pair(str(tmp_path))
    assert asked == [("1", 4.0), ("1", 4.0)]
    result = run.result()
    assert set(result["d_gpu_released"]) == {"kvtier-D-nixl", "kvtier-D-zmq"}
    line = "GPU memory of kvtier-D-nixl after it stopped: 0 MiB still held 5.5 s later"
    assert line in pd_engines_report.format_table(result)


def test_a_d_whose_gpu_memory_stays_held_makes_the_pair_restart_p_before_the_next_d(run, tmp_path, monkeypatch):
    monkeypatch.setattr(pd_engines_rows, "gpu_used_mib", lambda device: 4.0)
    monkeypatch.setattr(pd_engines_rows, "wait_released", lambda device, before: {"s": 30.0, "held_mib": 96_000})
    run.kvtier_pair(str(tmp_path))
    assert [e.name for e in FakeEngine.started] == ["kvtier-P", "kvtier-D-nixl", "kvtier-P", "kvtier-D-zmq"]
    assert "kvtier P, restarted" in run.result()["start_s"] and not run.result()["failures"]


def test_kvtier_rows_say_where_ds_leg_went_from_the_engines_timeline_marks(run, tmp_path, monkeypatch):
    """The marks of kvtier.timeline (engines at DEBUG), P's and D's joined by transfer id."""
    marks = {"P": "DEBUG kvtier timeline: p-1 finished 10.000 transfer t\n",
             "D": "".join(f"DEBUG kvtier timeline: d-1 {event} {at:.3f}{' transfer t' if event == 'arrived' else ''}\n"
                          for event, at in (("arrived", 10.010), ("planned", 10.011), ("load began", 10.012),
                                            ("load ended", 10.040), ("load reported", 10.041), ("load seen", 10.043)))}
    plain = FakeEngine.log_text
    monkeypatch.setattr(FakeEngine, "log_text", lambda self, start=0: plain(self, start) + (
        marks[self.role] if self.spec["connector"] == "kvtier" else ""))
    run.kvtier_pair(str(tmp_path))
    result = run.result()
    stages = result["d_stages_ms"]["kvtier pull hbm"]["600"]
    assert stages["load began -> load ended"] == pytest.approx([28.0, 28.0])
    assert stages["producer finished -> consumer arrived"] == pytest.approx([10.0, 10.0])
    assert "NixlConnector pull" not in result["d_stages_ms"]
    assert ("where kvtier pull hbm's D leg went at 600 tokens (median ms, kvtier timeline): "
            "producer finished -> consumer arrived 10.0, arrived -> planned 1.0") in pd_engines_report.format_table(result)


def test_the_table_says_how_the_engines_mapped_a_peers_gpu_memory():
    table = pd_engines.format_table({**fabricated_result(), "ucx_cuda_ipc_cache": "y"})
    assert "UCX_CUDA_IPC_CACHE in the engines: y (n: a peer's GPU memory mapped per transfer; y: kept mapped" in table
    assert "UCX_CUDA_IPC_CACHE" not in pd_engines.format_table(fabricated_result())  # older results name none


def test_cuda_graphs_turn_eager_off_in_every_engine_and_the_table_says_so(run, monkeypatch):
    built = []
    vllm = types.ModuleType("vllm")
    vllm.LLM = lambda **kw: built.append(kw)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    pd_child.build_engine({**run.spec("none"), "connector": "none"})
    run.args.cuda_graphs = True
    pd_child.build_engine({**run.spec("none"), "connector": "none"})
    assert [kw["enforce_eager"] for kw in built] == [True, False]
    assert run.result()["cuda_graphs"] is True
    assert "; CUDA graphs)" in pd_engines.format_table({**fabricated_result(), "cuda_graphs": True})
    assert "; eager)" in pd_engines.format_table(fabricated_result())  # results written before the flag: eager
