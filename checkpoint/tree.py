"""Turns a training state into (tensors, JSON tree) and back, without pickle.

A state is a mapping whose values are tensors, numpy arrays, nested dicts/lists/tuples, Python scalars,
``str``/``bytes``/``None``, or *Stateful* objects (anything with ``state_dict()``/``load_state_dict()``, such
as ``nn.Module`` and ``Optimizer``), like ``torch.distributed.checkpoint``'s Stateful protocol.

:func:`capture` records every tensor (by reference, nothing is copied) and encodes everything else as a JSON
tree in which each tensor is an index. :func:`restore_into` walks that tree against the live state and loads
each tensor *in place* when the live tensor has the same shape and dtype.

Sharded tensors (``torch.distributed.tensor.DTensor``: FSDP2 parameters, tensor-parallel weights, the optimizer
state of either) are captured shard-locally: only the local shard is staged, and the tree node records the
global shape, this shard's offsets in it, the mesh shape and the placements (``{"t": "dtensor", "i": 3, "g":
[4096, 1024], "o": [1024, 0], "mesh": [4], "pl": ["S(0)"]}``), so a reader can place any saved shard in any other
layout (see :mod:`.shards`).

Tree encoding: ``None``, ``bool``, ``int``, ``str`` and finite ``float`` are JSON scalars; everything else is a
JSON object ``{"t": tag, ...}`` (so a bare JSON object never appears as a value and decoding is unambiguous).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from trainguard.checkpoint.errors import CheckpointError, StateMismatchError, UnsupportedValueError
from trainguard.checkpoint.manifest import DTYPE_SIZES


@runtime_checkable
class Stateful(Protocol):
    """An object saved through its ``state_dict()`` and restored through ``load_state_dict()``."""

    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> Any: ...


def is_stateful(obj: Any) -> bool:
    """True for objects with callable ``state_dict`` and ``load_state_dict`` (not tensors)."""
    return (not isinstance(obj, torch.Tensor) and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


@dataclass
class LocalShard:
    """One rank's block of a larger tensor held as a plain tensor (manual tensor or sequence parallelism,
    Megatron-style layers): saved and resharded like a DTensor shard.

    Put it in the state in place of the plain tensor, on save and on restore (the restore fills ``tensor`` in
    place with the block at ``offsets``, whatever layout saved it).

    Attributes:
        tensor: this rank's block.
        global_shape: shape of the whole tensor.
        offsets: index of the block's first element in the whole tensor, per dimension.
    """

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(x) for x in self.global_shape)
        self.offsets = tuple(int(x) for x in self.offsets)
        shape = tuple(self.tensor.shape)
        if not (len(shape) == len(self.global_shape) == len(self.offsets)) or any(
                o < 0 or o + n > g for o, n, g in zip(self.offsets, shape, self.global_shape)):
            raise CheckpointError(f"LocalShard of shape {list(shape)} at offsets {list(self.offsets)} does not fit "
                                  f"in global shape {list(self.global_shape)}")


@dataclass
class CapturedTensor:
    """One tensor of a captured state (a reference to the live tensor, not a copy).

    Attributes:
        key: dotted path, e.g. ``model.layer.weight`` (for humans and DCP export).
        tensor: the live tensor.
        is_numpy: the live value was a numpy array.
    """

    key: str
    tensor: torch.Tensor
    is_numpy: bool = False


@dataclass
class Captured:
    """Result of :func:`capture`: the JSON tree and the tensors it indexes."""

    tree: dict[str, Any]
    tensors: list[CapturedTensor] = field(default_factory=list)
    sharded: bool = False


def capture(state: Mapping[str, Any]) -> Captured:
    """Walks ``state`` once, calling ``state_dict()`` on Stateful values.

    Args:
        state: the training state (see module docstring).

    Returns:
        The JSON-ready tree and the list of live tensors it references.

    Raises:
        CheckpointError: a value of an unsupported type (the message gives its path).
    """
    if not isinstance(state, Mapping):
        raise CheckpointError(f"state must be a mapping of name -> value, got {type(state).__name__}")
    out = Captured(tree={})
    out.tree = _encode_dict(state, "", out)
    return out


def is_dtensor(v: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (without importing torch.distributed when unused)."""
    if type(v).__name__ != "DTensor":
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(v, DTensor)


