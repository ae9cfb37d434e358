"""Putting loaded tensors where they belong: model parameters, optimizer state, scheduler.

Optimizer state is stored by parameter name, or, when an import's file numbered the
parameters, by position: then it goes to the given optimizer's parameters in its groups'
order, as ``Optimizer.load_state_dict`` pairs them (:func:`check_optimizer` refuses a
mismatch before anything is written).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Container, Iterable, Sequence
from contextlib import closing
from typing import Any

import torch

from ckptstore.client import jsonstate, keys, names
from ckptstore.client.loading import selection
from ckptstore.client.loading.device_copy import DeviceCopier
from ckptstore.client.loading.reader import TensorReader, plain_empty
from ckptstore.client.loading.selection import ModelPlan
from ckptstore.client.placement import HOST, device_for
from ckptstore.client.state import is_positional, optimizer_class
from ckptstore.client.tensors import NAME_TO_TORCH, byte_view, is_plain_dense
from ckptstore.service.errors import StateMismatchError, format_list
from ckptstore.service.format.manifest import Manifest, TensorEntry


def compare_keys(stored: set[str], expected: set[str]) -> tuple[list[str], list[str]]:
    """(missing, unexpected): names the target expects but the checkpoint lacks, and the reverse."""
    return sorted(expected - stored), sorted(stored - expected)


def mismatch_error(version: int, missing: list[str], unexpected: list[str]) -> StateMismatchError:
    """The strict-load error, naming every missing and unexpected key (up to a limit)."""
    parts = []
    if missing:
        parts.append(f"missing keys ({len(missing)}): {format_list(missing)}")
    if unexpected:
        parts.append(f"unexpected keys ({len(unexpected)}): {format_list(unexpected)}")
    return StateMismatchError(
        f"version {version} does not match the model: " + "; ".join(parts) + ". Pass strict=False to load the rest",
        missing_keys=missing,
        unexpected_keys=unexpected,
    )


def _wanted_dtype(saved: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and saved.is_floating_point else saved


def _reallocate(target: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    """Give ``target`` new storage of ``dtype`` on ``device`` while keeping the object itself."""
    fresh = torch.empty(target.shape, dtype=dtype, device=device)
    if torch._has_compatible_shallow_copy_type(target, fresh):
        target.data = fresh
        return
    if isinstance(target, torch.nn.Parameter):
        fresh = torch.nn.Parameter(fresh, requires_grad=target.requires_grad)
    try:
        torch.utils.swap_tensors(target, fresh)
    except RuntimeError as exc:
        raise StateMismatchError(
            f"cannot move a model tensor to {device} in place ({exc}); move the model with "
            "model.to(device) before building the optimizer, then load without device="
        ) from exc


def _copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copy ``source`` into ``target``: a plain memcpy when both are plain, contiguous CPU tensors
    of one dtype (torch's threaded copy contends with the hashing threads), else ``copy_``."""
    if target.dtype == source.dtype and is_plain_dense(target):
        byte_view(target.detach())[:] = byte_view(source)
        return
    with torch.no_grad():
        target.copy_(source)


def _readable_in_place(target: torch.Tensor, stored: torch.dtype) -> bool:
    """Whether the reader may fill ``target`` itself: a plain, contiguous CPU tensor of the stored dtype."""
    return target.dtype == stored and is_plain_dense(target)


