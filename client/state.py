"""Flattening a model, an optimizer, a scheduler and user extras into keyed tensors + JSON.

Every tensor becomes a :class:`TensorRecord` with its manifest key and placement; every
other value goes into a JSON tree that refers to tensors by key. Optimizer state is keyed by
the **parameter's name** in the model, so it loads into a freshly built optimizer whatever
order its parameters were passed in; the optimizer's class is recorded beside it.

Only an imported state_dict that numbers its parameters (a saved ``optim.state_dict()``)
is kept **by position** (:func:`flatten_positional_optimizer`): which parameter an index is,
only the optimizer that made it knew, so a load pairs positions with the optimizer it is
given, as ``Optimizer.load_state_dict`` does.
"""

from __future__ import annotations

import operator
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ckptstore.client import jsonstate, keys, names
from ckptstore.client.placement import group_places_step_on_device
from ckptstore.client.tensors import check_storable
from ckptstore.service.errors import StateEncodingError, StateMismatchError
from ckptstore.service.format.manifest import Placement


@dataclass(slots=True)
class TensorRecord:
    """One tensor to store: its key, the tensor, and how load must place it."""

    key: str
    tensor: torch.Tensor
    placement: Placement
    param: str | None = None
    trainable: bool | None = None
    #: A model parameter's ``requires_grad`` (None: not a parameter, or not known).
    requires_grad: bool | None = None


@dataclass
class FlatState:
    """Everything a save stores: tensors by key and the JSON sections referring to them."""

    records: list[TensorRecord] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    #: The class of the optimizer whose state ``state["optim"]`` holds, where known (:func:`optimizer_class`).
    optimizer_class: str | None = None
    _keys: set[str] = field(default_factory=set)

    def add(self, record: TensorRecord) -> str:
        """Add a record, refusing a key twice or a tensor the format cannot hold; returns the key."""
        if record.key in self._keys:
            raise StateEncodingError(f"two tensors map to the key {record.key!r}")
        check_storable(record.tensor, record.key)
        self._keys.add(record.key)
        self.records.append(record)
        return record.key

    def add_part(self, records: list[TensorRecord], keys: frozenset[str]) -> None:
        """Add ``records`` (with these ``keys``) of a part flattened before, whose tensors and
        keys :meth:`add` checked then."""
        if not self._keys.isdisjoint(keys):
            raise StateEncodingError(f"two tensors map to the key {sorted(self._keys & keys)[0]!r}")
        self._keys |= keys
        self.records += records


def optimizer_class(optim: torch.optim.Optimizer) -> str:
    """The module-qualified name of ``optim``'s class (``torch.optim.adamw.AdamW``), inside any
    wrapper that holds the real optimizer as ``.optimizer`` (Accelerate's ``AcceleratedOptimizer``)."""
    inner: Any = optim
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    cls = type(inner)
    return f"{cls.__module__}.{cls.__qualname__}"


def parameter_names(model: torch.nn.Module, known: names.ModelNames | None = None) -> dict[int, str]:
    """``id(parameter) -> canonical name`` for every parameter of ``model`` (first name for tied
    ones), from ``known`` names of it when given."""
    parameters = known.parameters if known is not None else names.parameters(model)
    return {id(p): name for name, p in parameters.items()}


def _host_or_target(tensor: torch.Tensor) -> Placement:
    return "host" if tensor.device.type == "cpu" else "target"


#: What a stored record depends on besides its tensor's identity: the dtype (``.data``
#: assignment changes it in place) and whether the tensor requires grad (``trainable``).
_SIGNATURE = operator.attrgetter("dtype", "requires_grad")
#: Optimizer state values whose JSON an unchanged identity vouches for: tensors (stored by
#: key) and immutable scalars. A list or dict may change inside without being replaced.
_LASTING = frozenset({torch.Tensor, torch.nn.Parameter, bool, int, float, str, type(None)})