def dtensor_region(t: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local shape, global offsets)`` of this rank's shard of DTensor ``t`` (torch's own computation)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(int(x) for x in shape), tuple(int(x) for x in offsets)


def check_storable(t: torch.Tensor, path: str) -> None:
    """Refuses tensors the raw-bytes format cannot store.

    Raises:
        UnsupportedValueError: sparse/quantized/nested/meta tensor or an unknown dtype (the message names the path).
    """
    what = None
    if t.layout != torch.strided:
        what = f"a {str(t.layout).removeprefix('torch.')} (sparse) tensor; save t.to_dense()"
    elif t.is_quantized:
        what = "a quantized tensor; save t.dequantize() or its int_repr() and scales"
    elif getattr(t, "is_nested", False):
        what = "a nested tensor; save its components"
    elif t.device.type == "meta":
        what = "a meta tensor (it has no data); materialize it first"
    elif str(t.dtype).removeprefix("torch.") not in DTYPE_SIZES:
        what = (f"a {str(t.dtype).removeprefix('torch.')} tensor, a dtype the format does not store; "
                f"convert it (e.g. to {'complex64' if t.is_complex() else 'float32'})")
    if what is not None:
        raise UnsupportedValueError(f"state value at {path or '<root>'} is {what}")


def _encode_dtensor(v: Any, path: str, out: Captured) -> dict[str, Any]:
    local = v.to_local()
    check_storable(local, path)
    shape, offsets = dtensor_region(v)
    if tuple(local.shape) != shape:
        raise UnsupportedValueError(f"DTensor at {path}: its local tensor is {tuple(local.shape)} but its "
                                    f"placements give {shape} (uneven padding?); save full_tensor() instead")
    out.tensors.append(CapturedTensor(path, local.detach()))
    out.sharded = True
    return {"t": "dtensor", "i": len(out.tensors) - 1, "g": list(v.shape), "o": list(offsets),
            "mesh": list(v.device_mesh.shape), "pl": [str(p) for p in v.placements]}


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _encode_dict(d: Mapping[Any, Any], path: str, out: Captured) -> dict[str, Any]:
    keys, values = [], []
    for k, v in d.items():
        keys.append(_encode_key(k, path))
        values.append(_encode(v, _join(path, k), out))
    return {"t": "dict", "k": keys, "v": values}


def _encode_key(k: Any, path: str) -> Any:
    if k is None or isinstance(k, (bool, int, str)):
        return k
    if isinstance(k, float):
        return {"t": "float", "v": repr(k)}
    if isinstance(k, tuple):
        return {"t": "tuple", "v": [_encode_key(x, path) for x in k]}
    raise CheckpointError(f"dict key {k!r} under {path or '<root>'} has unsupported type {type(k).__name__}")


