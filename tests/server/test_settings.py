"""One typed source of defaults: flags > KVBLEND_* environment > YAML file > defaults."""

from __future__ import annotations

import json

import pytest

from kvblend.cli import build_parser, main
from kvblend.rag.chunking import ChunkerConfig
from kvblend.settings import Settings, SettingsError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("KVBLEND_") and name != "KVBLEND_HOME":
            monkeypatch.delenv(name)


def write_yaml(tmp_path, text: str):
    path = tmp_path / "kvblend.yaml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    s = Settings.load()
    assert (s.host, s.port, s.model, s.device, s.dtype) == ("127.0.0.1", 8000, "smollm2-135m", "cpu", "float32")
    assert s.model_id == "smollm2-135m" and s.api_keys == {} and s.admin_key is None
    assert s.blend.blend_config().ratio == 0.2 and s.store.store_config().memory_bytes == 1024**3
    assert s.documents.chunk_tokens == ChunkerConfig().size  # the rag chunker's default


def test_a_redis_cluster_is_selected_by_settings(tmp_path, monkeypatch) -> None:
    cfg = write_yaml(tmp_path, "store:\n  redis_cluster: true\n  redis_url: redis://10.0.0.1:7000,redis://10.0.0.2:7000\n"
                               "  redis_groups: 32\n")
    monkeypatch.setenv("KVBLEND_STORE__REDIS_TIMEOUT_S", "0.25")
    config = Settings.load(cfg).store.store_config()
    assert config.redis_cluster and config.redis_groups == 32 and config.redis_timeout_s == 0.25
    assert config.redis_url == "redis://10.0.0.1:7000,redis://10.0.0.2:7000" and "redis" in config.enabled_tiers
    monkeypatch.setenv("KVBLEND_STORE__REDIS_URL", "redis://:s3cret-pw@10.0.0.1:7000,rediss://kv:s3cret-pw@h2:7000")
    shown = Settings.load(cfg).redacted()["store"]["redis_url"]
    assert "s3cret" not in shown and shown == "redis://:***@10.0.0.1:7000,rediss://kv:***@h2:7000"


def test_precedence_flags_over_env_over_yaml(tmp_path, monkeypatch) -> None:
    cfg = write_yaml(tmp_path, "port: 9001\nhost: 0.0.0.0\nmodel: from-yaml\nstore:\n  memory_bytes: 2GiB\n"
                               "  disk_dir: /tmp/d\nblend:\n  ratio: 0.3\n")
    monkeypatch.setenv("KVBLEND_PORT", "9002")
    monkeypatch.setenv("KVBLEND_MODEL", "from-env")
    monkeypatch.setenv("KVBLEND_STORE__MEMORY_BYTES", "512MiB")
    s = Settings.load(cfg, model="from-flag", port=None)  # None: the flag was not given
    assert s.model == "from-flag"  # flag beats env and file
    assert s.port == 9002  # env beats file
    assert s.host == "0.0.0.0" and s.blend.ratio == 0.3  # file beats defaults
    assert s.store.memory_bytes == 512 * 1024**2 and s.store.disk_dir == "/tmp/d"  # nested sections merge


