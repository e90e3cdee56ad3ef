"""A model that is never built whole: ``model_fn()`` recorded on the meta device, each tensor materialised alone.

:func:`record` runs ``model_fn()`` with every new tensor on PyTorch's ``meta`` device
(shapes only, no memory) while a dispatch mode records each operation on those tensors:
the factory that made a parameter, ``nn.init``'s ``uniform_``/``normal_``, a ``* 0.02``,
a ``copy_`` from another tensor, a slice that zeroes part of a weight. Random operations
also record the state of their generator just before them, and run once, on a scratch
tensor of the same shape and strides, so the generator advances exactly as building the
whole model would have advanced it (the caller's random state after :func:`record` is the
one ``model_fn()`` would have left).

:meth:`Recording.value` then computes one tensor: it replays, on real memory, only the
operations that tensor depends on, each random one from its recorded generator state. The
values are bit-equal to the whole model's built with the same seed, and the memory held is
that tensor and what it is computed from (usually itself), never the whole model.

While the :class:`Recording` is entered again (``with recording:``), operations on its meta
tensors stay recorded, so a layout that slices a layer (tensor parallelism) or converts a
dtype on the meta model yields tensors :meth:`~Recording.value` computes too, the whole
parameter being made only for the moment its slice is cut.

What cannot be recorded (``model_fn`` reads a value: ``.item()``, ``torch.load``, a data-
dependent branch; a random operation drawing from a meta tensor's values) raises
:class:`Unrecordable` with the operation, and the caller builds the model whole instead.

Examples
--------
>>> import torch
>>> from torch import nn
>>> _ = torch.manual_seed(0); whole = nn.Linear(4, 3)
>>> _ = torch.manual_seed(0); model, recording = record(lambda: nn.Linear(4, 3))
>>> model.weight.is_meta
True
>>> torch.equal(recording.value(model.weight), whole.weight.detach())
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from rapydli.errors import RapydliError

_RECORDING = "_rapydli_recording"
#: The attribute a lazily materialised parameter carries: ``(recording, meta tensor)``.
SOURCE = "_rapydli_deferred_source"


class Unrecordable(RapydliError):
    """``model_fn`` did something the recording cannot replay (its message names the operation)."""


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _key(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (_storage(tensor), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())


def _pinned(tree: Any) -> Any:
    """``tree`` with each meta tensor replaced by an alias of it as it is now (same storage, dtype, shape and strides).

    A recorded operation must keep the tensors it read and wrote as they were: the objects
    themselves change later, as ``Module.to(dtype)`` / ``.double()`` do through
    ``param.data = converted``, which gives the same parameter object the storage of a new
    tensor. An alias nobody else holds keeps the view the operation saw (and its storage alive).
    """
    with _disable_current_modes():
        return tree_map(lambda t: _aten.alias.default(t) if isinstance(t, torch.Tensor) and t.is_meta else t, tree)


@dataclass
class _Op:
    """One recorded operation: what ran, on which meta tensors, and the generator state before it if it is random."""

    index: int
    func: Any
    args: Any
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor]
    reads: set[int] = field(default_factory=set)  # storages of its meta inputs
    writes: set[int] = field(default_factory=set)  # storages of its meta outputs (new, mutated or viewed)
    generator: Any = None
    rng_state: torch.Tensor | None = None
    onto_meta: bool = False  # its device argument is the meta device (a factory, or a copy onto it)


_aten = torch.ops.aten
#: Operations that allocate or alias a tensor without giving it values: a parameter only these touched was never initialised.
_ALLOCATIONS = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default, _aten.new_empty.default,
                _aten.new_empty_strided.default, _aten.detach.default, _aten.alias.default, _aten.view.default}  # fmt: skip
#: In-place operations that write every element of their first argument whatever it held.
_OVERWRITES = {_aten.zero_.default, _aten.fill_.Scalar, _aten.fill_.Tensor, _aten.copy_.default}


class _Recorder(TorchDispatchMode):
    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        metas = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_meta]
        device = kwargs.get("device")
        onto_meta = device is not None and torch.device(device).type == "meta"
        if not metas and not onto_meta:
            return func(*args, **kwargs)  # real tensors only: not the model's
        return self.recording._record(func, args, kwargs, metas, onto_meta)


class _Replayed:
    """Real counterparts of the meta tensors a replay made: by exact view, and any tensor on each storage (for other views)."""

    def __init__(self) -> None:
        self.views: dict[tuple[Any, ...], torch.Tensor] = {}
        self.storages: dict[int, torch.Tensor] = {}

    def add(self, meta: torch.Tensor, made: torch.Tensor) -> None:
        self.views[_key(meta)] = made
        self.storages.setdefault(_storage(meta), made)

    def of(self, meta: torch.Tensor) -> torch.Tensor:
        found = self.views.get(_key(meta))
        if found is not None:
            return found
        handle = self.storages.get(_storage(meta))
        if handle is None or handle.dtype != meta.dtype:
            raise Unrecordable(f"a meta tensor of shape {tuple(meta.shape)} whose values were never computed")
        return handle.as_strided(
            meta.shape, meta.stride(), meta.storage_offset()
        )  # a view made without an op (nn.Parameter)

    def actual(self, x: Any) -> Any:
        return self.of(x) if isinstance(x, torch.Tensor) and x.is_meta else x


class Recording:
    """The operations that built a model on the meta device; computes any of its tensors alone (see the module).

    Attributes
    ----------
    device
        Where :meth:`value` puts what it computes.
    ops
        The recorded operations, in the order they ran.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.ops: list[_Op] = []
        self._by_storage: dict[int, list[int]] = {}  # storage -> the ops that output a tensor on it
        self._mode: _Recorder | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> Recording:
        return self  # one recording per model_fn() call: a copy of the model (a shape-only one) shares it

    # -- recording -----------------------------------------------------------------------
    def __enter__(self) -> Recording:
        self._mode = _Recorder(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        self._mode = None

    def _record(self, func: Any, args: Any, kwargs: dict[str, Any], metas: list[torch.Tensor], onto_meta: bool) -> Any:
        random = torch.Tag.nondeterministic_seeded in func.tags
        generator = (kwargs.get("generator") or torch.default_generator) if random else None
        if generator is not None and generator.device.type != "cpu":
            raise Unrecordable(f"{func}: a random operation drawing from a {generator.device.type} generator")
        for tensor in metas:
            if _storage(tensor) not in self._by_storage:
                self._adopt(func, args, tensor, random)
        state = generator.get_state() if generator is not None else None
        if random:
            self._advance(func, args, kwargs, metas, onto_meta)
        out = func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        args, kwargs = _pinned((args, kwargs))
        op = _Op(
            len(self.ops),
            func,
            args,
            kwargs,
            _pinned(outputs),
            {_storage(t) for t in metas},
            {_storage(t) for t in outputs if t.is_meta},
            generator,
            state,
            onto_meta,
        )
        self.ops.append(op)
        for storage in op.writes:
            self._by_storage.setdefault(storage, []).append(op.index)
        return out

    def _adopt(self, func: Any, args: Any, tensor: torch.Tensor, random: bool) -> None:
        """A meta tensor no recorded op made (``torch.tensor(0)`` has no values on the meta device): recorded as empty if ``func`` overwrites all of it."""
        overwrites = random or func in _OVERWRITES
        if not (overwrites and args and args[0] is tensor and tensor.storage_offset() == 0 and _covers(tensor)):
            raise Unrecordable(
                f"a tensor of shape {tuple(tensor.shape)} made from data on the meta device (torch.tensor(...), "
                f"torch.as_tensor(...)): its values are not kept there, and {func} reads them"
            )
        empty = torch.ops.aten.empty_strided.default
        kwargs = {"dtype": tensor.dtype, "device": torch.device("meta")}
        op = _Op(
            len(self.ops),
            empty,
            (list(tensor.shape), list(tensor.stride())),
            kwargs,
            _pinned([tensor]),
            set(),
            {_storage(tensor)},
            onto_meta=True,
        )
        self.ops.append(op)
        self._by_storage[_storage(tensor)] = [op.index]

    def macro(
        self, function: Callable[..., Any], tensor: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> torch.Tensor:
        """Record ``function(tensor, *args, **kwargs)`` as one operation (an initialiser whose steps depend on values drawn).

        ``nn.init.trunc_normal_`` redraws until every value is in range and ``orthogonal_``
        factorises what it drew: neither runs step by step on the meta device. The whole
        call is replayed instead, from the generator state before it; it runs once now on
        scratch memory of the same shape, so the generator advances as it would have.
        """
        generator = kwargs.get("generator") or torch.default_generator
        if _storage(tensor) not in self._by_storage:
            self._adopt(_aten.zero_.default, (tensor,), tensor, True)
        state = generator.get_state()
        function(torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu"), *args, **kwargs)
        op = _Op(
            len(self.ops),
            function,
            _pinned((tensor, *args)),
            kwargs,
            _pinned([tensor]),
            {_storage(tensor)},
            {_storage(tensor)},
            generator,
            state,
        )
        self.ops.append(op)
        self._by_storage[_storage(tensor)].append(op.index)
        return tensor

    def _advance(
        self, func: Any, args: Any, kwargs: dict[str, Any], metas: list[torch.Tensor], onto_meta: bool
    ) -> None:
        """Run random ``func`` once on real scratch memory: the generator moves as the whole build would move it."""
        if onto_meta and not metas:
            func(*args, **{**kwargs, "device": "cpu"})
            return
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if target is None or len(metas) != 1 or metas[0] is not target or not func._schema.is_mutable:
            raise Unrecordable(
                f"{func}: a random operation that reads a tensor's values (only in-place initialisers replay)"
            )
        scratch = torch.empty_strided(target.shape, target.stride(), dtype=target.dtype, device="cpu")
        func(scratch, *args[1:], **kwargs)

    def check_initialised(self, model: nn.Module) -> None:
        """Raise :class:`Unrecordable` if a parameter or buffer of ``model`` was only allocated (an initialiser that skips meta tensors)."""
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            made = [self.ops[i].func for i in self._by_storage.get(_storage(tensor), [])]
            if made and all(func in _ALLOCATIONS for func in made):
                raise Unrecordable(
                    f"{name} was allocated but never initialised on the meta device (an initialiser that skips meta tensors)"
                )

    # -- replaying -----------------------------------------------------------------------
    def value(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s value (a meta tensor this recording made) on :attr:`device`, computed alone; the caller's random state kept."""
        if not tensor.is_meta:
            return tensor.detach()
        storage = _storage(tensor)
        if storage not in self._by_storage:
            raise Unrecordable(f"a meta tensor of shape {tuple(tensor.shape)} that the recording did not make")
        made = self._replay(self._needed(storage)).of(tensor).detach()
        return made if _covers(made) else made.clone()  # a slice of a larger storage: keep only the slice

    def _needed(self, storage: int) -> list[_Op]:
        """The ops ``storage``'s final value depends on, in the order they ran (each read storage as of its reader)."""
        bound = {storage: len(self.ops)}
        included: set[int] = set()
        pending = [storage]
        while pending:
            current = pending.pop()
            for index in self._by_storage.get(current, []):
                if index >= bound[current] or index in included:
                    continue
                included.add(index)
                for read in self.ops[index].reads:
                    if read != current and bound.get(read, -1) < index:
                        bound[read] = index
                        pending.append(read)
        return [self.ops[i] for i in sorted(included)]

    def _replay(self, ops: list[_Op], device: torch.device | None = None) -> _Replayed:
        """Run ``ops`` on real memory (on ``device``: the meta device checks that every input resolves, computing nothing)."""
        shapes_only = device is not None and device.type == "meta"
        target = self.device if device is None else device
        replayed = _Replayed()
        for op in ops:
            args, kwargs = tree_map(replayed.actual, op.args), tree_map(replayed.actual, op.kwargs)
            if op.onto_meta:
                kwargs["device"] = (
                    target if op.rng_state is None or shapes_only else "cpu"
                )  # random: drawn where the recording drew it
                if "dtype" in _argument_names(op.func) and op.outputs:
                    kwargs["dtype"] = op.outputs[0].dtype  # what the default dtype made then, whatever it is now
            with contextlib.nullcontext() if shapes_only else self._generator(op):
                out = op.func(*args, **kwargs)
            for meta, made in zip(op.outputs, [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]):
                if meta.is_meta:
                    replayed.add(meta, made if made.device == target else made.to(target))
        return replayed

    def check_replayable(self, model: nn.Module) -> None:
        """Raise :class:`Unrecordable` if a parameter or buffer of ``model`` cannot be computed from the recording.

        Every operation is replayed once on the meta device (shapes only, no arithmetic, no
        memory), so a value that could not be made is found while recording, before any
        layout asks for it.
        """
        replayed = self._replay(self.ops, torch.device("meta"))
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_meta:
                try:
                    replayed.of(tensor)
                except Unrecordable as exc:
                    raise Unrecordable(f"{name}: {exc}") from None

    @contextlib.contextmanager
    def _generator(self, op: _Op) -> Iterator[None]:
        if op.rng_state is None:
            yield
            return
        before = op.generator.get_state()
        op.generator.set_state(op.rng_state)
        try:
            yield
        finally:
            op.generator.set_state(before)

    # -- materialising -------------------------------------------------------------------
    def materialize(
        self, module: nn.Module, lazy: bool = False, within: nn.Module | None = None
    ) -> dict[int, torch.Tensor]:
        """Replace every meta parameter and buffer of ``module`` by a real one, one tensor at a time (ties kept).

        ``lazy``: trained parameters become stride-0 placeholders (no memory) carrying their source
        (:data:`SOURCE`); :func:`value` computes them when a sharded optimizer takes its slice.
        Buffers are always computed. ``within``: the whole model ``module`` is part of; its
        other modules that hold the same tensors (a weight tied across pipeline stages) get
        the new ones too, so the whole model's ties stay what they were. Returns the new
        tensors by the ``id`` of the meta ones they replace, for whatever held on to those
        (:meth:`rapydli.parallel.training.PipelineTraining.adopt`; look up only tensors you
        hold, whose ids cannot have been reused).
        """
        made: dict[int, torch.Tensor] = {}
        replaced: list[
            torch.Tensor
        ] = []  # kept alive until the end: an id in `made` must not be reused by a new tensor
        for sub in module.modules():
            for name, param in list(sub._parameters.items()):
                if param is None:
                    continue
                if not param.is_meta:  # made from values (torch.tensor): real already, and moved where the rest goes
                    if param.device != self.device:
                        param.data = param.data.to(self.device)
                    continue
                if id(param) not in made:
                    replaced.append(param)
                    deferred = lazy and param.requires_grad  # a frozen parameter is kept whole by every rank: made now
                    if deferred:
                        data = torch.empty((), dtype=param.dtype, device=self.device).expand(param.shape)
                    else:
                        data = self.value(param)
                    fresh = nn.Parameter(data, requires_grad=param.requires_grad)
                    if deferred:
                        setattr(fresh, SOURCE, (self, param))
                    made[id(param)] = fresh
                sub._parameters[name] = made[id(param)]  # type: ignore[assignment]
            for name, buffer in list(sub._buffers.items()):
                if buffer is not None and not buffer.is_meta and buffer.device != self.device:
                    sub._buffers[name] = buffer.to(self.device)
                elif buffer is not None and buffer.is_meta:
                    if id(buffer) not in made:
                        replaced.append(buffer)
                        made[id(buffer)] = self.value(buffer)
                    sub._buffers[name] = made[id(buffer)]
        for sub in within.modules() if within is not None else ():
            for table in (sub._parameters, sub._buffers):
                for name, tensor in list(table.items()):
                    if tensor is not None and tensor.is_meta and id(tensor) in made:
                        table[name] = made[id(tensor)]  # type: ignore[assignment]
        return made


def _argument_names(func: Any) -> set[str]:
    schema = getattr(func, "_schema", None)
    return {argument.name for argument in schema.arguments} if schema is not None else set()


#: ``torch.nn.init``'s functions that return at once for a meta tensor (recorded whole instead: :meth:`Recording.macro`).
_MACROS = ("_no_grad_trunc_normal_", "orthogonal_", "dirac_", "sparse_")


@contextlib.contextmanager
def _initialisers(recording: Recording) -> Iterator[None]:
    """``torch.nn.init``'s data-dependent initialisers, recorded as one operation each while ``model_fn`` runs."""
    import torch.nn.init as init

    originals = {name: getattr(init, name) for name in _MACROS if hasattr(init, name)}

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        def initialise(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return recording.macro(function, tensor, args, kwargs)
            return function(tensor, *args, **kwargs)

        return initialise

    for name, function in originals.items():
        setattr(init, name, wrap(function))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(init, name, function)


def _covers(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` spans its whole storage (then its value is its storage's, no copy needed)."""
    return tensor.is_contiguous() and tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()


#: Constructors of a tensor from given values: kept real (on the CPU) while recording, so the values stay.
_FROM_VALUES = (torch.tensor, torch.as_tensor, torch.asarray, torch.scalar_tensor)


class _MetaByDefault(DeviceContext):
    """``torch.device("meta")`` for the factories that fill a tensor (``empty``, ``randn``, ``arange``...), not for those given values.

    ``torch.tensor([...])`` keeps its values on the CPU. Libraries ask it where the model is
    being built: ``transformers`` checks ``torch.tensor([]).device`` and skips ``post_init``'s
    weight initialisation on the meta device, which would leave every weight at its layer's
    default, a model different from the one ``model_fn()`` builds. Its initialisers run, and
    are recorded, as in the whole build.
    """

    def __init__(self) -> None:
        super().__init__("meta")

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _FROM_VALUES:
            return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


def record(model_fn: Callable[[], nn.Module], device: torch.device | str = "cpu") -> tuple[nn.Module, Recording]:
    """``model_fn()`` on the meta device and its :class:`Recording` (raises :class:`Unrecordable`; see the module).

    The generator advances as ``model_fn()`` would advance it, so what the caller draws
    next (a data order, dropout) is the same as after building the whole model.
    """
    recording = Recording(device)
    state = torch.random.get_rng_state()
    try:
        with _MetaByDefault(), _initialisers(recording), recording:
            model = model_fn()
    except Unrecordable:
        torch.random.set_rng_state(state)
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the meta device cannot run is named and the model built whole
        torch.random.set_rng_state(state)
        raise Unrecordable(f"model_fn() failed on the meta device: {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise Unrecordable(f"model_fn() returned {type(model).__name__}, not an nn.Module")
    recording.check_initialised(model)
    recording.check_replayable(model)
    model.__dict__[_RECORDING] = recording
    return model, recording


def recording_of(model: nn.Module) -> Recording | None:
    """The :class:`Recording` of a model :func:`record` made, ``None`` for a model built whole."""
    return model.__dict__.get(_RECORDING)


def value(param: torch.Tensor) -> torch.Tensor:
    """The real value of ``param``: computed from its recording if it is a lazy placeholder (:meth:`Recording.materialize`), else its data."""
    source = getattr(param, SOURCE, None)
    if source is None:
        return param.detach()
    recording, meta = source
    return recording.value(meta)


def is_lazy(param: torch.Tensor) -> bool:
    """Whether ``param`` is a placeholder whose value :func:`value` computes."""
    return getattr(param, SOURCE, None) is not None


def forget(param: torch.Tensor) -> None:
    """Drop ``param``'s source once its value lives elsewhere (a sharded optimizer's slice)."""
    if hasattr(param, SOURCE):
        delattr(param, SOURCE)