@dataclass
class _Part:
    """Records flattened from a model or an optimizer, and what they were made from: made again
    while the same objects (compared by identity) and the same plain values are found."""

    kept: list[object]  # the objects the records came from; tensors past ``weak_from`` by weak reference
    weak_from: int
    equal: list[object]  # values they came from, compared with ==
    #: Each record's fields, its tensor by index into the objects (where the records are not ``made``).
    template: list[tuple[str, int, Placement, str | None, bool | None]]
    keys: frozenset[str]
    types: list[type]
    signatures: list[tuple[torch.dtype, bool]]
    json: Any = None
    #: The records themselves, where every object is kept strongly (they keep nothing more alive).
    made: list[TensorRecord] | None = None

    @classmethod
    def of(
        cls,
        same: list[object],
        equal: list[object],
        records: list[TensorRecord],
        *,
        weak_from: int | None = None,
        json: Any = None,
    ) -> _Part:
        """The part of ``records``, just flattened from ``same`` (which holds every record's
        tensor, unless every object is kept strongly) and ``equal``. ``weak_from`` (default:
        none): the index in ``same`` from which tensors are kept by weak reference, so that state
        an optimizer replaces is not kept alive by this cache until the next save."""
        weak_from = len(same) if weak_from is None else weak_from
        made = records if weak_from == len(same) else None
        template = []
        if made is None:  # records made again at each hit: each one's fields, its tensor by index
            index = {id(value): number for number, value in enumerate(same)}
            template = [(r.key, index[id(r.tensor)], r.placement, r.param, r.trainable) for r in records]
        kept = same[:weak_from] + [_weak(value) for value in same[weak_from:]]
        tensors = [record.tensor for record in records]
        keys = frozenset(record.key for record in records)
        types, signatures = list(map(type, tensors)), list(map(_SIGNATURE, tensors))
        return cls(kept, weak_from, equal, template, keys, types, signatures, json, made)

    def records(self, same: list[object], equal: list[object]) -> list[TensorRecord] | None:
        """The records flattening ``same`` and ``equal`` gives now if they are these again: the
        same objects, equal values, and every tensor of the same type, dtype and
        ``requires_grad``; else None."""
        cut = self.weak_from
        if len(same) != len(self.kept) or equal != self.equal or not all(map(operator.is_, same[:cut], self.kept)):
            return None
        if not all(map(operator.is_, same[cut:], map(_strong, self.kept[cut:]))):
            return None
        if self.made is not None:
            tensors = [record.tensor for record in self.made]
        else:
            tensors = cast(list[torch.Tensor], [same[number] for _, number, _, _, _ in self.template])
        if list(map(type, tensors)) != self.types or list(map(_SIGNATURE, tensors)) != self.signatures:
            return None
        if self.made is not None:
            return self.made
        return [
            TensorRecord(key, tensor, placement, param, trainable)
            for (key, _, placement, param, trainable), tensor in zip(self.template, tensors, strict=True)
        ]


def _weak(value: object) -> object:
    return weakref.ref(value) if isinstance(value, torch.Tensor) else value


def _strong(value: object) -> object:
    return value() if type(value) is weakref.ref else value