@pytest.mark.parametrize("yaml_text,env,needle", [
    ("prot: 1\n", {}, "unknown setting(s) prot"),
    ("blend:\n  ratio: 3\n", {}, "blend.ratio"),
    ("blend:\n  check_layers: [2, 1]\n", {}, "strictly increasing"),
    ("", {"KVBLEND_PORT": "eighty"}, "port"),
    ("api_keys:\n  short: alice\n", {}, "at least 8 characters"),
    ("api_keys:\n  long-enough-key: 'bad tenant!'\n", {}, "tenant must be"),
    ("store:\n  memory_bytes: lots\n", {}, "not a size"),
    ("store:\n  redis_url: redis://10.0.0.1:6379,redis://10.0.0.2:6379\n", {}, "set store.redis_cluster"),
    ("", {"KVBLEND_STORE__REDIS_CLUSTER": "true", "KVBLEND_STORE__REDIS_URL": "redis://10.0.0.1:6379/2"},
     "database 0 only"),
    ("store:\n  redis_cluster: true\n  redis_url: http://10.0.0.1\n", {}, "want redis://HOST:PORT"),
    ("store:\n  redis_timeout_s: 0\n", {}, "store.redis_timeout_s"),
    ("documents:\n  chunk_tokens: 0\n", {}, "documents.chunk_tokens"),
    ("documents:\n  chunk_tokens: 100000\n", {}, "documents.chunk_tokens"),
    ("admin_key: k\n", {}, "the admin key needs at least 8 characters"),
    ("scheduler:\n  max_queued: 0\n", {}, "scheduler.max_queued must be at least 1"),
    ("blend:\n  ratio: .nan\n", {}, "ratio must be a finite number in [0, 1]"),
    ("", {"KVBLEND_BLEND__RATIO": "inf"}, "ratio must be a finite number in [0, 1]"),
    ("blend:\n  r_max: .inf\n", {}, "r_max must be a finite number in [0, 1]"),
    ("guard:\n  fallback_ratio: .nan\n", {}, "fallback_ratio must be a finite number in [0, 1]"),
    # found by an audit: accepted, then a late error naming no setting, or silently idle
    ("", {"KVBLEND_STORE__REDIS_TTL_S": "nan"}, "store.redis_ttl_s"),
    ("", {"KVBLEND_PROT": "9000"}, "unknown setting(s) in the environment: KVBLEND_PROT"),
    ("", {"KVBLEND_STORE_MEMORY_BYTES": "2GiB"}, "KVBLEND_STORE_MEMORY_BYTES"),
    ("store:\n  redis_ttl_s: -5\n", {}, "store.redis_ttl_s"),
    ("", {"KVBLEND_BLEND__SIGNAL": "k", "KVBLEND_BLEND__SELECTION": "question"},
     "signal applies to selection 'deviation' only"),
    ("blend:\n  selection: question\n  check_layers: [1, 5]\n", {}, "check_layers applies to selection"),
    ("", {"KVBLEND_STORE__REDIS_TTL_S": "1e300"}, "store.redis_ttl_s"),
])
def test_invalid_settings_are_named(tmp_path, monkeypatch, yaml_text, env, needle) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SettingsError) as info:
        Settings.load(write_yaml(tmp_path, yaml_text))
    assert needle in str(info.value)


