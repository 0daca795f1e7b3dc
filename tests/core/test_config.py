"""Configuration: file < environment < dict, validated with errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.core.config import KVTierConfig, load_config, reference_table
from kvtier.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_defaults() -> None:
    cfg = load_config(env={})
    assert cfg == KVTierConfig()
    assert cfg.chunk_size == 256 and cfg.tiers == ["local_cpu", "local_disk"]
    assert cfg.disk_path().name == "disk"


def test_precedence_file_env_dict(tmp_path: Path) -> None:
    f = tmp_path / "kvtier.yaml"
    f.write_text("chunk_size: 512\nlocal_cpu_size_gb: 1.5\nuse_layerwise: true\nlog_level: INFO\n")
    env = {
        "KVTIER_CONFIG_FILE": str(f),
        "KVTIER_CHUNK_SIZE": "128",
        "KVTIER_USE_LAYERWISE": "false",
        "KVTIER_TIERS": "local_cpu",
        "KVTIER_TEST_DEVICE": "cpu",
    }
    cfg = load_config(env=env, overrides={"chunk_size": 64})
    assert cfg.chunk_size == 64  # dict beats env beats file
    assert cfg.use_layerwise is False  # env beats file
    assert cfg.local_cpu_size_gb == 1.5  # file beats default
    assert cfg.log_level == "INFO"
    assert cfg.tiers == ["local_cpu"]  # comma-separated list from env


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": "lots"}, "chunk_size"),
        ({"chunk_size": True}, "chunk_size"),
        ({"use_layerwise": "maybe"}, "use_layerwise"),
        ({"local_cpu_size_gb": -1}, "local_cpu_size_gb"),
        ({"tiers": []}, "tiers"),
        ({"tiers": ["local_cpu", "local_cpu"]}, "tiers"),
        ({"tiers": ["local_cpu", "redis"]}, "redis_url"),
        ({"redis_url": "http://x"}, "redis_url"),
        ({"redis_ttl_s": -5}, "redis_ttl_s"),
        ({"local_disk_rescan_s": -1}, "local_disk_rescan_s"),
        ({"log_level": "LOUD"}, "log_level"),
        ({"chunk_sise": 256}, "chunk_sise"),
        ({"backend_options": 3}, "backend_options"),
    ],
)
def test_bad_values_name_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(env={}, overrides=overrides)
    assert exc.value.field == field
    assert field in str(exc.value)


def test_bad_env_and_file_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="io_threads"):
        load_config(env={"KVTIER_IO_THREADS": "four"})
    f = tmp_path / "bad.yaml"
    f.write_text("pin_memory: 3\n")
    with pytest.raises(ConfigError, match="pin_memory"):
        load_config(f, env={})
    f.write_text("- a list\n")
    with pytest.raises(ConfigError, match="config_file"):
        load_config(f, env={})
    with pytest.raises(ConfigError, match="config_file"):
        load_config(tmp_path / "missing.yaml", env={})


def test_unrelated_kvtier_env_vars_are_ignored() -> None:
    assert load_config(env={"KVTIER_SOMETHING_ELSE": "1"}) == KVTierConfig()


def test_optional_and_mapping_fields() -> None:
    cfg = load_config(env={"KVTIER_PLATFORM": "", "KVTIER_BACKEND_OPTIONS": "{s3: {bucket: b}}"})
    assert cfg.platform is None
    assert cfg.backend_options == {"s3": {"bucket": "b"}}
    assert cfg.replace(chunk_size=64).chunk_size == 64
    with pytest.raises(ConfigError):
        cfg.replace(chunk_size=-1)


def test_the_config_reference_documents_every_key() -> None:
    reference = (ROOT / "docs" / "configuration.md").read_text()
    for line in reference_table().splitlines()[2:]:
        assert line in reference, f"docs/configuration.md is stale: {line}"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"local_cpu_size_gb": float("nan")}, "local_cpu_size_gb"),
        ({"local_disk_size_gb": "inf"}, "local_disk_size_gb"),
        ({"redis_timeout_s": float("inf")}, "redis_timeout_s"),
        ({"lookup_timeout_s": "nan"}, "lookup_timeout_s"),
        ({"local_disk_rescan_s": "nan"}, "local_disk_rescan_s"),
        ({"redis_connect_timeout_s": "-inf"}, "redis_connect_timeout_s"),
        ({"redis_url": "redis://127.0.0.1:99999/0"}, "redis_url"),
        ({"redis_url": "redis://127.0.0.1:port/0"}, "redis_url"),
        ({"redis_url": "redis://127.0.0.1:0"}, "redis_url"),
        ({"redis_url": "redis://127.0.0.1:6379/zero"}, "redis_url"),
        ({"redis_url": "unix://"}, "redis_url"),
        ({"backend_options": {"redis": 3}}, "backend_options.redis"),
        ({"verify_fraction": 1.5}, "verify_fraction"),
        ({"verify_fraction": -0.1}, "verify_fraction"),
        ({"verify_max_tokens": 0}, "verify_max_tokens"),
        ({"verify_tolerance": -1}, "verify_tolerance"),
        ({"verify_quarantine_s": "nan"}, "verify_quarantine_s"),
        (
            {"backend_options": {"redis": {"retry_interval_s": float("nan")}}},
            "backend_options.redis.retry_interval_s",
        ),
    ],
)
def test_non_finite_numbers_bad_urls_and_options_are_errors_at_load(
    overrides: dict[str, object], field: str
) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(env={}, overrides=overrides)
    assert exc.value.field == field
    assert field in str(exc.value)


def test_the_constructor_and_replace_validate_too() -> None:
    with pytest.raises(ConfigError, match="local_cpu_size_gb"):
        KVTierConfig(local_cpu_size_gb=float("nan"))
    with pytest.raises(ConfigError, match="redis_timeout_s"):
        KVTierConfig().replace(redis_timeout_s=float("inf"))


def test_redis_password_is_masked_in_repr_and_errors() -> None:
    cfg = load_config(
        env={},
        overrides={
            "redis_url": "redis://user:hunter2@127.0.0.1:6379/0",
            "redis_password": "s3cret-pw",
        },
    )
    assert cfg.redis_password == "s3cret-pw"  # the value itself is kept
    for text in (repr(cfg), str(cfg)):
        assert "hunter2" not in text and "s3cret-pw" not in text
        assert "redis://user:***@127.0.0.1:6379/0" in text
    bad = [
        {"redis_url": "redis://user:hunter2@127.0.0.1:99999/0"},
        {"redis_url": "http://user:hunter2@127.0.0.1/"},
        {"redis_password": ["s3cret-pw"]},
    ]
    for overrides in bad:
        with pytest.raises(ConfigError) as exc:
            load_config(env={}, overrides=overrides)
        assert "hunter2" not in str(exc.value) and "s3cret-pw" not in str(exc.value)
        assert "hunter2" not in repr(exc.value.value) and "s3cret-pw" not in repr(exc.value.value)
    with pytest.raises(ConfigError) as exc:
        load_config(env={"KVTIER_REDIS_URL": "redis://:hunter2@127.0.0.1:6379x"})
    assert "hunter2" not in str(exc.value)


def test_a_binary_config_file_is_a_named_error(tmp_path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match="config_file") as info:
        load_config(path, env={})
    assert "UTF-8" in str(info.value)


@pytest.mark.parametrize(
    "field, value, coerced",
    [("chunk_size", "64", 64), ("local_cpu_size_gb", "0.5", 0.5), ("tiers", "local_cpu", None)],
)
def test_the_constructor_and_replace_coerce_as_load_config_does(field, value, coerced) -> None:
    expected = load_config(env={}, overrides={field: value})
    assert getattr(KVTierConfig(**{field: value}), field) == getattr(expected, field)
    assert getattr(KVTierConfig().replace(**{field: value}), field) == getattr(expected, field)
    if coerced is not None:
        assert getattr(expected, field) == coerced


@pytest.mark.parametrize(
    "field, value",
    [("verify_fraction", True), ("verify_max_tokens", 1.5), ("store_threshold", 1.5)],
)
def test_the_constructor_refuses_what_load_config_refuses(field, value) -> None:
    with pytest.raises(ConfigError, match=field):
        load_config(env={}, overrides={field: value})
    with pytest.raises(ConfigError, match=field):
        KVTierConfig(**{field: value})
    with pytest.raises(ConfigError, match=field):
        KVTierConfig().replace(**{field: value})
