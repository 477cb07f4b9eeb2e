import pytest

from kvtier.config import ConfigError, KvtierConfig


def test_defaults_and_values():
    config = KvtierConfig.from_dict({"cpu_bytes": "1024", "chunk_tokens": 64, "disk_path": "/tmp/x"})
    assert (config.cpu_bytes, config.chunk_tokens, config.disk_path) == (1024, 64, "/tmp/x")
    assert KvtierConfig.from_dict(None).cpu_bytes >= 1 << 28


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"cpu_byte": 1}, "'cpu_byte'"),
        ({"chunk_tokens": 0}, "'chunk_tokens'"),
        ({"chunk_tokens": "many"}, "'chunk_tokens'"),
        ({"cpu_bytes": True}, "'cpu_bytes'"),
        ({"disk_path": 3}, "'disk_path'"),
        ({"shared_url": "http://host:6379"}, "'shared_url'.*redis://"),
        ({"shared_url": "redis://host"}, "'shared_url'.*port"),
        ({"shared_url": "redis://host:6379?socket_timeout=9"}, "'shared_url'.*query"),
        ({"shared_timeout_ms": 0}, "'shared_timeout_ms'"),
        ({"pd_hbm_push": "push"}, "'pd_hbm_push'.*'read' or 'write'"),
        ({"switch_interval_us": 6000}, "'switch_interval_us'.*0 to 5000"),
        ({"switch_interval_us": -1}, "'switch_interval_us'"),
        ({"idle_wait_us": 5001}, "'idle_wait_us'.*0 to 5000"),
        ({"remote_url": "redis://host:6379"}, "'remote_url'"),  # the tier is called shared
    ],
)
def test_bad_settings_name_the_key(raw, key):
    with pytest.raises(ConfigError, match=key):
        KvtierConfig.from_dict(raw)


def test_chunk_must_be_a_multiple_of_the_block_size():
    with pytest.raises(ConfigError, match="'chunk_tokens' \\(48\\).*block size \\(32\\)"):
        KvtierConfig.from_dict({"chunk_tokens": 48}).check_block_size(32)


def test_a_shared_url_password_never_shows_in_errors():
    with pytest.raises(ConfigError) as err:
        KvtierConfig.from_dict({"shared_url": "redis://user:hunter2@host"})
    assert "hunter2" not in str(err.value) and "user:***@host" in str(err.value)
    assert KvtierConfig.from_dict({"shared_url": "valkey://:pw@host:6379/1"}).shared_url == "valkey://:pw@host:6379/1"


@pytest.mark.parametrize("key,hint", [("remote_url", "shared_url"), ("cpu_byte", "cpu_bytes")])
def test_an_unknown_key_names_the_setting_meant(key, hint):
    with pytest.raises(ConfigError, match=f"'{key}' \\(did you mean '{hint}'\\?\\)"):
        KvtierConfig.from_dict({key: 1})


def test_the_thread_switch_interval_comes_from_the_setting_else_the_environment(monkeypatch):
    monkeypatch.delenv("KVTIER_SWITCH_INTERVAL_US", raising=False)
    assert KvtierConfig.from_dict({}).switch_interval_s == 0.0005
    monkeypatch.setenv("KVTIER_SWITCH_INTERVAL_US", "250")
    assert KvtierConfig.from_dict({}).switch_interval_s == 0.00025
    assert KvtierConfig.from_dict({"switch_interval_us": 0}).switch_interval_s == 0  # Python's own is left
    monkeypatch.setenv("KVTIER_SWITCH_INTERVAL_US", "fast")
    with pytest.raises(ConfigError, match="KVTIER_SWITCH_INTERVAL_US"):
        KvtierConfig.from_dict({}).switch_interval_s


def test_the_idle_wait_comes_from_the_setting_else_the_environment_else_2_ms(monkeypatch):
    monkeypatch.delenv("KVTIER_IDLE_WAIT_US", raising=False)
    assert KvtierConfig.from_dict({}).idle_wait_s == 0.002
    monkeypatch.setenv("KVTIER_IDLE_WAIT_US", "0")
    assert KvtierConfig.from_dict({}).idle_wait_s == 0  # steps on at once, as vLLM does
    assert KvtierConfig.from_dict({"idle_wait_us": 500}).idle_wait_s == 0.0005
    monkeypatch.setenv("KVTIER_IDLE_WAIT_US", "2ms")
    with pytest.raises(ConfigError, match="KVTIER_IDLE_WAIT_US"):
        KvtierConfig.from_dict({}).idle_wait_s


def test_a_boolean_setting_takes_true_or_false_and_names_its_key_otherwise():
    assert KvtierConfig.from_dict({"save_replies": False}).save_replies is False
    assert KvtierConfig.from_dict({"save_replies": "true"}).save_replies is True
    with pytest.raises(ConfigError, match="'save_replies' must be true or false"):
        KvtierConfig.from_dict({"save_replies": 1})