class FlattenCache:
    """The flattened model and optimizer state of one client's last save, by model and optimizer.

    A loop that saves every step flattens the same tensors under the same keys every step, and
    encodes the same optimizer state JSON (which refers to tensors by key, not by value). The
    cache keeps both parts, weakly keyed by the model and the optimizer, and hands them out again
    while they hold (:meth:`_Part.records`): the model's names unchanged (the :class:`names.NamesCache`
    hands out the same :class:`names.ModelNames` while its walk holds), the optimizer's params in
    the same groups, its state the same keys holding the same objects, and every tensor of the
    same type, dtype and ``requires_grad``. Param groups (hyperparameters a scheduler changes
    every step) are encoded at every save.
    """

    def __init__(self) -> None:
        #: The names of the models saved, walked again only when a model's layout changed.
        self.names = names.NamesCache()
        self._models: weakref.WeakKeyDictionary[torch.nn.Module, _Part] = weakref.WeakKeyDictionary()
        self._optims: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Part] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self.hits = 0

    def model(self, flat: FlatState, model: torch.nn.Module, known: names.ModelNames) -> None:
        """:func:`flatten_model`, from the last save's part of ``model`` while it holds."""
        same: list[object] = [known]  # the same names hold the same tensors (made once, never changed)
        with self._lock:
            part = self._models.get(model)
        records = part.records(same, []) if part is not None else None
        if part is not None and records is not None:
            flat.add_part(records, part.keys)
            self.hits += 1
            return
        start = len(flat.records)
        flatten_model(flat, model, known)
        with self._lock:
            if self.names.keeps(model, known):
                self._models[model] = _Part.of(same, [], flat.records[start:])
            else:  # names made anew at every save (a state_dict hook may make its tensors): keep none
                self._models.pop(model, None)

    def optimizer(
        self, flat: FlatState, optim: torch.optim.Optimizer, model: torch.nn.Module, known: names.ModelNames
    ) -> None:
        """:func:`flatten_optimizer`, its state's records and JSON from the last save's part of
        ``optim`` while it holds."""
        flat.optimizer_class = optimizer_class(optim)
        saved = optim.state_dict()
        groups = optim.param_groups
        state = saved["state"]
        params = [p for group in groups for p in group["params"]]
        same = [known, *params, *(value for param_state in state.values() for value in param_state.values())]
        equal = [
            [len(group["params"]) for group in groups],
            [group_places_step_on_device(group) for group in saved["param_groups"]],
            list(state),
            [key for param_state in state.values() for key in param_state],
        ]
        with self._lock:
            part = self._optims.get(optim)
        records = part.records(same, equal) if part is not None else None
        if part is not None and records is not None:
            flat.add_part(records, part.keys)
            self.hits += 1
            _flatten_param_groups(flat, _named_groups(saved["param_groups"], part.json["names"]), part.json["state"])
            return
        group_names = _optimizer_param_names(optim, parameter_names(model, known))
        start = len(flat.records)
        state_json = _flatten_optimizer_state(flat, saved, group_names)
        with self._lock:
            lasting = all(type(value) in _LASTING for value in same[1 + len(params) :])
            if lasting and self.names.keeps(model, known):
                json = {"names": group_names, "state": state_json}
                records = flat.records[start:]
                self._optims[optim] = _Part.of(same, equal, records, weak_from=1 + len(params), json=json)
            else:  # a list or dict in the state may change inside; names made anew at every save
                self._optims.pop(optim, None)
        _flatten_param_groups(flat, _named_groups(saved["param_groups"], group_names), state_json)


def flatten_model(flat: FlatState, model: torch.nn.Module, known: names.ModelNames | None = None) -> None:
    """Add every tensor of ``model.state_dict()`` under ``model/<canonical name>``
    (:mod:`client.names`), from ``known`` names of it when given."""
    if known is None:
        known = names.ModelNames(names.state_dict(model), {})
    for (name, value), key in zip(known.state_dict.items(), known.model_keys, strict=True):
        if not isinstance(value, torch.Tensor):
            raise StateEncodingError(
                f"model/{name}: the model's state_dict holds a {type(value).__name__}, not a tensor "
                "(custom extra state); save it through extra= instead"
            )
        grad = bool(value.requires_grad)
        flat.add(
            TensorRecord(
                key,
                value,
                "target",
                trainable=grad,
                requires_grad=grad if isinstance(value, torch.nn.Parameter) else None,
            )
        )


def _optimizer_param_names(optim: torch.optim.Optimizer, param_names: dict[int, str]) -> list[list[str]]:
    groups: list[list[str]] = []
    for group_index, group in enumerate(optim.param_groups):
        group_names = []
        for param in group["params"]:
            name = param_names.get(id(param))
            if name is None:
                raise StateMismatchError(
                    f"optimizer param group {group_index} holds a parameter of shape {tuple(param.shape)} "
                    "that is not a parameter of the model passed to save(); optimizer state is keyed by "
                    "parameter name, so pass the model that owns every optimized parameter"
                )
            group_names.append(name)
        groups.append(group_names)
    return groups


