"""Compatibility names: the registry and the ``auto`` policy under their old module path.

New code imports `jaxmoe.impls.registry` and `jaxmoe.impls.policy` directly.
"""

from jaxmoe.impls.policy import GATHER_MAX_PAIRS, default_platform, resolve_impl
from jaxmoe.impls.registry import BUILTIN, ImplFn, available_impls, get_impl, register_impl, unregister_impl
from jaxmoe.platforms import INTEL_PLATFORMS, PALLAS_PLATFORMS

__all__ = [
    "BUILTIN",
    "GATHER_MAX_PAIRS",
    "INTEL_PLATFORMS",
    "PALLAS_PLATFORMS",
    "ImplFn",
    "available_impls",
    "default_platform",
    "get_impl",
    "register_impl",
    "resolve_impl",
    "unregister_impl",
]