def _encode(v: Any, path: str, out: Captured) -> Any:
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return v if math.isfinite(v) else {"t": "float", "v": repr(v)}
    if isinstance(v, LocalShard):
        check_storable(v.tensor, path)
        out.tensors.append(CapturedTensor(path, v.tensor.detach()))
        out.sharded = True
        return {"t": "dtensor", "i": len(out.tensors) - 1, "g": list(v.global_shape), "o": list(v.offsets),
                "mesh": [], "pl": ["local"]}
    if isinstance(v, torch.Tensor):
        if is_dtensor(v):
            return _encode_dtensor(v, path, out)
        check_storable(v, path)
        out.tensors.append(CapturedTensor(path, v.detach()))
        return {"t": "tensor", "i": len(out.tensors) - 1}
    if type(v).__module__ == "numpy" and hasattr(v, "dtype"):
        import numpy as np

        if isinstance(v, np.ndarray):
            # ascontiguousarray makes a 0-d array 1-d; the reshape keeps np.array(0.5) restorable into itself.
            c = np.ascontiguousarray(v).reshape(v.shape)
            try:
                t = torch.from_numpy(c)
            except (TypeError, ValueError) as exc:
                # Strings, objects, float128, another byte order: torch's own TypeError or ValueError left save()
                # naming neither the key nor a fix, although every refusal of the format is a CheckpointError.
                raise UnsupportedValueError(
                    f"state value at {path or '<root>'} is a numpy array of dtype {v.dtype}, which the format does "
                    "not store; convert it (numbers: arr.astype(a native numeric dtype); text or objects: a "
                    "list)") from exc
            out.tensors.append(CapturedTensor(path, t, is_numpy=True))
            return {"t": "tensor", "i": len(out.tensors) - 1, "np": True}
        return _encode(v.item(), path, out)  # numpy scalar
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"t": "bytes", "v": base64.b64encode(bytes(v)).decode("ascii")}
    if isinstance(v, Mapping):
        return _encode_dict(v, path, out)
    if isinstance(v, list):
        return {"t": "list", "v": [_encode(x, _join(path, i), out) for i, x in enumerate(v)]}
    if isinstance(v, tuple):
        return {"t": "tuple", "v": [_encode(x, _join(path, i), out) for i, x in enumerate(v)]}
    if isinstance(v, torch.dtype):
        return {"t": "dtype", "v": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"t": "device", "v": str(v)}
    if is_stateful(v):
        return {"t": "stateful", "v": _encode_dict(v.state_dict(), path, out)}
    raise CheckpointError(
        f"state value at {path or '<root>'} has unsupported type {type(v).__name__}; store tensors, "
        "containers, scalars, str/bytes or objects with state_dict()/load_state_dict()")


# ---------------------------------------------------------------------- decoding

#: ``loader(index, target_or_None, node_or_None) -> tensor``: returns ``target`` filled in place (raising
#: :class:`StateMismatchError` when it does not fit), or a new tensor when there is no target. ``node`` is the
#: tree node for sharded tensors (``"t": "dtensor"``), None for plain ones.
TensorLoader = Callable[..., torch.Tensor]


def decode(node: Any, loader: TensorLoader, target: Any = None) -> Any:
    """Rebuilds a value from its tree node, loading tensors through ``loader``.

    Args:
        node: a tree node produced by :func:`capture`.
        loader: loads tensor ``i``, into ``target`` when given and compatible.
        target: the live value at the same path (or None): tensors are filled in place, Stateful objects get
            ``load_state_dict``.

    Returns:
        The decoded value (the same object as ``target`` when it was loaded in place).

    Raises:
        CorruptCheckpointError: the tree is malformed.
        StateMismatchError: a Stateful object in the checkpoint meets a non-Stateful live value.
    """
    if not isinstance(node, dict):
        return node
    tag = node.get("t")
    if tag == "tensor":
        tgt = target
        if isinstance(target, torch.Tensor):
            tgt = target
        elif target is not None and type(target).__module__ == "numpy" and hasattr(target, "shape"):
            tgt = torch.from_numpy(target) if target.flags.writeable and target.flags.c_contiguous else None
        else:
            tgt = None
        t = loader(int(node["i"]), tgt, None)
        if node.get("np"):
            if tgt is not None and t is tgt and target is not None and not isinstance(target, torch.Tensor):
                return target
            return t.numpy()
        return t
    if tag == "dtensor":
        return loader(int(node["i"]), target if isinstance(target, (torch.Tensor, LocalShard)) else None, node)
    if tag == "dict" and is_stateful(target):
        # A plain state dict (e.g. imported from torch.distributed.checkpoint) restored into a Stateful object.
        return decode({"t": "stateful", "v": node}, loader, target)
    if tag == "dict":
        tmap = target if isinstance(target, Mapping) else {}
        result = {}
        for k_node, v_node in zip(node["k"], node["v"]):
            k = _decode_key(k_node)
            result[k] = decode(v_node, loader, tmap.get(k) if k in tmap else None)
        return result
    if tag in ("list", "tuple"):
        tlist = target if isinstance(target, (list, tuple)) else ()
        items = [decode(x, loader, tlist[i] if i < len(tlist) else None) for i, x in enumerate(node["v"])]
        return items if tag == "list" else tuple(items)
    if tag == "float":
        return float(node["v"])
    if tag == "bytes":
        return base64.b64decode(node["v"])
    if tag == "dtype":
        return getattr(torch, node["v"])
    if tag == "device":
        return torch.device(node["v"])
    if tag == "stateful":
        if target is None:
            return decode(node["v"], loader, None)
        if not is_stateful(target):
            raise StateMismatchError(
                f"checkpoint holds a state_dict() for a {type(target).__name__}, which has no load_state_dict()")
        current = target.state_dict()
        sub = loader
        if isinstance(target, torch.optim.Optimizer):
            current, made = _optimizer_state_targets(target, current, node["v"])
            sub = _casting_loader(loader, made)
        new_sd = decode(node["v"], sub, current)
        try:
            target.load_state_dict(new_sd)
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            # All of torch's message: its first line alone ("Error(s) in loading state_dict for X:") named nothing.
            said = " ".join(str(exc).split())[:2000] or repr(exc)
            raise StateMismatchError(f"{type(target).__name__}.load_state_dict refused the checkpoint: {said}") from exc
        return target
    from trainguard.checkpoint.errors import CorruptCheckpointError

    raise CorruptCheckpointError(f"checkpoint tree has an unknown node tag {tag!r}; the manifest is damaged")


