"""Logical axis names -> mesh axes: one rules table, meshes, sharded models.

Layers name their parameters' axes ("embed", "mlp", "heads", ...); only this
file knows the mesh axes ("data", "fsdp", "tensor"). A logical axis whose mesh
axes do not divide that dimension (e.g. 2 kv heads on a 4-way tensor axis), or
whose mesh axis is already used by an earlier dimension, is replicated instead.

Activations are named too ("activation_batch", "length", "activation_embed"):
`constrain` pins them to the rules table inside `activation_sharding(mesh,
rules)` and does nothing outside it, so a model runs unchanged without a mesh.
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ba_jax.policy import compiling
from ba_jax.config import schema

MESH_AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES: tuple = schema.DEFAULT_SHARDING_RULES


def make_mesh(shape: dict, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over `devices` (default all) with axes in `shape`'s order; one size may be -1."""
  devices = list(devices if devices is not None else jax.devices())
  names, sizes = list(shape.keys()), list(shape.values())
  if any(not isinstance(s, int) or (s < 1 and s != -1) for s in sizes):
    raise ValueError(f"mesh shape {shape}: every size must be a positive int or -1")
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh shape {shape}: at most one axis may be -1")
  known = math.prod(s for s in sizes if s != -1)
  if len(devices) % known:
    raise ValueError(f"mesh shape {shape}: product of fixed sizes {known} does not divide "
                     f"the {len(devices)} devices")
  sizes = [len(devices) // known if s == -1 else s for s in sizes]
  if math.prod(sizes) != len(devices):
    raise ValueError(f"mesh shape {shape} resolves to {dict(zip(names, sizes))}, which uses "
                     f"{math.prod(sizes)} devices; {len(devices)} are available")
  axis_types = (jax.sharding.AxisType.Auto,) * len(names)
  slices = len({getattr(d, "slice_index", 0) for d in devices})
  if slices > 1:
    return _multislice_mesh(names, sizes, devices, slices, axis_types)
  try:
    return jax.make_mesh(tuple(sizes), tuple(names), axis_types=axis_types, devices=devices)
  except NotImplementedError:
    # A torus whose axes no mesh axis matches (fsdp 16 x tensor 4 on a v6e 8x8 slice): let
    # a mesh axis span parts of physical axes, as JAX offers for this case.
    from jax.experimental import mesh_utils  # pylint: disable=import-outside-toplevel
    grid = mesh_utils.create_device_mesh(tuple(sizes), devices, allow_split_physical_axes=True)
    return Mesh(grid, tuple(names), axis_types=axis_types)


def _multislice_mesh(names, sizes, devices, slices: int, axis_types) -> Mesh:
  """Several TPU slices: the first axis splits across the slices (over the data-center
  network, data parallel), every other axis stays inside a slice (ICI)."""
  from jax.experimental import mesh_utils  # pylint: disable=import-outside-toplevel
  if sizes[0] % slices:
    raise ValueError(f"mesh {dict(zip(names, sizes))} over {slices} slices: its first axis "
                     f"({names[0]}={sizes[0]}) must be a multiple of the slices, which it spans")
  per_slice = [sizes[0] // slices, *sizes[1:]]
  across = [slices] + [1] * (len(sizes) - 1)
  grid = mesh_utils.create_hybrid_device_mesh(per_slice, across, devices,
                                              allow_split_physical_axes=True)
  return Mesh(grid, tuple(names), axis_types=axis_types)


def _rules_dict(rules) -> dict:
  table = {}
  for entry in rules:
    if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
      raise ValueError(f"sharding rule {entry!r}: expected (logical_name, mesh_axis | tuple | None)")
    name, axes = entry
    table.setdefault(name, axes)  # first match wins, as in flax's logical rules
  return table


def logical_to_spec(mesh: Mesh, rules, logical_axes: Sequence[str | None], shape=None) -> PartitionSpec:
  """PartitionSpec for `logical_axes`; with `shape`, mesh axes that do not divide it are dropped."""
  table = _rules_dict(rules)
  used: set = set()
  spec = []
  for dim, name in enumerate(logical_axes):
    if name is None:
      spec.append(None)
      continue
    if name not in table:
      raise ValueError(f"logical axis {name!r} has no sharding rule; rules cover {sorted(table)}")
    axes = table[name]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    for ax in axes:
      if ax not in mesh.shape:
        raise ValueError(f"rule {name!r} -> {ax!r}: mesh axis {ax!r} not in mesh axes {tuple(mesh.shape)}")
    kept = []
    for ax in axes:
      size = math.prod(mesh.shape[a] for a in kept) * mesh.shape[ax]
      if ax in used or (shape is not None and shape[dim] % size):
        continue
      kept.append(ax)
    used.update(kept)
    spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*spec)


def logical_sharding(mesh: Mesh, rules, logical_axes: Sequence[str | None], shape=None) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(mesh, rules, logical_axes, shape))