def flatten_optimizer(
    flat: FlatState, optim: torch.optim.Optimizer, model: torch.nn.Module, known: names.ModelNames | None = None
) -> None:
    """Add optimizer state keyed by parameter name, plus any tensors inside param_groups, and
    record the optimizer's class."""
    flat.optimizer_class = optimizer_class(optim)
    group_names = _optimizer_param_names(optim, parameter_names(model, known))
    saved = optim.state_dict()
    state_json = _flatten_optimizer_state(flat, saved, group_names)
    _flatten_param_groups(flat, _named_groups(saved["param_groups"], group_names), state_json)


def _named_groups(saved_groups: list[dict[str, Any]], group_names: list[list[str]]) -> list[dict[str, Any]]:
    """The param groups of an optimizer's state_dict with parameter names in place of indexes."""
    return [{**group, "params": names} for group, names in zip(saved_groups, group_names, strict=True)]


def _flatten_optimizer_state(flat: FlatState, saved: dict[str, Any], group_names: list[list[str]]) -> dict[str, Any]:
    """Add the per-parameter state of an optimizer's state_dict ``saved``; returns its JSON."""
    index_names = [name for group_params in group_names for name in group_params]
    state = {index_names[index]: param_state for index, param_state in saved["state"].items()}
    return _flatten_named_state(flat, state, _named_groups(saved["param_groups"], group_names))


def flatten_named_optimizer(flat: FlatState, state: dict[str, Any], param_groups: list[dict[str, Any]]) -> None:
    """Add an optimizer state_dict keyed by parameter name (``state`` by name, each group's
    ``params`` a list of names: the layout ``get_state_dict`` gives), placing Adam's ``step``
    on the host unless its group is fused or capturable."""
    _flatten_param_groups(flat, param_groups, _flatten_named_state(flat, state, param_groups))


def is_positional(param_groups: list[dict[str, Any]]) -> bool:
    """Whether an optimizer state_dict's groups number their parameters (``params`` lists of
    ints, as ``Optimizer.state_dict`` writes them) rather than name them."""
    return any(type(p) is int for group in param_groups for p in group["params"])


def flatten_optimizer_state(flat: FlatState, optim_state: dict[str, Any]) -> None:
    """Add an optimizer state_dict given as data (an import): keyed by name
    (:func:`flatten_named_optimizer`) or numbered (:func:`flatten_positional_optimizer`)."""
    if is_positional(optim_state["param_groups"]):
        flatten_positional_optimizer(flat, optim_state["state"], optim_state["param_groups"])
    else:
        flatten_named_optimizer(flat, optim_state["state"], optim_state["param_groups"])


def flatten_positional_optimizer(flat: FlatState, state: dict[int, Any], param_groups: list[dict[str, Any]]) -> None:
    """Add an optimizer state_dict that numbers its parameters 0, 1, ... in its groups' order
    (``state`` by that position, each group's ``params`` a list of positions), kept by position.

    Tensors are stored under ``optim/state/<position>/...`` with placement ``target`` (a load
    puts them on the device of the parameter at that position of the optimizer it is given),
    Adam's ``step`` on the host unless its group is fused or capturable.
    """
    group_of = {p: g for g, group in enumerate(param_groups) for p in group["params"]}
    step_on_host = [not group_places_step_on_device(group) for group in param_groups]
    state_json: dict[str, Any] = {}
    for position, param_state in state.items():
        if position not in group_of:
            raise StateEncodingError(f"optimizer state for parameter {position}, which no param group lists")
        prefix = keys.join("optim", "state", str(position))
        host_step = f"{prefix}/step" if step_on_host[group_of[position]] else None

        def store(tensor: torch.Tensor, path: str, host_step: str | None = host_step) -> str:
            return flat.add(TensorRecord(path, tensor, "host" if path == host_step else "target"))

        state_json[str(position)] = jsonstate.encode(param_state, prefix, store)
    _flatten_param_groups(flat, param_groups, state_json)