def _casting_loader(loader: TensorLoader, made: set[int] = frozenset()) -> TensorLoader:  # type: ignore[assignment]
    """``loader`` for an optimizer's state: a saved tensor whose dtype differs from the live one's (moments kept
    in bfloat16 by one run, in float32 by this one's) is loaded as saved and left to the optimizer's own
    ``load_state_dict``, which casts state to its parameter's dtype as torch does; filling the live tensor in
    place refused it (StateMismatchError) where ``optimizer.load_state_dict`` accepts it. Another shape still
    raises. A target :func:`_optimizer_state_targets` made (ids in ``made``) that the saved value does not fit
    (a plain scalar ``step`` beside a sharded parameter) is dropped: the value loads as saved."""

    def load(i: int, tgt: Any, node: Any) -> torch.Tensor:
        try:
            return loader(i, tgt, node)
        except StateMismatchError:
            if id(tgt) in made:
                return loader(i, None, node)
            if not isinstance(tgt, torch.Tensor) or is_dtensor(tgt):
                raise
            t = loader(i, None, node)
            if tuple(t.shape) != tuple(tgt.shape):
                raise
            return t

    return load


def _optimizer_state_targets(optim: torch.optim.Optimizer, current: Mapping[str, Any], saved: Any,
                             make: Callable[[torch.Tensor], torch.Tensor] | None = None
                             ) -> tuple[Mapping[str, Any], set[int]]:
    """``current`` (the live optimizer's ``state_dict()``) with a live target for each saved state value of a
    sharded parameter that the optimizer does not hold yet: an empty DTensor laid out like its parameter; and the
    ids of the targets made (a plain saved value that does not fit one, a scalar ``step``, loads as saved).

    A fresh optimizer has no state (Adam's moments appear at its first step), so a saved moment of an FSDP2 or
    tensor-parallel parameter had nothing to be placed into: it was loaded as a plain tensor of the whole global
    shape, and the first ``step()`` after the restore raised "got mixed torch.Tensor and DTensor". Laid out like
    the parameter, each rank reads only its own shard, as ``torch.distributed.checkpoint.state_dict`` does by
    initialising the optimizer's state first. Plain saved moments (a DDP or one-GPU run's) get the same targets,
    each rank copying its region: loaded whole they met the DTensor parameters at the first ``step()`` the same
    way. ``make(param)`` makes each target (default: an empty tensor like the parameter; the pre-load walk of
    :func:`sharded_targets` only needs the layout and passes the detached parameter, allocating nothing).
    """
    if not (isinstance(saved, dict) and saved.get("t") == "dict"):
        return current, set()
    saved_state = dict(zip((_decode_key(k) for k in saved["k"]), saved["v"])).get("state")
    if not (isinstance(saved_state, dict) and saved_state.get("t") == "dict"):
        return current, set()
    params = [p for group in optim.param_groups for p in group["params"]]  # state_dict()'s numbering
    live = current.get("state", {})
    added: dict[Any, dict[Any, Any]] = {}
    for k_node, entry in zip(saved_state["k"], saved_state["v"]):
        idx = _decode_key(k_node)
        if (not isinstance(idx, int) or not 0 <= idx < len(params) or idx in live or not is_dtensor(params[idx])
                or not (isinstance(entry, dict) and entry.get("t") == "dict")):
            continue
        param = params[idx]
        for name_node, value in zip(entry["k"], entry["v"]):
            if not isinstance(value, dict):
                continue
            if (value.get("t") == "dtensor" and tuple(value["g"]) == tuple(param.shape)) or value.get("t") == "tensor":
                added.setdefault(idx, {})[_decode_key(name_node)] = (
                    make(param) if make is not None else torch.empty_like(param.detach()))
    if not added:
        return current, set()
    made = {id(t) for entry in added.values() for t in entry.values()}
    return {**current, "state": {**live, **added}}, made


