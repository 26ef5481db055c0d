"""FL-compatible dispatch: types, registry, policy, manager, discovery, frozen tables."""
from .frozen import (DispatchFrozenError, FrozenDispatch, ManifestError, freeze_dispatch,
                     get_frozen_dispatch_manifest, is_dispatch_frozen, load_manifest,
                     thaw_dispatch)
from .manager import (NoImplementationError, OpManager, call_op, get_default_manager,
                      reset_default_manager)
from .policy import PolicyError, SelectionPolicy
from .registry import OpRegistry
from .types import BackendImplKind, OpImpl, QualifyContext
from . import frozen as _frozen

# frozen dispatch finds the default registry through this provider instead of importing the
# manager (which imports frozen): one direction between the two files
_frozen._registry_provider = lambda: get_default_manager().registry

__all__ = ["BackendImplKind", "OpImpl", "QualifyContext", "OpRegistry", "SelectionPolicy",
           "PolicyError", "OpManager", "call_op", "get_default_manager",
           "reset_default_manager", "NoImplementationError", "FrozenDispatch",
           "freeze_dispatch", "thaw_dispatch", "is_dispatch_frozen",
           "get_frozen_dispatch_manifest", "load_manifest", "ManifestError",
           "DispatchFrozenError"]