def _variable_sharding(var: nnx.Variable, mesh: Mesh, rules) -> NamedSharding:
  axes = var.get_metadata().get("out_sharding")
  shape = np.shape(var.get_value())
  if not axes:
    return NamedSharding(mesh, PartitionSpec())
  if len(axes) != len(shape):
    raise ValueError(f"logical axes {axes} do not match the parameter's shape {shape}")
  return logical_sharding(mesh, rules, axes, shape)


def state_shardings(state: Any, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
  """The NamedSharding tree of an nnx State (or of `nnx.state(model)` if given a module)."""
  if isinstance(state, nnx.Module):
    state = nnx.state(state)
  return jax.tree.map(lambda v: v.replace(_variable_sharding(v, mesh, rules)), state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules=DEFAULT_RULES) -> nnx.Module:
  """Moves every variable of `model` (in place) to its sharding on `mesh`; returns `model`."""
  state = nnx.state(model)
  nnx.update(model, jax.device_put(state, state_shardings(state, mesh, rules)))
  return model


def create_sharded(make_model: Callable[[], nnx.Module], mesh: Mesh, rules=DEFAULT_RULES) -> nnx.Module:
  """Builds `make_model()` abstractly, then materialises every variable directly in its sharding."""
  abstract = nnx.eval_shape(make_model)
  graphdef, abstract_state = nnx.split(abstract)
  shardings = state_shardings(abstract_state, mesh, rules)

  def init():
    return nnx.state(make_model())

  state = compiling.jit(init, out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def data_sharding(mesh: Mesh, rules=DEFAULT_RULES, ndim: int = 2) -> NamedSharding:
  """Sharding of a [batch, ...] array: batch over the rules' "batch" axes, the rest replicated."""
  return logical_sharding(mesh, rules, ("batch",) + (None,) * (ndim - 1))


_ACTIVATION = threading.local()


@contextlib.contextmanager
def activation_sharding(mesh: Mesh | None, rules=DEFAULT_RULES):
  """Within this context (entered while tracing), `constrain` pins activations to `rules` on `mesh`."""
  previous = getattr(_ACTIVATION, "mesh_rules", None)
  _ACTIVATION.mesh_rules = None if mesh is None else (mesh, rules)
  try:
    yield
  finally:
    _ACTIVATION.mesh_rules = previous


def current_mesh_rules() -> tuple | None:
  """`(mesh, rules)` inside `activation_sharding`, else None."""
  return getattr(_ACTIVATION, "mesh_rules", None)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """`with_sharding_constraint` by logical axis names; `x` unchanged outside `activation_sharding`."""
  mesh_rules = getattr(_ACTIVATION, "mesh_rules", None)
  if mesh_rules is None:
    return x
  if len(logical_axes) != x.ndim:
    raise ValueError(f"logical axes {tuple(logical_axes)} do not match the activation's shape {x.shape}")
  mesh, rules = mesh_rules
  return jax.lax.with_sharding_constraint(x, logical_sharding(mesh, rules, logical_axes, shape=x.shape))