def dtensor_nodes(node: Any) -> list[dict[str, Any]]:
    """Every ``"dtensor"`` node of a tree, in tree order."""
    out: list[dict[str, Any]] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if n.get("t") == "dtensor":
                out.append(n)
            else:
                stack.extend(reversed(list(n.values())))
        elif isinstance(n, list):
            stack.extend(reversed(n))
    return out


def _decode_key(k: Any) -> Any:
    if isinstance(k, dict):
        if k.get("t") == "float":
            return float(k["v"])
        if k.get("t") == "tuple":
            return tuple(_decode_key(x) for x in k["v"])
    return k


def shares_memory_within(t: torch.Tensor) -> bool:
    """True when several elements of ``t`` are one memory location: a dimension of size > 1 with stride 0, as
    ``expand()`` and broadcasting make (``copy_`` into such a tensor raises). Transposes, slices and views into a
    larger tensor do not count: each of their elements has a location of its own."""
    if is_dtensor(t):
        t = t.to_local()
    return any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))


def _shared_memory_error(key: str) -> StateMismatchError:
    return StateMismatchError(
        f"{key}: the live tensor's elements share memory (an expand()ed or broadcast view, stride 0), so it cannot "
        "be filled in place; restore into a tensor that owns its memory (e.g. .clone() it); nothing was loaded")