def load_into_model(
    reader: TensorReader,
    plan: ModelPlan,
    device: torch.device | None,
    dtype: torch.dtype | None,
    before_write: Callable[[list[torch.Tensor]], object] = lambda tensors: None,
    loaded: Callable[[torch.Tensor, str], object] = lambda tensor, digest: None,
) -> list[str]:
    """Read ``plan.sources`` into the model's own parameters and buffers; returns casts made.

    Shapes are all checked before anything is written. A tensor is re-allocated only when
    ``device`` or ``dtype`` asks for a change, and keeps its identity, so an optimizer that
    holds it stays valid. A CPU tensor of the stored dtype is read into directly; the others
    are read into fresh memory, then copied (and cast or moved). ``before_write`` gets every
    tensor, in one list, before any changes (the digest cache forgets them); ``loaded`` sees every
    tensor that now holds exactly the verified bytes of a stored digest (no cast), with that digest.
    """
    targets, sources, entries = plan.targets, plan.sources, reader.entries
    pairs = [(name, key, targets[name], entries[key]) for name, key in sources.items()]
    wrong = [
        f"{name}: checkpoint {entry.shape}, model {list(target.shape)}"
        for name, _key, target, entry in pairs
        if target.shape != tuple(entry.shape)
    ]
    if wrong:
        raise StateMismatchError(f"shape mismatch for {len(wrong)} tensors: {format_list(wrong, 5)}")
    direct = {}  # key -> the target the reader fills itself
    moving = device is not None or dtype is not None
    before_write([target for _name, _key, target, _entry in pairs])
    for _name, key, target, entry in pairs:
        if moving:
            want_dtype = _wanted_dtype(target.dtype, dtype)
            want_device = device if device is not None else target.device
            if target.dtype != want_dtype or target.device != want_device:
                _reallocate(target, want_dtype, want_device)
        if _readable_in_place(target, NAME_TO_TORCH[entry.dtype]):
            direct[key] = target
    name_of = {key: name for name, key in sources.items()}
    casts = []
    verified: list[tuple[torch.Tensor, str]] = []
    copier = DeviceCopier(target.device for target in targets.values())
    # Each of ``direct`` passed _readable_in_place and the shape check above: the reader's rules and more.
    stream = reader.read_batches(sources.values(), into=direct, host_empty=copier.host_empty, checked=True)
    with copier, closing(stream):
        for batch in stream:
            for key, source in batch:
                target = targets[name_of[key]]
                if source is target:  # read in place: same dtype, on the CPU
                    if (digest := entries[key].digest) is not None:
                        loaded(target, digest)
                    continue
                if target.is_cpu:
                    _copy_into(target, source)
                else:
                    copier.copy(target, source)
                if source.dtype != target.dtype:
                    casts.append(f"{key}: {source.dtype} -> {target.dtype}".replace("torch.", ""))
                elif (digest := entries[key].digest) is not None:
                    if target.is_cpu:
                        loaded(target, digest)  # while the next reads go on
                    else:
                        verified.append((target, digest))
    # Once the copies to devices are done: the digest cache may take a sample of each tensor.
    for target, digest in verified:
        loaded(target, digest)
    restore_requires_grad((t, entry) for _name, _key, t, entry in pairs if isinstance(t, torch.nn.Parameter))
    return casts


def restore_requires_grad(pairs: Iterable[tuple[torch.Tensor, TensorEntry]]) -> None:
    """Give each tensor (a model's parameter, or a tensor a load without a model made) the
    ``requires_grad`` its entry recorded; a tensor whose entry records none (a buffer, a version
    saved before the flag was recorded, an import whose file did not say) keeps its own."""
    for tensor, entry in pairs:
        wanted = entry.requires_grad
        if wanted is not None and tensor.requires_grad != wanted and (tensor.is_floating_point() or not wanted):
            tensor.requires_grad_(wanted)


