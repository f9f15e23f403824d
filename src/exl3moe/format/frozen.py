"""Validated records (EXL3Weight, ExpertSet, ResidualStage) whose fields cannot change after construction.

A record is validated when it is made and then frozen: assigning a field raises FrozenFieldError, and
`record.replace(field=...)` (or `dataclasses.replace`) makes a modified copy, validated like any new record.
Tensors can still be changed in place (`t.set_`, `t.resize_`, `t.data = ...`) and fields forced with
`object.__setattr__`, so the ops call `ensure_valid()` at their entry points: it validates again, with the
construction rules, only when the record's fingerprint (each field's identity and each tensor's address,
shape, strides and dtype) differs from the one it last validated, so an unchanged record costs one
fingerprint. Values written in place into a tensor of the same layout are not re-checked.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import ContractError, FormatError

_CHECKED = "_checked_fingerprint"


class FrozenFieldError(ContractError, AttributeError):
    """Assignment to (or deletion of) a field of a frozen, validated record."""


def tensor_key(t) -> tuple:
    """What identifies a field's value for re-validation: a tensor's object, address and layout, or any object."""
    if isinstance(t, torch.Tensor):   # CUDA addresses are unified across devices: the address implies the device
        return id(t), t.data_ptr(), t.shape, t.stride(), t.dtype
    return id(t), type(t)


class Frozen:
    """Mixin of a validated dataclass: `validate()` holds its own rules, `_members()` the records it holds."""

    name: str

    def validate(self) -> None:
        raise NotImplementedError

    def _own_key(self) -> tuple:
        """The fingerprint of this record's own fields (not of its members)."""
        return tuple(tensor_key(getattr(self, f.name)) for f in dataclasses.fields(self))

    def _members(self) -> tuple:
        """The validated records this one holds, re-validated with it."""
        return ()

    def __post_init__(self) -> None:
        self._normalize()
        self.ensure_valid()

    def _normalize(self) -> None:
        """Turn mutable containers into immutable ones before validation (subclasses)."""

    def ensure_valid(self) -> tuple:
        """Validate again where the record changed since it was last validated; returns its fingerprint."""
        members = self._members()
        key = (self._own_key(), tuple(m.ensure_valid() for m in members)) if members else self._own_key()
        checked = self.__dict__.get(_CHECKED)
        if key != checked:
            try:
                self.validate()
            except (FormatError, ContractError) as err:
                if checked is None:
                    raise
                raise type(err)(err.name, f"{err.rule} (changed after it was validated)") from None
            object.__setattr__(self, _CHECKED, key)
        return key

    def fingerprint(self) -> tuple:
        """The key ensure_valid compares, without validating."""
        members = self._members()
        return (self._own_key(), tuple(m.fingerprint() for m in members)) if members else self._own_key()

    def replace(self, **changes):
        """A modified copy, validated as a new record (fields fixed after construction; this is how to change one)."""
        return dataclasses.replace(self, **changes)

    def _refuse(self, field: str):
        kind = type(self).__name__
        return FrozenFieldError(f"{getattr(self, 'name', kind)}.{field}",
                                f"cannot be changed: the {kind} is validated once and frozen; make a modified copy "
                                f"with `.replace({field}=...)` (or dataclasses.replace), which validates it")

    def __setattr__(self, field: str, value) -> None:
        if _CHECKED in self.__dict__:
            raise self._refuse(field)
        object.__setattr__(self, field, value)

    def __delattr__(self, field: str) -> None:
        if _CHECKED in self.__dict__:
            raise self._refuse(field)
        object.__delattr__(self, field)