def _fit_error(key: str, saved: str, live: str) -> StateMismatchError:
    return StateMismatchError(
        f"{key}: the checkpoint holds {saved}, the live tensor is {live}; restore into a state of the same shapes "
        "and dtypes (or leave the key out); nothing was loaded")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_fits_before_loading(tree: dict[str, Any], entries: Any, state: Mapping[str, Any],
                              loader: Any = None) -> None:
    """Raises the :class:`StateMismatchError` a restore would raise for a tensor of ``state`` (or of a module in
    it) whose shape or dtype differs from the saved one, or whose elements share memory (an ``expand()``ed view,
    which ``copy_`` cannot fill), before anything is loaded; then runs the loader's own pre-load check (a sharded
    restore's check that the saved shards tile every tensor it reshards, see :mod:`.shards`).

    The load fills the state key by key: a mismatch found at the fifth key left the first four holding the
    checkpoint and the rest the fresh model's values, so a script that caught the error and trained on (from
    scratch, or after restoring into a resized model by hand) trained a mixture with no word. Optimizers are
    left out (their state may load in another dtype, cast by ``load_state_dict``), and so are values that are
    not tensors. Sharded tensors (DTensor, :class:`LocalShard`) are checked against their global shape.

    Args:
        tree: the root tree node of the checkpoint.
        entries: the manifest's tensor entries (``.key``, ``.shape``, ``.dtype``), indexed by the tree's ``"i"``.
        state: the live state.
        loader: the loader about to load ``tree``; when it has ``check_before_loading(state)`` (a sharded
            restore's, which needs the live state and every rank's manifest), that runs last.

    Raises:
        StateMismatchError: a live tensor does not fit its saved one (the message names the key).
        CorruptCheckpointError: the loader's check failed (a sharded step whose shards do not tile a tensor).
    """

    def walk(node: Any, target: Any, path: str) -> None:
        if not isinstance(node, dict) or target is None:
            return
        tag = node.get("t")
        if tag == "tensor" and isinstance(target, torch.Tensor):
            e = entries[int(node["i"])]
            dtype = getattr(torch, e.dtype, None)
            if tuple(target.shape) != tuple(e.shape) or target.dtype != dtype:
                raise _fit_error(e.key, f"{e.dtype}{list(e.shape)}",
                                 f"{_dtype_name(target.dtype)}{list(target.shape)}")
            if shares_memory_within(target):
                raise _shared_memory_error(e.key)
        elif tag == "dtensor" and isinstance(target, (torch.Tensor, LocalShard)):
            e = entries[int(node["i"])]
            dtype = getattr(torch, e.dtype, None)
            gshape = tuple(int(x) for x in node["g"])
            live = target.tensor if isinstance(target, LocalShard) else target
            lshape = target.global_shape if isinstance(target, LocalShard) else tuple(target.shape)
            if tuple(lshape) != gshape or live.dtype != dtype:
                what = "live LocalShard is of" if isinstance(target, LocalShard) else "live tensor is"
                raise StateMismatchError(
                    f"{e.key}: the checkpoint holds {e.dtype}{list(gshape)}, the {what} "
                    f"{_dtype_name(live.dtype)}{list(lshape)}; restore into a state of the same shapes and dtypes "
                    "(or leave the key out); nothing was loaded")
            if shares_memory_within(live):
                raise _shared_memory_error(e.key)
        elif tag == "dict" and isinstance(target, Mapping):
            for k_node, v_node in zip(node["k"], node["v"]):
                k = _decode_key(k_node)
                if k in target:
                    walk(v_node, target[k], f"{path}.{k}" if path else str(k))
        elif tag in ("list", "tuple") and isinstance(target, (list, tuple)):
            for i, (x, t) in enumerate(zip(node["v"], target)):
                walk(x, t, f"{path}[{i}]")
        elif tag == "stateful" and isinstance(target, torch.nn.Module):
            live = target.state_dict(keep_vars=True)
            saved = node["v"]
            if isinstance(saved, dict) and saved.get("t") == "dict" and _loads_keys_as_named(target):
                _check_module_keys(path, type(target).__name__, [_decode_key(k) for k in saved["k"]], live)
            walk(saved, live, path)

    keys = [_decode_key(k) for k in tree["k"]]
    for k, v in zip(keys, tree["v"]):
        if k in state:
            walk(v, state[k], str(k))
    check = getattr(loader, "check_before_loading", None)
    if check is not None:
        check(state)


def _loads_keys_as_named(module: torch.nn.Module) -> bool:
    """Whether ``module.load_state_dict`` takes exactly the names its ``state_dict()`` gives: no load hook and no
    loading of its own anywhere in it. Torch lets a module rename or migrate keys while loading (a pre-hook
    mapping a renamed layer's keys, the old ``weight_norm``'s ``weight_g``/``weight_v`` into a parametrization's),
    and such a checkpoint loads; only torch can tell, so the names are not compared then. BatchNorm's own loading
    only adds a missing ``num_batches_tracked``, which the comparison allows for."""
    base = torch.nn.Module
    if type(module).load_state_dict is not base.load_state_dict:
        return False
    for m in module.modules():
        if getattr(m, "_load_state_dict_pre_hooks", None) or getattr(m, "_load_state_dict_post_hooks", None):
            return False
        if type(m)._load_from_state_dict is not base._load_from_state_dict and \
                not isinstance(m, torch.nn.modules.batchnorm._NormBase):
            return False
    return True


def _check_module_keys(path: str, kind: str, saved: list[Any], live: Mapping[str, Any]) -> None:
    """Raises when a module's parameter and buffer names differ from those it was saved with: the load filled
    the names both have and then ``load_state_dict`` refused the rest, so a script that caught the error trained a
    mixture, and the message kept only torch's first line ("Error(s) in loading state_dict for Sequential:"),
    naming no key. ``num_batches_tracked`` missing from a checkpoint is left to torch, which fills it in.

    Raises:
        StateMismatchError: names missing from the checkpoint or not in the live module (a few of each).
    """
    have = set(saved)
    missing = [k for k in live if k not in have and not str(k).endswith("num_batches_tracked")]
    unexpected = [k for k in saved if k not in live]
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"not in the checkpoint: {_some(missing)}")
    if unexpected:
        parts.append(f"in the checkpoint but not in the live {kind}: {_some(unexpected)}")
    raise StateMismatchError(f"{path or 'the state'}: the live {kind}'s parameters and buffers are not the ones it was "
                             f"saved with ({'; '.join(parts)}); restore into the same architecture (or leave the "
                             "key out and load the matching part yourself); nothing was loaded")