def materialize_model(
    reader: TensorReader, selected: dict[str, str], device: torch.device, dtype: torch.dtype | None
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A new state_dict of the ``selected`` (name -> key) model tensors on ``device``; returns it and the casts made."""
    name_of = {key: name for name, key in selected.items()}
    result: dict[str, torch.Tensor] = {}
    casts = []
    copier = DeviceCopier([device])
    with copier, closing(reader.read_many(selected.values(), host_empty=copier.host_empty)) as stream:
        for key, tensor in stream:
            want = _wanted_dtype(tensor.dtype, dtype)
            if want != tensor.dtype:
                casts.append(f"{key}: {tensor.dtype} -> {want}".replace("torch.", ""))
            result[name_of[key]] = copier.to(tensor, device, want)
    # Storage order served the reads; callers expect the model's own order.
    return {name: result[name] for name in selected}, casts


def _placed_reader(
    reader: TensorReader,
    prefix: str,
    param_devices: dict[str, torch.device],
    target: torch.device,
    wanted: Callable[[str], bool] = lambda key: True,
    place: Callable[[TensorEntry], torch.device] | None = None,
) -> Callable[[str], torch.Tensor]:
    """A key -> placed tensor function for one state section, fetching its ``wanted`` tensors in bulk.

    The whole section is needed at once anyway (an optimizer loads its full state_dict), so
    reading it in storage order first costs no extra memory and saves round trips. Each tensor
    goes to its device as it arrives (:class:`DeviceCopier`), so the copies overlap the reads and
    host memory holds only the tensors that stay there. Those are read into pageable memory, not
    the copier's pinned blocks: a tensor the optimizer keeps on the host (Adam's ``step``) must
    not hold a pinned block for as long as the optimizer lives. ``place`` (default: the
    placement rules, :func:`client.placement.device_for`) gives each entry's device.
    """
    keys = [k for k in reader.entries if k.startswith(prefix) and wanted(k)]
    if place is None:

        def place(entry: TensorEntry) -> torch.device:
            return device_for(entry, param_devices, target)

    # Optimizer tensors keep their saved dtype: no silent upcast of bf16 state.
    places = {key: place(reader.entries[key]) for key in keys}
    copier = DeviceCopier(places.values())
    fetched: dict[str, torch.Tensor] = {}
    moved = [key for key in keys if places[key].type != "cpu"]
    kept = [key for key in keys if places[key].type == "cpu"]
    with copier:
        for chosen, host_empty in ((moved, copier.host_empty), (kept, plain_empty)):
            if not chosen:
                continue
            with closing(reader.read_many(chosen, host_empty=host_empty)) as stream:
                for key, tensor in stream:
                    fetched[key] = copier.to(tensor, places[key])

    def tensor_for(key: str) -> torch.Tensor:
        if key not in fetched:
            raise StateMismatchError(f"stored state refers to tensor {key!r}, which the version does not hold")
        return fetched[key]

    return tensor_for


def _current_groups(optim: torch.optim.Optimizer, param_names: dict[int, str]) -> list[list[str]]:
    groups = []
    for index, group in enumerate(optim.param_groups):
        try:
            groups.append([param_names[id(p)] for p in group["params"]])
        except KeyError:
            raise StateMismatchError(
                f"optimizer param group {index} holds a parameter that is not in the model passed to load()"
            ) from None
    return groups


def _check_groups(saved_groups: list[dict[str, Any]], current: list[list[str]]) -> None:
    if len(saved_groups) != len(current):
        raise StateMismatchError(
            f"the checkpoint's optimizer has {len(saved_groups)} param groups, this one has {len(current)}"
        )
    for index, (saved, group_names) in enumerate(zip(saved_groups, current, strict=True)):
        missing, unexpected = compare_keys(set(saved["params"]), set(group_names))
        if missing or unexpected:
            raise StateMismatchError(
                f"optimizer param group {index} differs from the checkpoint's: "
                f"not in checkpoint: {format_list(missing) or 'none'}; "
                f"not in optimizer: {format_list(unexpected) or 'none'}",
                missing_keys=missing,
                unexpected_keys=unexpected,
            )


def _prefer_ours(holder: dict[Any, Any], ours: dict[Any, Any], everything: bool) -> None:
    """Undo what an optimizer's load_state_dict did to values we decoded and placed.

    PyTorch's stock ``Optimizer.load_state_dict`` casts floating state to the parameter's
    dtype, moves nested tensors and even turns strings into generator reprs, so after it
    every decoded value is put back (``everything``). An optimizer with its own
    load_state_dict may transform state on purpose; then only tensors whose dtype or device
    alone changed are put back.
    """
    for name, value in ours.items():
        theirs = holder.get(name)
        if everything or (
            isinstance(value, torch.Tensor)
            and isinstance(theirs, torch.Tensor)
            and theirs.shape == value.shape
            and (theirs.dtype != value.dtype or theirs.device != value.device)
        ):
            holder[name] = value


def _saved_optimizer(
    reader: TensorReader, canonical: set[str], patterns: Sequence[str] | None
) -> tuple[dict[str, Any], list[dict[str, Any]], set[str], dict[str, str]]:
    """The version's optimizer ``state`` and ``param_groups`` under the target's canonical names,
    restricted to the parameters ``patterns`` select; the stored names kept; and every stored
    name that differs from its canonical one (a version saved before names were canonical)."""
    saved: Any = reader.manifest.state.get("optim")
    if not isinstance(saved, dict):
        raise StateMismatchError(f"version {reader.manifest.version} holds no optimizer state")
    stored = [n for group in saved["param_groups"] for n in group["params"]]
    renamed = names.match_names(stored, canonical)
    kept = {n for n in stored if selection.matches(renamed.get(n, n), patterns)}
    state = {renamed.get(n, n): v for n, v in saved["state"].items() if n in kept}
    groups = [
        {**group, "params": [renamed.get(n, n) for n in group["params"] if n in kept]}
        for group in saved["param_groups"]
    ]
    return state, groups, kept, renamed


def check_optimizer(manifest: Manifest, optim: torch.optim.Optimizer, *, strict: bool, partial: bool) -> None:
    """Refuse, before anything is written, to load ``manifest``'s optimizer state into ``optim``
    where it cannot be right.

    - The version records its optimizer's class: a strict load into another class is refused
      (AdamW's state in an SGD fails at its next ``step()``, or worse, runs); ``strict=False``
      loads it anyway.
    - State kept by position pairs with ``optim``'s parameters in its groups' order, so the
      groups must hold as many parameters as the saved ones, and a partial load (``keys=``)
      cannot select by name.

    Raises:
        StateMismatchError: naming the version and what differs.
    """
    version = manifest.version
    saved: Any = manifest.state.get("optim")
    if not isinstance(saved, dict):
        raise StateMismatchError(f"version {version} holds no optimizer state")
    stored, ours = manifest.optimizer_class, optimizer_class(optim)
    if strict and stored is not None and stored != ours:
        raise StateMismatchError(
            f"version {version} holds the state of a {stored}, not of a {ours}: resume with an optimizer of "
            "the saved class, or pass strict=False to load the state into this one anyway"
        )
    if not is_positional(saved["param_groups"]):
        return
    if partial:
        raise StateMismatchError(
            f"version {version} holds optimizer state by position (its source numbered the parameters), "
            "which keys= cannot select by name; load it without keys="
        )
    sizes = [len(group["params"]) for group in saved["param_groups"]]
    have = [len(group["params"]) for group in optim.param_groups]
    if sizes != have:
        raise StateMismatchError(
            f"version {version} holds optimizer state by position for param groups of {sizes} parameters, "
            f"this optimizer's groups hold {have}: build it as the optimizer that saved the state was "
            "built (the same parameters in the same order)"
        )


def restore_optimizer(
    reader: TensorReader,
    optim: torch.optim.Optimizer,
    model: torch.nn.Module,
    target: torch.device,
    patterns: Sequence[str] | None = None,
) -> None:
    """Load the version's optimizer state into ``optim``, placing every tensor by the rules
    (call :func:`check_optimizer` first).

    With ``patterns`` (a partial load), only the state of the parameters they select is read,
    and ``optim`` must optimize exactly those parameters, grouped as in the checkpoint. State
    kept by position goes to ``optim``'s parameters in its groups' order.
    """
    saved: Any = reader.manifest.state.get("optim")
    if isinstance(saved, dict) and is_positional(saved["param_groups"]):
        _restore_positional(reader, optim, saved, target)
        return
    params = names.parameters(model)
    saved_state, saved_groups, kept, renamed = _saved_optimizer(reader, set(params), patterns)
    current = _current_groups(optim, {id(p): name for name, p in params.items()})
    _check_groups(saved_groups, current)

    def wanted(key: str) -> bool:
        parts = key.split("/")
        return parts[1] != "state" or keys.unescape(parts[2]) in kept

    # Placement names each tensor's parameter as stored.
    devices = {n: p.device for n, p in params.items()}
    devices.update((stored, devices[name]) for stored, name in renamed.items())
    tensor_for = _placed_reader(reader, "optim/", devices, target, wanted)
    order = {name: index for index, name in enumerate(n for group in current for n in group)}
    state: dict[int, Any] = {}
    for name, encoded in saved_state.items():
        if name not in order:
            raise StateMismatchError(f"the checkpoint has optimizer state for {name!r}, which this optimizer lacks")
        state[order[name]] = jsonstate.decode(encoded, tensor_for)
    groups = []
    for saved_group, group_names in zip(saved_groups, current, strict=True):
        hyper = jsonstate.decode({k: v for k, v in saved_group.items() if k != "params"}, tensor_for)
        hyper["params"] = [order[n] for n in group_names]
        groups.append(hyper)
    _load_state_dict(optim, state, groups, dict(enumerate(params[n] for group in current for n in group)))


def _restore_positional(
    reader: TensorReader, optim: torch.optim.Optimizer, saved: dict[str, Any], target: torch.device
) -> None:
    """Load state kept by position into ``optim``: saved position ``i`` of a group is the
    parameter at the same place of ``optim``'s group (``Optimizer.load_state_dict``'s pairing),
    and its tensors go to that parameter's device."""
    version = reader.manifest.version
    param_of: dict[int, torch.Tensor] = {}
    for saved_group, group in zip(saved["param_groups"], optim.param_groups, strict=True):
        param_of.update(zip(saved_group["params"], group["params"], strict=True))

    def position(text: str, held: Container[int]) -> int:
        number = int(text) if text.isdecimal() and len(text) < 12 else -1
        if number not in held:
            raise StateMismatchError(f"version {version}: optimizer state at place {text[:40]!r}, which no group holds")
        return number

    def place(entry: TensorEntry) -> torch.device:
        if entry.placement == "host":
            return HOST
        _, section, at, *_ = entry.key.split("/")
        if section == "state":
            return param_of[position(keys.unescape(at), param_of)].device
        group = optim.param_groups[position(keys.unescape(at), range(len(optim.param_groups)))]["params"]
        return group[0].device if group else target

    tensor_for = _placed_reader(reader, "optim/", {}, target, place=place)
    state = {position(text, param_of): jsonstate.decode(value, tensor_for) for text, value in saved["state"].items()}
    groups = []
    for saved_group in saved["param_groups"]:
        hyper = jsonstate.decode({k: v for k, v in saved_group.items() if k != "params"}, tensor_for)
        hyper["params"] = list(saved_group["params"])
        groups.append(hyper)
    _load_state_dict(optim, state, groups, param_of)