def _flatten_named_state(flat: FlatState, state: dict[str, Any], param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """Add the per-parameter state of :func:`flatten_named_optimizer`; returns its JSON."""
    group_of = {name: g for g, group in enumerate(param_groups) for name in group["params"]}
    step_on_host = [not group_places_step_on_device(group) for group in param_groups]
    state_json: dict[str, Any] = {}
    for name, param_state in state.items():
        if name not in group_of:
            raise StateEncodingError(f"optimizer state for {name!r}, which no param group lists")
        prefix = keys.join("optim", "state", name)
        host_step = f"{prefix}/step" if step_on_host[group_of[name]] else None

        def store(tensor: torch.Tensor, path: str, name: str = name, host_step: str | None = host_step) -> str:
            if path == host_step:
                return flat.add(TensorRecord(path, tensor, "host"))
            return flat.add(TensorRecord(path, tensor, "param", name))

        state_json[name] = jsonstate.encode(param_state, prefix, store)
    return state_json


def _flatten_param_groups(flat: FlatState, param_groups: list[dict[str, Any]], state_json: dict[str, Any]) -> None:
    """Add the tensors inside ``param_groups`` (params by name) and set the optimizer's JSON."""
    groups_json = []
    for group_index, group in enumerate(param_groups):
        group_params = list(group["params"])
        # A positional group's tensors go where the load is asked to put them (their parameter is not named).
        owner = group_params[0] if group_params and isinstance(group_params[0], str) else None

        def store_group(tensor: torch.Tensor, path: str, owner: str | None = owner) -> str:
            if owner is None:
                return flat.add(TensorRecord(path, tensor, "target"))
            return flat.add(TensorRecord(path, tensor, "param", owner))

        hyper = {k: v for k, v in group.items() if k != "params"}
        encoded = jsonstate.encode(hyper, keys.join("optim", "param_groups", group_index), store_group)
        encoded["params"] = group_params
        groups_json.append(encoded)
    flat.state["optim"] = {"state": state_json, "param_groups": groups_json}


def flatten_other(flat: FlatState, section: str, value: Any) -> None:
    """Add a scheduler's state_dict or user extras under ``section``."""

    def store(tensor: torch.Tensor, path: str) -> str:
        return flat.add(TensorRecord(path, tensor, _host_or_target(tensor)))

    flat.state[section] = jsonstate.encode(value, section, store)


def flatten_extra(flat: FlatState, extra: Any) -> None:
    """Add user extras (a dict of JSON values and tensors) under ``extra``."""
    if not isinstance(extra, dict):
        raise StateEncodingError(f"extra must be a dict, not {type(extra).__name__}")
    flatten_other(flat, "extra", extra)


def flatten(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    reuse: FlattenCache | None = None,
) -> FlatState:
    """Flatten everything a save stores; ``reuse`` (a client's :class:`FlattenCache`) gives the
    model's names and the parts of its last saves that still hold."""
    if not isinstance(model, torch.nn.Module):
        raise StateEncodingError(
            f"model must be a torch.nn.Module, not a {type(model).__name__}; "
            "store a plain {name: tensor} dict with save_state_dict"
        )
    flat = FlatState()
    known = reuse.names.names(model) if reuse is not None else names.model_names(model)
    if reuse is not None:
        reuse.model(flat, model, known)
    else:
        flatten_model(flat, model, known)
    if optim is not None:
        if reuse is not None:
            reuse.optimizer(flat, optim, model, known)
        else:
            flatten_optimizer(flat, optim, model, known)
    if scheduler is not None:
        flatten_other(flat, "scheduler", scheduler.state_dict())
    if extra is not None:
        flatten_extra(flat, extra)
    return flat