def _some(names: list[Any], most: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def sharded_targets(tree: dict[str, Any], state: Mapping[str, Any]) -> list[tuple[dict[str, Any], Any]]:
    """``(node, live target)`` of every sharded tensor (``"dtensor"`` node) a :func:`restore_into` of ``state``
    loads, the target resolved as :func:`decode` resolves it: a tensor or :class:`LocalShard` to fill in place,
    or None when a new tensor of the whole global shape is made. Nothing is loaded or allocated; Stateful values
    are asked for their ``state_dict()`` (which :func:`decode` asks too), only where sharded tensors are below.
    """
    out: list[tuple[dict[str, Any], Any]] = []

    def walk(node: Any, target: Any) -> None:
        if not isinstance(node, dict):
            return
        tag = node.get("t")
        if tag == "dtensor":
            out.append((node, target if isinstance(target, (torch.Tensor, LocalShard)) else None))
        elif tag == "dict" and is_stateful(target):
            walk({"t": "stateful", "v": node}, target)
        elif tag == "dict":
            tmap = target if isinstance(target, Mapping) else {}
            for k_node, v_node in zip(node["k"], node["v"]):
                k = _decode_key(k_node)
                walk(v_node, tmap.get(k) if k in tmap else None)
        elif tag in ("list", "tuple"):
            tlist = target if isinstance(target, (list, tuple)) else ()
            for i, x in enumerate(node["v"]):
                walk(x, tlist[i] if i < len(tlist) else None)
        elif tag == "stateful":
            if target is None or not is_stateful(target) or not dtensor_nodes(node["v"]):
                walk(node["v"], None)  # decode makes new tensors (or raises before loading any of it)
                return
            current = target.state_dict()
            if isinstance(target, torch.optim.Optimizer):
                current, _ = _optimizer_state_targets(target, current, node["v"], make=lambda p: p.detach())
            walk(node["v"], current)

    keys = [_decode_key(k) for k in tree["k"]]
    for k, v in zip(keys, tree["v"]):
        if k in state:
            walk(v, state[k])
    return out


def placed_as_saved(node: dict[str, Any], entry: Any, target: Any) -> bool:
    """Whether the sharded tensor of ``node`` (its saved ``entry``) loads into live ``target`` as the very block
    this rank's copy holds (same offsets, shape and dtype): then no other rank's shard is read."""
    if isinstance(target, LocalShard):
        live, off, shape = target.tensor, target.offsets, tuple(target.tensor.shape)
    elif is_dtensor(target):
        shape, off = dtensor_region(target)
        live = target
    elif isinstance(target, torch.Tensor):
        live, off, shape = target, (0,) * target.dim(), tuple(target.shape)
    else:
        return False
    return (tuple(node["o"]) == tuple(off) and tuple(entry.shape) == tuple(shape)
            and live.dtype == getattr(torch, entry.dtype, None))


def restore_into(tree: dict[str, Any], loader: TensorLoader, state: MutableMapping[str, Any]) -> None:
    """Loads a checkpoint tree into the live ``state`` mapping in place.

    Stateful values get ``load_state_dict``, tensors get filled in place, other leaves are replaced in the mapping.

    Args:
        tree: the root tree node (a ``dict`` node).
        loader: see :func:`decode`.
        state: the live state; every one of its keys must be in the checkpoint.

    Raises:
        StateMismatchError: a key of ``state`` is not in the checkpoint.
    """
    keys = [_decode_key(k) for k in tree["k"]]
    nodes = dict(zip(keys, tree["v"]))
    missing = [k for k in state if k not in nodes]
    if missing:
        raise StateMismatchError(
            f"state keys {missing} are not in the checkpoint (it has {keys}); restore with matching keys")
    for k in list(state):
        new = decode(nodes[k], loader, state[k])
        if new is not state[k]:
            state[k] = new
