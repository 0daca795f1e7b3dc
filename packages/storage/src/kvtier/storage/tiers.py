"""Building the ordered list of tiers from the config: entry-point lookup, the host-first rule,
and the check that no tier would send payloads out unsealed while an encryption key is set."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.core.errors import ConfigError
from kvtier.core.platform import load_object, plugin_entry_points
from kvtier.core.storage import HOST_TIER
from kvtier.storage.backends.base import BackendContext, StorageBackend
from kvtier.storage.sealing import Sealer

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.layout import KVLayout
    from kvtier.core.memory import HostArena
    from kvtier.storage.stats import StorageStats

BACKEND_GROUP = "kvtier.backends"


def load_backend_class(name: str, allow: Sequence[str] | None = None) -> type[StorageBackend]:
    """The backend class registered as ``name`` in the ``kvtier.backends`` group."""
    eps = {ep.name: ep for ep in plugin_entry_points(BACKEND_GROUP, allow)}
    if name not in eps:
        hint = " (it is not in the plugins allow-list)" if allow else ""
        raise ConfigError(
            "tiers",
            name,
            f"no storage backend named {name!r}{hint}; installed: {', '.join(sorted(eps)) or 'none'}",
        )
    cls = load_object(eps[name].value)
    if not (isinstance(cls, type) and issubclass(cls, StorageBackend)):
        raise ConfigError(
            "tiers", name, f"backend {name!r} points at {eps[name].value!r}, not a StorageBackend"
        )
    return cls


def build_tiers(
    config: KVTierConfig, arena: HostArena, layout: KVLayout, namespace: str, stats: StorageStats
) -> list[StorageBackend]:
    """One backend per name in ``config.tiers``, in order; on any error the ones already built
    are closed before it propagates."""
    if not config.tiers or config.tiers[0] != HOST_TIER:
        raise ConfigError(
            "tiers",
            config.tiers,
            f"must start with {HOST_TIER!r}: every chunk passes through host memory",
        )
    unused = sorted(set(config.backend_options) - set(config.tiers))
    if unused:
        raise ConfigError(
            f"backend_options.{unused[0]}",
            config.backend_options[unused[0]],
            f"options for a tier that is not in tiers ({', '.join(config.tiers)}): add the tier "
            f"or remove its options (a misspelt tier name?)",
        )
    key = config.encryption_key_bytes()
    sealer = Sealer(key) if key is not None else None
    built: list[StorageBackend] = []
    try:
        for name in config.tiers:
            cls = load_backend_class(name, config.plugins)
            if sealer is not None and not (cls.keeps_host_objects or cls.seals_payloads):
                raise ConfigError(
                    "encryption_key",
                    "***",
                    f"the {name!r} tier cannot seal its payloads yet: payloads would leave the "
                    f"process unencrypted; remove {name!r} from tiers or unset the key",
                )
            ctx = BackendContext(
                config=config,
                layout=layout,
                namespace=namespace,
                arena=arena,
                stats=stats,
                options=dict(config.backend_options.get(name, {})),
                sealer=sealer,
            )
            built.append(cls(ctx))
    except BaseException:
        for tier in built:
            tier.close()
        raise
    return built
