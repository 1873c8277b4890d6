"""`CPUOffloadAdamW`: AdamW whose state lives in host memory and whose update runs on the CPU.

The optimizer state of AdamW is two fp32 tensors per parameter (8 bytes per parameter: 52 GB for a
6.5B model), more than the weights and gradients together. Here it lives in host memory; each step
streams the (already clipped) gradients and the weights through two small pinned staging buffers, runs
the fused CPU AdamW kernel on each piece and writes the weights back, the device-to-host copy of the
next piece overlapping the CPU update of this one. Nothing but the staging buffers (`STAGE_ELEMENTS`
elements each) is added to host memory beyond the state itself; no host copy of the weights is kept.

Why not torchao's `CPUOffloadOptimizer`: it copies each gradient to the host from a post-accumulate-grad
hook, which FSDP2's sharded parameters never fire (FSDP2 assigns their `.grad` after its reduce-scatter),
and which runs before the gradients are clipped. Under FSDP2 the state tensors are DTensors with CPU
local shards (as `offload.move_optimizer` leaves them), so distributed checkpoints save and load them.
On a CPU device the same code runs with plain copies (tests check it equals `torch.optim.AdamW`).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

# elements per staging buffer (fp32: 256 MiB); a parameter is updated piece by piece (AdamW is elementwise)
STAGE_ELEMENTS = 1 << 26


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class CPUOffloadAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) over device parameters with host-resident state. Parameters must be
    fp32 (the master weights): the update runs in fp32 on the host."""

    state_on_host = True  # `offload.move_optimizer` leaves the state where it is

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, stage_elements: int = STAGE_ELEMENTS) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise ValueError(f"CPUOffloadAdamW updates fp32 master weights; got a {p.dtype} parameter "
                                     f"(use model.master_dtype=fp32 with actor.optimizer=adamw_cpu_offload)")
        self.stage_elements = stage_elements
        self._stages: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            local = _local(p)

            def zeros() -> torch.Tensor:
                t = torch.zeros(local.shape, dtype=torch.float32)
                if isinstance(p, DTensor):  # from_local moves the shard to the mesh's device: move it back
                    t = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                           stride=p.stride()).to("cpu")
                return t

            state.update(step=torch.tensor(0.0), exp_avg=zeros(), exp_avg_sq=zeros())
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """`Optimizer.load_state_dict` puts the state beside each parameter; it belongs in host memory."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key, value in state.items():
                if key != "step" and value.device.type != "cpu":
                    state[key] = value.to("cpu")

    def _staging(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._stages is None:
            pin = device.type == "cuda"

            def buffer() -> torch.Tensor:
                return torch.empty(self.stage_elements, dtype=torch.float32, pin_memory=pin)

            self._stages = [(buffer(), buffer()) for _ in range(2)]
        return self._stages

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        pieces = []  # (group, step counter before this step, device weight, device grad, m, v) per piece
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._init_state(p)
                before = state["step"].clone()
                state["step"] += 1
                w, g = _local(p).detach().view(-1), _local(p.grad).view(-1)
                m, v = _local(state["exp_avg"]).view(-1), _local(state["exp_avg_sq"]).view(-1)
                for s in range(0, w.numel(), self.stage_elements):
                    e = min(w.numel(), s + self.stage_elements)
                    pieces.append((group, before, w[s:e], g[s:e], m[s:e], v[s:e]))
        if not pieces:
            return loss
        device = pieces[0][2].device
        stages = self._staging(device)
        cuda = device.type == "cuda"
        stream = torch.cuda.Stream(device) if cuda else None
        if cuda:
            stream.wait_stream(torch.cuda.current_stream(device))  # gradients final (clipped)

        def fetch(i: int):
            _, _, w, g, _, _ = pieces[i]
            hw, hg = (buf[:w.numel()] for buf in stages[i % 2])
            if not cuda:
                hw.copy_(w), hg.copy_(g)
                return None
            with torch.cuda.stream(stream):  # ordered after the previous write-back from this stage
                hw.copy_(w, non_blocking=True), hg.copy_(g, non_blocking=True)
                return stream.record_event()

        ready = fetch(0)
        for i, (group, before, w, _, m, v) in enumerate(pieces):
            if ready is not None:
                ready.synchronize()
            ready = fetch(i + 1) if i + 1 < len(pieces) else None
            hw, hg = (buf[:w.numel()] for buf in stages[i % 2])
            beta1, beta2 = group["betas"]
            adamw([hw], [hg], [m], [v], [], [before.clone()], fused=True, amsgrad=False, beta1=beta1,
                  beta2=beta2, lr=float(group["lr"]), weight_decay=group["weight_decay"], eps=group["eps"],
                  maximize=False)
            if cuda:
                with torch.cuda.stream(stream):
                    w.copy_(hw, non_blocking=True)
            else:
                w.copy_(hw)
        if cuda:
            stream.synchronize()  # weights back before the next forward; staging free for the next step
        return loss