def test_print_config_shows_the_merged_result_with_keys_hidden(tmp_path, monkeypatch, capsys) -> None:
    cfg = write_yaml(tmp_path, "api_keys:\n  sk-very-secret-1: alice\nadmin_key: admin-secret-9\nport: 9100\n")
    monkeypatch.setenv("KVBLEND_SCHEDULER__MAX_RUNNING", "3")
    assert main(["serve", "--config", str(cfg), "--port", "9200", "--print-config"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert data["port"] == 9200 and data["scheduler"]["max_running"] == 3
    assert list(data["api_keys"].values()) == ["alice"]
    assert "very-secret" not in out and "admin-secret" not in out


def test_print_config_is_json_with_an_endless_drain(monkeypatch, capsys) -> None:
    monkeypatch.setenv("KVBLEND_DRAIN_TIMEOUT_S", "inf")
    assert main(["serve", "--print-config"]) == 0
    data = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert data["drain_timeout_s"] == "inf" and Settings(drain_timeout_s=data["drain_timeout_s"]).drain_timeout_s > 1e308


def test_cli_model_arguments_come_from_the_same_source(monkeypatch, capsys) -> None:
    monkeypatch.setenv("KVBLEND_DEVICE", "cuda:1")
    monkeypatch.setenv("KVBLEND_MODEL", "my-model")
    args = build_parser().parse_args(["generate", "hi"])
    assert (args.model, args.device, args.dtype) == ("my-model", "cuda:1", "float32")
    monkeypatch.setenv("KVBLEND_DTYPE", "float64")
    assert main(["models"]) == 2  # an invalid default is a clear error, not a traceback
    assert "dtype" in capsys.readouterr().err


def test_the_smallest_valid_queue_and_keys_load(tmp_path) -> None:
    s = Settings.load(write_yaml(tmp_path, "scheduler:\n  max_queued: 1\nadmin_key: 8-chars!\n"
                                           "api_keys:\n  8-chars?: alice\nblend:\n  ratio: auto\n"))
    assert s.scheduler.max_queued == 1 and s.admin_key == "8-chars!" and s.blend.ratio == "auto"


def test_a_commands_store_flags_reach_redis_and_store_kv_as_the_server_does() -> None:
    """``kvblend ask --doc``/``profile``'s --store-dir/--redis-url tiers take the server's
    Redis Cluster, group, prefix and KV dtype settings (they were a plain one-server store)."""
    store = Settings(store={"redis_cluster": True, "redis_url": "redis://a:7000,redis://b:7000", "redis_groups": 4,
                            "redis_prefix": "acme", "kv_dtype": "fp16", "redis_bytes": "100GiB",
                            "tenant_bytes": "1GiB"}).store
    config = store.flagged(None, "redis://c:7000")
    assert (config.redis_cluster, config.redis_groups, config.redis_prefix, config.kv_dtype) == (True, 4, "acme", "fp16")
    # its puts evict down to the server's caps, not a default 10 GiB one
    assert (config.redis_bytes, config.tenant_bytes) == (100 << 30, 1 << 30)
    assert config.redis_url == "redis://c:7000" and "disk" not in config.enabled_tiers
    assert store.flagged("/tmp/kv", None, kv_dtype="int8").kv_dtype == "int8"
    assert "redis" not in store.flagged("/tmp/kv", None).enabled_tiers


def test_deviation_knobs_load_with_deviation_selection_and_do_not_follow_a_request_away() -> None:
    from kvblend.server.protocol import ChatCompletionRequest
    from kvblend.server.translate import blend_options

    settings = Settings(blend={"selection": "deviation", "signal": "k", "check_layers": [1, 5]})
    assert settings.blend.blend_config().signal == "k"
    # a knob without a selection selects by deviation, in the settings as in a request
    assert Settings(blend={"signal": "k"}).blend.blend_config().selection == "deviation"
    assert Settings(blend={"signal": "v"}).blend.blend_config().selection == "question"  # the default: no knob set
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 kvblend={"selection": "question"})
    _, cfg = blend_options(body, settings, num_layers=30)  # was a 400 blaming the server's signal
    assert (cfg.selection, cfg.signal, cfg.check_layers) == ("question", "v", (1,))


def test_the_server_refuses_check_layers_its_model_does_not_have(monkeypatch) -> None:
    """``blend.check_layers: [99]`` loaded, then every blend request got a 400 blaming the client."""
    import kvblend.models
    from kvblend.server.main import build_engine
    from tests.conftest import make_loaded

    monkeypatch.setattr(kvblend.models, "load_model", lambda *a, **k: make_loaded())
    settings = Settings(blend={"selection": "deviation", "check_layers": [1, 99]}, store={"tiers": ["memory"]})
    with pytest.raises(ValueError, match=r"blend.check_layers \[1, 99\] must be below the model's 2 layers"):
        build_engine(settings)


def test_cli_blend_flags_follow_the_request_rule(monkeypatch) -> None:
    from kvblend.cli import _blend_config
    from kvblend.errors import KvblendError

    def cfg(*flags: str):
        return _blend_config(build_parser().parse_args(["ask", "--doc", "d.txt", "q", *flags]))

    assert cfg().selection == "question"
    assert (cfg("--signal", "k").selection, cfg("--signal", "k").signal) == ("deviation", "k")  # was silently idle
    assert cfg("--check-layers", "1,5", "--schedule", "0.5,0.15").check_layers == (1, 5)
    with pytest.raises(KvblendError, match="--signal applies to --selection deviation only"):
        cfg("--selection", "question", "--signal", "k")
    with pytest.raises(KvblendError, match="comma-separated numbers"):
        cfg("--check-layers", "a")


def test_ask_blends_with_the_servers_blend_settings(monkeypatch) -> None:
    """``kvblend ask`` took its blend knobs from literal flag defaults: ``blend.*`` (and
    ``blend.calibrate``) changed the server and not the command line."""
    from kvblend.cli import _blend_config

    def parsed(*flags: str):
        return build_parser().parse_args(["ask", "--doc", "d.txt", "q", *flags])

    monkeypatch.setenv("KVBLEND_BLEND__RATIO", "0.3")
    monkeypatch.setenv("KVBLEND_BLEND__SINKS", "2")
    monkeypatch.setenv("KVBLEND_BLEND__SELECTION", "deviation")
    monkeypatch.setenv("KVBLEND_BLEND__SIGNAL", "k")
    monkeypatch.setenv("KVBLEND_BLEND__CALIBRATE", "false")
    monkeypatch.setenv("KVBLEND_BLEND__METHOD", "reuse")
    args = parsed()
    cfg = _blend_config(args)
    assert (cfg.ratio, cfg.sinks, cfg.selection, cfg.signal) == (0.3, 2, "deviation", "k")
    assert args.calibrate is False and args.method == "reuse"
    assert _blend_config(parsed("--ratio", "0.5", "--selection", "question")).ratio == 0.5  # a flag still wins
    assert _blend_config(parsed("--selection", "question")).selection == "question"
    monkeypatch.setenv("KVBLEND_BLEND__METHOD", "auto")  # the guard's method: ask has no guard
    assert parsed().method == "blend"


def test_decode_weights_reach_every_model_load_from_one_source(monkeypatch) -> None:
    """``decode_weights``: auto by default, from KVBLEND_DECODE_WEIGHTS, a flag over it, and
    passed to the server's model load (its engine then decodes on that packed copy)."""
    import kvblend.models
    from kvblend.server.main import build_engine
    from tests.conftest import make_loaded

    assert Settings().decode_weights == "auto"
    assert build_parser().parse_args(["generate", "hi"]).decode_weights == "auto"
    monkeypatch.setenv("KVBLEND_DECODE_WEIGHTS", "fp16")
    assert build_parser().parse_args(["ask", "q"]).decode_weights == "fp16"
    assert build_parser().parse_args(["generate", "hi", "--decode-weights", "fp32"]).decode_weights == "fp32"
    assert Settings.load(decode_weights="int8").decode_weights == "int8"
    seen = {}

    def load(*args, **kw):
        seen.update(kw)
        return make_loaded()

    monkeypatch.setattr(kvblend.models, "load_model", load)
    build_engine(Settings.load(store={"tiers": ["memory"]})).close()
    assert seen["decode_weights"] == "fp16"
    monkeypatch.setenv("KVBLEND_DECODE_WEIGHTS", "int4")
    with pytest.raises(Exception, match="decode_weights"):
        Settings.load()


def test_logprobs_mode_is_one_list_in_the_settings_the_flags_and_the_sampler() -> None:
    """The three spellings of the logprobs modes (the settings' type, the serve flag's
    choices, the sampler's check) are the same list, and the flag reaches the settings."""
    import typing

    from kvblend.cliargs import LOGPROBS_MODES
    from kvblend.generation.sampling import LOGPROBS_MODES as SAMPLER_MODES

    assert LOGPROBS_MODES == SAMPLER_MODES == typing.get_args(Settings.model_fields["logprobs_mode"].annotation)
    assert Settings().logprobs_mode == "processed"
    assert build_parser().parse_args(["serve", "--logprobs-mode", "raw"]).logprobs_mode == "raw"


def test_every_kvblend_variable_the_code_reads_is_accepted(tmp_path, monkeypatch) -> None:
    """A ``KVBLEND_*`` variable that kvblend's code reads itself (the model cache, the
    allocator, the native kernels' ``-march``) is no setting, and the settings must not
    refuse it as unknown: ``KVBLEND_NATIVE_ARCH``, documented in the README, once stopped
    ``kvblend serve`` from starting. The names come from the source, so a new one is
    checked too."""
    import re
    from pathlib import Path

    import kvblend

    source = Path(kvblend.__file__).parent
    read = re.compile(r"""(?:environ\.get|getenv|environ\[)\(?\s*["'](KVBLEND_[A-Z_]+)["']""")
    names = {m for path in source.rglob("*.py") for m in read.findall(path.read_text())}
    assert {"KVBLEND_HOME", "KVBLEND_NATIVE_ARCH", "KVBLEND_MALLOC_TUNING"} <= names
    for name in names:
        monkeypatch.setenv(name, "native" if name == "KVBLEND_NATIVE_ARCH" else "0")
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path))
    monkeypatch.delenv("KVBLEND_CONFIG", raising=False)
    Settings.load(write_yaml(tmp_path, ""))