def _load_state_dict(
    optim: torch.optim.Optimizer,
    state: dict[int, Any],
    groups: list[dict[str, Any]],
    param_of: dict[int, torch.Tensor],
) -> None:
    """``optim.load_state_dict`` of decoded and placed ``state`` and ``groups`` (``param_of``: the
    parameter each index of theirs pairs with), then every value of ours put back where a stock
    loader cast or moved it."""
    with warnings.catch_warnings():
        # The stock loader casts floating and complex state to the parameter's dtype (warning
        # when that drops an imaginary part); every such cast is undone just below.
        warnings.filterwarnings("ignore", "Casting complex values to real", UserWarning)
        optim.load_state_dict({"state": state, "param_groups": groups})
    stock = type(optim).load_state_dict is torch.optim.Optimizer.load_state_dict
    for index, ours in state.items():
        theirs = optim.state.get(param_of[index])
        if isinstance(ours, dict) and isinstance(theirs, dict):
            _prefer_ours(theirs, ours, stock)
    for group, ours in zip(optim.param_groups, groups, strict=True):
        _prefer_ours(group, {k: v for k, v in ours.items() if k != "params"}, stock)


def restore_section(
    reader: TensorReader, section: str, target: torch.device, param_devices: dict[str, torch.device] | None = None
) -> Any:
    """Decode a section (scheduler, extra; optimizer state with ``param_devices``), placing its tensors."""
    if section not in reader.manifest.state:
        return None
    tensor_for = _placed_reader(reader, f"{section}/", param_devices or {}, target)
    return jsonstate.decode(reader.manifest.state[section], tensor_for)


def live_tensors(model: torch.nn.Module | None, optim: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The tensors a load filled: the model's state_dict and the optimizer's state and groups."""
    tensors = list(model.state_dict(keep_vars=True).values()) if model is not None else []
    if optim is not None:
        holders = [*optim.state.values(), *optim.param_groups]
        tensors += [v for holder in holders for v in holder.values() if isinstance(v, torch.Tensor)]
    return [t for t in tensors if isinstance(t, torch.Tensor)]
