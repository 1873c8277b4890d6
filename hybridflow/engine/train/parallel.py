"""Applying FSDP2 to a model, separately from the model's code (torchtitan's habit).

`shard_model` calls `fully_shard` on every decoder layer, then on the root (embeddings, final norm, head),
over a 1-D data-parallel mesh of the current process group. Mixed precision: parameters are gathered in
the compute dtype, gradients reduced in fp32, the sharded master weights stay fp32, and forward inputs are
not cast. On one rank nothing is sharded, so layers keep their gathered parameters from forward to backward
(no second gather), and `TrainEngine` keeps them, with fp32 gradients, unsharded across a step's
micro-batches; on several, they are resharded after forward (ZeRO-3). `full_tensor` gathers one parameter.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from hybridflow.engine.train.model import Precision, decoder_layers

M = TypeVar("M", bound=torch.nn.Module)


def dp_mesh(device: torch.device) -> DeviceMesh:
    """A 1-D mesh over all ranks of the default process group."""
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def shard_model(model: M, mesh: DeviceMesh, precision: Precision) -> M:
    """`fully_shard` per decoder layer, then the root; returns the same (now sharded) module."""
    # Inputs pass uncast: the layers already receive compute-dtype hidden states, and a layer input kept in
    # fp32 on purpose (exact mode's rope rows) would be cast in the forward but, on torch 2.11, not in
    # gradient checkpointing's recomputation, which then refuses the mismatched saved tensors.
    mp = MixedPrecisionPolicy(param_dtype=precision.param, reduce_dtype=precision.reduce,
                              cast_forward_inputs=False) if precision.mixed else MixedPrecisionPolicy()
    reshard = mesh.size() > 1
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of a (possibly sharded) tensor: a DTensor is gathered (a collective: every rank calls it),
    except a one-rank shard, which already is the whole tensor and is taken as it is (a collective would
    cost time for nothing: docs/benchmarks.md); a plain tensor is returned unchanged."""
    if not isinstance(t, DTensor):
        return t
    if t.device_mesh.size() == 1 and t.to_local().shape == t.shape:
        return t.to_local()
    return t.full_tensor()
