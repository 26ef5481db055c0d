"""Selection policy: how the fixed (unmeasured) order is formed, as in vllm-plugin-FL.

The policy is FL's, field for field — ``prefer``, ``strict``, ``per_op_order``,
``allow_vendors``, ``deny_vendors`` — read from the environment (``FLTUNE_*``, with FL's
``VLLM_FL_*`` spellings accepted) or a YAML file (``FLTUNE_CONFIG`` / ``VLLM_FL_CONFIG``).
fltune uses it twice: as the baseline it measures against (the "fixed FL order"), and as
the filter a calibrated selection must respect (a denied vendor never wins, however fast).

Order tokens, in ``prefer`` and ``per_op_order``:
  ``flagos`` (or ``default``), ``vendor``, ``reference`` — a kind;
  ``vendor:NAME`` — one vendor's implementations;
  ``impl:IMPL_ID`` — one implementation.
``FLTUNE_PER_OP`` is ``op=token|token;op2=token`` (``rms_norm=vendor|flagos;silu_and_mul=reference``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable, Optional

from .types import PREFER_TOKENS, BackendImplKind, OpImpl

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class PolicyError(ValueError):
    """A policy value that cannot be understood; the message names the source and the fix."""


def _check_token(tok, where: str) -> str:
    if not isinstance(tok, str):
        raise PolicyError(f"{where}: order tokens must be strings, got {tok!r}")
    tok = tok.strip()
    if tok in PREFER_TOKENS or (tok.startswith(("vendor:", "impl:")) and len(tok.split(":", 1)[1]) > 0):
        return tok
    raise PolicyError(f"{where}: unknown order token {tok!r}; use one of flagos, vendor, "
                      f"reference, vendor:NAME, impl:IMPL_ID")


@dataclass(frozen=True)
class SelectionPolicy:
    prefer: str = "flagos"
    strict: bool = False
    per_op_order: dict = field(default_factory=dict)   # op -> tuple of tokens
    allow_vendors: frozenset = frozenset()              # empty = all allowed
    deny_vendors: frozenset = frozenset()

    def __post_init__(self):
        if not isinstance(self.prefer, str) or self.prefer not in PREFER_TOKENS:
            raise PolicyError(f"prefer: unknown value {self.prefer!r}; use flagos, vendor or "
                              f"reference")
        object.__setattr__(self, "per_op_order", {
            op: tuple(_check_token(t, f"per_op_order[{op}]") for t in order)
            for op, order in dict(self.per_op_order).items()})
        object.__setattr__(self, "allow_vendors", frozenset(self.allow_vendors))
        object.__setattr__(self, "deny_vendors", frozenset(self.deny_vendors))

    # ---- construction -----------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Optional[dict] = None) -> "SelectionPolicy":
        """Env over YAML over defaults. Each variable has an FLTUNE_ and a VLLM_FL_ name."""
        env = os.environ if environ is None else environ

        def get(name):
            for prefix in ("FLTUNE_", "VLLM_FL_"):
                if prefix + name in env:
                    return prefix + name, env[prefix + name]
            return None, None

        base = {}
        src, path = get("CONFIG")
        if path:
            base = cls.from_yaml(path).to_dict()
        src, v = get("PREFER")
        if v is not None:
            base["prefer"] = v.strip().lower()
            if base["prefer"] not in PREFER_TOKENS:
                raise PolicyError(f"policy from environment: {src}: unknown value {v!r}; use "
                                  f"flagos, vendor or reference")
        src, v = get("STRICT")
        if v is not None:
            base["strict"] = _parse_bool(v, src)
        src, v = get("PER_OP")
        if v is not None:
            base["per_op_order"] = {**base.get("per_op_order", {}), **_parse_per_op(v, src)}
        for key in ("ALLOW_VENDORS", "DENY_VENDORS"):
            src, v = get(key)
            if v is not None:
                base[key.lower()] = frozenset(x.strip() for x in v.split(",") if x.strip())
        try:
            return cls(**base)
        except PolicyError as e:
            raise PolicyError(f"policy from environment: {e}") from None

    @classmethod
    def from_yaml(cls, path: str) -> "SelectionPolicy":
        import yaml

        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise PolicyError(f"policy file {path} not found (set FLTUNE_CONFIG to an existing "
                              f"YAML file or unset it)") from None
        except yaml.YAMLError as e:
            raise PolicyError(f"policy file {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise PolicyError(f"policy file {path}: expected a mapping at top level, got "
                              f"{type(data).__name__}")
        known = {"prefer", "strict", "per_op_order", "allow_vendors", "deny_vendors"}
        unknown = set(data) - known
        if unknown:
            raise PolicyError(f"policy file {path}: unknown keys {sorted(unknown)}; known keys "
                              f"are {sorted(known)}")
        kw = dict(data)
        if "strict" in kw:
            kw["strict"] = _parse_bool(kw["strict"], f"{path}: strict")
        if "per_op_order" in kw:
            per = kw["per_op_order"]
            if not isinstance(per, dict):
                raise PolicyError(f"policy file {path}: per_op_order must map op -> list")
            kw["per_op_order"] = {op: tuple(v if isinstance(v, list) else str(v).split("|"))
                                  for op, v in per.items()}
        for key in ("allow_vendors", "deny_vendors"):
            if key in kw:
                v = kw[key] or ()
                if isinstance(v, str):          # `deny_vendors: vllm` means one vendor
                    v = [x.strip() for x in v.split(",") if x.strip()]
                if not isinstance(v, (list, tuple, set)) or not all(isinstance(x, str) for x in v):
                    raise PolicyError(f"policy file {path}: {key} must be a list of vendor "
                                      f"names, got {kw[key]!r}")
                kw[key] = frozenset(v)
        try:
            return cls(**kw)
        except PolicyError as e:
            raise PolicyError(f"policy file {path}: {e}") from None

    def to_dict(self) -> dict:
        return {"prefer": self.prefer, "strict": self.strict,
                "per_op_order": {k: list(v) for k, v in sorted(self.per_op_order.items())},
                "allow_vendors": sorted(self.allow_vendors),
                "deny_vendors": sorted(self.deny_vendors)}

    # ---- semantics --------------------------------------------------------------------
    def permits(self, impl: OpImpl) -> bool:
        """Vendor allow/deny lists (only VENDOR implementations carry a vendor)."""
        if impl.vendor is None:
            return True
        if impl.vendor in self.deny_vendors:
            return False
        return not self.allow_vendors or impl.vendor in self.allow_vendors

    def order(self, op_name: str, impls: Iterable[OpImpl]) -> list[OpImpl]:
        """The candidates in the fixed order this policy gives, permitted ones only.

        Default order: the preferred kind first, then the others by FL priority (higher
        first), then by impl_id so the order is total and reproducible. A per-op order
        lists tokens; anything it does not mention follows in the default order.
        """
        impls = [i for i in impls if self.permits(i)]
        prefer_kind = PREFER_TOKENS[self.prefer]
        default = sorted(impls, key=lambda i: (i.kind is not prefer_kind, -i.priority,
                                               i.impl_id))
        tokens = self.per_op_order.get(op_name)
        if not tokens:
            return default
        picked: list[OpImpl] = []
        for tok in tokens:
            for impl in default:
                if impl not in picked and _matches(tok, impl):
                    picked.append(impl)
        return picked + [i for i in default if i not in picked]


def _matches(tok: str, impl: OpImpl) -> bool:
    if tok.startswith("impl:"):
        return impl.impl_id == tok[5:]
    if tok.startswith("vendor:"):
        return impl.kind is BackendImplKind.VENDOR and impl.vendor == tok[7:]
    return impl.kind is PREFER_TOKENS[tok]


def _parse_bool(v, where) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise PolicyError(f"{where}: expected a boolean (1/0, true/false), got {v!r}")


def _parse_per_op(v: str, where: str) -> dict:
    out = {}
    for part in v.split(";"):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            raise PolicyError(f"{where}: expected 'op=token|token;op2=token', got {part!r}")
        op, order = part.split("=", 1)
        out[op.strip()] = tuple(_check_token(t, where) for t in order.split("|") if t.strip())
    return out


def fl_pick(policy: SelectionPolicy, op_name: str, impls: Iterable[OpImpl],
            outcome_of) -> tuple[Optional[str], list[str]]:
    """The one rule for "what the fixed FL order runs": ``(impl_id or None, skipped)``.

    Walk the candidates in policy order; skip those that do not qualify (``outcome_of``
    returns ``"unqualified"``) or were not measured (``None``); under a non-strict policy
    also skip one that raised (``"refused"``), as ``OpManager.call_op`` falls back past it
    — those are listed in ``skipped``. The first one left is FL's pick; FL checks no
    parity, so it may be one that fails it. ``report``, ``freeze --order fl``, ``bench``
    and ``candidates`` all call this (they used to apply three different rules)."""
    skipped = []
    for impl in policy.order(op_name, impls):
        out = outcome_of(impl.impl_id)
        if out is None or out == "unqualified":
            continue
        if out == "refused" and not policy.strict:
            skipped.append(impl.impl_id)
            continue
        return impl.impl_id, skipped
    return None, skipped
